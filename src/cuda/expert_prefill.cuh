#pragma once
// Routed experts of a prefill chunk, grouped by expert: the chunk's (row, slot) pairs are sorted by expert id on the
// device (counting sort, stable: slots of one expert keep their order), the rows gathered into one block per expert so
// that each active expert is one GEMM (gemm.cuh), and the results scattered back to slot order.
#include <cuda_runtime.h>

#include <vector>

#include "cuda/gemm.cuh"

namespace vavilov::cuda {

// For ids [slots] (each < experts ≤ 2048): counts[e] = slots routed to e, offsets[e] = Σ_{e' < e} counts[e'];
// order[p] = the slot at grouped position p (sorted by expert, then slot); position[s] = the grouped position of
// slot s (order's inverse).
void group_by_expert(const int* ids, int slots, int experts, int* counts, int* offsets, int* order, int* position,
                     cudaStream_t stream);

// The non-empty groups, read from the device counts (waits for the stream): one {expert, offset, count} per active
// expert, in expert order. The status of the copy.
cudaError_t active_experts(const int* counts, int experts, std::vector<ExpertGroup>& groups, cudaStream_t stream);

// out[p, :] = x[order[p] / x_divisor, :] for p < slots (x_divisor = experts per token: slot s belongs to row s / k).
void gather_grouped_rows(const float* x, const int* order, int slots, int x_divisor, int cols, float* out,
                         cudaStream_t stream);

// out[s, :] = grouped[position[s], :] for s < slots.
void scatter_grouped_rows(const float* grouped, const int* position, int slots, int cols, float* out,
                          cudaStream_t stream);

}  // namespace vavilov::cuda
