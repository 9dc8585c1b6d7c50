#pragma once
// The GPU kernels of a qwen4_exp layer besides matrix products and Gated DeltaNet (cuda/gated_deltanet.cuh), each
// mirroring one step of the CPU engine (src/cpu/): norms, RoPE, hyper-connections, QSA block selection and sparse
// attention, MoE routing, PLE. All fp32; positions are passed from the host.
#include <cuda_runtime.h>

#include <cstdint>

namespace vavilov::cuda {

// Zero-centred RMSNorm of `groups` groups of `width` values per row: group g of row r starts at
// x + r·x_row_stride + g·x_group_stride and uses weight + g·weight_group_stride; out is [rows, groups, width]
// (may alias x when the layouts agree).
void rms_norm(const float* x, int64_t x_row_stride, int64_t x_group_stride, int rows, int groups, int width,
              const float* weight, int64_t weight_group_stride, float eps, float* out, cudaStream_t stream);

// RoPE on `vectors_per_row` consecutive vectors of `width` values per row (the first rotary_dim values of each),
// row r at position first_position + r.
void rope(float* x, int rows, int vectors_per_row, int width, int rotary_dim, const float* inv_freq,
          int64_t first_position, cudaStream_t stream);

// Hyper-connections: low = silu(low / S) in place; input[r, d] = Σ_s σ(mix[r, s, d])·normed[r, s, d] / S;
// inject = 2σ(inject / S) in place; stack[r, s, :] += inject[r, s]·y[r, :].
void hc_low_activation(float* low, int64_t n, int streams, cudaStream_t stream);
void hc_combine(const float* mix, const float* normed, int rows, int streams, int hidden, float* input,
                cudaStream_t stream);
void hc_inject_activation(float* inject, int64_t n, int streams, cudaStream_t stream);
void hc_write(const float* inject, const float* y, int rows, int streams, int hidden, float* stack,
              cudaStream_t stream);

// Sparse attention.
// Pooled block keys for blocks [first_block, end_block): mean of `ratio` raw index keys, zero-centred RMSNorm,
// RoPE at the block's first position.
void pool_block_keys(const float* index_keys, int first_block, int end_block, int ratio, int dim,
                     const float* norm_weight, float eps, const float* inv_freq, int rotary_dim, float* block_keys,
                     cudaStream_t stream);
struct AttentionShape {
  int heads, kv_heads, head_dim;
  int index_heads, index_dim, ratio, keep_blocks;
};
// For each row (at first_position + r): selected[r, b] = 1 for the blocks its QSA indexer keeps (all when there are
// at most keep_blocks; else the top keep_blocks by score, ties to the lower index). scores: scratch
// [rows, max_blocks].
void qsa_select(const AttentionShape& shape, const float* index_queries, const float* block_keys, int rows,
                int64_t first_position, int max_blocks, float* scores, uint8_t* selected, cudaStream_t stream);
// Gated attention of every row over its selected tokens; queries [rows, heads, hd], gates at q_gate + (r·heads +
// h)·2hd, out [rows, heads·hd]. weights: scratch [rows, heads, max_tokens].
void sparse_attention(const AttentionShape& shape, const float* queries, const float* q_gate, const float* keys,
                      const float* values, const uint8_t* selected, int rows, int64_t first_position, int max_blocks,
                      int max_tokens, float* weights, float* out, cudaStream_t stream);

// MoE.
// Softmax over `experts` logits per row (in place: probabilities), top-k (ties to the lower index), weights
// renormalised when norm_topk.
void moe_route(float* logits, int rows, int experts, int top_k, bool norm_topk, int* ids, float* weights,
               cudaStream_t stream);
// gate = silu(gate)·up.
void swiglu(float* gate, const float* up, int64_t n, cudaStream_t stream);
// y[r, :] = σ(gate[r])·y[r, :] + Σ_j weights[r·k + j]·expert_out[r·k + j, :].
void moe_combine(float* y, const float* shared_gate, const float* weights, const float* expert_out, int rows, int top_k,
                 int hidden, cudaStream_t stream);

// PLE.
struct PleShape {
  int ngram, heads_per_ngram, context;  // context = ngram − 1
  int64_t eos;
};
// Table rows [rows, heads] of every n-gram head for ids (after previous [context]); previous advanced;
// row_previous (optional) [rows, context] the previous ids after each row.
void ple_table_rows(const PleShape& shape, const int64_t* multipliers, const int64_t* head_sizes,
                    const int64_t* head_offsets, int64_t* previous, const int32_t* ids, int rows, int64_t* table_rows,
                    int64_t* row_previous, cudaStream_t stream);
// out[r, s, :] = σ(shape(score))·value[r, :] with score = key_normed[r, s]·query_normed[r, s] / √H.
void ple_gate(const float* keys, const float* queries, const float* value, int rows, int streams, int hidden,
              float* out, cudaStream_t stream);
// out += silu(dilated causal conv of normed) per channel; state [(kernel−1)·dilation, channels] advanced;
// row_states (optional) [rows, (kernel−1)·dilation, channels].
void ple_conv(const float* taps, int channels, int kernel, int dilation, float* state, const float* normed, int rows,
              float* out, float* row_states, cudaStream_t stream);

// x[r, s, :] += e[r, :] for every stream s.
void add_to_streams(float* x, const float* e, int rows, int streams, int hidden, cudaStream_t stream);
// x[i] += y[i].
void add(float* x, const float* y, int64_t n, cudaStream_t stream);

}  // namespace vavilov::cuda
