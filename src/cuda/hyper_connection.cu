#include "cuda/device_math.cuh"
#include "cuda/hyper_connection.cuh"
#include "cuda/launch.cuh"

namespace vavilov::cuda {

namespace {

__global__ void hc_low_kernel(float* low, int64_t n, float streams) {
  wait_for_producers();
  allow_dependents();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) low[i] = silu(low[i] / streams);
}

__global__ void hc_combine_kernel(const float* mix, const float* normed, int rows, int streams, int hidden,
                                  float* input) {
  wait_for_producers();
  allow_dependents();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(rows) * hidden) return;
  const int64_t r = i / hidden, d = i % hidden;
  float sum = 0.0f;
  for (int s = 0; s < streams; ++s) {
    const int64_t at = (r * streams + s) * hidden + d;
    sum += sigmoid(mix[at]) * normed[at];
  }
  input[i] = sum / float(streams);
}

// One block per (row, stream): the gated write, then (optionally) the group's RMSNorm. Each thread reads back only
// the values it wrote.
__global__ void hc_write_kernel(const float* inject, const float* y, int streams, int hidden, float* stack,
                                const float* norm_weight, float eps, float* normed) {
  wait_for_producers();
  allow_dependents();
  const int rs = blockIdx.x, r = rs / streams, s = rs % streams;
  const float gate = 2.0f * sigmoid(inject[rs] / float(streams));
  float* group = stack + size_t(rs) * hidden;
  const float* out = y + size_t(r) * hidden;
  float sum = 0.0f;
  for (int d = threadIdx.x; d < hidden; d += blockDim.x) {
    const float value = group[d] + gate * out[d];
    group[d] = value;
    sum += value * value;
  }
  if (!norm_weight) return;  // uniform over the block
  const float scale = rms_scale(block_sum(sum), hidden, eps);
  const float* weight = norm_weight + size_t(s) * hidden;
  float* target = normed + size_t(rs) * hidden;
  for (int d = threadIdx.x; d < hidden; d += blockDim.x) target[d] = group[d] * scale * (1.0f + weight[d]);
}

}  // namespace

void hc_low_activation(float* low, int64_t n, int streams, cudaStream_t stream) {
  if (n) launch_dependent(hc_low_kernel, blocks_for(n, 256), 256, 0, stream, low, n, float(streams));
}

void hc_combine(const float* mix, const float* normed, int rows, int streams, int hidden, float* input,
                cudaStream_t stream) {
  const int64_t n = int64_t(rows) * hidden;
  if (n)
    launch_dependent(hc_combine_kernel, blocks_for(n, 256), 256, 0, stream, mix, normed, rows, streams, hidden, input);
}

void hc_write(const float* inject, const float* y, int rows, int streams, int hidden, float* stack,
              const float* norm_weight, float eps, float* normed, cudaStream_t stream) {
  if (rows * streams == 0) return;
  launch_dependent(hc_write_kernel, rows * streams, norm_threads(hidden), 0, stream, inject, y, streams, hidden, stack,
                   norm_weight, eps, normed);
}

}  // namespace vavilov::cuda
