#include <cmath>

#include "cuda/device_math.cuh"
#include "cuda/launch.cuh"
#include "cuda/ops.cuh"

namespace vavilov::cuda {

namespace {

__global__ void rms_norm_kernel(const float* x, int64_t x_row_stride, int64_t x_group_stride, int groups, int width,
                                const float* weight, int64_t weight_group_stride, float eps, float* out) {
  wait_for_producers();
  allow_dependents();
  const int r = blockIdx.x / groups, g = blockIdx.x % groups;
  const float* xg = x + r * x_row_stride + g * x_group_stride;
  float sum = 0.0f;
  for (int i = threadIdx.x; i < width; i += blockDim.x) sum += xg[i] * xg[i];
  const float scale = rms_scale(block_sum(sum), width, eps);
  const float* wg = weight + g * weight_group_stride;
  float* og = out + (size_t(r) * groups + g) * width;
  for (int i = threadIdx.x; i < width; i += blockDim.x) og[i] = xg[i] * scale * (1.0f + wg[i]);
}

__global__ void add_to_streams_kernel(float* x, const float* e, int rows, int streams, int hidden) {
  wait_for_producers();
  allow_dependents();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(rows) * streams * hidden) return;
  x[i] += e[(i / hidden / streams) * hidden + i % hidden];
}

}  // namespace

void rms_norm(const float* x, int64_t x_row_stride, int64_t x_group_stride, int rows, int groups, int width,
              const float* weight, int64_t weight_group_stride, float eps, float* out, cudaStream_t stream) {
  if (rows * groups == 0) return;
  // One block a group, with enough threads that each reads about four values: a decode step normalises a few
  // groups of thousands of values, and 128 threads left each block latency-bound (16 µs for 2560 values).
  const int threads = norm_threads(width);
  launch_dependent(rms_norm_kernel, rows * groups, threads, 0, stream, x, x_row_stride, x_group_stride, groups, width,
                   weight, weight_group_stride, eps, out);
}

void add_to_streams(float* x, const float* e, int rows, int streams, int hidden, cudaStream_t stream) {
  const int64_t n = int64_t(rows) * streams * hidden;
  if (n) launch_dependent(add_to_streams_kernel, blocks_for(n, 256), 256, 0, stream, x, e, rows, streams, hidden);
}

}  // namespace vavilov::cuda
