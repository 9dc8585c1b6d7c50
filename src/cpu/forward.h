#pragma once
// The trunk on the CPU: embed, every decoder layer, the final mixer and lm_head, for a chunk of tokens that
// continues the sequence in `state`.
#include <cstdint>
#include <span>

#include "engine/state.h"
#include "model/weights.h"

namespace vavilov::cpu {

struct ForwardOutputs {
  bool all_rows = false;    // logits for every row, or only the last
  float* logits = nullptr;  // [all_rows ? rows : 1, vocab]; null to skip lm_head
  float* stacks = nullptr;  // [rows, S·H]: the residual stack before the final mixer (the MTP head's input)
  RowStates* row_states = nullptr;  // filled with the recurrent state after every row (speculative verify)
};

void forward(const Model& model, SequenceState& state, std::span<const int32_t> ids, const ForwardOutputs& outputs);

// lm_head over the final mixer's read of `rows` residual stacks.
void logits_from_stacks(const Model& model, const GatedResidualWeights& mixer, const float* stacks, int64_t rows,
                        float* logits);

}  // namespace vavilov::cpu
