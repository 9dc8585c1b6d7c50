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

// Attention of each (row, head) over its chosen positions, split over the positions (flash-decoding): block (chunk c,
// row r, head set) takes kHeads query heads that share one kv head, and its warp w the positions p ≡ 8c + w (mod
// 8·chunks). A warp keeps a running softmax (peak, sum, weighted values) per head, with the key and value rows of
// kAttendUnroll positions in flight; the block merges its warps' partials through shared memory and writes one partial
// a head; the last block of the (row, head set) to finish merges the chunks' partials in chunk order (deterministic),
// normalises and gates. Chunks past the row's context exit at once. Before, a captured step launched a block per 64
// positions of the cache capacity to score and one block a head to weigh the values, each warp walking its positions
// one dependent load after another: 25 µs a layer at a context of 64 on an H200, 9.1 ms a decode step at 8192.
constexpr int kAttendWarps = 8;
constexpr int kAttendThreads = kAttendWarps * 32;
constexpr int kMaxLaneColumns = kMaxAttentionHeadDim / 32;  // columns lane + 32i of a head, i < kMaxLaneColumns
constexpr int kAttendUnroll = 2;                            // positions a warp loads before it uses them
constexpr int kAttendChunkPositions = 256;                  // positions a chunk of the launch span covers
constexpr int kMaxAttendSlots = 128;                        // rows × chunks of one launch (bounds the partials)
constexpr int kMergeUnroll = 4;                             // chunks' values a thread loads at once in the merge
static_assert(kAttendThreads >= kMaxAttentionHeadDim, "the merges take a thread per column");

// A running softmax over some positions: the largest score and the sum of exp(score − peak) (scratch: a float2).
struct RunningSoftmax {
  float peak = -INFINITY, sum = 0.0f;
};

// The factor of a partial with peak `peak` in a merge whose peak is `merged` (0 for an empty partial).
__device__ inline float merge_scale(float peak, float merged) { return peak == -INFINITY ? 0.0f : expf(peak - merged); }

// Where a row may look: its visible positions and whether the indexer's choice applies (more complete blocks than it
// keeps, as in qsa_rank_kernel; else every position is chosen and `selected` is not read).
struct RowSpan {
  int64_t visible, complete;
  bool all_chosen;
  const uint8_t* selected;
  __device__ bool chosen(int64_t p, int ratio) const {
    return p < visible && (all_chosen || p >= complete || selected[p / ratio]);
  }
};

// One warp's running softmaxes and weighted values over positions first, first + stride, …
template <int kHeads>
__device__ void attend_positions(const AttentionShape& s, const float (&q)[kHeads][kMaxAttentionHeadDim],
                                 const float* keys, const float* values, int kv, const RowSpan& row, int64_t first,
                                 int64_t stride, RunningSoftmax (&run)[kHeads], float (&acc)[kHeads][kMaxLaneColumns]) {
  const int hd = s.head_dim, lane = threadIdx.x % 32;
  const float inv_sqrt_hd = 1.0f / sqrtf(float(hd));
  for (int64_t p0 = first; p0 < row.visible; p0 += kAttendUnroll * stride) {
    float key[kAttendUnroll][kMaxLaneColumns], value[kAttendUnroll][kMaxLaneColumns];
    bool chosen[kAttendUnroll];
#pragma unroll
    for (int u = 0; u < kAttendUnroll; ++u) {
      const int64_t p = p0 + u * stride;
      chosen[u] = row.chosen(p, s.ratio);
      const size_t at = (size_t(p) * s.kv_heads + kv) * hd + lane;
#pragma unroll
      for (int i = 0; i < kMaxLaneColumns; ++i) {
        const bool in = chosen[u] && lane + 32 * i < hd;
        key[u][i] = in ? keys[at + 32 * i] : 0.0f;
        value[u][i] = in ? values[at + 32 * i] : 0.0f;
      }
    }
#pragma unroll
    for (int u = 0; u < kAttendUnroll; ++u) {
      if (!chosen[u]) continue;  // the whole warp: one position
#pragma unroll
      for (int g = 0; g < kHeads; ++g) {
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < kMaxLaneColumns; ++i)
          if (lane + 32 * i < hd) dot += q[g][lane + 32 * i] * key[u][i];
        const float score = warp_sum(dot) * inv_sqrt_hd, peak = fmaxf(run[g].peak, score);
        const float rescale = merge_scale(run[g].peak, peak), weight = expf(score - peak);
        run[g] = {peak, run[g].sum * rescale + weight};
#pragma unroll
        for (int i = 0; i < kMaxLaneColumns; ++i) acc[g][i] = acc[g][i] * rescale + weight * value[u][i];
      }
    }
  }
}

