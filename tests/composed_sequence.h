#pragma once
// A backend that hands every seam call to another one but takes SequenceBackend's default greedy_step, composed from
// those calls: the reference a fused greedy_step (the CUDA backend's) is compared against, and, having no CPU state, a
// device-style backend whose decoders step through the default greedy_step on the CPU engine.
#include <memory>
#include <span>

#include "engine/backend.h"

namespace vavilov::test {

class ComposedSequence final : public SequenceBackend {
 public:
  explicit ComposedSequence(std::unique_ptr<SequenceBackend> inner) : inner_(std::move(inner)) {}

  int64_t position() const override { return inner_->position(); }
  void forward(std::span<const int32_t> ids, const TrunkOutputs& outputs) override { inner_->forward(ids, outputs); }
  void keep_rows(int64_t first_position, int64_t kept) override { inner_->keep_rows(first_position, kept); }
  void mtp_forward(const float* stacks, std::span<const int32_t> next_ids, float* head_stacks,
                   MtpRows output) override {
    inner_->mtp_forward(stacks, next_ids, head_stacks, output);
  }
  void mtp_logits(const float* head_stacks, int64_t rows, float* logits) override {
    inner_->mtp_logits(head_stacks, rows, logits);
  }
  void mtp_greedy(const float* head_stacks, int64_t rows, int32_t* ids) override {
    inner_->mtp_greedy(head_stacks, rows, ids);
  }
  void draft_logits(const float* head_stack, float* logits) override { inner_->draft_logits(head_stack, logits); }
  int32_t draft_greedy(const float* head_stack) override { return inner_->draft_greedy(head_stack); }
  void truncate_head(int64_t position) override { inner_->truncate_head(position); }
  void export_state(SequenceState& state) override { inner_->export_state(state); }
  void import_state(const SequenceState& state) override { inner_->import_state(state); }

 private:
  std::unique_ptr<SequenceBackend> inner_;
};

}  // namespace vavilov::test
