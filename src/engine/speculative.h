#pragma once
// MTP self-speculative greedy decoding. Each step verifies [last token, drafts…] in one trunk pass, keeps the longest
// prefix whose drafts equal the trunk's own argmax (never past a stop token), and rolls every other part of the
// state back. The head's first draft is computed from the verified rows themselves (folded into the verify step);
// further drafts are chained on the head's own residual. Output is token-identical to plain greedy decoding.
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "engine/generate.h"
#include "engine/state.h"
#include "model/weights.h"

namespace vavilov {

struct SpeculativeOptions {
  int drafts = 2;         // 0–3 drafts per step
  bool adaptive = false;  // `drafts` after a fully accepted step, 1 after a rejection
  // Replaces the head's draft for `position` (tests: oracle drafts; benchmarks: forced acceptance).
  std::function<int32_t(int64_t position, int32_t head_draft)> draft_override;
  // Called after every verify step with the committed state (tests compare it with plain decoding).
  std::function<void(const SequenceState&, std::span<const int32_t> committed)> on_step;
};

struct SpeculativeStats {
  std::vector<int64_t> proposed, accepted;  // per draft position (index 0 = first draft)
  int64_t verify_steps = 0, emitted = 0;

  double mean_accepted() const;    // accepted drafts per verify step
  double tokens_per_step() const;  // emitted tokens per verify step
  void add(const SpeculativeStats& other);
};

std::vector<int32_t> generate_speculative(const Model& model, std::span<const int32_t> prompt,
                                          const GenerateOptions& options, const SpeculativeOptions& speculative,
                                          GenerateStats& stats, SpeculativeStats& spec_stats,
                                          const std::function<void(int32_t)>& on_token = {});

}  // namespace vavilov