template <int kHeads>
__global__ void __launch_bounds__(kAttendThreads)
    attend_kernel(AttentionShape s, const float* queries, const float* q_gate, const float* keys, const float* values,
                  const uint8_t* selected, const int64_t* first_position, int stride_blocks, int chunks,
                  AttendScratch scratch, float* out) {
  wait_for_producers();
  allow_dependents();
  __shared__ float q[kHeads][kMaxAttentionHeadDim];
  __shared__ RunningSoftmax warp_stats[kAttendWarps][kHeads];
  __shared__ float warp_values[kAttendWarps][kHeads][kMaxAttentionHeadDim];
  __shared__ float2 chunk_stats[kMaxAttendSlots][kHeads];
  __shared__ bool last;
  const int sets = s.heads / kHeads, set = blockIdx.y, r = set / sets, h0 = set % sets * kHeads;
  const int hd = s.head_dim, warp = threadIdx.x / 32, lane = threadIdx.x % 32, c = blockIdx.x, d = threadIdx.x;
  for (int i = threadIdx.x; i < kHeads * hd; i += kAttendThreads)  // in flight with the position's load
    q[i / hd][i % hd] = queries[(size_t(r) * s.heads + h0) * hd + i];
  const int64_t visible = *first_position + r + 1, complete = visible / s.ratio * s.ratio;
  const int used = int(min(int64_t(chunks), (visible + kAttendWarps - 1) / kAttendWarps));  // chunks with positions
  if (c >= used) return;
  __syncthreads();

  const RowSpan row{visible, complete, complete / s.ratio <= s.keep_blocks, selected + size_t(r) * stride_blocks};
  RunningSoftmax run[kHeads];
  float acc[kHeads][kMaxLaneColumns] = {};
  attend_positions<kHeads>(s, q, keys, values, h0 / (s.heads / s.kv_heads), row, int64_t(c) * kAttendWarps + warp,
                           int64_t(chunks) * kAttendWarps, run, acc);

  // The block's partial: its warps' merged in warp order, a thread per column.
#pragma unroll
  for (int g = 0; g < kHeads; ++g) {
    if (lane == 0) warp_stats[warp][g] = run[g];
#pragma unroll
    for (int i = 0; i < kMaxLaneColumns; ++i)
      if (lane + 32 * i < hd) warp_values[warp][g][lane + 32 * i] = acc[g][i];
  }
  __syncthreads();
  const size_t first_slot = size_t(set) * chunks;
#pragma unroll
  for (int g = 0; g < kHeads; ++g) {
    float peak = -INFINITY;
    for (int w = 0; w < kAttendWarps; ++w) peak = fmaxf(peak, warp_stats[w][g].peak);
    float sum = 0.0f, merged = 0.0f;
    for (int w = 0; w < kAttendWarps; ++w) {
      const float scale = merge_scale(warp_stats[w][g].peak, peak);
      sum += warp_stats[w][g].sum * scale;
      if (d < hd) merged += warp_values[w][g][d] * scale;
    }
    if (d < hd) scratch.values[((first_slot + c) * kHeads + g) * hd + d] = merged;
    if (d == 0) scratch.stats[(first_slot + c) * kHeads + g] = make_float2(peak, sum);
  }

  // The last of the used chunks' blocks to get here merges their partials.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&scratch.arrivals[set], 1u) == unsigned(used) - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int i = threadIdx.x; i < used * kHeads; i += kAttendThreads)
    chunk_stats[i / kHeads][i % kHeads] = __ldcg(&scratch.stats[first_slot * kHeads + i]);
  __syncthreads();
#pragma unroll
  for (int g = 0; g < kHeads; ++g) {
    float peak = -INFINITY;
    for (int k = 0; k < used; ++k) peak = fmaxf(peak, chunk_stats[k][g].x);
    float sum = 0.0f, merged = 0.0f;
    for (int k0 = 0; k0 < used; k0 += kMergeUnroll) {
      float part[kMergeUnroll];
#pragma unroll
      for (int u = 0; u < kMergeUnroll; ++u)
        part[u] =
            k0 + u < used && d < hd ? __ldcg(&scratch.values[((first_slot + k0 + u) * kHeads + g) * hd + d]) : 0.0f;
#pragma unroll
      for (int u = 0; u < kMergeUnroll; ++u) {
        if (k0 + u >= used) break;
        const float scale = merge_scale(chunk_stats[k0 + u][g].x, peak);
        sum += chunk_stats[k0 + u][g].y * scale;
        merged += part[u] * scale;
      }
    }
    const size_t rh = size_t(r) * s.heads + h0 + g;
    if (d < hd) out[rh * hd + d] = merged / sum * sigmoid(q_gate[rh * 2 * hd + d]);
  }
  if (threadIdx.x == 0) scratch.arrivals[set] = 0;  // ready for the next launch
}

