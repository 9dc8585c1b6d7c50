#include <algorithm>

#include "cuda/attend_prefill.cuh"
#include "cuda/attention.cuh"
#include "cuda/device_math.cuh"
#include "cuda/launch.cuh"

namespace vavilov::cuda {

namespace {

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

// The mean of the `ratio` raw index keys of block b into `pooled` (shared, dim values): positions from the pass's first
// row on from the pass's index-key projections (the copy job of the same launch writes them into the cache), earlier
// ones from the cache.
__device__ void pool_index_keys(const AttentionShape& s, const AttentionInputs& in, const float* cached_index_keys,
                                int64_t first, int64_t b, float* pooled) {
  const int dim = s.index_dim;
  const size_t projection_row = size_t(s.index_heads + 1) * dim;
  for (int d = threadIdx.x; d < dim; d += blockDim.x) {
    float sum = 0.0f;
    for (int i = 0; i < s.ratio; ++i) {
      const int64_t p = b * s.ratio + i;
      sum += p >= first ? in.index_qk[size_t(p - first) * projection_row + size_t(s.index_heads) * dim + d]
                        : cached_index_keys[size_t(p) * dim + d];
    }
    pooled[d] = sum / float(s.ratio);
  }
}

// Block (job, row): jobs [0, heads) the queries, then the keys, then the index queries, then one that copies the
// value and the index key, then one that pools the block keys of the block the row completes (if it does one): the
// mean of its `ratio` raw index keys, zero-centred RMSNorm, RoPE at the block's first position.
__global__ void __launch_bounds__(kInputThreads)
    attention_inputs_kernel(AttentionShape s, AttentionInputs in, const int64_t* first_position, float* queries,
                            float* index_queries, AttentionCaches caches) {
  wait_for_producers();
  allow_dependents();
  extern __shared__ float normed[];
  const int job = blockIdx.x, r = blockIdx.y, hd = s.head_dim, ihd = s.index_dim;
  const int64_t first = *first_position, position = first + r;
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
  } else if (job == s.heads + s.kv_heads + s.index_heads) {
    const size_t kv = size_t(s.kv_heads) * hd;
    for (size_t i = threadIdx.x; i < kv; i += blockDim.x) caches.values[size_t(position) * kv + i] = in.v[r * kv + i];
    for (int i = threadIdx.x; i < ihd; i += blockDim.x)
      caches.index_keys[size_t(position) * ihd + i] = in.index_qk[index_row + size_t(s.index_heads) * ihd + i];
  } else if ((position + 1) % s.ratio == 0) {
    const int64_t b = position / s.ratio;
    pool_index_keys(s, in, caches.index_keys, first, b, normed);  // each thread normalises the values it pooled
    norm_rope(normed, ihd, in.index_k_norm, in.eps, in.inv_freq, in.rotary_dim, b * s.ratio, normed,
              caches.block_keys + size_t(b) * ihd);
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

// Block (candidates, row): selected[r, b] = whether fewer than keep_blocks of the row's blocks rank above block b
// (a higher score, or an equal one at a lower index). Lane l of every warp takes candidate 32·blockIdx.x + l and warp w
// counts the blocks above it in the w-th part of the row, kRankTiles tiles of 32 scores (one a lane, shared by
// shuffles) loaded at once; the block adds the parts. Before, a thread a candidate walked the whole row one load after
// another: O(blocks) dependent loads a thread.
constexpr int kRankWarps = 8;
constexpr int kRankTiles = 8;  // tiles of 32 scores a warp loads at once

__global__ void __launch_bounds__(kRankWarps * 32)
    qsa_rank_kernel(AttentionShape s, const int64_t* first_position, int stride_blocks, const float* scores,
                    uint8_t* selected) {
  wait_for_producers();
  allow_dependents();
  __shared__ int above[kRankWarps][32];
  const int r = blockIdx.y, lane = threadIdx.x % 32, warp = threadIdx.x / 32, b = blockIdx.x * 32 + lane;
  const int64_t blocks = (*first_position + r + 1) / s.ratio;
  if (int64_t(blockIdx.x) * 32 >= blocks) return;
  uint8_t* chosen = selected + size_t(r) * stride_blocks;
  if (blocks <= s.keep_blocks) {
    if (warp == 0 && b < blocks) chosen[b] = 1;
    return;
  }
  const float* row = scores + size_t(r) * stride_blocks;
  const float mine = b < blocks ? row[b] : 0.0f;
  const int tiles = int((blocks + 31) / 32), first_tile = tiles * warp / kRankWarps;
  const int end_tile = tiles * (warp + 1) / kRankWarps;
  int count = 0;
  for (int t0 = first_tile; t0 < end_tile; t0 += kRankTiles) {
    float other[kRankTiles];  // kRankTiles loads in flight
#pragma unroll
    for (int k = 0; k < kRankTiles; ++k) {
      const int64_t o = int64_t(t0 + k) * 32 + lane;
      other[k] = t0 + k < end_tile && o < blocks ? row[o] : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < kRankTiles; ++k) {
      if (t0 + k >= end_tile) break;  // the whole warp
      const int t = t0 + k, valid = int(min(int64_t(32), blocks - int64_t(t) * 32));
      for (int j = 0; j < valid; ++j) {
        const float v = __shfl_sync(0xffffffffu, other[k], j);
        count += v > mine || (v == mine && t * 32 + j < b);
      }
    }
  }
  above[warp][lane] = count;
  __syncthreads();
  if (warp != 0 || b >= blocks) return;
  int rank = 0;
  for (int w = 0; w < kRankWarps; ++w) rank += above[w][lane];
  chosen[b] = rank < s.keep_blocks;
}

// Block (row): the same selection as qsa_rank_kernel by a radix select, O(blocks) a row in place of its O(blocks²)
// comparisons: four passes over the row's scores (L2-resident) each fix 8 more bits of the keep_blocks-th largest
// score's order key (a 256-bin histogram of the scores that match the bits fixed so far, its bins summed from the top
// by warp 0); then a block is chosen when its score is above that threshold, or equal to it and among the lowest
// indices of the equal ones that are still wanted (a block-wide running count in index order: ties to the lower
// index, as the CPU's partial_sort). Prefill passes take it: at 8192 positions qsa_rank_kernel's 512-row pass
// compares 2048 × 2048 scores a row. Decode and verify passes keep qsa_rank_kernel (many blocks a row in flight).
constexpr int kSelectThreads = 512;
constexpr int kSelectWarps = kSelectThreads / 32;
constexpr int kRadixBins = 256;
constexpr int kRankMaxRows = 4;  // passes of at most this many rows rank by comparisons (qsa_rank_kernel)

// An order-preserving key of a score (uint order = float order; −0 and +0 equal, as == has them).
__device__ inline uint32_t order_key(float x) {
  const uint32_t u = __float_as_uint(x == 0.0f ? 0.0f : x);
  return u & 0x80000000u ? ~u : u | 0x80000000u;
}

// The digit (bits shift..shift+7) of the wanted-th largest key among those counted in `histogram`; `wanted` becomes
// its rank among the keys of that digit (1 = the largest). Warp 0: lane l sums the bins 255 − 8l − j, j < 8.
__device__ void top_digit(const unsigned* histogram, int& wanted, int& digit) {
  const int lane = threadIdx.x % 32;
  unsigned count[8], total = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) total += count[j] = histogram[kRadixBins - 1 - 8 * lane - j];
  unsigned before = total;  // inclusive scan over the lanes, then made exclusive
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    const unsigned v = __shfl_up_sync(0xffffffffu, before, offset);
    if (lane >= offset) before += v;
  }
  before -= total;
  int found_digit = -1, found_wanted = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (found_digit < 0 && int(before) < wanted && int(before + count[j]) >= wanted)
      found_digit = kRadixBins - 1 - 8 * lane - j, found_wanted = wanted - int(before);
    before += count[j];
  }
  const unsigned owner = __ballot_sync(0xffffffffu, found_digit >= 0);
  const int source = __ffs(int(owner)) - 1;
  digit = __shfl_sync(0xffffffffu, found_digit, source);
  wanted = __shfl_sync(0xffffffffu, found_wanted, source);
}

