#pragma once
// The routed and shared experts of a decode step (1–4 rows, Q4 weights) in two launches, after moe_route_slots:
//   gate/up: every distinct expert's gate and up rows, and the shared expert's, with SwiGLU applied where the two
//            meet, so h = silu(gate·x)·(up·x) is all that is written;
//   down:    each output row's Σ over the step's experts of (the row's routing weight)·down·h, plus
//            σ(shared gate)·shared down·h_shared, in a fixed order (no atomics: every run gives the same bits).
// Each expert's weights are read once for all rows; a row's weight of an expert it did not pick is 0. Every matrix must
// be Q4 in the GEMV kernels' layout (gemv_reads; moe_block.cpp checks once per sequence).
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
  const float* slot_weights = nullptr;        // ExpertSlots::weights
  float* h = nullptr;                         // [rows·top_k slots, rows, inner]
  float* shared_h = nullptr;                  // [rows, shared_inner]
  float* y = nullptr;                         // [rows, hidden]
};

// h and shared_h for `rows` rows with `selections` = rows·top_k (the grid's bound on the slot count).
cudaError_t expert_gate_up(const ExpertDecode& p, int rows, int selections, cudaStream_t stream);

// y from h and shared_h.
cudaError_t expert_down(const ExpertDecode& p, int rows, cudaStream_t stream);

}  // namespace vavilov::cuda
