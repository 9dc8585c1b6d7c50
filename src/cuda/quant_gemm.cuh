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

// Whether the products read m: a format they take, whole groups of 64 columns, codes aligned for their loads (8 bytes
// for Q4, 4 for Q3/Q2). quant_gemm_reads_all: every one of `count` matrices of a device array (copied to the host),
// all in `format` and of shape rows × cols (what quant_expert_gemm assumes).
bool quant_gemm_reads(const DeviceMatrix& m);
bool quant_gemm_reads_all(const DeviceMatrix* device, int count, WeightFormat format, int rows, int cols);

// How the dense form cuts the product: warp tiles (a warp owns 16 matrix rows and walks all columns for slices of up
// to 16 activation rows, decoding its weights once a slice) or block tiles (a block owns 256 matrix rows × 64
// activation rows, which it splits once into shared memory; each warp decodes its 64 matrix rows once for them and
// multiplies 64 × 32 sub-tiles). Both give the same bits; automatic takes block tiles where they fill the GPU
// (quant_gemm.cu's block_tiles_pay). The explicit choices are for tests and benchmarks.
enum class QuantGemmTiles { automatic, warp, block };

// y[r, :] = W · x[r, :] for r < x_rows. cudaErrorInvalidValue when !quant_gemm_reads(w) or x is not 16-byte
// aligned (nothing is launched: the caller takes another path); otherwise the launch's status.
cudaError_t quant_gemm(const DeviceMatrix& w, const float* x, int x_rows, float* y, cudaStream_t stream,
                       QuantGemmTiles tiles = QuantGemmTiles::automatic);

// Activation rows split once into the products' fp16 hi/lo fragments (quant_mma.cuh's split_activations, the same
// values the dense products stage), for the grouped products, which read every row in every row block of its
// expert: split once a chunk, each block only copies them (cp.async) instead of loading fp32 rows and splitting them
// again (five times a row for Flash-Next's gate and up, twenty for down). The split depends on the codes' format (its
// k-slot → column map). quant_split_bytes: the bytes of `rows` split rows of `cols` columns (16-byte aligned).
size_t quant_split_bytes(int rows, int cols);

// split = rows [0, rows) of x ([rows, cols], 16-byte aligned) split for products with matrices in `format`.
// cudaErrorInvalidValue for a format quant_gemm_takes refuses, cols not whole groups of 64, or misaligned x or split;
// otherwise the launch's status.
cudaError_t quant_split_rows(WeightFormat format, const float* x, int rows, int cols, void* split, cudaStream_t stream);

// split = rows of silu(gate) · up, elementwise (the routed experts' swiglu, the values moe.cuh's swiglu computes),
// split as quant_split_rows splits rows: the swiglu folded into down's split (gate and up stay as they were).
// cudaErrorInvalidValue as quant_split_rows, and for a null or misaligned up.
cudaError_t quant_split_swiglu_rows(WeightFormat format, const float* gate, const float* up, int rows, int cols,
                                    void* split, cudaStream_t stream);

// Where quant_expert_gemm reads and writes grouped row p: split row x_rows[p] / x_divisor and y's row y_rows[p]
// (device arrays; null: row p). With expert_prefill.cuh's `order` (grouped row → slot) as x_rows and the experts per
// token as x_divisor, the products read a chunk's rows where they are (no gathered copy); with it as y_rows they
// write slot order (no scatter). A row's result has the same bits either way.
struct GroupedRowMap {
  const int* x_rows = nullptr;
  int x_divisor = 1;
  const int* y_rows = nullptr;
};

// For every expert e < experts_count with counts[e] > 0: y[offsets[e] + i, :] = E[e] · x[offsets[e] + i, :] for
// i < counts[e] (rows mapped by `map`), where `experts` is a device array of matrices of one format and shape rows_out
// × cols that quant_gemm_reads_all accepted, split_x holds x's rows as quant_split_rows split them for `format` and y
// is [*, rows_out]; counts and offsets are device arrays (expert_prefill.cuh's grouping). cudaErrorInvalidValue for a
// shape or format it does not take or a map's x_divisor < 1; otherwise the launch's status.
cudaError_t quant_expert_gemm(const DeviceMatrix* experts, WeightFormat format, int experts_count, int rows_out,
                              int cols, const int* counts, const int* offsets, const void* split_x, float* y,
                              cudaStream_t stream, const GroupedRowMap& map = {});

}  // namespace vavilov::cuda