__global__ void __launch_bounds__(kSelectThreads)
    qsa_select_top_kernel(AttentionShape s, const int64_t* first_position, int stride_blocks, const float* scores,
                          uint8_t* selected) {
  wait_for_producers();
  allow_dependents();
  __shared__ unsigned histogram[kRadixBins];
  __shared__ int warp_ties[kSelectWarps];
  __shared__ int shared_wanted, shared_digit;
  const int r = blockIdx.x, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int blocks = int((*first_position + r + 1) / s.ratio);
  uint8_t* chosen = selected + size_t(r) * stride_blocks;
  if (blocks <= s.keep_blocks || s.keep_blocks <= 0) {
    for (int b = tid; b < blocks; b += kSelectThreads) chosen[b] = s.keep_blocks > 0;
    return;
  }
  const float* row = scores + size_t(r) * stride_blocks;
  uint32_t prefix = 0, mask = 0;
  int wanted = s.keep_blocks;  // rank of the threshold among the keys matching `prefix` on `mask`
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int i = tid; i < kRadixBins; i += kSelectThreads) histogram[i] = 0;
    __syncthreads();
    for (int b = tid; b < blocks; b += kSelectThreads) {
      const uint32_t key = order_key(row[b]);
      if ((key & mask) == prefix) atomicAdd(&histogram[key >> shift & 0xffu], 1u);
    }
    __syncthreads();
    if (warp == 0) {
      int digit = 0;
      top_digit(histogram, wanted, digit);
      if (lane == 0) shared_wanted = wanted, shared_digit = digit;
    }
    __syncthreads();
    wanted = shared_wanted;
    prefix |= uint32_t(shared_digit) << shift, mask |= 0xffu << shift;
  }
  // prefix is the threshold's key; `wanted` blocks of that key are chosen, the lowest-indexed.
  int ties_before = 0;  // blocks of the threshold key below this round's
  for (int base = 0; base < blocks; base += kSelectThreads) {
    const int b = base + tid;
    const uint32_t key = b < blocks ? order_key(row[b]) : 0u;
    const bool tie = b < blocks && key == prefix;
    const unsigned ties = __ballot_sync(0xffffffffu, tie);
    if (lane == 0) warp_ties[warp] = __popc(ties);
    __syncthreads();
    int rank = ties_before + __popc(ties & ((1u << lane) - 1u)), round = 0;
    for (int w = 0; w < kSelectWarps; ++w) {
      rank += w < warp ? warp_ties[w] : 0;
      round += warp_ties[w];
    }
    if (b < blocks) chosen[b] = key > prefix || (tie && rank < wanted);
    ties_before += round;
    __syncthreads();  // warp_ties is free for the next round
  }
}

