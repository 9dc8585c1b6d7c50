#include <algorithm>
#include <cmath>

#include "cuda/ops.cuh"

namespace vavilov::cuda {

namespace {

constexpr int kMaxConvKernel = 8;
constexpr int kMaxPleWindow = 64;
constexpr int kMaxNgram = 16;
constexpr int kMaxIndexDim = 1024;

__device__ inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ inline float silu(float x) { return x / (1.0f + expf(-x)); }
__device__ inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

__device__ inline float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The sum of v over the block, returned to every thread.
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

inline int blocks_for(int64_t n, int threads) { return int((n + threads - 1) / threads); }

__global__ void rms_norm_kernel(const float* x, int64_t x_row_stride, int64_t x_group_stride, int groups, int width,
                                const float* weight, int64_t weight_group_stride, float eps, float* out) {
  const int r = blockIdx.x / groups, g = blockIdx.x % groups;
  const float* xg = x + r * x_row_stride + g * x_group_stride;
  float sum = 0.0f;
  for (int i = threadIdx.x; i < width; i += blockDim.x) sum += xg[i] * xg[i];
  const float scale = 1.0f / sqrtf(block_sum(sum) / float(width) + eps);
  const float* wg = weight + g * weight_group_stride;
  float* og = out + (size_t(r) * groups + g) * width;
  for (int i = threadIdx.x; i < width; i += blockDim.x) og[i] = xg[i] * scale * (1.0f + wg[i]);
}

__global__ void rope_kernel(float* x, int rows, int vectors_per_row, int width, int half, const float* inv_freq,
                            int64_t first_position) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= int64_t(rows) * vectors_per_row * half) return;
  const int i = int(idx % half);
  const int64_t vector = idx / half;
  const int64_t r = vector / vectors_per_row;
  float* p = x + vector * width;
  const float angle = inv_freq[i] * float(first_position + r);
  const float c = cosf(angle), s = sinf(angle);
  const float a = p[i], b = p[i + half];
  p[i] = a * c - b * s;
  p[i + half] = b * c + a * s;
}

__global__ void hc_low_kernel(float* low, int64_t n, float streams) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) low[i] = silu(low[i] / streams);
}

__global__ void hc_combine_kernel(const float* mix, const float* normed, int rows, int streams, int hidden,
                                  float* input) {
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

__global__ void hc_inject_kernel(float* inject, int64_t n, float streams) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) inject[i] = 2.0f * sigmoid(inject[i] / streams);
}

__global__ void hc_write_kernel(const float* inject, const float* y, int rows, int streams, int hidden, float* stack) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(rows) * streams * hidden) return;
  const int64_t d = i % hidden, rs = i / hidden, r = rs / streams;
  stack[i] += inject[rs] * y[r * hidden + d];
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

__global__ void pool_block_keys_kernel(const float* index_keys, int first_block, int ratio, int dim,
                                       const float* norm_weight, float eps, const float* inv_freq, int rotary_dim,
                                       float* block_keys) {
  __shared__ float normed[kMaxIndexDim];
  const int b = first_block + blockIdx.x;
  float sum = 0.0f;
  for (int d = threadIdx.x; d < dim; d += blockDim.x) {
    float pooled = 0.0f;
    for (int i = 0; i < ratio; ++i) pooled += index_keys[(size_t(b) * ratio + i) * dim + d];
    pooled /= float(ratio);
    normed[d] = pooled;
    sum += pooled * pooled;
  }
  const float scale = 1.0f / sqrtf(block_sum(sum) / float(dim) + eps);
  for (int d = threadIdx.x; d < dim; d += blockDim.x) normed[d] = normed[d] * scale * (1.0f + norm_weight[d]);
  __syncthreads();
  const int half = rotary_dim / 2;
  float* out = block_keys + size_t(b) * dim;
  for (int d = threadIdx.x; d < dim; d += blockDim.x) {
    if (d >= rotary_dim) {
      out[d] = normed[d];
      continue;
    }
    const int i = d % half;
    const float angle = inv_freq[i] * float(int64_t(b) * ratio);
    const float c = cosf(angle), s = sinf(angle);
    out[d] = d < half ? normed[d] * c - normed[d + half] * s : normed[d] * c + normed[d - half] * s;
  }
}

