#pragma once
// Decoding one sequence, plainly or with MTP self-speculation. Each step verifies [last token, drafts…] in one trunk
// pass, keeps the accepted prefix of the drafts (never past a stop token), and rolls every other part of the state
// back. The head's first draft is computed from the verified rows themselves (folded into the verify step); further
// drafts are chained on the head's own residual. The trunk passes of several decoders can run as one batch
// (step_batch).
//
// Greedy (temperature 0): a draft is accepted while it equals the trunk's choice; the output is token-identical to
// plain greedy decoding. Sampling: drafts are drawn from the head's filtered distribution q, and draft x is accepted
// with probability min(1, p(x)/q(x)), p being the trunk's distribution after the same filters; on rejection the
// token is drawn from normalise(max(0, p − q)), after full acceptance a bonus token from p. The output then has
// exactly the distribution of plain sampling (docs/SAMPLING.md). Every row is filtered with the penalties of the
// tokens before it, accepted drafts included.
//
// Greedy without logit adjustments (no bias, no penalties; the Decoder returns no logprobs) needs only each row's
// argmax: a decoder on a device then hands its backend the whole step (SequenceBackend::greedy_step, built on greedy
// ids: TrunkOutputs::greedy, draft_greedy) instead of asking for logits, which a GPU runs on the device (a few ids to
// the host instead of the vocabulary's logits). The ids follow cpu::argmax's rule, the same as choose() on the logits,
// so both paths give the same tokens.
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "engine/backend.h"
#include "engine/generate.h"
#include "engine/sampling.h"
#include "engine/state.h"
#include "model/weights.h"

namespace vavilov {

// Drafts per step when the user does not say, the fastest setting measured on the bundled model (docs/MTP.md): on the
// GPU 2 (1053 tok/s against 785 without drafts), on the CPU 2 with the default adaptive mode (892 / 1062 tok/s on
// 1 / 2 threads against 724 / 906 without and 866 / 1063 with 1 draft: the best total over both thread counts).
constexpr int kDefaultDraftsGpu = 2;
constexpr int kDefaultDraftsCpu = 2;
inline int default_drafts(const Model& model, bool gpu) {
  return model.mtp ? (gpu ? kDefaultDraftsGpu : kDefaultDraftsCpu) : 0;
}

struct SpeculativeOptions {
  int drafts = 2;         // 0–3 drafts per step
  bool adaptive = false;  // `drafts` after a fully accepted step, 1 after a rejection
  // Replaces the head's draft for `position` (tests: oracle drafts; benchmarks: forced acceptance). When sampling, a
  // replaced draft counts as drawn from a point mass (q = 1 at it), which keeps verification lossless.
  std::function<int32_t(int64_t position, int32_t head_draft)> draft_override;
  // TEST ONLY: the probability of accepting a sampled draft given p(x) and q(x), instead of min(1, p/q). Lets the
  // statistical test check that it detects a wrong rule; any other rule makes the output distribution wrong.
  std::function<double(double p, double q)> acceptance_override;
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

class Decoder {
 public:
  // `device` makes the sequence's backend (default: the CPU engine).
  Decoder(const Model& model, const GenerateOptions& options, const SpeculativeOptions& speculative,
          const SequenceFactory& device = {});

  // Prefills the prompt (in chunks of options.prefill_chunk) and chooses the first token; returns it. With `prefix`,
  // starts from that state (an earlier decoder's state after a prefix of this prompt, from any device: prefix
  // caching; the backend's import_state checks its shapes). `on_chunk` sees the state after complete prompt chunks
  // (trunk and head both at its end), in the CPU engine's layout: the CPU engine's after every chunk but the last; a
  // device backend's, exported for the call (SequenceBackend::export_state), only at snapshot_boundary()'s chunks.
  // Pass no on_chunk when nothing keeps it.
  int32_t start(std::span<const int32_t> prompt, const SequenceState* prefix = nullptr,
                const std::function<void(const SequenceState&)>& on_chunk = {});
  // start() in steps, for schedulers that run other sequences between prompt chunks: begin() takes the prompt (and
  // prefix state), each prefill_next() runs one chunk and returns the first token after the last one, -1 before.
  void begin(std::span<const int32_t> prompt, const SequenceState* prefix = nullptr);
  int32_t prefill_next(const std::function<void(const SequenceState&)>& on_chunk = {});
  // The rows the next verify step runs through the trunk: the last token, then the drafts.
  std::span<const int32_t> rows() const { return rows_; }
  // Takes the trunk's outputs for rows() (a pass that recorded its rows): logits [rows, vocab], stacks [rows, S·H].
  // Keeps the accepted prefix, drafts the next step, and returns the tokens it emits (1 + accepted drafts).
  std::vector<int32_t> accept(const float* logits, const float* stacks);
  // One verify step on its own.
  std::vector<int32_t> step();
  // One verify step through this decoder's own backend (step_batch's path for non-CPU decoders): with greedy ids,
  // the backend's greedy_step; otherwise a recorded trunk pass's logits through accept().
  std::vector<int32_t> step_alone();
  // Buffers sized for the next verify pass (step_batch fills them for CPU decoders).
  float* verify_logits();
  float* verify_stacks();
  // Whether this decoder takes greedy ids instead of logits from its backend (greedy, no logit adjustments).
  bool greedy_ids() const { return greedy_ids_; }

