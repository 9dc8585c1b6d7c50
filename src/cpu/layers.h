#pragma once
// The qwen4_exp building blocks on the CPU. A batch of rows may hold several sequences: each Segment is a run of
// consecutive rows of one sequence. Weight products run once over all rows; stateful parts run per segment.
#include <cstdint>
#include <span>
#include <vector>

#include "engine/state.h"
#include "model/weights.h"

namespace vavilov::cpu {

struct Segment {
  LayerState* state = nullptr;  // this sequence's state for the layer being run
  int64_t first_position = 0;   // position of the segment's first row
  int64_t row_begin = 0, rows = 0;
  const int32_t* ids = nullptr;  // the segment's tokens
  // When set, filled with the recurrent state after every row but the last (speculative rollback).
  std::vector<GatedDeltaNetState>* gdn_rows = nullptr;
  std::vector<PleState>* ple_rows = nullptr;
};

// Hyper-connection read of the residual stack R [rows, S·H]: the block input [rows, H] and, when the module has
// an inject matrix and `inject` is not null, the injection weights λ [rows, S].
void hyper_read(const GatedResidualWeights& w, const ModelConfig& c, const float* stack, int64_t rows, float* input,
                float* inject);
// R[r, s, :] += λ[r, s] · y[r, :]
void hyper_write(const float* inject, const float* y, int64_t rows, const ModelConfig& c, float* stack);

void gated_deltanet(const GatedDeltaNetWeights& w, const ModelConfig& c, std::span<const Segment> segments,
                    const float* x, int64_t rows, float* y);

// Sparse attention with the QSA indexer.
void sparse_attention(const SparseAttentionWeights& w, const ModelConfig& c, std::span<const Segment> segments,
                      const float* x, int64_t rows, float* y);

// Appends the keys, values and indexer keys of the segment's rows (input x [seg.rows, H]) without attending: rows
// whose output nobody reads (the MTP head's rows before its last) only have to be visible to later queries.
void extend_attention_cache(const SparseAttentionWeights& w, const ModelConfig& c, const Segment& seg,
                            const float* x);

void moe(const MoeWeights& w, const ModelConfig& c, const float* x, int64_t rows, float* y);

// PLE: the value added to the stack [rows, S·H].
void ple(const PleWeights& w, const ModelConfig& c, std::span<const Segment> segments, const float* stack,
         int64_t rows, float* out);

// One decoder layer (PLE when present, mixer, MoE, both hyper-connection writes) on the stack [rows, S·H].
void decoder_layer(const LayerWeights& w, const ModelConfig& c, std::span<const Segment> segments, float* stack,
                   int64_t rows);

}  // namespace vavilov::cpu
