#pragma once
// The qwen4_exp building blocks on the CPU. Each works on `rows` consecutive tokens of one sequence.
#include <cstdint>
#include <span>
#include <vector>

#include "engine/state.h"
#include "model/weights.h"

namespace vavilov::cpu {

// Hyper-connection read of the residual stack R [rows, S·H]: the block input [rows, H] and, when the module has
// an inject matrix, the injection weights λ [rows, S].
void hyper_read(const GatedResidualWeights& w, const ModelConfig& c, const float* stack, int64_t rows, float* input,
                float* inject);
// R[r, s, :] += λ[r, s] · y[r, :]
void hyper_write(const float* inject, const float* y, int64_t rows, const ModelConfig& c, float* stack);

// With `row_states`, also records the state after every row (for speculative rollback).
void gated_deltanet(const GatedDeltaNetWeights& w, const ModelConfig& c, GatedDeltaNetState& state, const float* x,
                    int64_t rows, float* y, std::vector<GatedDeltaNetState>* row_states = nullptr);

// Sparse attention with the QSA indexer; the rows sit at positions first_position, first_position + 1, ...
void sparse_attention(const SparseAttentionWeights& w, const ModelConfig& c, AttentionState& state,
                      int64_t first_position, const float* x, int64_t rows, float* y);

void moe(const MoeWeights& w, const ModelConfig& c, const float* x, int64_t rows, float* y);

// PLE: the value added to the stack [rows, S·H] for tokens `ids`.
void ple(const PleWeights& w, const ModelConfig& c, PleState& state, const int32_t* ids, const float* stack,
         int64_t rows, float* out, std::vector<PleState>* row_states = nullptr);

// One decoder layer (PLE when present, mixer, MoE, both hyper-connection writes) on the stack [rows, S·H].
void decoder_layer(const LayerWeights& w, const ModelConfig& c, LayerState& state, int64_t first_position,
                   std::span<const int32_t> ids, float* stack, RowStates* row_states = nullptr, int layer = 0);

}  // namespace vavilov::cpu
