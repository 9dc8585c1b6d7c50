#pragma once
// A backend that answers every greedy request from logits on the host with std::max_element — what the Decoder did
// before backends returned greedy ids (TrunkOutputs::greedy, mtp_greedy, draft_greedy). Tests run the Decoder
// through it and directly to show that both paths give the same tokens, and count which outputs were asked for.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "engine/backend.h"

namespace vavilov::test {

class LogitsOnlySequence final : public SequenceBackend {
 public:
  LogitsOnlySequence(std::unique_ptr<SequenceBackend> inner, int64_t vocab) : inner_(std::move(inner)), vocab_(vocab) {}

  int64_t position() const override { return inner_->position(); }
  void forward(std::span<const int32_t> ids, const TrunkOutputs& out) override {
    greedy_requests += out.greedy != nullptr;
    if (!out.greedy) {
      logits_requests += out.logits != nullptr;
      inner_->forward(ids, out);
      return;
    }
    const int64_t rows = out.all_rows ? int64_t(ids.size()) : 1;
    std::vector<float> logits(size_t(rows * vocab_));
    inner_->forward(ids, {out.all_rows, logits.data(), out.stacks, out.record_rows});
    for (int64_t r = 0; r < rows; ++r) out.greedy[r] = max_element_of(logits.data() + r * vocab_);
    if (out.logits) std::copy(logits.begin(), logits.end(), out.logits);
  }
  void keep_rows(int64_t first_position, int64_t kept) override { inner_->keep_rows(first_position, kept); }
  void mtp_forward(const float* stacks, std::span<const int32_t> next_ids, float* head_stacks,
                   MtpRows output) override {
    inner_->mtp_forward(stacks, next_ids, head_stacks, output);
  }
  void mtp_logits(const float* head_stacks, int64_t rows, float* logits) override {
    ++logits_requests;
    inner_->mtp_logits(head_stacks, rows, logits);
  }
  void mtp_greedy(const float* head_stacks, int64_t rows, int32_t* ids) override {
    ++greedy_requests;
    std::vector<float> logits(size_t(rows * vocab_));
    inner_->mtp_logits(head_stacks, rows, logits.data());
    for (int64_t r = 0; r < rows; ++r) ids[r] = max_element_of(logits.data() + r * vocab_);
  }
  void draft_logits(const float* head_stack, float* logits) override {
    ++logits_requests;
    inner_->draft_logits(head_stack, logits);
  }
  int32_t draft_greedy(const float* head_stack) override {
    ++greedy_requests;
    std::vector<float> logits(static_cast<size_t>(vocab_));
    inner_->draft_logits(head_stack, logits.data());
    return max_element_of(logits.data());
  }
  void truncate_head(int64_t position) override { inner_->truncate_head(position); }
  void export_state(SequenceState& state) override { inner_->export_state(state); }
  void import_state(const SequenceState& state) override { inner_->import_state(state); }

  int64_t logits_requests = 0, greedy_requests = 0;  // calls that asked for logits, for greedy ids

 private:
  int32_t max_element_of(const float* row) const { return int32_t(std::max_element(row, row + vocab_) - row); }

  std::unique_ptr<SequenceBackend> inner_;
  int64_t vocab_;
};

}  // namespace vavilov::test
