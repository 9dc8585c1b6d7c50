#include <cmath>

#include "cuda/device_math.cuh"
#include "cuda/ops.cuh"

namespace vavilov::cuda {

namespace {

constexpr int kMaxConvKernel = 8;

__global__ void rms_norm_kernel(const float* x, int64_t x_row_stride, int64_t x_group_stride, int groups, int width,
                                const float* weight, int64_t weight_group_stride, float eps, float* out) {
  const int r = blockIdx.x / groups, g = blockIdx.x % groups;
  const float* xg = x + r * x_row_stride + g * x_group_stride;
  float sum = 0.0f;
  for (int i = threadIdx.x; i < width; i += blockDim.x) sum += xg[i] * xg[i];
  const float scale = rms_scale(block_sum(sum), width, eps);
  const float* wg = weight + g * weight_group_stride;
  float* og = out + (size_t(r) * groups + g) * width;
  for (int i = threadIdx.x; i < width; i += blockDim.x) og[i] = xg[i] * scale * (1.0f + wg[i]);
}

__global__ void gdn_gates_kernel(float* beta, float* decay, const float* a_log, const float* dt_bias, int rows,
                                 int heads) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= rows * heads) return;
  const int h = i % heads;
  beta[i] = sigmoid(beta[i]);
  decay[i] = -expf(a_log[h]) * softplus(decay[i] + dt_bias[h]);
}

__global__ void gdn_conv_kernel(const float* taps, int channels, int kernel, float* state, float* x, int rows,
                                float* row_states) {
  const int ch = blockIdx.x * blockDim.x + threadIdx.x;
  if (ch >= channels) return;
  const int history = kernel - 1;
  float window[kMaxConvKernel];
  for (int k = 0; k < history; ++k) window[k] = state[size_t(k) * channels + ch];
  for (int t = 0; t < rows; ++t) {
    window[history] = x[size_t(t) * channels + ch];
    float sum = 0.0f;
    for (int k = 0; k < kernel; ++k) sum += taps[ch * kernel + k] * window[k];
    x[size_t(t) * channels + ch] = silu(sum);
    for (int k = 0; k < history; ++k) window[k] = window[k + 1];
    if (row_states)
      for (int k = 0; k < history; ++k) row_states[(size_t(t) * history + k) * channels + ch] = window[k];
  }
  for (int k = 0; k < history; ++k) state[size_t(k) * channels + ch] = window[k];
}

// One warp owns `32` value columns of one head; each lane keeps its column of the dk × dv state in registers.
template <int kMaxDk>
__global__ void __launch_bounds__(32)
    gdn_delta_kernel(GdnShape s, const float* qkv, const float* beta, const float* decay, int rows, float* recurrent,
                     float* out, float* row_states) {
  const int head = blockIdx.x, lane = threadIdx.x, j = blockIdx.y * 32 + lane;
  const bool active = j < s.dv;
  const int key_head = head / (s.heads / s.key_heads);
  __shared__ float q[kMaxDk], k[kMaxDk];
  float state[kMaxDk];
  float* head_state = recurrent + size_t(head) * s.dk * s.dv;
#pragma unroll
  for (int i = 0; i < kMaxDk; ++i) state[i] = (i < s.dk && active) ? head_state[size_t(i) * s.dv + j] : 0.0f;
  const float q_scale = 1.0f / sqrtf(float(s.dk));
  for (int t = 0; t < rows; ++t) {
    const float* row = qkv + size_t(t) * s.conv_dim;
    float q_sum = 0.0f, k_sum = 0.0f;
    for (int i = lane; i < s.dk; i += 32) {
      const float a = row[key_head * s.dk + i], b = row[s.key_dim + key_head * s.dk + i];
      q[i] = a;
      k[i] = b;
      q_sum += a * a;
      k_sum += b * b;
    }
    const float q_norm = 1.0f / sqrtf(warp_sum(q_sum) + 1e-6f), k_norm = 1.0f / sqrtf(warp_sum(k_sum) + 1e-6f);
    __syncwarp();
    for (int i = lane; i < s.dk; i += 32) {
      q[i] = q[i] * q_norm * q_scale;
      k[i] = k[i] * k_norm;
    }
    __syncwarp();
    const float g = expf(decay[t * s.heads + head]), b = beta[t * s.heads + head];
    const float v = active ? row[2 * s.key_dim + head * s.dv + j] : 0.0f;
    float kv = 0.0f;
#pragma unroll
    for (int i = 0; i < kMaxDk; ++i) {
      if (i >= s.dk) break;
      state[i] *= g;
      kv += state[i] * k[i];
    }
    const float delta = b * (v - kv);
    float o = 0.0f;
#pragma unroll
    for (int i = 0; i < kMaxDk; ++i) {
      if (i >= s.dk) break;
      state[i] += k[i] * delta;
      o += state[i] * q[i];
    }
    if (active) {
      out[(size_t(t) * s.heads + head) * s.dv + j] = o;
      if (row_states) {
        float* snapshot = row_states + (size_t(t) * s.heads + head) * s.dk * s.dv;
#pragma unroll
        for (int i = 0; i < kMaxDk; ++i)
          if (i < s.dk) snapshot[size_t(i) * s.dv + j] = state[i];
      }
    }
    __syncwarp();
  }
  if (active)
#pragma unroll
    for (int i = 0; i < kMaxDk; ++i)
      if (i < s.dk) head_state[size_t(i) * s.dv + j] = state[i];
}

