#include <algorithm>

#include "cuda/attention.cuh"
#include "cuda/device_math.cuh"
#include "cuda/launch.cuh"

namespace vavilov::cuda {

namespace {

constexpr int kMaxIndexDim = 1024;  // check_supported (device_model.cpp) holds configs to it
constexpr int kInputThreads = 128;

// out = RoPE(zero-centred RMSNorm(x) with weight) at `position`, over `width` values (the first rotary_dim rotate);
// staged in `normed` (shared, width values) because a rotation pairs values that other threads normalised.
__device__ void norm_rope(const float* x, int width, const float* weight, float eps, const float* inv_freq,
                          int rotary_dim, int64_t position, float* normed, float* out) {
  float sum = 0.0f;
  for (int i = threadIdx.x; i < width; i += blockDim.x) sum += x[i] * x[i];
  const float scale = rms_scale(block_sum(sum), width, eps);
  for (int i = threadIdx.x; i < width; i += blockDim.x) normed[i] = x[i] * scale * (1.0f + weight[i]);
  __syncthreads();
  const int half = rotary_dim / 2;
  for (int i = threadIdx.x; i < width; i += blockDim.x) {
    if (i >= rotary_dim) {
      out[i] = normed[i];
      continue;
    }
    const float angle = inv_freq[i % half] * float(position);
    const float c = cosf(angle), s = sinf(angle);
    out[i] = i < half ? normed[i] * c - normed[i + half] * s : normed[i] * c + normed[i - half] * s;
  }
}

// Block (job, row): jobs [0, heads) the queries, then the keys, then the index queries, then one that copies the
// value and the index key.
__global__ void __launch_bounds__(kInputThreads)
    attention_inputs_kernel(AttentionShape s, AttentionInputs in, const int64_t* first_position, float* queries,
                            float* index_queries, AttentionCaches caches) {
  wait_for_producers();
  allow_dependents();
  extern __shared__ float normed[];
  const int job = blockIdx.x, r = blockIdx.y, hd = s.head_dim, ihd = s.index_dim;
  const int64_t position = *first_position + r;
  const size_t index_row = size_t(r) * (s.index_heads + 1) * ihd;
  if (job < s.heads) {
    norm_rope(in.q + (size_t(r) * s.heads + job) * 2 * hd, hd, in.q_norm, in.eps, in.inv_freq, in.rotary_dim, position,
              normed, queries + (size_t(r) * s.heads + job) * hd);
  } else if (job < s.heads + s.kv_heads) {
    const int h = job - s.heads;
    norm_rope(in.k + (size_t(r) * s.kv_heads + h) * hd, hd, in.k_norm, in.eps, in.inv_freq, in.rotary_dim, position,
              normed, caches.keys + (size_t(position) * s.kv_heads + h) * hd);
  } else if (job < s.heads + s.kv_heads + s.index_heads) {
    const int h = job - s.heads - s.kv_heads;
    norm_rope(in.index_qk + index_row + size_t(h) * ihd, ihd, in.index_q_norm, in.eps, in.inv_freq, in.rotary_dim,
              position, normed, index_queries + (size_t(r) * s.index_heads + h) * ihd);
  } else {
    const size_t kv = size_t(s.kv_heads) * hd;
    for (size_t i = threadIdx.x; i < kv; i += blockDim.x) caches.values[size_t(position) * kv + i] = in.v[r * kv + i];
    for (int i = threadIdx.x; i < ihd; i += blockDim.x)
      caches.index_keys[size_t(position) * ihd + i] = in.index_qk[index_row + size_t(s.index_heads) * ihd + i];
  }
}

__global__ void pool_block_keys_kernel(const float* index_keys, const int64_t* first_position, int rows, int ratio,
                                       int dim, const float* norm_weight, float eps, const float* inv_freq,
                                       int rotary_dim, float* block_keys) {
  wait_for_producers();
  allow_dependents();
  __shared__ float normed[kMaxIndexDim];
  const int64_t first = *first_position, b = first / ratio + blockIdx.x;
  if (b >= (first + rows) / ratio) return;  // the whole block: only blocks completed by this pass
  float sum = 0.0f;
  for (int d = threadIdx.x; d < dim; d += blockDim.x) {
    float pooled = 0.0f;
    for (int i = 0; i < ratio; ++i) pooled += index_keys[(size_t(b) * ratio + i) * dim + d];
    pooled /= float(ratio);
    normed[d] = pooled;
    sum += pooled * pooled;
  }
  const float scale = rms_scale(block_sum(sum), dim, eps);
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
    const float angle = inv_freq[i] * float(b * ratio);
    const float c = cosf(angle), s = sinf(angle);
    out[d] = d < half ? normed[d] * c - normed[d + half] * s : normed[d] * c + normed[d - half] * s;
  }
}

__global__ void qsa_scores_kernel(AttentionShape s, const float* index_queries, const float* block_keys,
                                  const int64_t* first_position, int stride_blocks, float* scores) {
  wait_for_producers();
  allow_dependents();
  const int r = blockIdx.y, lane = threadIdx.x % 32;
  const int b = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int64_t blocks = (*first_position + r + 1) / s.ratio;
  if (b >= blocks || blocks <= s.keep_blocks) return;
  float score = 0.0f;
  for (int h = 0; h < s.index_heads; ++h) {
    const float* q = index_queries + (size_t(r) * s.index_heads + h) * s.index_dim;
    const float* key = block_keys + size_t(b) * s.index_dim;
    float dot = 0.0f;
    for (int d = lane; d < s.index_dim; d += 32) dot += q[d] * key[d];
    score += fmaxf(0.0f, warp_sum(dot));
  }
  if (lane == 0) scores[size_t(r) * stride_blocks + b] = score / sqrtf(float(s.index_dim));
}

__global__ void qsa_rank_kernel(AttentionShape s, const int64_t* first_position, int stride_blocks, const float* scores,
                                uint8_t* selected) {
  wait_for_producers();
  allow_dependents();
  const int r = blockIdx.y, b = blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t blocks = (*first_position + r + 1) / s.ratio;
  if (b >= blocks) return;
  if (blocks <= s.keep_blocks) {
    selected[size_t(r) * stride_blocks + b] = 1;
    return;
  }
  const float* row = scores + size_t(r) * stride_blocks;
  const float mine = row[b];
  int rank = 0;
  for (int other = 0; other < blocks; ++other) rank += row[other] > mine || (row[other] == mine && other < b);
  selected[size_t(r) * stride_blocks + b] = rank < s.keep_blocks;
}

// Block (x, row·head) scores positions [64x, 64x + 64), a warp each position of a stride of 8: a captured step
// launches for the whole cache capacity, so a block does several positions rather than most blocks exiting at once.
constexpr int kScoreWarps = 8;
constexpr int kScoresPerBlock = 64;

__global__ void __launch_bounds__(kScoreWarps * 32)
    attention_scores_kernel(AttentionShape s, const float* queries, const float* keys, const uint8_t* selected,
                            const int64_t* first_position, int stride_blocks, int max_tokens, float* weights) {
  wait_for_producers();
  allow_dependents();
  const int rh = blockIdx.y, r = rh / s.heads, h = rh % s.heads, lane = threadIdx.x % 32;
  const int64_t visible = *first_position + r + 1, blocks = visible / s.ratio;
  const int64_t begin = int64_t(blockIdx.x) * kScoresPerBlock, end = min(begin + kScoresPerBlock, visible);
  const int kv = h / (s.heads / s.kv_heads);
  const float* q = queries + size_t(rh) * s.head_dim;
  for (int64_t p = begin + threadIdx.x / 32; p < end; p += kScoreWarps) {
    const bool chosen = p >= blocks * s.ratio || selected[size_t(r) * stride_blocks + p / s.ratio];
    float score = -INFINITY;
    if (chosen) {
      const float* key = keys + (size_t(p) * s.kv_heads + kv) * s.head_dim;
      float dot = 0.0f;
      for (int d = lane; d < s.head_dim; d += 32) dot += q[d] * key[d];
      score = warp_sum(dot) / sqrtf(float(s.head_dim));
    }
    if (lane == 0) weights[size_t(rh) * max_tokens + p] = score;
  }
}

// Block (row, head): the softmax over the row's visible scores in place, then the weighted sum of the values with
// positions spread over the warps (lane-contiguous columns: coalesced reads of each value row) and the warps'
// partial sums added in shared memory. A warp per position stride keeps many value rows in flight; a thread per
// column walking every position did one dependent load after another (17 µs for 70 positions on an H200). Positions
// of weight zero — the blocks QSA did not select — are skipped: at 8192 tokens of context a row's head would
// otherwise read all 8 MB of its value rows for the ≤ 2048 it keeps.
constexpr int kValueWarps = 8;
constexpr int kValuesPerLane = 8;  // columns a lane accumulates per pass over the positions (256 per warp)

__global__ void __launch_bounds__(kValueWarps * 32)
    attention_values_kernel(AttentionShape s, const float* q_gate, const float* values, const int64_t* first_position,
                            int max_tokens, float* weights, float* out) {
  wait_for_producers();
  allow_dependents();
  extern __shared__ float partial[];  // [kValueWarps, head_dim]
  const int rh = blockIdx.x, r = rh / s.heads, h = rh % s.heads, hd = s.head_dim;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t visible = *first_position + r + 1;
  const int kv = h / (s.heads / s.kv_heads);
  float* w = weights + size_t(rh) * max_tokens;
  float peak = -INFINITY;
  for (int64_t p = threadIdx.x; p < visible; p += blockDim.x) peak = fmaxf(peak, w[p]);
  peak = block_max(peak);
  float sum = 0.0f;
  for (int64_t p = threadIdx.x; p < visible; p += blockDim.x) sum += (w[p] = expf(w[p] - peak));
  sum = block_sum(sum);  // its barriers also publish the weights to the whole block
  for (int first_column = 0; first_column < hd; first_column += 32 * kValuesPerLane) {
    float acc[kValuesPerLane] = {};
    for (int64_t p = warp; p < visible; p += kValueWarps) {
      const float weight = w[p];
      if (weight == 0.0f) continue;  // outside the selected blocks (or underflowed): its value row adds nothing
      const float* row = values + (size_t(p) * s.kv_heads + kv) * hd + first_column + lane;
#pragma unroll
      for (int i = 0; i < kValuesPerLane; ++i)
        if (first_column + lane + 32 * i < hd) acc[i] += weight * row[32 * i];
    }
#pragma unroll
    for (int i = 0; i < kValuesPerLane; ++i)
      if (first_column + lane + 32 * i < hd) partial[warp * hd + first_column + lane + 32 * i] = acc[i];
  }
  __syncthreads();
  const float* gate = q_gate + size_t(rh) * 2 * hd;
  for (int d = threadIdx.x; d < hd; d += blockDim.x) {
    float acc = 0.0f;
    for (int k = 0; k < kValueWarps; ++k) acc += partial[k * hd + d];
    out[size_t(rh) * hd + d] = acc / sum * sigmoid(gate[d]);
  }
}

}  // namespace

