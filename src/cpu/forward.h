#pragma once
// The trunk on the CPU: embed, every decoder layer, the final mixer and lm_head, for chunks of tokens that continue
// one or several sequences. Several sequences in one call share every weight read (batched steps).
#include <cstdint>
#include <span>

#include "engine/state.h"
#include "model/weights.h"

namespace vavilov::cpu {

struct ForwardOutputs {
  bool all_rows = false;    // logits for every row, or only the last
  float* logits = nullptr;  // [all_rows ? rows : 1, vocab]; null to skip lm_head
  float* stacks = nullptr;  // [rows, S·H]: the residual stack before the final mixer (the MTP head's input)
  RowStates* row_states = nullptr;  // filled with the recurrent state after every row but the last (speculative verify)
};

struct SequenceChunk {
  SequenceState* state = nullptr;
  std::span<const int32_t> ids;
  ForwardOutputs outputs;
};

void forward_batch(const Model& model, std::span<const SequenceChunk> chunks);

inline void forward(const Model& model, SequenceState& state, std::span<const int32_t> ids,
                    const ForwardOutputs& outputs) {
  SequenceChunk chunk{&state, ids, outputs};
  forward_batch(model, std::span<const SequenceChunk>(&chunk, 1));
}

// lm_head over the final mixer's read of `rows` residual stacks.
void logits_from_stacks(const Model& model, const GatedResidualWeights& mixer, const float* stacks, int64_t rows,
                        float* logits);

}  // namespace vavilov::cpu
