#include "engine/backend.h"

#include "cpu/forward.h"
#include "cpu/mtp.h"

namespace vavilov {

namespace {

class CpuSequence final : public SequenceBackend {
 public:
  explicit CpuSequence(const Model& model) : model_(model), state_(new_sequence_state(model)) {}

  int64_t position() const override { return state_.position; }
  void forward(std::span<const int32_t> ids, const TrunkOutputs& out) override {
    cpu::forward(model_, state_, ids, {out.all_rows, out.logits, out.stacks, out.record_rows ? &rows_ : nullptr});
  }
  void keep_rows(int64_t first_position, int64_t kept) override {
    vavilov::keep_rows(state_, rows_, first_position, kept, model_.config);
  }
  void mtp_forward(const float* stacks, std::span<const int32_t> next_ids, float* head_stacks,
                   MtpRows output) override {
    cpu::mtp_forward(model_, state_, stacks, next_ids, head_stacks, output);
  }
  void mtp_logits(const float* head_stacks, int64_t rows, float* logits) override {
    cpu::mtp_logits(model_, head_stacks, rows, logits);
  }
  void truncate_head(int64_t position) override {
    truncate_attention(state_.mtp.attn, position, model_.config);
    state_.mtp_position = position;
  }
  SequenceState* cpu_state() override { return &state_; }
  RowStates* cpu_row_states() override { return &rows_; }

 private:
  const Model& model_;
  SequenceState state_;
  RowStates rows_;
};

}  // namespace

std::unique_ptr<SequenceBackend> cpu_sequence(const Model& model) { return std::make_unique<CpuSequence>(model); }

}  // namespace vavilov