// Attention of each (row, head) over its chosen positions, split over the positions (flash-decoding): block (chunk c,
// row r, head set) takes kHeads query heads that share one kv head, and its warp w the positions p ≡ 8c + w (mod
// 8·used), where `used` is the number of chunks the row's context fills (one per chunk_positions positions, at most
// the launch's chunks; the rest exit at once). A warp keeps a running softmax (peak, sum, weighted values) per head
// over its chosen positions, four at a time with their key and value rows in flight (AttendBatch); the block merges
// its warps' partials through shared memory. A row with one used chunk writes its output from there; else each block
// writes one partial a head and the last block of the (row, head set) to finish merges the chunks' partials in chunk
// order (deterministic), normalises and gates. Before its wait a block asks L2 for the key and value rows of its warps'
// first positions when its row keeps every block and those positions precede the chunk of rows (so no kernel of the
// pass writes them). Before, a captured step launched a block per 64 positions of the cache capacity to score and one
// block a head to weigh the values, each warp walking its positions one dependent load after another: 25 µs a layer at
// a context of 64 on an H200, 9.1 ms a decode step at 8192.
constexpr int kAttendWarps = 8;
constexpr int kAttendThreads = kAttendWarps * 32;
constexpr int kAttendBlocksPerSM = 2;  // 128 registers a thread: a 1-row pass's 192 blocks at 8192 fit one wave
constexpr int kMaxLaneColumns = kMaxAttentionHeadDim / 32;  // columns lane + 32i of a head, i < kMaxLaneColumns
constexpr int kPrefetchPositions = 8;                       // positions a warp asks L2 for before its wait
constexpr int kAttendChunkPositions = 256;                  // positions a chunk of the launch span covers
constexpr int kMaxAttendSlots = 128;                        // rows × chunks of one launch (bounds the partials)
constexpr int kMergeUnroll = 4;                             // chunks' values a thread loads at once in the merge
static_assert(kAttendThreads >= kMaxAttentionHeadDim, "the merges take a thread per column");

