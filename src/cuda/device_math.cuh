#pragma once
// Device-side helpers shared by the kernel files: activations and warp/block reductions (fp32).
#include <cuda_runtime.h>

#include <cmath>

namespace vavilov::cuda {

__device__ inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ inline float silu(float x) { return x / (1.0f + expf(-x)); }
__device__ inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

__device__ inline float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The sum of v over the block, returned to every thread (every thread of the block must call it).
__device__ inline float block_sum(float v) {
  __shared__ float partial[32];
  v = warp_sum(v);
  __syncthreads();  // an earlier call's readers are done with `partial`
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < int(blockDim.x + 31) / 32; ++w) total += partial[w];
  return total;
}

__device__ inline float block_max(float v) {
  __shared__ float partial[32];
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  __syncthreads();
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  float peak = -INFINITY;
  for (int w = 0; w < int(blockDim.x + 31) / 32; ++w) peak = fmaxf(peak, partial[w]);
  return peak;
}

// 1 / RMS of sum_of_squares over `width` values (the zero-centred RMSNorm scale).
__device__ inline float rms_scale(float sum_of_squares, int width, float eps) {
  return 1.0f / sqrtf(sum_of_squares / float(width) + eps);
}

// Threads for a block that normalises groups of `width` values: about four values a thread (128–1024).
inline int norm_threads(int width) {
  const int threads = (width / 4 + 31) / 32 * 32;
  return threads < 128 ? 128 : threads > 1024 ? 1024 : threads;
}

inline int blocks_for(int64_t n, int threads) { return int((n + threads - 1) / threads); }

}  // namespace vavilov::cuda
