#pragma once
// Decode-time matrix-vector products on the GPU for 1–4 activation rows: every weight byte is read once with 16-byte
// loads and dequantized in registers. One matrix passes by value (no descriptor in device memory); several (e.g. a
// layer's selected experts) can run in one launch from a device array of descriptors.
// Self-contained (CUDA runtime only) so that it also builds where the engine's host libraries are absent.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace vavilov::cuda {

constexpr int kMaxGemvRows = 4;
constexpr int kQuantGroup = 64;

// One weight matrix W [rows, cols] with y = W x. Quantized (Q4, Q3, Q2): each row's codes packed densely,
// least-significant bit first, code i at bit i·bits of the row (Q4: 8 per uint32 word), bf16 scale and bias per group
// of 64 columns, w = scale·q + bias (MLX's layout). BF16, F32: dense rows, each 16-byte aligned.
struct GemvMatrix {
  const uint32_t* codes = nullptr;        // quantized codes [rows, cols·bits / 32]; Q4: 8-byte aligned
  const __nv_bfloat16* scales = nullptr;  // quantized [rows, cols / 64]
  const __nv_bfloat16* biases = nullptr;
  const __nv_bfloat16* dense = nullptr;  // BF16 [rows, cols]
  const float* dense_f32 = nullptr;      // F32 [rows, cols]
  int rows = 0, cols = 0;
  const float* x = nullptr;  // [batch, cols] activations for this matrix
  float* y = nullptr;        // [batch, rows] results
  // Quantized formats only: when set, the activations are silu(x)·x_up ([batch, cols] too), SwiGLU computed while the
  // block stages them (the MoE experts' down products), the same fp32 value the separate SwiGLU kernel writes.
  const float* x_up = nullptr;
};

// How a launch divides its work, chosen from the shape and batch alone (so results never depend on the device or on
// scheduling): a block holds `tiles` tiles of 16 output rows (dense formats: rows) × `splits` warps per tile, each
// warp summing one slice of the columns. Partial sums are added in slice order, so every run gives the same bits.
struct GemvSplit {
  int tiles = 1, splits = 1;
};
GemvSplit gemv_quant_split(int rows, int cols, int count, int batch);
GemvSplit gemv_dense_split(int rows, int cols, int count);

// Whether a grouped launch's descriptors are written by the kernels of a pass (the MoE block's routing writes its
// experts') or stay fixed while the stream runs (written once, e.g. a sequence's product groups). The kernels are
// dependent launches (launch.cuh) that read their weights before waiting for the previous kernel; fixed descriptors
// may be read then too, the others only after the wait — except written_two_back: written in the pass by a kernel at
// least two launches back, every launch in between waiting for its producers before it lets its dependents start
// (launch.cuh's two-deep rule), so they are final when this launch starts and are read before the wait, from L2
// (coherent loads; the MoE experts' down launch, whose descriptors the routing wrote before gate/up ran).
enum class GemvDescriptors { written_in_pass, fixed, written_two_back };

// Runs `count` matrices described by the device array `matrices`, each against `batch` (1–4) activation rows;
// max_rows/max_cols bound them (grid and shared-memory size). All matrices of one call share the format.
// cols must be a multiple of 64 (quantized), 8 (BF16) or 4 (F32); x 16-byte aligned. The quantized kernels run on the
// tensor cores with the activations split exactly into two fp16 halves (error ≤ 2^-22 relative, quant_mma.cuh), or,
// for Q4 at 1–2 rows, into three signed-byte digits (error ≤ 2^-22 of a group's peak, quant_imma.cuh); a block stages
// those in shared memory: 4.125·batch·max_cols bytes, or (8 + batch/8)·max_cols for the digits, must fit (223 KB on
// Hopper: max_cols ≤ 13824 at batch 4).
cudaError_t gemv_q4(const GemvMatrix* matrices, int count, int max_rows, int max_cols, int batch, cudaStream_t stream,
                    GemvDescriptors descriptors = GemvDescriptors::written_in_pass);
cudaError_t gemv_q3(const GemvMatrix* matrices, int count, int max_rows, int max_cols, int batch, cudaStream_t stream,
                    GemvDescriptors descriptors = GemvDescriptors::written_in_pass);
cudaError_t gemv_q2(const GemvMatrix* matrices, int count, int max_rows, int max_cols, int batch, cudaStream_t stream,
                    GemvDescriptors descriptors = GemvDescriptors::written_in_pass);
cudaError_t gemv_bf16(const GemvMatrix* matrices, int count, int max_rows, int max_cols, int batch, cudaStream_t stream,
                      GemvDescriptors descriptors = GemvDescriptors::written_in_pass);

// Q4 matrices whose descriptors are fixed (GemvDescriptors::fixed) and whose heights the host knows (matrix_rows[i] ≤
// max_rows, i < count): a grid of only the row blocks that hold rows (up to 8 matrices; more take the grid of the
// tallest), with the work split chosen from all the heights together (a GDN layer's in_qkv, in_z, in_b and in_a).
cudaError_t gemv_q4_fixed(const GemvMatrix* matrices, const int* matrix_rows, int count, int max_rows, int max_cols,
                          int batch, cudaStream_t stream);

// Q4 matrices whose descriptors are written in the pass (the MoE experts'): as gemv_q4 while their tiles fit one wave
// of warps; past that, blocks that each stage their activations once and sum gemv_expert_rounds(...) runs of tiles in
// turn, whole rows a warp (same sums as gemv_q4 with one slice). settled_x: when every matrix's x is this array of
// max_cols columns, written two launches back or earlier (launch.cuh's two-deep rule), so that those blocks may stage
// it before their wait; nullptr: staged after it.
cudaError_t gemv_q4_experts(const GemvMatrix* matrices, int count, int max_rows, int max_cols, int batch,
                            cudaStream_t stream, GemvDescriptors descriptors = GemvDescriptors::written_in_pass,
                            const float* settled_x = nullptr);
// Those runs a block of gemv_q4_experts sums (1: gemv_q4's kernel and split).
int gemv_expert_rounds(int count, int max_rows, int max_cols, int batch);

// One matrix (cuda::linear's formats), its descriptor passed by value as a kernel parameter.
cudaError_t gemv_q4(const GemvMatrix& matrix, int batch, cudaStream_t stream);
cudaError_t gemv_q3(const GemvMatrix& matrix, int batch, cudaStream_t stream);
cudaError_t gemv_q2(const GemvMatrix& matrix, int batch, cudaStream_t stream);
cudaError_t gemv_bf16(const GemvMatrix& matrix, int batch, cudaStream_t stream);
cudaError_t gemv_f32(const GemvMatrix& matrix, int batch, cudaStream_t stream);
// One Q4 matrix with a given split (tiles · splits ≤ 16 warps), for the benchmark's split sweeps.
cudaError_t gemv_q4(const GemvMatrix& matrix, int batch, GemvSplit split, cudaStream_t stream);

// launch(std::integral_constant<int, B>{}) for the batch size B (1–4): the kernels take it as a template argument.
template <typename Launch>
cudaError_t with_batch(int batch, Launch&& launch) {
  switch (batch) {
    case 1:
      return launch(std::integral_constant<int, 1>{});
    case 2:
      return launch(std::integral_constant<int, 2>{});
    case 3:
      return launch(std::integral_constant<int, 3>{});
    case 4:
      return launch(std::integral_constant<int, 4>{});
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace vavilov::cuda
