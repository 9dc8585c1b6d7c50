#pragma once
// The MTP head (SGLang/vLLM definition, docs/MTP.md): folds a residual stack with the embedding of the token that
// follows it, runs its own full-attention MoE layer with its own caches, and predicts the token after next.
#include <cstdint>
#include <span>

#include "engine/backend.h"
#include "engine/state.h"
#include "model/weights.h"

namespace vavilov::cpu {

// `rows` head rows at positions state.mtp_position, +1, ...: row r pairs stacks[r] (the trunk's pre-mixer stack,
// or the head's own for a chained draft) with next_ids[r]. Writes the head's pre-mixer stacks [rows, S·H] (MtpRows::Last:
// only the last row's [S·H]) and advances state.mtp_position.
void mtp_forward(const Model& model, SequenceState& state, const float* stacks, std::span<const int32_t> next_ids,
                 float* head_stacks, MtpRows output = MtpRows::All);

// Draft logits [rows, vocab] from head stacks.
void mtp_logits(const Model& model, const float* head_stacks, int64_t rows, float* logits);

}  // namespace vavilov::cpu
