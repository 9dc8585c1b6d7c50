#pragma once
// The seam between the Decoder and a device: the few operations a decoding step needs on one sequence's state. The
// CPU engine and the CUDA backend implement it, so every decoding rule (verification, drafting, rollback) is written
// once, in the Decoder.
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "engine/sampling.h"
#include "engine/state.h"
#include "model/weights.h"

namespace vavilov {

// Which MTP head rows the caller reads: all (the logits command), or only the last (decoding, where earlier rows only
// have to extend the head's attention caches).
enum class MtpRows { All, Last };

struct TrunkOutputs {
  bool all_rows = false;     // logits for every row, or only the last
  float* logits = nullptr;   // host [all_rows ? rows : 1, vocab]; null (and greedy null) to skip lm_head
  float* stacks = nullptr;   // host [rows, S·H]: residual stacks before the final mixer (the MTP head's input)
  bool record_rows = false;  // keep the recurrent state after every row so keep_rows can roll back
  // host [all_rows ? rows : 1]: each wanted row's greedy token, cpu::argmax of its logits (cpu/argmax.h: the lowest
  // index among equal maxima, NaN as std::max_element). Without `logits` a device returns only these ids (4 bytes a
  // row instead of the vocabulary's logits).
  int32_t* greedy = nullptr;
  // The wanted rows' logits stay on the device for verify_sampled (a backend that samples_on_device()).
  bool keep_logits = false;
};

// What sampling on the device needs besides the logits (SequenceBackend::verify_sampled, draft_sampled): the
// settings, the tokens the penalties look at, the sequence's generator state (engine::Rng), and the stop tokens.
struct SampleRequest {
  const SamplingOptions* options = nullptr;
  const TokenHistory* history = nullptr;
  uint64_t rng_state = 0;
  std::span<const int64_t> stops;
};

struct SampledVerify {
  std::vector<int32_t> emitted;  // as Decoder::accept emits them
  int64_t uniforms = 0;          // drawn from the generator
};

// One greedy verify step (SequenceBackend::greedy_step): verify `rows` = [last token, drafts…], keep the accepted
// prefix, roll back, fold the MTP head over the kept rows and draft the next step.
struct GreedyStep {
  std::span<const int32_t> rows;   // the last emitted token, then 0–3 drafts
  std::span<const int64_t> stops;  // tokens that end acceptance (empty when stops are ignored)
  int64_t stack_size = 0;          // S·H: one row's residual stack (the MTP head's input)
  bool head = false;               // fold the MTP head and draft (the Decoder's drafts > 0)
  int drafts = 0;                  // next drafts after a step that accepted every draft
  int drafts_after_rejection = 0;  // next drafts after a rejection (adaptive drafting: 1)
  // Replaces the head's draft for a position (SpeculativeOptions::draft_override); the replaced draft is what the
  // next chained draft continues from.
  const std::function<int32_t(int64_t position, int32_t head_draft)>* draft_override = nullptr;
  // Benchmarks only (`vavilov bench`'s forced full acceptance): every draft kept whatever the trunk's ids; the emitted
  // tokens are then the drafts and the last row's greedy id.
  bool accept_all = false;
};

struct GreedyStepResult {
  std::vector<int32_t> emitted;  // the trunk's greedy ids up to and including the first mismatch or stop
  std::vector<int32_t> drafts;   // the next step's drafts
};

struct SampledStepResult {
  GreedyStepResult step;  // the emitted tokens (verify_sampled's) and the next drafts (draft_sampled's)
  int64_t uniforms = 0;   // drawn from the generator
};

class SequenceBackend {
 public:
  virtual ~SequenceBackend() = default;
  virtual int64_t position() const = 0;
  // Runs the trunk over `ids`, continuing the sequence.
  virtual void forward(std::span<const int32_t> ids, const TrunkOutputs& outputs) = 0;
  // Keeps the first `kept` rows of the last forward pass (which recorded its rows and started at first_position).
  virtual void keep_rows(int64_t first_position, int64_t kept) = 0;
  // The MTP head over host stacks [rows, S·H] paired with next_ids (cpu/mtp.h); writes its stacks to head_stacks
  // ([rows, S·H], or the last row's [S·H] with MtpRows::Last).
  virtual void mtp_forward(const float* stacks, std::span<const int32_t> next_ids, float* head_stacks,
                           MtpRows output) = 0;
  virtual void mtp_logits(const float* head_stacks, int64_t rows, float* logits) = 0;
  // Each row's greedy token of mtp_logits (cpu::argmax's rule), without the logits leaving the device.
  virtual void mtp_greedy(const float* head_stacks, int64_t rows, int32_t* ids) = 0;
  // The logits a draft is chosen from, for one head stack [S·H]: mtp_logits or a cheaper approximation of it. Either
  // is lossless, since the trunk verifies every draft exactly and sampling tests a draft against the distribution it
  // was drawn from.
  virtual void draft_logits(const float* head_stack, float* logits) { mtp_logits(head_stack, 1, logits); }
  // The greedy draft: cpu::argmax of draft_logits (a backend that overrides draft_logits overrides this too).
  virtual int32_t draft_greedy(const float* head_stack) {
    int32_t id = 0;
    mtp_greedy(head_stack, 1, &id);
    return id;
  }
  // Drops the head's cache entries from `position` on.
  virtual void truncate_head(int64_t position) = 0;
  // Sampling on the device, by the Decoder's rules (engine/sampling.h, speculative.cpp) with its generator's uniforms
  // in its order, so that no logits cross to the host. verify_sampled: the rows [last, drafts…] of the forward pass
  // just run with keep_logits, each penalised by request.history plus the drafts before it, verified against the
  // drafts' distributions from draft_sampled (draft j of the step: index j) or replace_draft. draft_sampled: a draft
  // drawn from distribution(draft_logits(head_stack)), kept as draft `index`'s q. replace_draft: draft `index`'s q
  // becomes a point mass at `token` (an overridden draft).
  virtual bool samples_on_device() const { return false; }
  virtual SampledVerify verify_sampled(std::span<const int32_t> rows, const SampleRequest& request);
  virtual int32_t draft_sampled(const float* head_stack, int index, const SampleRequest& request);
  virtual void replace_draft(int index, int32_t token);
  // A whole sampled verify step with greedy_step's shape and the rules of the calls above (the drafts' distributions
  // kept as their q), fused on the device where the backend can (the CUDA one: one graph, without penalties); false,
  // leaving everything as it was, where it cannot, and the caller composes the calls above.
  virtual bool sampled_step(const GreedyStep&, const SampleRequest&, SampledStepResult&) { return false; }
  // One greedy verify step: a recorded trunk pass over step.rows (greedy ids, stacks), the accepted prefix kept
  // (draft r + 1 is accepted while it equals row r's greedy id and that id is no stop; the emitted tokens are the
  // greedy ids up to and including the first mismatch or stop), the rest rolled back, the head over the kept rows
  // paired with their next tokens, the first draft from its last row and chained drafts on its own stack, the head
  // truncated to the committed position. Needs head ⇒ the head at the trunk's position. The default composes the
  // calls above exactly as the Decoder always did; a device may fuse them (the CUDA backend: one graph, one
  // synchronisation).
  virtual GreedyStepResult greedy_step(const GreedyStep& step);
  // The state in the CPU engine's layout (engine/state.h), whatever the device: position, attention and indexer
  // caches up to the position, GDN, PLE and the MTP head's caches. A state is portable: any backend of the same model
  // geometry imports it (prefix caching keeps these).
  virtual void export_state(SequenceState& state) = 0;
  // Continues from `state` instead of the sequence's own; an error naming the field (and layer) whose shape does not
  // fit this model (check_state_fits), leaving the sequence as it was.
  virtual void import_state(const SequenceState& state) = 0;
  // The state as the CPU engine holds it, without a copy; null on other devices (batched CPU steps use it).
  virtual SequenceState* cpu_state() { return nullptr; }
  virtual RowStates* cpu_row_states() { return nullptr; }
};

// The ids the CPU draft head scores: the first `count` ids of <model directory>/draft_vocab.json (token ids by
// training-corpus frequency, tools/default_model/draft_vocab.py) when the model has that file, else none (meaning
// every id). A draft outside them is never proposed, which costs acceptance, never correctness.
constexpr int64_t kDraftVocabulary = 4096;
std::vector<int32_t> draft_vocabulary(const Model& model, int64_t count = kDraftVocabulary);

// The CPU engine's sequence (cpu/forward.h, cpu/mtp.h).
std::unique_ptr<SequenceBackend> cpu_sequence(const Model& model);

// Makes one sequence's backend for a model; the Decoder asks for one per sequence.
using SequenceFactory = std::function<std::unique_ptr<SequenceBackend>()>;

}  // namespace vavilov
