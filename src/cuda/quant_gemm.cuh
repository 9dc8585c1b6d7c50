#pragma once
// Products of many activation rows with Q4/Q3/Q2 matrices on the tensor cores, straight from the codes (prefill
// chunks): the codes are decoded in registers as in the decode GEMV (quant_mma.cuh) and every decoded weight fragment
// is multiplied with up to 16 rows at once. Nothing is widened into scratch (unlike gemm.cuh's cuBLAS path), and the
// grouped expert form reads the per-expert counts on the device, so the host never waits for them.
//
// Each output is the same sum in the same order whatever the other rows are, so a row's result does not depend on
// the chunk or on which rows share its expert. Accuracy: activations enter the tensor cores as two fp16 halves (22
// significant bits), codes exactly, sums in fp32 — like the decode GEMV, within 1e-5 of Σ|w·x| in the tests.
#include <cuda_runtime.h>

#include "cuda/device_matrix.h"

namespace vavilov::cuda {

// The formats these products take.
bool quant_gemm_takes(WeightFormat format);

// y[r, :] = W · x[r, :] for r < x_rows (W quant_gemm_takes, cols a multiple of 64). cudaErrorInvalidValue for a
// matrix it does not take; otherwise the launch's status.
cudaError_t quant_gemm(const DeviceMatrix& w, const float* x, int x_rows, float* y, cudaStream_t stream);

// For every expert e < experts_count with counts[e] > 0: y[offsets[e] + i, :] = E[e] · x[offsets[e] + i, :] for
// i < counts[e], where `experts` is a device array of matrices of one format (quant_gemm_takes) and shape
// rows_out × cols (cols a multiple of 64), x is [*, cols] and y [*, rows_out]; counts and offsets are device arrays
// (expert_prefill.cuh's grouping). cudaErrorInvalidValue for a shape or format it does not take; otherwise the
// launch's status.
cudaError_t quant_expert_gemm(const DeviceMatrix* experts, WeightFormat format, int experts_count, int rows_out,
                              int cols, const int* counts, const int* offsets, const float* x, float* y,
                              cudaStream_t stream);

}  // namespace vavilov::cuda
