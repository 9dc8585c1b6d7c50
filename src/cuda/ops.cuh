#pragma once
// The GPU kernels of a qwen4_exp layer besides matrix products that have no file of their own (attention.cuh,
// hyper_connection.cuh, ple.cuh, moe.cuh), each mirroring one step of the CPU engine (src/cpu/): RMSNorm, the Gated
// DeltaNet conv and recurrence. All fp32.
#include <cuda_runtime.h>

#include <cstdint>

namespace vavilov::cuda {

// Zero-centred RMSNorm of `groups` groups of `width` values per row: group g of row r starts at
// x + r·x_row_stride + g·x_group_stride and uses weight + g·weight_group_stride; out is [rows, groups, width]
// (may alias x when the layouts agree).
void rms_norm(const float* x, int64_t x_row_stride, int64_t x_group_stride, int rows, int groups, int width,
              const float* weight, int64_t weight_group_stride, float eps, float* out, cudaStream_t stream);

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


// x[r, s, :] += e[r, :] for every stream s.
void add_to_streams(float* x, const float* e, int rows, int streams, int hidden, cudaStream_t stream);

}  // namespace vavilov::cuda