// A running softmax over some positions: the largest score and the sum of 2^(score − peak) (scratch: a float2).
struct RunningSoftmax {
  float peak = -INFINITY, sum = 0.0f;
};

// The factor of a partial with peak `peak` in a merge whose peak is `merged` (0 for an empty partial).
// Peaks are in base-2 units (the queries carry log2(e)).
__device__ inline float merge_scale(float peak, float merged) {
  return peak == -INFINITY ? 0.0f : exp2f(peak - merged);
}

// Where a row may look: its visible positions and whether the indexer's choice applies (more complete blocks than it
// keeps, as in qsa_rank_kernel; else every position is chosen and `selected` is not read).
struct RowSpan {
  int visible, complete;  // within the launch's bound (an int)
  bool all_chosen;
  const uint8_t* selected;
  __device__ bool chosen(int p, int ratio) const {
    return p < visible && (all_chosen || p >= complete || selected[p / ratio]);
  }
};

// Positions of one warp: first, first + stride, …
struct WarpPositions {
  int64_t first, stride;
};

// Copies 4 bytes from global to shared memory without holding a register (cp.async); wait_async_copies makes the
// thread's own copies visible to it.
__device__ inline void copy_async(float* shared, const float* global) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(unsigned(__cvta_generic_to_shared(shared))), "l"(global)
               : "memory");
}
__device__ inline void wait_async_copies() { asm volatile("cp.async.wait_all;" ::: "memory"); }

__device__ inline void prefetch_l2(const void* address) { asm volatile("prefetch.global.L2 [%0];" ::"l"(address)); }

// Asks L2 for the key and value rows (kv head `kv`) of the warp's first kPrefetchPositions positions before `settled`.
__device__ void prefetch_rows(const AttentionShape& s, const float* keys, const float* values, int kv,
                              const WarpPositions& at, int64_t settled) {
  const int lines = (s.head_dim * int(sizeof(float)) + 127) / 128;  // 128-byte lines of a row
  for (int i = threadIdx.x % 32; i < kPrefetchPositions * 2 * lines; i += 32) {
    const int64_t p = at.first + i / (2 * lines) * at.stride;
    if (p >= settled) continue;
    const float* row = (i / lines % 2 ? values : keys) + (size_t(p) * s.kv_heads + kv) * s.head_dim;
    prefetch_l2(reinterpret_cast<const char*>(row) + (i % lines) * 128);
  }
}

// How a warp walks its chosen positions in batches (flash-decoding): the key and value rows of kBatch positions are
// loaded together, the kBatch × kHeads partial scores of every lane summed over the warp by one transposed butterfly
// (kScores − 1 shuffle-adds in log2(kScores) levels, then plain levels while kScores < 32), which leaves lane l holding
// score l >> kShift = slot · kHeads + head; the running softmax is rescaled once a batch. Before, each position and
// head took its own 5-shuffle sum, exponential and rescale, every one waiting on the previous one's running state.
template <int kHeads>
struct AttendBatch {
  // Positions a warp takes at once: their key and value rows are 32 registers a lane each, which with the weighted
  // values keeps the kernel within 128 registers (two blocks a multiprocessor); a batch of 8 took 255.
  static constexpr int kBatch = 4;
  static constexpr int kScores = kBatch * kHeads;  // (slot, head) scores of a batch
  static constexpr int kCopies = 32 / kScores;     // lanes holding each score
  static constexpr int kShift = kCopies >= 8 ? 3 : kCopies >= 4 ? 2 : kCopies >= 2 ? 1 : 0;  // log2(kCopies)
  static_assert(kScores * kCopies == 32 && (1 << kShift) == kCopies, "a batch's scores spread over the warp's lanes");
};

