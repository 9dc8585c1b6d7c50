#pragma once
// The GPU kernels of a qwen4_exp layer besides matrix products that have no file of their own (attention.cuh,
// hyper_connection.cuh, ple.cuh, moe.cuh, gated_deltanet.cuh), each mirroring one step of the CPU engine (src/cpu/):
// RMSNorm, adding an embedding to every stream. All fp32.
#include <cuda_runtime.h>

#include <cstdint>

namespace vavilov::cuda {

// Zero-centred RMSNorm of `groups` groups of `width` values per row: group g of row r starts at
// x + r·x_row_stride + g·x_group_stride and uses weight + g·weight_group_stride; out is [rows, groups, width]
// (may alias x when the layouts agree).
void rms_norm(const float* x, int64_t x_row_stride, int64_t x_group_stride, int rows, int groups, int width,
              const float* weight, int64_t weight_group_stride, float eps, float* out, cudaStream_t stream);

// x[r, s, :] += e[r, :] for every stream s.
void add_to_streams(float* x, const float* e, int rows, int streams, int hidden, cudaStream_t stream);

}  // namespace vavilov::cuda