// Query heads a block takes: the most of 4, 2, 1 that divides the heads sharing a kv head.
int attend_heads(const AttentionShape& s) {
  const int group = s.heads / s.kv_heads;
  return group % 4 == 0 ? 4 : group % 2 == 0 ? 2 : 1;
}

// Chunks a launch splits each (row, head set) into: one per 256 positions of its span, within kMaxAttendSlots.
int attend_chunks(int rows, int launch_tokens) {
  const int by_span = (launch_tokens + kAttendChunkPositions - 1) / kAttendChunkPositions;
  return std::clamp(by_span, 1, std::max(1, kMaxAttendSlots / rows));
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

size_t attend_value_floats(const AttentionShape& s, int max_rows) {
  return size_t(std::max(max_rows, kMaxAttendSlots)) * size_t(s.heads) * size_t(s.head_dim);
}
size_t attend_stat_count(const AttentionShape& s, int max_rows) {
  return size_t(std::max(max_rows, kMaxAttendSlots)) * size_t(s.heads);
}
size_t attend_arrival_count(const AttentionShape& s, int max_rows) { return size_t(max_rows) * size_t(s.heads); }

void sparse_attention(const AttentionShape& s, const float* queries, const float* q_gate, const float* keys,
                      const float* values, const uint8_t* selected, int rows, const int64_t* first_position,
                      const AttentionBounds& bounds, const AttendScratch& scratch, float* out, cudaStream_t stream) {
  if (rows == 0) return;
  const int heads = attend_heads(s), chunks = attend_chunks(rows, bounds.launch_tokens);
  const dim3 grid(unsigned(chunks), unsigned(rows * (s.heads / heads)));
  const int stride = bounds.stride_blocks(s.ratio);
  auto launch = [&](auto kernel) {
    launch_dependent(kernel, grid, kAttendThreads, 0, stream, s, queries, q_gate, keys, values, selected,
                     first_position, stride, chunks, scratch, out);
  };
  if (heads == 4)
    launch(attend_kernel<4>);
  else if (heads == 2)
    launch(attend_kernel<2>);
  else
    launch(attend_kernel<1>);
}

}  // namespace vavilov::cuda
