#pragma once
// One row of router logits routed by a whole block (softmax, top-k as the CPU picks), shared by moe_route_slots and
// route_plan_kernel (a block a row of a 2–4-row pass, moe.cu) and the 1-row expert products, which route inside each
// of their blocks (expert_decode.cu).
#include <cmath>

#include "cuda/device_math.cuh"
#include "cuda/device_matrix.h"
#include "cuda/moe.cuh"

namespace vavilov::cuda::route_block {

constexpr unsigned kFullMask = 0xffffffffu;

__device__ inline float warp_max(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// Before the wait: the expert descriptor arrays (fixed for the sequence) into L2, so that the reads of the picked
// experts' descriptors after the routing hit there.
__device__ inline void prefetch_expert_tables(const DeviceMatrix* gate, const DeviceMatrix* up,
                                              const DeviceMatrix* down, int experts) {
  constexpr int kLine = 128;
  const int lines = int((size_t(experts) * sizeof(DeviceMatrix) + kLine - 1) / kLine);
  for (int i = int(threadIdx.x); i < 3 * lines; i += int(blockDim.x)) {
    const DeviceMatrix* table = i < lines ? gate : i < 2 * lines ? up : down;
    const char* line = reinterpret_cast<const char*>(table) + size_t(i % lines) * kLine;
    asm volatile("prefetch.global.L2 [%0];" ::"l"(line));
  }
}

// A row is routed by the whole block: its warps (kRouteBlockWarps unless the caller says), each holding 32·PerThread
// experts (expert (c·warps + warp)·32 + lane for c < PerThread), sort their keys and merge them in a tree, so that no
// step is a serial pass over all experts. A key orders as the CPU does: probability descending, then index
// ascending; NaN probabilities after every real one (by index), padding past the last expert after everything.
constexpr int kRouteBlockWarps = 16;
constexpr int kRouteBlockThreads = kRouteBlockWarps * 32;
static_assert(kMaxMoeTopK <= 32, "a warp's sorted list holds the top 32");

__device__ inline unsigned long long route_key(float prob, int expert) {
  const unsigned rank = prob == prob ? __float_as_uint(prob) + 1u : 0u;  // probabilities are ≥ +0 or NaN
  return (static_cast<unsigned long long>(rank) << 32) | static_cast<unsigned long long>(~unsigned(expert));
}

__device__ inline int key_expert(unsigned long long key) { return int(~unsigned(key & 0xffffffffu)); }

// Keeps the larger key of the lane pair (lane, lane ^ offset) at the lane where `keep_max` holds.
__device__ inline unsigned long long exchange(unsigned long long key, int offset, bool keep_max) {
  const unsigned long long other = __shfl_xor_sync(kFullMask, key, offset);
  return (other > key) == keep_max ? other : key;
}

// The warp's 32 keys sorted descending across lanes (bitonic sort: lane 0 ends with the largest).
__device__ inline unsigned long long sort_warp(unsigned long long key) {
  const int lane = int(threadIdx.x) % 32;
  for (int size = 2; size <= 32; size <<= 1)
    for (int offset = size / 2; offset > 0; offset >>= 1)
      key = exchange(key, offset, ((lane & offset) == 0) == ((lane & size) == 0));
  return key;
}

// The 32 largest of two descending lists (`reversed` read in ascending order), descending: their lane-wise maximum is
// the top half, bitonic, which five exchange steps sort.
__device__ inline unsigned long long merge_top(unsigned long long key, unsigned long long reversed) {
  const int lane = int(threadIdx.x) % 32;
  key = key > reversed ? key : reversed;
  for (int offset = 16; offset > 0; offset >>= 1) key = exchange(key, offset, (lane & offset) == 0);
  return key;
}

template <int Warps>
__device__ inline float block_reduce(float v, float* partial, bool is_max) {
  v = is_max ? warp_max(v) : warp_sum(v);
  __syncthreads();  // an earlier call's readers are done with `partial`
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  float total = partial[0];
  for (int w = 1; w < Warps; ++w) total = is_max ? fmaxf(total, partial[w]) : total + partial[w];
  return total;
}

// One row with the whole block of Warps warps: softmax (exp(l − max) / Σ, the sum in a fixed order), the top_k keys,
// and the picks in selection order: ids/weights in global memory (unless null) and in `picked`/`picked_weight`
// (shared). Selection j is kept by lane j of warp 0, which sums the renormalising total in selection order like the
// CPU.
template <int PerThread, int Warps = kRouteBlockWarps>
__device__ void route_row_by_block(const RouteShape& s, const float* logits, int* ids, float* weights, int* picked,
                                   float* picked_weight) {
  __shared__ float prob[Warps * 32 * PerThread];
  __shared__ float partial[Warps];
  __shared__ unsigned long long lists[Warps][32];
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  float value[PerThread];
  float peak = -INFINITY;
#pragma unroll
  for (int c = 0; c < PerThread; ++c) {
    const int e = (c * Warps + warp) * 32 + lane;
    value[c] = e < s.experts ? logits[e] : -INFINITY;
    peak = fmaxf(peak, value[c]);
  }
  peak = block_reduce<Warps>(peak, partial, true);
  float sum = 0.0f;
#pragma unroll
  for (int c = 0; c < PerThread; ++c) {
    const int e = (c * Warps + warp) * 32 + lane;
    value[c] = e < s.experts ? expf(value[c] - peak) : 0.0f;
    sum += value[c];
  }
  sum = block_reduce<Warps>(sum, partial, false);
  unsigned long long best = 0;
#pragma unroll
  for (int c = 0; c < PerThread; ++c) {
    const int e = (c * Warps + warp) * 32 + lane;
    unsigned long long key = 0;  // padding
    if (e < s.experts) {
      prob[e] = value[c] / sum;
      key = route_key(prob[e], e);
    }
    key = sort_warp(key);
    best = c == 0 ? key : merge_top(best, __shfl_sync(kFullMask, key, 31 - lane));
  }
  for (int half = Warps / 2; half > 0; half /= 2) {
    if (warp < 2 * half && warp >= half) lists[warp][lane] = best;
    __syncthreads();
    if (warp < half) best = merge_top(best, lists[warp + half][31 - lane]);
    __syncthreads();  // the next level's writers wait for this level's readers
  }
  if (warp != 0) return;
  const int expert = key_expert(best);
  const float kept = lane < s.top_k ? prob[expert] : 0.0f;
  float total = 0.0f;
  for (int j = 0; j < s.top_k; ++j) total += __shfl_sync(kFullMask, kept, j);
  if (lane < s.top_k) {
    const float weight = s.norm_topk ? kept / total : kept;
    if (ids) ids[lane] = expert, weights[lane] = weight;
    picked[lane] = expert;
    picked_weight[lane] = weight;
  }
}

}  // namespace vavilov::cuda::route_block