// One level of transposed_warp_sum: v[j] for j < kHalf becomes the sum over lane pairs (l, l ^ offset) of the half
// the lane keeps, the upper one where the lane's offset bit is set.
template <int kHalf, int N>
__device__ inline void transposed_level(float (&v)[N], int lane) {
  constexpr int offset = kHalf * (32 / N);
  const bool upper = (lane & offset) != 0;
#pragma unroll
  for (int j = 0; j < kHalf; ++j) {
    const float send = upper ? v[j] : v[j + kHalf], keep = upper ? v[j + kHalf] : v[j];
    v[j] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
  }
  if constexpr (kHalf > 1) transposed_level<kHalf / 2>(v, lane);
}

// v[j] summed over the warp's lanes, where lane l returns the sum of v[l >> log2(32 / N)]: each level sends the half of
// the values the partner keeps (high index bits first), then plain levels add the copies' lanes while N < 32.
template <int N>
__device__ inline float transposed_warp_sum(float (&v)[N], int lane) {
  if constexpr (N > 1) transposed_level<N / 2>(v, lane);
  float total = v[0];
#pragma unroll
  for (int offset = 16 / N; offset >= 1; offset /= 2) total += __shfl_xor_sync(0xffffffffu, total, offset);
  return total;
}

// One warp's running softmaxes and weighted values over its chosen positions (scores in base-2 units: the queries
// carry log2(e)/√head_dim): the warp reads the choice of 32 of its positions at once (a lane each), then takes them
// kBatch chosen ones at a time, so that unchosen positions cost no round trip. Every lane ends with the peaks and sums
// of all heads.
template <int kHeads>
__device__ void attend_positions(const AttentionShape& s, const float (&q)[kHeads][kMaxAttentionHeadDim],
                                 const float* keys, const float* values, int kv, const RowSpan& row,
                                 const WarpPositions& at, RunningSoftmax (&run)[kHeads],
                                 float (&acc)[kHeads][kMaxLaneColumns]) {
  using B = AttendBatch<kHeads>;
  const int hd = s.head_dim, lane = threadIdx.x % 32;
  const int score = lane >> B::kShift, slot = score / kHeads, head = score % kHeads;  // what the lane's score is of
  float peak[kHeads];                                                                 // the same on every lane
#pragma unroll
  for (int g = 0; g < kHeads; ++g) peak[g] = -INFINITY;
  float lane_sum = 0.0f;              // of its head's weights (the first lane of each score's copies)
  const int stride = int(at.stride);  // positions are within the launch's bound (an int)
  for (int base = int(at.first); base < row.visible; base += 32 * stride) {
    unsigned pending = __ballot_sync(0xffffffffu, row.chosen(base + lane * stride, s.ratio));
    while (pending != 0) {  // the same on every lane
      const int taken = min(__popc(pending), B::kBatch);
      float key[B::kBatch][kMaxLaneColumns], value[B::kBatch][kMaxLaneColumns];
#pragma unroll
      for (int u = 0; u < B::kBatch; ++u) {
        // A slot past the chosen ones loads row `base` (readable) and gets weight 0: no predicate a slot.
        const int p = base + (u < taken ? __ffs(int(pending)) - 1 : 0) * stride;
        if (u < taken) pending &= pending - 1;
        const size_t at_row = (size_t(p) * s.kv_heads + kv) * hd + lane;
#pragma unroll
        for (int i = 0; i < kMaxLaneColumns; ++i) {
          const bool in = lane + 32 * i < hd;
          key[u][i] = in ? keys[at_row + 32 * i] : 0.0f;
          value[u][i] = in ? values[at_row + 32 * i] : 0.0f;
        }
      }
      float part[B::kScores];
#pragma unroll
      for (int u = 0; u < B::kBatch; ++u)
#pragma unroll
        for (int g = 0; g < kHeads; ++g) {
          float dot = 0.0f;
#pragma unroll
          for (int i = 0; i < kMaxLaneColumns; ++i)
            if (lane + 32 * i < hd) dot = fmaf(q[g][lane + 32 * i], key[u][i], dot);
          part[u * kHeads + g] = dot;
        }
      const float total = transposed_warp_sum<B::kScores>(part, lane);  // on every lane: it shuffles
      const float mine = slot < taken ? total : -INFINITY;
      float batch_peak = mine;  // over the batch's slots of the lane's head
#pragma unroll
      for (int offset = kHeads << B::kShift; offset < 32; offset *= 2)
        batch_peak = fmaxf(batch_peak, __shfl_xor_sync(0xffffffffu, batch_peak, offset));
      float rescale[kHeads], head_peak = 0.0f, head_rescale = 0.0f;
#pragma unroll
      for (int g = 0; g < kHeads; ++g) {
        const float merged = fmaxf(peak[g], __shfl_sync(0xffffffffu, batch_peak, g << B::kShift));
        rescale[g] = merge_scale(peak[g], merged);
        peak[g] = merged;
        if (g == head) head_peak = merged, head_rescale = rescale[g];
      }
      const float weight = exp2f(mine - head_peak);  // 0 for an empty slot
      lane_sum = lane_sum * head_rescale + ((lane & (B::kCopies - 1)) == 0 ? weight : 0.0f);
#pragma unroll
      for (int g = 0; g < kHeads; ++g)
#pragma unroll
        for (int i = 0; i < kMaxLaneColumns; ++i) acc[g][i] *= rescale[g];
#pragma unroll
      for (int u = 0; u < B::kBatch; ++u) {
#pragma unroll
        for (int g = 0; g < kHeads; ++g) {
          const float w = __shfl_sync(0xffffffffu, weight, (u * kHeads + g) << B::kShift);
#pragma unroll
          for (int i = 0; i < kMaxLaneColumns; ++i) acc[g][i] = fmaf(w, value[u][i], acc[g][i]);
        }
      }
    }
  }
  // Each head's sum over the lanes of its scores (the offsets that keep the head bits).
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2)
    if (offset < (1 << B::kShift) || offset >= (kHeads << B::kShift))
      lane_sum += __shfl_xor_sync(0xffffffffu, lane_sum, offset);
