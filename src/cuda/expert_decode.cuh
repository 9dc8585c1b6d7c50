#pragma once
// The routed and shared experts of a decode step (1–4 rows, Q4 weights), after the router product:
//   routing:  moe_route_slots gives the step's distinct experts their slots — except in a 1-row pass (up to
//             kMaxRouteInsideExperts experts), whose products blocks each route the row themselves;
//   products: a block per (64 rows of h, expert) computes gate and up of those rows, h = silu(gate·x)·(up·x) in its
//             shared memory, and then down's product with just those 64 columns: each output row's partial for
//             (expert, group of h). h never leaves the block, so gate/up and down need no launch between them;
//   combine:  each output row's Σ over the step's experts of (the row's routing weight)·Σ over groups of the partials,
//             plus σ(shared gate)·the shared expert's, in a fixed order (no atomics: every run gives the same bits).
//             A 1-row pass given y_fixed has no combine launch: its products blocks add their weighted partials into
//             y_fixed as fixed-point integers (fixed_sum.cuh: the same bits in any order), which the hyper-connection
//             read after the block converts and clears (hc_fused_read).
// Each expert's weights are read once for all rows; a row's weight of an expert it did not pick is 0. Every matrix must
// be Q4 in the GEMV kernels' layout (gemv_reads; moe_block.cpp checks once per sequence), with whole groups of 64 in
// the expert widths.
#include <cuda_runtime.h>

#include "cuda/device_matrix.h"
#include "cuda/moe.cuh"

namespace vavilov::cuda {

constexpr int kMaxRouteInsideExperts = 512;  // a 1-row pass routes inside the products blocks up to this many experts

struct ExpertDecode {
  DeviceMatrix shared_gate, shared_up, shared_down;
  int hidden = 0, inner = 0, shared_inner = 0;
  RouteShape route;
  const float* x = nullptr;               // [rows, hidden]
  const float* logits = nullptr;          // [rows, experts]: the router's
  const float* shared_scale = nullptr;    // [rows]: the shared-expert gate's logit
  int* route_ids = nullptr;               // [rows, top_k]: the picks (every MoE path leaves them there)
  float* route_weights = nullptr;         // [rows, top_k]
  ExpertSlots slots;                      // the expert tables and the step's slots (with their descriptors)
  float* partials = nullptr;              // [expert_partial_count(...)]: the down partials
  float* y = nullptr;                     // [rows, hidden]
  unsigned long long* y_fixed = nullptr;  // [hidden], all zero on entry: y in fixed point instead (1-row passes)
};

// Routing (when the pass needs its launch), products and combine: y for `rows` rows; with p.y_fixed, y_fixed += y
// instead (cudaErrorInvalidValue unless expert_decode_takes_fixed). A 1-row pass stages x before its wait (launch.cuh's
// two-deep rule): x must be written before the launch that precedes this call, and that launch must let its dependents
// start only after its own wait, as the router product (moe_block.cpp) does.
cudaError_t expert_decode(const ExpertDecode& p, int rows, cudaStream_t stream);

// Whether a pass of `rows` rows can leave y in y_fixed: a 1-row pass that routes inside its products.
bool expert_decode_takes_fixed(const ExpertDecode& p, int rows);

// Floats of ExpertDecode::partials for passes of up to kMaxGemvRows rows.
size_t expert_partial_count(int top_k, int inner, int shared_inner, int hidden);

}  // namespace vavilov::cuda