__global__ void qsa_scores_kernel(AttentionShape s, const float* index_queries, const float* block_keys,
                                  int64_t first_position, int max_blocks, float* scores) {
  const int r = blockIdx.y, lane = threadIdx.x % 32;
  const int b = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int64_t blocks = (first_position + r + 1) / s.ratio;
  if (b >= blocks || blocks <= s.keep_blocks) return;
  float score = 0.0f;
  for (int h = 0; h < s.index_heads; ++h) {
    const float* q = index_queries + (size_t(r) * s.index_heads + h) * s.index_dim;
    const float* key = block_keys + size_t(b) * s.index_dim;
    float dot = 0.0f;
    for (int d = lane; d < s.index_dim; d += 32) dot += q[d] * key[d];
    score += fmaxf(0.0f, warp_sum(dot));
  }
  if (lane == 0) scores[size_t(r) * max_blocks + b] = score / sqrtf(float(s.index_dim));
}

__global__ void qsa_rank_kernel(AttentionShape s, int64_t first_position, int max_blocks, const float* scores,
                                uint8_t* selected) {
  const int r = blockIdx.y, b = blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t blocks = (first_position + r + 1) / s.ratio;
  if (b >= blocks) return;
  if (blocks <= s.keep_blocks) {
    selected[size_t(r) * max_blocks + b] = 1;
    return;
  }
  const float* row = scores + size_t(r) * max_blocks;
  const float mine = row[b];
  int rank = 0;
  for (int other = 0; other < blocks; ++other) rank += row[other] > mine || (row[other] == mine && other < b);
  selected[size_t(r) * max_blocks + b] = rank < s.keep_blocks;
}

__global__ void attention_scores_kernel(AttentionShape s, const float* queries, const float* keys,
                                        const uint8_t* selected, int64_t first_position, int max_blocks, int max_tokens,
                                        float* weights) {
  const int rh = blockIdx.y, r = rh / s.heads, h = rh % s.heads, lane = threadIdx.x % 32;
  const int64_t p = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int64_t visible = first_position + r + 1, blocks = visible / s.ratio;
  if (p >= visible) return;
  const int kv = h / (s.heads / s.kv_heads);
  const bool chosen = p >= blocks * s.ratio || selected[size_t(r) * max_blocks + p / s.ratio];
  float score = -INFINITY;
  if (chosen) {
    const float* q = queries + size_t(rh) * s.head_dim;
    const float* key = keys + (size_t(p) * s.kv_heads + kv) * s.head_dim;
    float dot = 0.0f;
    for (int d = lane; d < s.head_dim; d += 32) dot += q[d] * key[d];
    score = warp_sum(dot) / sqrtf(float(s.head_dim));
  }
  if (lane == 0) weights[size_t(rh) * max_tokens + p] = score;
}

__global__ void attention_values_kernel(AttentionShape s, const float* q_gate, const float* values,
                                        int64_t first_position, int max_tokens, float* weights, float* out) {
  const int rh = blockIdx.x, r = rh / s.heads, h = rh % s.heads;
  const int64_t visible = first_position + r + 1;
  const int kv = h / (s.heads / s.kv_heads);
  float* w = weights + size_t(rh) * max_tokens;
  float peak = -INFINITY;
  for (int64_t p = threadIdx.x; p < visible; p += blockDim.x) peak = fmaxf(peak, w[p]);
  peak = block_max(peak);
  float sum = 0.0f;
  for (int64_t p = threadIdx.x; p < visible; p += blockDim.x) sum += (w[p] = expf(w[p] - peak));
  sum = block_sum(sum);  // its barriers also publish the weights to the whole block
  const float* gate = q_gate + size_t(rh) * 2 * s.head_dim;
  for (int d = threadIdx.x; d < s.head_dim; d += blockDim.x) {
    float acc = 0.0f;
    for (int64_t p = 0; p < visible; ++p) acc += w[p] * values[(size_t(p) * s.kv_heads + kv) * s.head_dim + d];
    out[size_t(rh) * s.head_dim + d] = acc / sum * sigmoid(gate[d]);
  }
}

