#pragma once
// What the tests that compare the engine's logits with a reference share: a fixture's reference.json (prompt,
// greedy continuation, logits file), the error measure, and the CPU engine's logits for a prompt in chunks and its
// greedy continuation.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <span>
#include <string>
#include <vector>

#include "cpu/forward.h"
#include "engine/generate.h"
#include "engine/state.h"
#include "fixture_paths.h"
#include "model/weights.h"

namespace vavilov::test {

struct ReferenceFixture {
  std::filesystem::path dir;
  nlohmann::json reference;
  std::vector<int32_t> prompt, greedy;
  std::vector<float> logits;  // [prompt, vocab]

  explicit ReferenceFixture(const std::filesystem::path& d) : dir(d) {
    std::ifstream in(dir / "reference.json");
    reference = nlohmann::json::parse(in);
    prompt = reference["prompt_ids"].get<std::vector<int32_t>>();
    greedy = reference["greedy_ids"].get<std::vector<int32_t>>();
    logits = read_floats(dir / reference["logits_file"].get<std::string>());
  }
};

// max |got − want| / max |want|: the error relative to the largest reference logit. Sizes must agree (a mismatch
// counts as an infinite error).
inline double relative_error(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return INFINITY;
  double max_diff = 0, max_ref = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    max_diff = std::max(max_diff, std::fabs(double(got[i]) - double(want[i])));
    max_ref = std::max(max_ref, std::fabs(double(want[i])));
  }
  return max_diff / max_ref;
}

// The CPU engine's logits [prompt, vocab] for every position, the prompt run in chunks of `chunk` tokens.
inline std::vector<float> engine_logits(const Model& model, const std::vector<int32_t>& prompt, size_t chunk) {
  const size_t vocab = size_t(model.config.vocab_size);
  SequenceState state = new_sequence_state(model);
  std::vector<float> logits(prompt.size() * vocab);
  for (size_t begin = 0; begin < prompt.size(); begin += chunk) {
    const size_t count = std::min(chunk, prompt.size() - begin);
    cpu::forward(model, state, std::span<const int32_t>(prompt).subspan(begin, count),
                 {true, logits.data() + begin * vocab, nullptr});
  }
  return logits;
}

// The CPU engine's greedy continuation of the fixture's prompt, as many tokens as the reference's (EOS ignored).
inline std::vector<int32_t> engine_greedy(const Model& model, const ReferenceFixture& fixture) {
  GenerateOptions options;
  options.max_tokens = int64_t(fixture.greedy.size());
  options.ignore_eos = true;
  GenerateStats stats;
  return generate_greedy(model, fixture.prompt, options, stats);
}

}  // namespace vavilov::test