__global__ void gdn_gated_norm_kernel(float* core, const float* z, const float* weight, int dv, float eps,
                                      bool sigmoid_gate) {
  float* o = core + size_t(blockIdx.x) * dv;
  const float* gate = z + size_t(blockIdx.x) * dv;
  float sum = 0.0f;
  for (int j = threadIdx.x; j < dv; j += blockDim.x) sum += o[j] * o[j];
  const float scale = 1.0f / sqrtf(block_sum(sum) / float(dv) + eps);
  for (int j = threadIdx.x; j < dv; j += blockDim.x)
    o[j] = weight[j] * (o[j] * scale) * (sigmoid_gate ? sigmoid(gate[j]) : silu(gate[j]));
}

__global__ void add_to_streams_kernel(float* x, const float* e, int rows, int streams, int hidden) {
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
  rms_norm_kernel<<<rows * groups, threads, 0, stream>>>(x, x_row_stride, x_group_stride, groups, width, weight,
                                                         weight_group_stride, eps, out);
}

void gdn_gates(float* beta, float* decay, const float* a_log, const float* dt_bias, int rows, int heads,
               cudaStream_t stream) {
  if (rows * heads > 0)
    gdn_gates_kernel<<<blocks_for(rows * heads, 256), 256, 0, stream>>>(beta, decay, a_log, dt_bias, rows, heads);
}

void gdn_conv(const float* taps, int channels, int kernel, float* state, float* x, int rows, float* row_states,
              cudaStream_t stream) {
  gdn_conv_kernel<<<blocks_for(channels, 128), 128, 0, stream>>>(taps, channels, kernel, state, x, rows, row_states);
}

void gdn_delta_rule(const GdnShape& s, const float* qkv, const float* beta, const float* decay, int rows,
                    float* recurrent, float* out, float* row_states, cudaStream_t stream) {
  const dim3 grid(s.heads, (s.dv + 31) / 32);
  if (s.dk <= 16)
    gdn_delta_kernel<16><<<grid, 32, 0, stream>>>(s, qkv, beta, decay, rows, recurrent, out, row_states);
  else if (s.dk <= 32)
    gdn_delta_kernel<32><<<grid, 32, 0, stream>>>(s, qkv, beta, decay, rows, recurrent, out, row_states);
  else if (s.dk <= 64)
    gdn_delta_kernel<64><<<grid, 32, 0, stream>>>(s, qkv, beta, decay, rows, recurrent, out, row_states);
  else
    gdn_delta_kernel<128><<<grid, 32, 0, stream>>>(s, qkv, beta, decay, rows, recurrent, out, row_states);
}

void gdn_gated_norm(float* core, const float* z, const float* weight, int rows_heads, int dv, float eps,
                    bool sigmoid_gate, cudaStream_t stream) {
  if (rows_heads) gdn_gated_norm_kernel<<<rows_heads, 128, 0, stream>>>(core, z, weight, dv, eps, sigmoid_gate);
}

void add_to_streams(float* x, const float* e, int rows, int streams, int hidden, cudaStream_t stream) {
  const int64_t n = int64_t(rows) * streams * hidden;
  if (n) add_to_streams_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(x, e, rows, streams, hidden);
}

}  // namespace vavilov::cuda
