#pragma once
// PLE (per-layer n-gram embeddings, src/cpu/ple.cpp) on the GPU: the hashed table rows of each token's n-grams, the
// gated mix of the looked-up value into every residual stream with its norms in one launch, and the dilated causal
// conv that adds the result to the streams.
#include <cuda_runtime.h>

#include <cstdint>

namespace vavilov::cuda {

struct PleShape {
  int ngram, heads_per_ngram, context;  // context = ngram − 1
  int64_t eos;
};

// Table rows [rows, heads] of every n-gram head for ids (after previous [context]); previous advanced;
// row_previous (optional) [rows, context] the previous ids after each row.
void ple_table_rows(const PleShape& shape, const int64_t* multipliers, const int64_t* head_sizes,
                    const int64_t* head_offsets, int64_t* previous, const int32_t* ids, int rows, int64_t* table_rows,
                    int64_t* row_previous, cudaStream_t stream);

// Per row r and stream s (norms zero-centred RMSNorms with weight + s·hidden):
// gated[r, s, :] = σ(shape(score))·value[r, :] with score = norm_key(keys[r, s])·norm_query(stack[r, s]) / √H, and
// normed[r, s, :] = norm_conv(gated[r, s, :]).
struct PleNorms {
  const float *key, *query, *conv;
  float eps;
};
void ple_mix(const float* keys, const float* stack, const float* value, const PleNorms& norms, int rows, int streams,
             int hidden, float* gated, float* normed, cudaStream_t stream);

// stack += gated + silu(dilated causal conv of normed), per channel; state [(kernel−1)·dilation, channels] advanced;
// row_states (optional) [rows, (kernel−1)·dilation, channels].
void ple_conv(const float* taps, int channels, int kernel, int dilation, float* state, const float* normed, int rows,
              const float* gated, float* stack, float* row_states, cudaStream_t stream);

}  // namespace vavilov::cuda
