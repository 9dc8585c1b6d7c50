#pragma once
// Matrix products on the GPU for any number of activation rows and any stored format (device_matrix.h): 1–4 rows of
// Q4/Q3/Q2/BF16/F32 go to gemv.cuh's bandwidth-bound kernels and of NVFP4 to nvfp4.cuh's, more rows to cuBLAS
// (gemm.cuh) or one warp per output row that reads each weight once for up to four activation rows. Never allocates
// or synchronises, so it can be captured into a CUDA graph. Also the expert variant, whose matrices are chosen per
// row by expert ids that live in device memory (no host round trip for routing).
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device_matrix.h"

namespace vavilov::cuda {

// y[r, :] = W · x[r, :] for r < x_rows; x is [x_rows, W.cols], y is [x_rows, W.rows].
void linear(const DeviceMatrix& w, const float* x, int x_rows, float* y, cudaStream_t stream);

// For each slot s < slots: y[s, :] = E[ids[s]] · x[s / x_divisor, :], with `experts` a device array of matrices of
// one shape (rows_out × cols) that share `format`, or, with format Mixed, each in its own.
void expert_linear(const DeviceMatrix* experts, WeightFormat format, int rows_out, int cols, const int* ids, int slots,
                   const float* x, int x_divisor, float* y, cudaStream_t stream);

// out[r, c·row_width + :] = row ids[r] of `table` as fp32, for `copies` copies (c < copies) of each row.
void gather_rows(const DeviceMatrix& table, const int32_t* ids, int rows, int copies, float* out, cudaStream_t stream);
void gather_rows(const DeviceMatrix& table, const int64_t* ids, int rows, int copies, float* out, cudaStream_t stream);

}  // namespace vavilov::cuda
