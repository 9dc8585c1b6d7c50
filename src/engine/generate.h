#pragma once
// Plain generation on one sequence: prefill the prompt (optionally in chunks), then decode token by token, greedily
// or sampled (engine/sampling.h).
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "engine/sampling.h"
#include "engine/state.h"
#include "model/weights.h"

namespace vavilov {

struct GenerateOptions {
  int64_t max_tokens = 64;
  int64_t prefill_chunk = 0;  // 0: the whole prompt at once
  bool ignore_eos = false;
  std::vector<int64_t> stop_ids;  // besides the config's EOS ids
  SamplingOptions sampling;       // default: greedy
};

struct GenerateStats {
  int64_t prompt_tokens = 0, generated_tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;
};

// Prefills `prompt` into `state` and returns the logits of its last position.
std::vector<float> prefill(const Model& model, SequenceState& state, std::span<const int32_t> prompt, int64_t chunk);

// Token by token without speculation, greedy or sampled by options.sampling; the reference the speculative decoder
// is tested against. Calls on_token for each generated token as soon as it is known.
std::vector<int32_t> generate_plain(const Model& model, std::span<const int32_t> prompt, const GenerateOptions& options,
                                    GenerateStats& stats, const std::function<void(int32_t)>& on_token = {});

// generate_plain with options.sampling replaced by greedy defaults.
std::vector<int32_t> generate_greedy(const Model& model, std::span<const int32_t> prompt,
                                     const GenerateOptions& options, GenerateStats& stats,
                                     const std::function<void(int32_t)>& on_token = {});

// Stop tokens: config EOS ids plus generation_config.json's eos_token_id, when present.
std::vector<int64_t> stop_token_ids(const Model& model);

}  // namespace vavilov
