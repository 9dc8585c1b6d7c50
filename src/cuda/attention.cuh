#pragma once
// Sparse (QSA) attention on the GPU (src/cpu/sparse_attention.cpp): the layer's inputs normalised, rotated and written
// into the caches and the completed blocks' keys pooled in one launch, per-row block selection by the indexer, gated
// attention over the selected tokens. The position of the pass's first row is read from device memory and every grid
// is sized by a bound the host passes (the cache capacity in a captured step), so one CUDA graph serves every
// position up to that bound.
#include <cuda_runtime.h>

#include <cstdint>

namespace vavilov::cuda {

struct AttentionShape {
  int heads, kv_heads, head_dim;
  int index_heads, index_dim, ratio, keep_blocks;
};

// The raw projections of a pass's rows and the weights that turn them into attention inputs.
struct AttentionInputs {
  const float* q;         // [rows, heads, 2·head_dim]: each head's query, then its gate
  const float *k, *v;     // [rows, kv_heads·head_dim]
  const float* index_qk;  // [rows, (index_heads + 1)·index_dim]: the index queries, then the index key
  const float *q_norm, *k_norm, *index_q_norm, *index_k_norm;
  const float* inv_freq;  // RoPE [rotary_dim / 2]
  int rotary_dim;
  float eps;
};

// One layer's caches, indexed by position.
struct AttentionCaches {
  float *keys, *values;  // [capacity, kv_heads, head_dim]
  float* index_keys;     // [capacity, index_dim]
  float* block_keys;     // [capacity / ratio + 1, index_dim]
};

// Row r at position *first_position + r: queries [rows, heads, head_dim] and index_queries [rows, index_heads,
// index_dim] = RoPE(zero-centred RMSNorm(·)); the key likewise, the value and the raw index key stored into the caches
// at the row's position; and the pooled key of each block the pass's rows complete: the mean of its `ratio` raw index
// keys (earlier positions' from the cache), RMSNorm with index_k_norm, RoPE at the block's first position.
void attention_inputs(const AttentionShape& shape, const AttentionInputs& in, int rows, const int64_t* first_position,
                      float* queries, float* index_queries, const AttentionCaches& caches, cudaStream_t stream);

// Grid bound and scratch strides of a pass: every row sees fewer than launch_tokens positions (launch_tokens ≤
// max_tokens); scratch rows hold max_tokens / ratio + 1 block scores.
struct AttentionBounds {
  int launch_tokens, max_tokens;
  int stride_blocks(int ratio) const { return max_tokens / ratio + 1; }
};

// For each row: selected[r, b] = 1 for the blocks its indexer keeps (all when there are at most keep_blocks; else
// the top keep_blocks by score, ties to the lower index). scores: scratch [rows, stride_blocks]. Launches nothing when
// the bound leaves no row more than keep_blocks complete blocks (launch_tokens / ratio ≤ keep_blocks): sparse_attention
// does not read `selected` then.
void qsa_select(const AttentionShape& shape, const float* index_queries, const float* block_keys, int rows,
                const int64_t* first_position, const AttentionBounds& bounds, float* scores, uint8_t* selected,
                cudaStream_t stream);

// sparse_attention's scratch for passes of up to max_rows rows: per (row, head, chunk of positions) a partial result
// (values [·, head_dim] and (peak, sum) stats), and per (row, head set) an arrival counter that must be zero before
// the first launch (each launch leaves it zero).
struct AttendScratch {
  float* values;
  float2* stats;
  unsigned* arrivals;
};
size_t attend_value_floats(const AttentionShape& shape, int max_rows);
size_t attend_stat_count(const AttentionShape& shape, int max_rows);
size_t attend_arrival_count(const AttentionShape& shape, int max_rows);

// Gated attention of every row over its selected tokens (selected [rows, stride_blocks] is read only for rows with more
// than keep_blocks complete blocks, as qsa_select selects all of them otherwise); queries [rows, heads, hd], gates at
// q_gate + (r·heads + h)·2hd, out [rows, heads·hd]. No kernel of the pass writes the keys and values of positions
// before *settled_position (the first position of the pass's chunk of rows; ≤ *first_position), so the kernel may ask
// for them before its producers are done. Head dims up to kMaxAttentionHeadDim.
inline constexpr int kMaxAttentionHeadDim = 256;
void sparse_attention(const AttentionShape& shape, const float* queries, const float* q_gate, const float* keys,
                      const float* values, const uint8_t* selected, int rows, const int64_t* first_position,
                      const int64_t* settled_position, const AttentionBounds& bounds, const AttendScratch& scratch,
                      float* out, cudaStream_t stream);

}  // namespace vavilov::cuda