__global__ void ple_rows_kernel(PleShape s, const int64_t* multipliers, const int64_t* head_sizes,
                                const int64_t* head_offsets, int64_t* previous, const int32_t* ids, int rows,
                                int64_t* table_rows, int64_t* row_previous) {
  auto history = [&](int64_t i) { return i < s.context ? previous[i] : int64_t(ids[i - s.context]); };
  const int heads = s.context * s.heads_per_ngram;
  for (int t = threadIdx.x; t < rows; t += blockDim.x) {
    const int64_t index = t + s.context;
    int64_t context[kMaxNgram];
    bool cut = false;
    for (int back = 0; back < s.ngram; ++back) {
      if (back >= 2 && history(index - back + 1) == s.eos) cut = true;
      context[back] = (back == 0 || !cut) ? history(index - back) : s.eos;
    }
    uint64_t mixed = uint64_t(context[0]) * uint64_t(multipliers[0]);
    for (int n = 2; n <= s.ngram; ++n) {
      mixed ^= uint64_t(context[n - 1]) * uint64_t(multipliers[n - 1]);
      for (int head = (n - 2) * s.heads_per_ngram; head < (n - 1) * s.heads_per_ngram; ++head) {
        int64_t remainder = int64_t(mixed) % head_sizes[head];
        if (remainder < 0) remainder += head_sizes[head];
        table_rows[size_t(t) * heads + head] = remainder + head_offsets[head];
      }
    }
    if (row_previous)
      for (int i = 0; i < s.context; ++i) row_previous[size_t(t) * s.context + i] = history(t + 1 + i);
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int i = 0; i < s.context; ++i) previous[i] = history(rows + i);  // reads ahead of the writes
}

__global__ void ple_gate_kernel(const float* keys, const float* queries, const float* value, int streams, int hidden,
                                float* out) {
  const int rs = blockIdx.x, r = rs / streams;
  const float* key = keys + size_t(rs) * hidden;
  const float* query = queries + size_t(rs) * hidden;
  float dot = 0.0f;
  for (int d = threadIdx.x; d < hidden; d += blockDim.x) dot += key[d] * query[d];
  const float score = block_sum(dot) / sqrtf(float(hidden));
  const float shaped = sqrtf(fmaxf(fabsf(score), 1e-6f)) * float((score > 0) - (score < 0));
  const float gate = sigmoid(shaped);
  for (int d = threadIdx.x; d < hidden; d += blockDim.x)
    out[size_t(rs) * hidden + d] = gate * value[size_t(r) * hidden + d];
}

__global__ void ple_conv_kernel(const float* taps, int channels, int kernel, int dilation, float* state,
                                const float* normed, int rows, float* out, float* row_states) {
  const int ch = blockIdx.x * blockDim.x + threadIdx.x;
  if (ch >= channels) return;
  const int history = (kernel - 1) * dilation;
  float window[kMaxPleWindow];
  for (int i = 0; i < history; ++i) window[i] = state[size_t(i) * channels + ch];
  for (int t = 0; t < rows; ++t) {
    window[history] = normed[size_t(t) * channels + ch];
    float sum = 0.0f;
    for (int k = 0; k < kernel; ++k) sum += taps[ch * kernel + k] * window[history - dilation * (kernel - 1 - k)];
    out[size_t(t) * channels + ch] += silu(sum);
    for (int i = 0; i < history; ++i) window[i] = window[i + 1];
    if (row_states)
      for (int i = 0; i < history; ++i) row_states[(size_t(t) * history + i) * channels + ch] = window[i];
  }
  for (int i = 0; i < history; ++i) state[size_t(i) * channels + ch] = window[i];
}

__global__ void add_to_streams_kernel(float* x, const float* e, int rows, int streams, int hidden) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(rows) * streams * hidden) return;
  x[i] += e[(i / hidden / streams) * hidden + i % hidden];
}

__global__ void add_kernel(float* x, const float* y, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) x[i] += y[i];
}

}  // namespace

void rms_norm(const float* x, int64_t x_row_stride, int64_t x_group_stride, int rows, int groups, int width,
              const float* weight, int64_t weight_group_stride, float eps, float* out, cudaStream_t stream) {
  if (rows * groups == 0) return;
  // One block a group, with enough threads that each reads about four values: a decode step normalises a few
  // groups of thousands of values, and 128 threads left each block latency-bound (16 µs for 2560 values).
  const int threads = std::clamp((width / 4 + 31) / 32 * 32, 128, 1024);
  rms_norm_kernel<<<rows * groups, threads, 0, stream>>>(x, x_row_stride, x_group_stride, groups, width, weight,
                                                         weight_group_stride, eps, out);
}