#pragma unroll
  for (int g = 0; g < kHeads; ++g) run[g] = {peak[g], __shfl_sync(0xffffffffu, lane_sum, g << B::kShift)};
}

// Chunks of a row that hold its positions: one per `chunk_positions` positions of its context, at most `chunks`.
__device__ inline int used_chunks(int64_t visible, int chunks, int chunk_positions) {
  return int(min(int64_t(chunks), (visible + chunk_positions - 1) / chunk_positions));
}

// The last block's merge of the `used` chunks' partials of its (row, head set) into the gated output: every value of
// a batch of kMergeUnroll chunks in flight together, the first batch with the chunks' stats.
template <int kHeads>
__device__ void merge_chunks(const AttentionShape& s, const AttendScratch& scratch, size_t first_slot, int used,
                             const float (&gate)[kHeads][kMaxAttentionHeadDim],
                             float2 (&chunk_stats)[kMaxAttendSlots][kHeads], float* out) {
  const int hd = s.head_dim, d = threadIdx.x;
  auto load = [&](int k0, float(&part)[kMergeUnroll][kHeads]) {
#pragma unroll
    for (int u = 0; u < kMergeUnroll; ++u)
#pragma unroll
      for (int g = 0; g < kHeads; ++g)
        part[u][g] =
            k0 + u < used && d < hd ? __ldcg(&scratch.values[((first_slot + k0 + u) * kHeads + g) * hd + d]) : 0.0f;
  };
  float part[kMergeUnroll][kHeads];
  load(0, part);
  for (int i = threadIdx.x; i < used * kHeads; i += kAttendThreads)
    chunk_stats[i / kHeads][i % kHeads] = __ldcg(&scratch.stats[first_slot * kHeads + i]);
  __syncthreads();
  float peak[kHeads], sum[kHeads], merged[kHeads];
#pragma unroll
  for (int g = 0; g < kHeads; ++g) {
    peak[g] = -INFINITY, sum[g] = 0.0f, merged[g] = 0.0f;
    for (int k = 0; k < used; ++k) peak[g] = fmaxf(peak[g], chunk_stats[k][g].x);
  }
  for (int k0 = 0; k0 < used; k0 += kMergeUnroll) {
    float next[kMergeUnroll][kHeads];
    load(k0 + kMergeUnroll, next);
#pragma unroll
    for (int u = 0; u < kMergeUnroll; ++u) {
      if (k0 + u >= used) break;
#pragma unroll
      for (int g = 0; g < kHeads; ++g) {
        const float scale = merge_scale(chunk_stats[k0 + u][g].x, peak[g]);
        sum[g] += chunk_stats[k0 + u][g].y * scale;
        merged[g] += part[u][g] * scale;
      }
    }
#pragma unroll
    for (int u = 0; u < kMergeUnroll; ++u)
#pragma unroll
      for (int g = 0; g < kHeads; ++g) part[u][g] = next[u][g];
  }
#pragma unroll
  for (int g = 0; g < kHeads; ++g)
    if (d < hd) out[g * hd + d] = __fdividef(merged[g], sum[g]) * fast_sigmoid(gate[g][d]);
}

