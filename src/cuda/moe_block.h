#pragma once
// The MoE block of a decode step (1–4 rows) on the GPU, in six launches and without the host:
//   1. the products of the block's input (router, shared expert gate and up, shared-expert gate): one GEMV launch per
//      weight format, their descriptors written once per sequence;
//   2. softmax, top-k and the step's expert plan (moe.cuh): each distinct expert among the rows' picks gets a slot
//      and the descriptors of its products, written on the device;
//   3. gate and up of every distinct expert, each read once for all rows: one GEMV launch (gemv_q4_experts for Q4:
//      a 4-row step's 3200 tiles in one wave of blocks that stage the activations once);
//   4. SwiGLU of those and of the shared expert: one launch, none when down is Q4 (its kernel stages silu(gate)·up,
//      GemvMatrix::x_up);
//   5. down of every distinct expert and of the shared expert: one GEMV launch;
//   6. the combine: y = σ(shared gate)·shared + Σ routing weight·expert, only over each row's own picks.
// When every expert matrix and the shared expert are Q4 (Flash-Next), passes of up to fused_max_rows rows take
// expert_decode.cuh's path instead: the router and the shared-expert gate in one launch; the routing (moe_route_slots,
// except in a 1-row pass, whose products blocks route the row themselves); the products (gate/up, SwiGLU and down's
// partial per 64 rows of h, in one launch); and the combine with the routing weights and the gated shared expert, in a
// fixed order — or, for a 1-row pass given output_fixed, no combine: the products add into fixed-point sums.
// Experts in formats the GEMV kernels do not read (F32, other quantizations) take the row-general path in
// sequence.cpp instead.
#include <cuda_runtime.h>

#include <utility>
#include <vector>

#include "cuda/device_model.h"
#include "cuda/expert_decode.cuh"
#include "cuda/gemv.cuh"
#include "cuda/moe.cuh"
#include "cuda/product_groups.h"

namespace vavilov::cuda {

struct MoeShape {
  int hidden = 0, inner = 0, shared_inner = 0;
  RouteShape route;
};
MoeShape moe_shape(const ModelConfig& config);

// The block's scratch memory (device pointers). Float buffers are [rows, width] for the pass's rows; the decode path
// keeps expert results per slot: expert_gate/expert_up [kMaxGemvRows·top_k, rows, inner], expert_out
// [kMaxGemvRows·top_k, rows, hidden].
struct MoeBuffers {
  const float* input = nullptr;
  float* output = nullptr;
  float *router = nullptr, *route_weights = nullptr;
  int* route_ids = nullptr;
  float *shared_gate = nullptr, *shared_up = nullptr, *shared_scale = nullptr;
  float *expert_gate = nullptr, *expert_up = nullptr, *expert_out = nullptr;
  GemvMatrix* descriptors = nullptr;  // [moe_descriptor_count(top_k)]; the fused path: ExpertSlots' matrices
  int* slot_of = nullptr;             // [moe_slot_count(top_k)]; the fused path: ExpertSlots' expert, then its count
  float* slot_weights = nullptr;      // [moe_slot_weight_count(top_k)]: ExpertSlots' weights
  float* expert_partials = nullptr;   // [expert_partial_count(...)]: the fused path's down partials
};
size_t moe_descriptor_count(int top_k);
size_t moe_slot_count(int top_k);
size_t moe_slot_weight_count(int top_k);

// One layer's decode setup, made once per sequence: whether the experts take the decode path, and the descriptors
// of the input's products grouped by format.
struct MoeDecodePlan {
  bool decodes = false;            // every expert matrix is Q4 or BF16 in the GEMV kernels' layout
  bool shared_down_joins = false;  // the shared expert's down runs in the experts' down launch
  bool swiglu_in_down = false;     // Q4 down: its kernel stages silu(gate)·up (no SwiGLU launch for the experts)
  bool fused = false;              // every expert and the shared expert Q4: expert_decode.cuh's kernels read them
  // The most rows a pass may have to take the fused launches (VAVILOV_MOE_FUSED_ROWS overrides it for measurements).
  // Measured on the H200 (docs/CUDA.md): faster than the six launches at 1 row, slower at 2–4.
  int fused_max_rows = 1;
  ExpertDecode experts;       // their arguments but the row count (fused only)
  ProductGroup inputs;        // router, shared expert gate and up, shared-expert gate
  ProductGroup fused_inputs;  // router, shared-expert gate (fused only)
};

// Reads the expert descriptors back once to check every expert's format, shape and alignment.
MoeDecodePlan plan_moe_decode(const DeviceMoe& w, const MoeShape& shape, const MoeBuffers& buffers);

// y = MoE(input) for 1–4 rows into buffers.output; needs plan.decodes. With output_fixed (only where
// moe_decode_takes_fixed), output_fixed += y in fixed point instead (expert_decode.cuh), with no combine launch.
void moe_decode(const DeviceMoe& w, const MoeShape& shape, const MoeDecodePlan& plan, const MoeBuffers& buffers,
                int rows, cudaStream_t stream, unsigned long long* output_fixed = nullptr);

// Whether moe_decode can leave a pass of `rows` rows in fixed point: the 1-row pass that routes inside its products.
bool moe_decode_takes_fixed(const MoeDecodePlan& plan, int rows);

}  // namespace vavilov::cuda
