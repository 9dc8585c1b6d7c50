#pragma once
// The routed and shared experts of a decode step (1–4 rows, Q4 weights) in two launches, after moe_route_slots:
//   products: a block per (64 rows of h, expert) computes gate and up of those rows, h = silu(gate·x)·(up·x) in its
//             shared memory, and then down's product with just those 64 columns: each output row's partial for
//             (expert, group of h). h never leaves the block, so gate/up and down need no launch between them;
//   combine:  each output row's Σ over the step's experts of (the row's routing weight)·Σ over groups of the partials,
//             plus σ(shared gate)·the shared expert's, in a fixed order (no atomics: every run gives the same bits).
// Each expert's weights are read once for all rows; a row's weight of an expert it did not pick is 0. Every matrix must
// be Q4 in the GEMV kernels' layout (gemv_reads; moe_block.cpp checks once per sequence), with whole groups of 64 in
// the expert widths.
#include <cuda_runtime.h>

#include "cuda/device_matrix.h"
#include "cuda/moe.cuh"

namespace vavilov::cuda {

struct ExpertDecode {
  DeviceMatrix shared_gate, shared_up, shared_down;
  int hidden = 0, inner = 0, shared_inner = 0, top_k = 0;
  const float* x = nullptr;                   // [rows, hidden]
  const float* shared_scale = nullptr;        // [rows]: the shared-expert gate's logit
  const GemvMatrix* slot_matrices = nullptr;  // ExpertSlots::matrices (an empty slot: rows = 0)
  const int* slot_count = nullptr;            // ExpertSlots::count
  const float* slot_weights = nullptr;        // ExpertSlots::weights
  float* partials = nullptr;                  // [expert_partial_count(...)]: the down partials
  float* y = nullptr;                         // [rows, hidden]
};

// The partials of `rows` rows with `selections` = rows·top_k (the grid's bound on the slot count; the shared expert's
// are at slot `selections`).
cudaError_t expert_products(const ExpertDecode& p, int rows, int selections, cudaStream_t stream);

// y from the partials.
cudaError_t expert_combine(const ExpertDecode& p, int rows, int selections, cudaStream_t stream);

// Floats of ExpertDecode::partials for passes of up to kMaxGemvRows rows.
size_t expert_partial_count(int top_k, int inner, int shared_inner, int hidden);

}  // namespace vavilov::cuda