template <int kHeads>
__global__ void __launch_bounds__(kAttendThreads, kAttendBlocksPerSM)
    attend_kernel(AttentionShape s, const float* queries, const float* q_gate, const float* keys, const float* values,
                  const uint8_t* selected, const int64_t* first_position, const int64_t* settled_position,
                  int stride_blocks, int chunks, int chunk_positions, AttendScratch scratch, float* out) {
  __shared__ float q[kHeads][kMaxAttentionHeadDim];
  __shared__ RunningSoftmax warp_stats[kAttendWarps][kHeads];
  __shared__ float warp_values[kAttendWarps][kHeads][kMaxAttentionHeadDim];
  __shared__ float2 chunk_stats[kMaxAttendSlots][kHeads];
  __shared__ float gate[kHeads][kMaxAttentionHeadDim];  // a thread reads only the columns it copied
  __shared__ bool last;
  const int sets = s.heads / kHeads, set = blockIdx.y, r = set / sets, h0 = set % sets * kHeads;
  const int hd = s.head_dim, warp = threadIdx.x / 32, lane = threadIdx.x % 32, c = blockIdx.x, d = threadIdx.x;
  const int kv = h0 / (s.heads / s.kv_heads);
  // The positions are uploaded before the pass (no kernel of it writes them).
  const int64_t visible = *first_position + r + 1, complete = visible / s.ratio * s.ratio;
  const bool all_chosen = complete / s.ratio <= s.keep_blocks;
  const int used = used_chunks(visible, chunks, chunk_positions);
  const WarpPositions at{int64_t(c) * kAttendWarps + warp, int64_t(used) * kAttendWarps};
  if (c < used && all_chosen) prefetch_rows(s, keys, values, kv, at, *settled_position);
  wait_for_producers();
  allow_dependents();
  if (c >= used) return;
  const size_t rh0 = size_t(r) * s.heads + h0;
  const float score_scale = 1.4426950408889634f * rsqrtf(float(hd));  // log2(e)/√head_dim: scores in base-2 units
  for (int i = threadIdx.x; i < kHeads * hd; i += kAttendThreads)
    q[i / hd][i % hd] = queries[rh0 * hd + i] * score_scale;
    // In flight with the positions, for whichever block writes the output; in shared memory, not registers, which the
    // walk needs (with gates in registers ptxas spilled them, and the spill waited for their load).
#pragma unroll
  for (int g = 0; g < kHeads; ++g)
    if (d < hd) copy_async(&gate[g][d], &q_gate[(rh0 + g) * 2 * hd + d]);
  __syncthreads();

  const RowSpan row{int(visible), int(complete), all_chosen, selected + size_t(r) * stride_blocks};
  RunningSoftmax run[kHeads];
  float acc[kHeads][kMaxLaneColumns] = {};
  attend_positions<kHeads>(s, q, keys, values, kv, row, at, run, acc);

  // The block's partial: its warps' merged in warp order, a thread per column.
  wait_async_copies();
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
    if (used == 1) {
      if (d < hd) out[(rh0 + g) * hd + d] = __fdividef(merged, sum) * fast_sigmoid(gate[g][d]);
      continue;
    }
    if (d < hd) scratch.values[((first_slot + c) * kHeads + g) * hd + d] = merged;
    if (d == 0) scratch.stats[(first_slot + c) * kHeads + g] = make_float2(peak, sum);
  }
  if (used == 1) return;

  // The last of the used chunks' blocks to get here merges their partials.
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&scratch.arrivals[set], 1u) == unsigned(used) - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  merge_chunks<kHeads>(s, scratch, first_slot, used, gate, chunk_stats, out + rh0 * hd);
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
  const dim3 grid(unsigned(s.heads + s.kv_heads + s.index_heads + 2), unsigned(rows));
  const size_t shared = size_t(std::max(s.head_dim, s.index_dim)) * sizeof(float);
  launch_dependent(attention_inputs_kernel, grid, kInputThreads, shared, stream, s, in, first_position, queries,
                   index_queries, caches);
}

