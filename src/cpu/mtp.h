#pragma once
// The MTP head (SGLang/vLLM definition, docs/MTP.md): folds a residual stack with the embedding of the token that
// follows it, runs its own full-attention MoE layer with its own caches, and predicts the token after next.
#include <cstdint>
#include <span>

#include "cpu/int8_linear.h"
#include "engine/backend.h"
#include "engine/state.h"
#include "model/weights.h"

namespace vavilov::cpu {

// `rows` head rows at positions state.mtp_position, +1, ...: row r pairs stacks[r] (the trunk's pre-mixer stack,
// or the head's own for a chained draft) with next_ids[r]. Writes the head's pre-mixer stacks [rows, S·H]
// (MtpRows::Last: only the last row's [S·H]) and advances state.mtp_position.
void mtp_forward(const Model& model, SequenceState& state, const float* stacks, std::span<const int32_t> next_ids,
                 float* head_stacks, MtpRows output = MtpRows::All);

// Draft logits [rows, vocab] from head stacks.
void mtp_logits(const Model& model, const float* head_stacks, int64_t rows, float* logits);

// The head's lm_head for drafting: an int8 copy (int8_linear.h) of the rows of a draft vocabulary (all ids, or the
// most frequent ones first).
struct DraftLmHead {
  std::vector<int32_t> ids;  // the token of each row of `rows`
  Int8Matrix rows;
  bool every_id = false;  // ids are 0 … vocab − 1 in order
};
DraftLmHead draft_lm_head(const Model& model, std::vector<int32_t> ids);  // empty ids: every id

// Draft logits [vocab] of one head stack: approximate for the draft vocabulary's ids, -inf for every other id (a
// draft is never one of them). What drafts are chosen from.
void mtp_draft_logits(const Model& model, const DraftLmHead& lm_head, const float* head_stack, float* logits);

}  // namespace vavilov::cpu
