#include <algorithm>
#include <cmath>

#include "cuda/ops.cuh"

namespace vavilov::cuda {

namespace {

constexpr int kMaxPleWindow = 64;
constexpr int kMaxNgram = 16;
constexpr int kMaxExperts = 2048;
constexpr int kMaxIndexDim = 1024;

__device__ inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ inline float silu(float x) { return x / (1.0f + expf(-x)); }

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

__global__ void moe_route_kernel(float* logits, int experts, int top_k, bool norm_topk, int* ids, float* weights) {
  __shared__ float prob[kMaxExperts];
  __shared__ uint8_t taken[kMaxExperts];
  __shared__ float best_value[32];
  __shared__ int best_index[32];
  __shared__ float chosen[32];
  float* row = logits + size_t(blockIdx.x) * experts;
  float peak = -INFINITY;
  for (int e = threadIdx.x; e < experts; e += blockDim.x) peak = fmaxf(peak, row[e]);
  peak = block_max(peak);
  float sum = 0.0f;
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    prob[e] = expf(row[e] - peak);
    taken[e] = 0;
    sum += prob[e];
  }
  sum = block_sum(sum);
  for (int e = threadIdx.x; e < experts; e += blockDim.x) prob[e] /= sum;
  __syncthreads();
  for (int j = 0; j < top_k; ++j) {
    float value = -1.0f;
    int index = experts;
    for (int e = threadIdx.x; e < experts; e += blockDim.x)
      if (!taken[e] && (prob[e] > value || (prob[e] == value && e < index))) value = prob[e], index = e;
    for (int offset = 16; offset > 0; offset >>= 1) {
      const float other_value = __shfl_xor_sync(0xffffffffu, value, offset);
      const int other_index = __shfl_xor_sync(0xffffffffu, index, offset);
      if (other_value > value || (other_value == value && other_index < index))
        value = other_value, index = other_index;
    }
    if (threadIdx.x % 32 == 0) best_value[threadIdx.x / 32] = value, best_index[threadIdx.x / 32] = index;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < int(blockDim.x + 31) / 32; ++w)
        if (best_value[w] > best_value[0] || (best_value[w] == best_value[0] && best_index[w] < best_index[0]))
          best_value[0] = best_value[w], best_index[0] = best_index[w];
      if (best_index[0] >= experts)  // every remaining probability is NaN: take the lowest free expert
        for (best_index[0] = 0; taken[best_index[0]];) ++best_index[0];
      taken[best_index[0]] = 1;
      ids[blockIdx.x * top_k + j] = best_index[0];
      chosen[j] = prob[best_index[0]];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (int j = 0; j < top_k; ++j) total += chosen[j];
    for (int j = 0; j < top_k; ++j) weights[blockIdx.x * top_k + j] = norm_topk ? chosen[j] / total : chosen[j];
  }
}

__global__ void swiglu_kernel(float* gate, const float* up, int64_t n) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) gate[i] = silu(gate[i]) * up[i];
}

__global__ void moe_combine_kernel(float* y, const float* shared_gate, const float* weights, const float* expert_out,
                                   int rows, int top_k, int hidden) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(rows) * hidden) return;
  const int64_t r = i / hidden, d = i % hidden;
  float value = y[i] * sigmoid(shared_gate[r]);
  for (int j = 0; j < top_k; ++j) value += weights[r * top_k + j] * expert_out[(r * top_k + j) * hidden + d];
  y[i] = value;
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

void moe_route(float* logits, int rows, int experts, int top_k, bool norm_topk, int* ids, float* weights,
               cudaStream_t stream) {
  if (rows) moe_route_kernel<<<rows, 256, 0, stream>>>(logits, experts, top_k, norm_topk, ids, weights);
}

void swiglu(float* gate, const float* up, int64_t n, cudaStream_t stream) {
  if (n) swiglu_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(gate, up, n);
}

void moe_combine(float* y, const float* shared_gate, const float* weights, const float* expert_out, int rows, int top_k,
                 int hidden, cudaStream_t stream) {
  const int64_t n = int64_t(rows) * hidden;
  if (n)
    moe_combine_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(y, shared_gate, weights, expert_out, rows, top_k,
                                                               hidden);
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