void attention_inputs(const AttentionShape& s, const AttentionInputs& in, int rows, const int64_t* first_position,
                      float* queries, float* index_queries, const AttentionCaches& caches, cudaStream_t stream) {
  if (rows == 0) return;
  const dim3 grid(unsigned(s.heads + s.kv_heads + s.index_heads + 1), unsigned(rows));
  const size_t shared = size_t(std::max(s.head_dim, s.index_dim)) * sizeof(float);
  launch_dependent(attention_inputs_kernel, grid, kInputThreads, shared, stream, s, in, first_position, queries,
                   index_queries, caches);
}

void pool_block_keys(const AttentionShape& s, int rows, const int64_t* first_position, const float* norm_weight,
                     float eps, const float* inv_freq, int rotary_dim, const AttentionCaches& caches,
                     cudaStream_t stream) {
  if (rows == 0) return;
  launch_dependent(pool_block_keys_kernel, rows / s.ratio + 1, 128, 0, stream, caches.index_keys, first_position, rows,
                   s.ratio, s.index_dim, norm_weight, eps, inv_freq, rotary_dim, caches.block_keys);
}

void qsa_select(const AttentionShape& s, const float* index_queries, const float* block_keys, int rows,
                const int64_t* first_position, const AttentionBounds& bounds, float* scores, uint8_t* selected,
                cudaStream_t stream) {
  const int launch_blocks = bounds.launch_tokens / s.ratio, stride = bounds.stride_blocks(s.ratio);
  if (rows == 0 || launch_blocks == 0) return;
  launch_dependent(qsa_scores_kernel, dim3((launch_blocks + 7) / 8, rows), 256, 0, stream, s, index_queries, block_keys,
                   first_position, stride, scores);
  launch_dependent(qsa_rank_kernel, dim3((launch_blocks + 255) / 256, rows), 256, 0, stream, s, first_position, stride,
                   scores, selected);
}

void sparse_attention(const AttentionShape& s, const float* queries, const float* q_gate, const float* keys,
                      const float* values, const uint8_t* selected, int rows, const int64_t* first_position,
                      const AttentionBounds& bounds, float* weights, float* out, cudaStream_t stream) {
  if (rows == 0) return;
  const int score_blocks = (bounds.launch_tokens + kScoresPerBlock - 1) / kScoresPerBlock;
  launch_dependent(attention_scores_kernel, dim3(unsigned(score_blocks), unsigned(rows * s.heads)), kScoreWarps * 32, 0,
                   stream, s, queries, keys, selected, first_position, bounds.stride_blocks(s.ratio), bounds.max_tokens,
                   weights);
  const size_t partial_bytes = size_t(kValueWarps) * size_t(s.head_dim) * sizeof(float);
  launch_dependent(attention_values_kernel, rows * s.heads, kValueWarps * 32, partial_bytes, stream, s, q_gate, values,
                   first_position, bounds.max_tokens, weights, out);
}

}  // namespace vavilov::cuda
