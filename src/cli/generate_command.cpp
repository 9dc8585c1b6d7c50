// vavilov generate: greedy or sampled decoding from a text prompt (text streamed to stdout) or prompt ids (ids on
// stdout); statistics on stderr.
#include <fmt/core.h>
#include <fmt/ranges.h>

#include <charconv>
#include <cstdio>
#include <memory>
#include <optional>
#include <random>
#include <string>

#include "cli/commands.h"
#include "cli/common.h"
#include "core/error.h"
#include "engine/generate.h"
#include "engine/speculative.h"
#include "model/weights.h"
#include "tokenizer/prompt.h"

namespace vavilov::cli {

namespace {
struct GenerateArgs {
  std::string model, ids, prompt;
  bool raw = false;
  QuantizeOptions quantize;
  std::string device = "auto";
  int64_t expert_cache_mb = -1;
  int64_t max_tokens = 64;
  int64_t chunk = 0;
  bool ignore_eos = false;
  int threads = 0;
  int drafts = -1;  // -1: the default for the model
  std::string draft_mode = "adaptive";
  SamplingOptions sampling;
  std::string logit_bias;
  std::optional<uint64_t> seed;
};

// "ID:BIAS,ID:BIAS" → {(ID, BIAS), ...}; ranges are checked against the model by validate().
std::vector<std::pair<int32_t, float>> parse_logit_bias(const std::string& text) {
  std::vector<std::pair<int32_t, float>> biases;
  for (size_t begin = 0; begin < text.size();) {
    size_t end = std::min(text.find(',', begin), text.size()), colon = text.find(':', begin);
    int32_t id = -1;
    float bias = 0;
    bool ok = colon < end;
    if (ok) {
      auto [id_end, id_ec] = std::from_chars(text.data() + begin, text.data() + colon, id);
      auto [bias_end, bias_ec] = std::from_chars(text.data() + colon + 1, text.data() + end, bias);
      ok = id_ec == std::errc() && id_end == text.data() + colon && bias_ec == std::errc() &&
           bias_end == text.data() + end;
    }
    check(ok, "--logit-bias: expected ID:BIAS pairs separated by commas, got '{}'", text.substr(begin, end - begin));
    biases.emplace_back(id, bias);
    begin = end + 1;
  }
  return biases;
}

// The sampling flags, with a fresh random seed (reported on stderr) when --seed is absent.
SamplingOptions sampling_options(const GenerateArgs& args) {
  SamplingOptions sampling = args.sampling;
  sampling.logit_bias = parse_logit_bias(args.logit_bias);
  std::random_device entropy;
  sampling.seed = args.seed ? *args.seed : uint64_t(entropy()) << 32 | entropy();
  if (!sampling.greedy())
    fmt::print(stderr, "sampling: temperature {}, seed {}\n", sampling.temperature, sampling.seed);
  return sampling;
}

void add_sampling_options(CLI::App* command, GenerateArgs& args) {
  SamplingOptions& s = args.sampling;
  command->add_option("--temperature", s.temperature, "Sampling temperature (0: greedy)")
      ->check(CLI::NonNegativeNumber);
  command->add_option("--top-k", s.top_k, "Keep the K most likely tokens (0: all)")->check(CLI::NonNegativeNumber);
  command->add_option("--top-p", s.top_p, "Keep the most likely tokens up to this probability mass")
      ->check(CLI::Range(0.0f, 1.0f));
  command->add_option("--min-p", s.min_p, "Drop tokens below MIN_P times the top probability")
      ->check(CLI::Range(0.0f, 1.0f));
  command->add_option("--presence-penalty", s.presence_penalty, "Subtracted from tokens already generated");
  command->add_option("--frequency-penalty", s.frequency_penalty, "Subtracted per earlier generation of a token");
  command->add_option("--repetition-penalty", s.repetition_penalty,
                      "Divides positive (multiplies negative) logits of prompt and generated tokens");
  command->add_option("--logit-bias", args.logit_bias, "Added logits, ID:BIAS,... (e.g. 42:-100,7:2.5)");
  command->add_option("--seed", args.seed, "Random seed (default: a fresh one, printed on stderr)");
}

void print_speculative_stats(const SpeculativeStats& stats) {
  std::string positions;
  for (size_t j = 0; j < stats.proposed.size(); ++j)
    positions += fmt::format(" d{}: {}/{} ({:.0f}%)", j + 1, stats.accepted[j], stats.proposed[j],
                             stats.proposed[j] ? 100.0 * double(stats.accepted[j]) / double(stats.proposed[j]) : 0.0);
  fmt::print(stderr, "mtp: {} verify steps, accepted{} | mean accepted {:.2f}, {:.2f} tokens/step\n",
             stats.verify_steps, positions, stats.mean_accepted(), stats.tokens_per_step());
}

void run_generate(const GenerateArgs& args) {
  apply_threads(args.threads);
  check(!args.ids.empty() || !args.prompt.empty(), "give a prompt: text, --prompt TEXT or --ids 1,2,3");
  check(args.ids.empty() || args.prompt.empty(), "give either a text prompt or --ids, not both");
  const std::string model_dir = args.model.empty() ? default_model_dir() : args.model;
  std::optional<tokenizer::PromptTokenizer> text;
  std::vector<int32_t> prompt;
  if (args.prompt.empty()) {
    prompt = parse_ids(args.ids);
  } else {
    text.emplace(model_dir);
    for (uint32_t id : text->encode_prompt(args.prompt, args.raw)) prompt.push_back(int32_t(id));
  }
  auto model = load_model_quantized(model_dir, args.quantize);
  const bool cuda = cuda_selected(args.device, *model);
  check(cuda || args.expert_cache_mb < 0, "--expert-cache-mb: the expert cache is for the GPU (--device cuda)");
  GenerateOptions options;
  options.max_tokens = args.max_tokens;
  options.prefill_chunk = args.chunk;
  options.ignore_eos = args.ignore_eos;
  options.sampling = sampling_options(args);
  GenerateStats stats;
  SpeculativeOptions speculative;
  speculative.drafts = args.drafts >= 0 ? args.drafts : default_drafts(*model, cuda);
  speculative.adaptive = args.draft_mode == "adaptive";
  // Text prompts stream text as it is generated (never splitting a UTF-8 character); --ids prints the ids.
  std::optional<tokenizer::StreamDecoder> stream;
  if (text) stream.emplace(text->stream_decoder());
  auto on_token = [&](int32_t id) {
    if (!stream) return;
    std::fputs(stream->push(uint32_t(id)).c_str(), stdout);
    std::fflush(stdout);
  };
  std::vector<int32_t> generated;
  SpeculativeStats spec_stats;
  std::function<std::string()> cache_stats;
  // The GPU always decodes through the Decoder (with 0 drafts it is plain decoding); the CPU's plain path stays the
  // independent reference.
  if (cuda)
    generated = generate_speculative(*model, prompt, options, speculative, stats, spec_stats, on_token,
                                     device_sequences(*model, true, args.expert_cache_mb, &cache_stats));
  else if (speculative.drafts > 0)
    generated = generate_speculative(*model, prompt, options, speculative, stats, spec_stats, on_token);
  else
    generated = generate_plain(*model, prompt, options, stats, on_token);
  if (stream)
    fmt::print("{}\n", stream->finish());
  else
    fmt::print("[{}]\n", fmt::join(generated, ", "));
  std::fflush(stdout);
  if (speculative.drafts > 0) print_speculative_stats(spec_stats);
  fmt::print(stderr, "prefill: {} tokens, {:.1f} tok/s | decode: {} tokens, {:.2f} tok/s\n", stats.prompt_tokens,
             stats.prompt_tokens / std::max(stats.prefill_seconds, 1e-9), stats.generated_tokens,
             stats.generated_tokens / std::max(stats.decode_seconds, 1e-9));
  if (cache_stats) fmt::print(stderr, "{}\n", cache_stats());
}
}  // namespace

void register_generate(CLI::App& app) {
  auto args = std::make_shared<GenerateArgs>();
  CLI::App* command = app.add_subcommand("generate", "Generate text or tokens, greedily or sampled (MTP speculation stays on)");
  command->add_option("prompt", args->prompt, "Prompt text (same as --prompt)");
  command->add_option("--prompt", args->prompt, "Prompt text, chat-templated as one user message unless --raw");
  command->add_flag("--raw", args->raw, "Use the prompt text as it is, without the chat template");
  command->add_option("--model", args->model, "Model directory or packed store (default: the bundled model under models/)");
  command->add_option("--ids", args->ids, "Prompt token ids, comma-separated (prints ids instead of text)");
  command->add_option("--max-tokens", args->max_tokens, "Tokens to generate")->check(CLI::PositiveNumber);
  command->add_option("--chunk", args->chunk, "Prefill in chunks of N tokens (0: all at once)")
      ->check(CLI::NonNegativeNumber);
  command->add_flag("--ignore-eos", args->ignore_eos, "Keep generating past EOS");
  command->add_option("--drafts", args->drafts,
                      "MTP drafts per step, 0-3 (default with an MTP head: " + std::to_string(kDefaultDraftsGpu) +
                          " on the GPU, " + std::to_string(kDefaultDraftsCpu) + " on the CPU; else 0)")
      ->check(CLI::Range(0, 3));
  command->add_option("--draft-mode", args->draft_mode,
                      "fixed: always --drafts; adaptive: --drafts after a fully accepted step, 1 after a rejection")
      ->check(CLI::IsMember({"fixed", "adaptive"}));
  add_sampling_options(command, *args);
  add_quantize_option(command, args->quantize);
  add_device_option(command, args->device);
  add_expert_cache_option(command, args->expert_cache_mb);
  add_threads_option(command, args->threads);
  command->callback([args] { run_generate(*args); });
}

}  // namespace vavilov::cli