  bool is_stop(int32_t token) const;
  // The CPU engine's own state (tests, the on_step hook); an error on other devices (export_state copies any).
  SequenceState& state();
  SequenceBackend& backend() { return *sequence_; }
  const SpeculativeStats& stats() const { return stats_; }

 private:
  void fold_head(const float* trunk_stacks, std::span<const int32_t> next_ids, bool draft = true);
  void add_draft(const float* head_logits, int64_t position);
  void add_draft(int32_t draft, bool sampled, int64_t position);
  std::vector<double>& draft_distribution(size_t j);
  int32_t verify_row(const float* logits, int64_t row);
  void count_step(int64_t proposed, int64_t accepted);
  GreedyStep fused_step_request() const;
  std::span<const int64_t> stops() const;
  std::vector<int32_t> take_fused_step(GreedyStepResult result);
  std::vector<int32_t> step_greedy();
  std::vector<int32_t> step_sampled_on_device();
  std::vector<int32_t> commit(std::vector<int32_t> emitted, const float* stacks);
  SampleRequest sample_request() const;
  void truncate_head(int64_t position);
  const SequenceState& chunk_state();
  bool wants_chunk_state(int64_t end) const;

  const Model& model_;
  const ModelConfig& c_;
  GenerateOptions options_;
  SpeculativeOptions spec_;
  SpeculativeStats stats_;
  std::unique_ptr<SequenceBackend> sequence_;
  std::vector<int64_t> stops_;
  std::vector<int32_t> prompt_;  // while prefilling
  std::vector<int32_t> rows_;    // [last, drafts...]
  // The verify pass's outputs, kept from step to step: [rows, vocab] and [rows, S·H].
  std::vector<float> verify_logits_, verify_stacks_;
  // When sampling: the distribution each draft of rows_ was drawn from, and the verify row's (buffers reused).
  std::vector<std::vector<double>> draft_q_;
  std::vector<double> verify_p_;
  TokenHistory history_;  // prompt and emitted tokens (the penalties' input)
  Rng rng_;               // this sequence's own stream: batching cannot change it
  int drafts_wanted_;
  bool greedy_ids_;         // greedy without logit adjustments: the backend returns ids, not logits
  bool device_sampling_;    // sampling on a backend that samples_on_device(): no logits reach the host
  SequenceState exported_;  // a device backend's state at the last prompt chunk boundary (on_chunk's argument)
};

// False when the environment sets VAVILOV_DEVICE_SAMPLING=0: a device's sampled steps then download logits and sample
// on the host (A/B measurements, tests comparing both).
bool device_sampling_enabled_by_environment();

// Whether a device-resident sequence offers its state to on_chunk at prompt position `end` (a boundary of `chunk`-token
// chunks before the last chunk of a `prompt_size`-token prompt): after 1, 2, 4, ... chunks and before the last one.
bool snapshot_boundary(int64_t end, int64_t prompt_size, int64_t chunk);

// One verify step for several decoders with a single batched trunk pass. Returns each decoder's emitted tokens.
std::vector<std::vector<int32_t>> step_batch(const Model& model, std::span<Decoder* const> decoders);

std::vector<int32_t> generate_speculative(const Model& model, std::span<const int32_t> prompt,
                                          const GenerateOptions& options, const SpeculativeOptions& speculative,
                                          GenerateStats& stats, SpeculativeStats& spec_stats,
                                          const std::function<void(int32_t)>& on_token = {},
                                          const SequenceFactory& device = {});

}  // namespace vavilov