void rope(float* x, int rows, int vectors_per_row, int width, int rotary_dim, const float* inv_freq,
          int64_t first_position, cudaStream_t stream) {
  const int64_t n = int64_t(rows) * vectors_per_row * (rotary_dim / 2);
  if (n == 0) return;
  rope_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(x, rows, vectors_per_row, width, rotary_dim / 2, inv_freq,
                                                      first_position);
}

void hc_low_activation(float* low, int64_t n, int streams, cudaStream_t stream) {
  if (n) hc_low_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(low, n, float(streams));
}

void hc_combine(const float* mix, const float* normed, int rows, int streams, int hidden, float* input,
                cudaStream_t stream) {
  const int64_t n = int64_t(rows) * hidden;
  if (n) hc_combine_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(mix, normed, rows, streams, hidden, input);
}

void hc_inject_activation(float* inject, int64_t n, int streams, cudaStream_t stream) {
  if (n) hc_inject_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(inject, n, float(streams));
}

void hc_write(const float* inject, const float* y, int rows, int streams, int hidden, float* stack,
              cudaStream_t stream) {
  const int64_t n = int64_t(rows) * streams * hidden;
  if (n) hc_write_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(inject, y, rows, streams, hidden, stack);
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

void pool_block_keys(const float* index_keys, int first_block, int end_block, int ratio, int dim,
                     const float* norm_weight, float eps, const float* inv_freq, int rotary_dim, float* block_keys,
                     cudaStream_t stream) {
  if (end_block <= first_block) return;
  pool_block_keys_kernel<<<end_block - first_block, 128, 0, stream>>>(index_keys, first_block, ratio, dim, norm_weight,
                                                                      eps, inv_freq, rotary_dim, block_keys);
}

void qsa_select(const AttentionShape& s, const float* index_queries, const float* block_keys, int rows,
                int64_t first_position, int max_blocks, float* scores, uint8_t* selected, cudaStream_t stream) {
  if (rows == 0 || max_blocks == 0) return;
  qsa_scores_kernel<<<dim3((max_blocks + 7) / 8, rows), 256, 0, stream>>>(s, index_queries, block_keys, first_position,
                                                                          max_blocks, scores);
  qsa_rank_kernel<<<dim3((max_blocks + 255) / 256, rows), 256, 0, stream>>>(s, first_position, max_blocks, scores,
                                                                            selected);
}

void sparse_attention(const AttentionShape& s, const float* queries, const float* q_gate, const float* keys,
                      const float* values, const uint8_t* selected, int rows, int64_t first_position, int max_blocks,
                      int max_tokens, float* weights, float* out, cudaStream_t stream) {
  if (rows == 0) return;
  attention_scores_kernel<<<dim3((max_tokens + 7) / 8, rows * s.heads), 256, 0, stream>>>(
      s, queries, keys, selected, first_position, max_blocks, max_tokens, weights);
  attention_values_kernel<<<rows * s.heads, 256, 0, stream>>>(s, q_gate, values, first_position, max_tokens, weights,
                                                              out);
}

void ple_table_rows(const PleShape& s, const int64_t* multipliers, const int64_t* head_sizes,
                    const int64_t* head_offsets, int64_t* previous, const int32_t* ids, int rows, int64_t* table_rows,
                    int64_t* row_previous, cudaStream_t stream) {
  ple_rows_kernel<<<1, 256, 0, stream>>>(s, multipliers, head_sizes, head_offsets, previous, ids, rows, table_rows,
                                         row_previous);
}

void ple_gate(const float* keys, const float* queries, const float* value, int rows, int streams, int hidden,
              float* out, cudaStream_t stream) {
  if (rows) ple_gate_kernel<<<rows * streams, 128, 0, stream>>>(keys, queries, value, streams, hidden, out);
}

void ple_conv(const float* taps, int channels, int kernel, int dilation, float* state, const float* normed, int rows,
              float* out, float* row_states, cudaStream_t stream) {
  ple_conv_kernel<<<blocks_for(channels, 128), 128, 0, stream>>>(taps, channels, kernel, dilation, state, normed, rows,
                                                                 out, row_states);
}

void add_to_streams(float* x, const float* e, int rows, int streams, int hidden, cudaStream_t stream) {
  const int64_t n = int64_t(rows) * streams * hidden;
  if (n) add_to_streams_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(x, e, rows, streams, hidden);
}

void add(float* x, const float* y, int64_t n, cudaStream_t stream) {
  if (n) add_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(x, y, n);
}

}  // namespace vavilov::cuda
