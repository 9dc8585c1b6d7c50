#pragma once
// The MoE block's own kernels: router softmax and top-k (with, for decode steps, the list of distinct experts and
// the GEMV descriptors of their products, written on the device), SwiGLU, and the weighted combine with the shared
// expert. The matrix products themselves are gemv.cuh's (1–4 rows) or linear.cuh's.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device_matrix.h"
#include "cuda/gemv.cuh"

namespace vavilov::cuda {

constexpr int kMaxMoeExperts = 2048;  // router probabilities of one row fit in a warp's registers (64 a lane)
constexpr int kMaxMoeTopK = 32;       // one lane per selected expert

struct RouteShape {
  int experts = 0, top_k = 0;
  bool norm_topk = false;
};

// The GEMV descriptor of y = m·x (Q4 or BF16 m; x [batch, m.cols], y [batch, m.rows]).
__host__ __device__ inline GemvMatrix gemv_matrix(const DeviceMatrix& m, const float* x, float* y) {
  GemvMatrix g;
  g.rows = m.rows;
  g.cols = m.cols;
  g.x = x;
  g.y = y;
  if (m.format == WeightFormat::BF16) {
    g.dense = static_cast<const __nv_bfloat16*>(m.data);
  } else {
    g.codes = static_cast<const uint32_t*>(m.data);
    g.scales = reinterpret_cast<const __nv_bfloat16*>(m.scales);
    g.biases = reinterpret_cast<const __nv_bfloat16*>(m.biases);
  }
  return g;
}

// Softmax over each row's router logits [rows, experts], then its top_k experts by probability (equal probabilities:
// the lower index first, as the CPU's partial_sort), their weights renormalised to sum 1 when norm_topk.
// ids, weights: [rows, top_k] in selection order.
void moe_route(const RouteShape& shape, const float* logits, int rows, int* ids, float* weights, cudaStream_t stream);

// What a decode step's routing also writes so that the experts' products run without the host: the distinct experts
// of all rows (first-come order) become slots j; for each, descriptors of gate and up (x = the block's input, all
// rows; y = gate_out/up_out + j·rows·inner) at gate_up[2j], [2j + 1], and of down (x = gate_out slot j after SwiGLU,
// y = down_out + j·rows·hidden) at down[j], with x_up = up_out slot j when swiglu_in_down (the down kernel stages
// silu(gate)·up itself). Descriptors of slots past the distinct count have rows = 0 (no work).
// shared_down, when its rows > 0, is written at down[rows·top_k]. slot_of[s] is the slot of selection s (row
// s / top_k); slot_of[rows·top_k] the number of distinct experts.
struct ExpertPlan {
  const DeviceMatrix *gate = nullptr, *up = nullptr, *down = nullptr;  // device arrays, one matrix per expert
  int inner = 0, hidden = 0;
  const float* x = nullptr;
  float *gate_out = nullptr, *up_out = nullptr, *down_out = nullptr;
  GemvMatrix *gate_up = nullptr, *down_products = nullptr;  // [2·rows·top_k], [rows·top_k + 1]
  GemvMatrix shared_down;
  int* slot_of = nullptr;  // [rows·top_k + 1]
  bool swiglu_in_down = false;
};

// moe_route for 1–4 rows (a cluster of a block a row, the 1-row products' block routing), then the plan above.
void moe_route_and_plan(const RouteShape& shape, const float* logits, int rows, int* ids, float* weights,
                        const ExpertPlan& plan, cudaStream_t stream);

// A decode step's distinct experts, for kernels that take each expert's matrices from the DeviceMatrix arrays
// themselves (expert_decode.cuh): the experts of all rows' picks in first-come order become slots 0..count−1.
// With `matrices` set, also each slot's descriptors, so that the expert kernels read one value before the weights.
struct ExpertSlots {
  int* expert = nullptr;     // [kMaxGemvRows·top_k]: slot j's expert
  int* count = nullptr;      // the number of slots
  float* weights = nullptr;  // [slot, kMaxGemvRows]: row b's routing weight of the slot's expert, 0 where b did not
                             // pick it (and for b ≥ rows)
  const DeviceMatrix *gate = nullptr, *up = nullptr, *down = nullptr;  // device arrays, one matrix per expert
  GemvMatrix* matrices = nullptr;  // [3·kMaxGemvRows·top_k]: slot j's gate, up, down at 3j, 3j + 1, 3j + 2 (x and y
                                   // unset); rows = 0 for the slots from the count to rows·top_k
};

// moe_route for 1–4 rows (one block: a row with its 16 warps, the experts' keys sorted per warp and merged in a tree;
// 2–4 rows of up to 512 experts a warp each), then the slots above.
void moe_route_slots(const RouteShape& shape, const float* logits, int rows, int* ids, float* weights,
                     const ExpertSlots& slots, cudaStream_t stream);

// gate = silu(gate)·up over n values.
void swiglu(float* gate, const float* up, int64_t n, cudaStream_t stream);

// swiglu over the first slot_of[slots] (the distinct count) blocks of `block` values of expert_gate/expert_up, and
// over the shared expert's `shared` values, in one launch.
void swiglu_slots(float* expert_gate, const float* expert_up, int64_t block, const int* slot_of, int slots,
                  float* shared_gate, const float* shared_up, int64_t shared, cudaStream_t stream);

// y[r, :] = σ(shared_gate[r])·y[r, :] + Σ_j weights[r·k + j]·expert_out[r·k + j, :].
void moe_combine(float* y, const float* shared_gate, const float* weights, const float* expert_out, int rows, int top_k,
                 int hidden, cudaStream_t stream);

// The same with the experts' outputs per distinct slot: expert_out[(slot_of[r·k + j]·rows + r)·hidden + :].
void moe_combine_slots(float* y, const float* shared_gate, const float* weights, const int* slot_of,
                       const float* expert_out, int rows, int top_k, int hidden, cudaStream_t stream);

}  // namespace vavilov::cuda
