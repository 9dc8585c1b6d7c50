#include "engine/generate.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "cpu/forward.h"

namespace vavilov {

namespace {
double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}
}  // namespace

std::vector<float> prefill(const Model& model, SequenceState& state, std::span<const int32_t> prompt, int64_t chunk) {
  check(!prompt.empty(), "the prompt is empty");
  std::vector<float> logits(size_t(model.config.vocab_size));
  size_t step = chunk > 0 ? size_t(chunk) : prompt.size();
  for (size_t begin = 0; begin < prompt.size(); begin += step) {
    size_t count = std::min(step, prompt.size() - begin);
    bool last = begin + count == prompt.size();
    cpu::forward(model, state, prompt.subspan(begin, count), {false, last ? logits.data() : nullptr, nullptr});
  }
  return logits;
}

std::vector<int64_t> stop_token_ids(const Model& model) {
  std::vector<int64_t> ids = model.config.eos_token_ids;
  std::filesystem::path path = std::filesystem::path(model.directory) / "generation_config.json";
  if (!std::filesystem::exists(path)) return ids;
  std::ifstream in(path);
  auto parsed = nlohmann::json::parse(in, nullptr, false);
  check(!parsed.is_discarded() && parsed.is_object(), "{}: not a JSON object", path.string());
  if (parsed.contains("eos_token_id")) {
    const auto& eos = parsed["eos_token_id"];
    auto add = [&](const nlohmann::json& value) {
      check(value.is_number_integer(), "{}: field eos_token_id: expected integers", path.string());
      ids.push_back(value.get<int64_t>());
    };
    if (eos.is_array())
      for (const auto& value : eos) add(value);
    else if (!eos.is_null())
      add(eos);
  }
  return ids;
}

std::vector<int32_t> generate_plain(const Model& model, std::span<const int32_t> prompt, const GenerateOptions& options,
                                    GenerateStats& stats, const std::function<void(int32_t)>& on_token) {
  validate(options.sampling, model.config.vocab_size);
  SequenceState state = new_sequence_state(model);
  TokenHistory history;
  history.add_prompt(prompt);
  Rng rng(options.sampling.seed);
  std::vector<int64_t> stops = stop_token_ids(model);
  stops.insert(stops.end(), options.stop_ids.begin(), options.stop_ids.end());
  const int64_t vocab = model.config.vocab_size;

  auto start = std::chrono::steady_clock::now();
  std::vector<float> logits = prefill(model, state, prompt, options.prefill_chunk);
  stats.prompt_tokens = int64_t(prompt.size());
  stats.prefill_seconds = seconds_since(start);

  start = std::chrono::steady_clock::now();
  std::vector<int32_t> generated;
  while (int64_t(generated.size()) < options.max_tokens) {
    int32_t next = choose(logits.data(), vocab, options.sampling, history, rng);
    history.push(next);
    generated.push_back(next);
    if (on_token) on_token(next);
    bool stop = !options.ignore_eos && std::find(stops.begin(), stops.end(), next) != stops.end();
    if (stop || int64_t(generated.size()) == options.max_tokens) break;
    cpu::forward(model, state, std::span<const int32_t>(&next, 1), {false, logits.data(), nullptr});
  }
  stats.generated_tokens = int64_t(generated.size());
  stats.decode_seconds = seconds_since(start);
  return generated;
}

std::vector<int32_t> generate_greedy(const Model& model, std::span<const int32_t> prompt,
                                     const GenerateOptions& options, GenerateStats& stats,
                                     const std::function<void(int32_t)>& on_token) {
  GenerateOptions greedy = options;
  greedy.sampling = {};
  return generate_plain(model, prompt, greedy, stats, on_token);
}

}  // namespace vavilov