void qsa_select(const AttentionShape& s, const float* index_queries, const float* block_keys, int rows,
                const int64_t* first_position, const AttentionBounds& bounds, float* scores, uint8_t* selected,
                cudaStream_t stream) {
  const int launch_blocks = bounds.launch_tokens / s.ratio, stride = bounds.stride_blocks(s.ratio);
  if (rows == 0 || launch_blocks <= s.keep_blocks) return;  // every row keeps all of its blocks
  launch_dependent(qsa_scores_kernel, dim3((launch_blocks + 7) / 8, rows), 256, 0, stream, s, index_queries, block_keys,
                   first_position, stride, scores);
  if (rows <= kRankMaxRows)
    launch_dependent(qsa_rank_kernel, dim3((launch_blocks + 31) / 32, rows), kRankWarps * 32, 0, stream, s,
                     first_position, stride, scores, selected);
  else
    launch_dependent(qsa_select_top_kernel, dim3(rows), kSelectThreads, 0, stream, s, first_position, stride, scores,
                     selected);
}

// The scratch serves both kernels: attend_kernel's and, for passes it takes, attend_prefill's.
size_t attend_value_floats(const AttentionShape& s, int max_rows) {
  return std::max(size_t(std::max(max_rows, kMaxAttendSlots)) * size_t(s.heads) * size_t(s.head_dim),
                  attend_prefill_value_floats(s));
}
size_t attend_stat_count(const AttentionShape& s, int max_rows) {
  return std::max(size_t(std::max(max_rows, kMaxAttendSlots)) * size_t(s.heads), attend_prefill_stat_count(s));
}
size_t attend_arrival_count(const AttentionShape& s, int max_rows) {
  return std::max(size_t(max_rows) * size_t(s.heads), attend_prefill_arrival_count(s));
}

void sparse_attention(const AttentionShape& s, const float* queries, const float* q_gate, const float* keys,
                      const float* values, const uint8_t* selected, int rows, const int64_t* first_position,
                      const int64_t* settled_position, const AttentionBounds& bounds, const AttendScratch& scratch,
                      float* out, cudaStream_t stream) {
  if (rows == 0) return;
  if (attend_prefill_takes(s, rows, bounds.launch_tokens))
    return attend_prefill(s, queries, q_gate, keys, values, selected, rows, first_position, bounds, scratch, out,
                          stream);
  const int heads = attend_heads(s), chunks = attend_chunks(rows, bounds.launch_tokens);
  const dim3 grid(unsigned(chunks), unsigned(rows * (s.heads / heads)));
  const int stride = bounds.stride_blocks(s.ratio);
  // Positions a row's chunk takes at least. One row has only heads / 4 head sets: at a short context splitting it
  // gains nothing (equal on an H200 at 64 positions), and at a long one fuller chunks fit one wave of blocks (two a
  // multiprocessor): 192 blocks in place of 384 at 8192 positions, 41.5 → 30.0 µs. Several rows fill the GPU by
  // splitting even short contexts (4 rows at 64 positions: 11.5 µs at a position a warp, 13.7 at 256 a chunk).
  const int chunk_positions = rows == 1 ? kAttendChunkPositions : kAttendWarps;
  auto launch = [&](auto kernel) {
    launch_dependent(kernel, grid, kAttendThreads, 0, stream, s, queries, q_gate, keys, values, selected,
                     first_position, settled_position, stride, chunks, chunk_positions, scratch, out);
  };
  if (heads == 4)
    launch(attend_kernel<4>);
  else if (heads == 2)
    launch(attend_kernel<2>);
  else
    launch(attend_kernel<1>);
}

}  // namespace vavilov::cuda
