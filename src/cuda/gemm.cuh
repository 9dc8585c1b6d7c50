#pragma once
// Matrix products of prefill chunks (more than four activation rows) on cuBLAS: dense products for `linear()` and the
// grouped products of routed experts. Dense F32 weights go to the GEMM as they are; other weights are widened
// (dequantised, `scale·q + bias` in fp32 as the CPU does) block by block into a bounded scratch first.
#include <cuda_runtime.h>

#include <vector>

#include "cuda/device_matrix.h"

namespace vavilov::cuda {

// The arithmetic of the products. Fp32 (default): fp32 inputs and accumulation (SGEMM), error ≤ cols·2⁻²⁴·Σ|w·x|
// like any fp32 dot product; the only precision that keeps the GPU logits within 1e-3 of the CPU's by construction.
// Tf32: inputs rounded to 10-bit mantissas on the tensor cores (adds ≤ 2·2⁻¹⁰·Σ|w·x|); Bf16: weights and activations
// rounded to bf16, fp32 accumulation (adds ≤ 2·2⁻⁸·Σ|w·x|; dense products only, routed experts stay fp32 under
// Bf16: cuBLAS's grouped GEMM refuses bf16 inputs with fp32 outputs). Tf32/Bf16 exist to be measured
// (VAVILOV_GEMM_PRECISION=fp32|tf32|bf16, read once; anything else is an error naming the variable). Tf32 and Bf16 also
// switch the chunked GDN prefill to one-pass TF32 and to bf16 products (gdn_prefill_products(),
// cuda/gated_deltanet.cuh).
enum class GemmPrecision { Fp32, Tf32, Bf16 };
GemmPrecision gemm_precision();
void set_gemm_precision(GemmPrecision precision);

// Bytes of the scratch that widened weights go through (row blocks of a dense matrix, batches of experts): 256 MiB
// unless set (tests set less to make the block loops run).
constexpr size_t kWeightScratchBytes = size_t(256) << 20;
void set_weight_scratch_limit(size_t bytes);

// The formats the GEMMs widen (F32, BF16, Q4); the others run on the generic kernels.
bool gemm_widens(WeightFormat format);

// y[r, :] = W · x[r, :] for r < x_rows through cuBLAS. False when cuBLAS or its scratch is unavailable or the format
// is not one gemm_widens takes (the caller's generic kernels then run the product).
bool gemm_linear(const DeviceMatrix& w, const float* x, int x_rows, float* y, cudaStream_t stream);

// One routed expert's share of a prefill chunk: rows [offset, offset + count) of the grouped activations.
struct ExpertGroup {
  int expert, offset, count;
};

// For every group g: y[offset_g + i, :] = E[expert_g] · x[offset_g + i, :] for i < count_g, where `experts` is a device
// array of matrices of one format and shape (rows_out × cols), x is [*, cols] and y [*, rows_out]. Experts are widened
// in batches that fit kWeightScratchBytes, each batch one grouped cuBLAS call. False when cuBLAS is unavailable or
// gemm_widens(format) is false.
bool grouped_expert_gemm(const DeviceMatrix* experts, WeightFormat format, int rows_out, int cols,
                         const std::vector<ExpertGroup>& groups, const float* x, float* y, cudaStream_t stream);

}  // namespace vavilov::cuda
