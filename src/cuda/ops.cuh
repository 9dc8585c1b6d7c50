#pragma once
// The GPU kernels of a qwen4_exp layer besides matrix products, each mirroring one step of the CPU engine
// (src/cpu/): norms, RoPE, hyper-connections, the Gated DeltaNet conv and recurrence, QSA block selection and sparse
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

// Gated DeltaNet.
// beta = σ(beta); decay = −e^{a_log}·softplus(decay + dt_bias), per [rows, heads].
void gdn_gates(float* beta, float* decay, const float* a_log, const float* dt_bias, int rows, int heads,
               cudaStream_t stream);
// Causal depthwise conv with silu over x [rows, channels] in place; state [kernel−1, channels] advanced;
// row_states (optional) [rows, kernel−1, channels] gets the state after every row.
void gdn_conv(const float* taps, int channels, int kernel, float* state, float* x, int rows, float* row_states,
              cudaStream_t stream);
// The delta rule over all rows for every value head; recurrent [heads, dk, dv]; out [rows, heads·dv];
// row_states (optional) [rows, heads, dk, dv].
struct GdnShape {
  int heads, key_heads, dk, dv, conv_dim, key_dim;
};
void gdn_delta_rule(const GdnShape& shape, const float* qkv, const float* beta, const float* decay, int rows,
                    float* recurrent, float* out, float* row_states, cudaStream_t stream);
// o = w ⊙ rmsnorm(o) ⊙ gate(z) per head of dv values; gate σ or silu.
void gdn_gated_norm(float* core, const float* z, const float* weight, int rows_heads, int dv, float eps,
                    bool sigmoid_gate, cudaStream_t stream);

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
