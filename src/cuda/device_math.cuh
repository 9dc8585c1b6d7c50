#pragma once
// Device-side helpers shared by the kernel files: activations and warp/block reductions (fp32).
#include <cuda_runtime.h>

#include <cmath>

namespace vavilov::cuda {

__device__ inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ inline float silu(float x) { return x / (1.0f + expf(-x)); }
__device__ inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// For a kernel's critical path after its wait: the hardware's reciprocal (within 2 ulp) instead of IEEE division or
// square root, whose range checks and slow-path calls lengthen the path and keep the scheduler from moving loads across
// them (bench/results/2026-12-01-h200-hc-read-s7.json). 1 / (1 + e^-x) tends to 0 correctly where e^-x overflows.
__device__ inline float fast_sigmoid(float x) { return __fdividef(1.0f, 1.0f + expf(-x)); }
__device__ inline float fast_silu(float x) { return __fdividef(x, 1.0f + expf(-x)); }
// 1 / sqrt(mean + eps) for an RMS norm, from a sum of squares and 1 / width.
__device__ inline float rms_scale(float sum_of_squares, float inverse_width, float eps) {
  return rsqrtf(fmaf(sum_of_squares, inverse_width, eps));
}

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
