#pragma once
// Top-k by sorting keys (the MoE routing of route_slots_kernel in moe.cu, and of the 1-row gate/up blocks in
// expert_decode.cu, which must pick exactly the same experts): each router probability becomes a 64-bit key that orders
// as the CPU ranks (probability descending, then index ascending; NaN after every real one, padding 0 after
// everything), a warp sorts 32 keys by shuffles, and two sorted lists merge into their top 32. Keys are distinct (they
// hold the index), so the top k are one set in one order, whatever the sorting network.
#include <cuda_runtime.h>

namespace vavilov::cuda {

__device__ inline unsigned long long route_key(float prob, int expert) {
  const unsigned rank = prob == prob ? __float_as_uint(prob) + 1u : 0u;  // probabilities are ≥ +0 or NaN
  return (static_cast<unsigned long long>(rank) << 32) | static_cast<unsigned long long>(~unsigned(expert));
}

__device__ inline int key_expert(unsigned long long key) { return int(~unsigned(key & 0xffffffffu)); }

// Keeps the larger key of the lane pair (lane, lane ^ offset) at the lane where `keep_max` holds.
__device__ inline unsigned long long exchange(unsigned long long key, int offset, bool keep_max) {
  const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, offset);
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

}  // namespace vavilov::cuda
