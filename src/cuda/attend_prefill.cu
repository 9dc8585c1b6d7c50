#include <algorithm>

#include "cuda/attend_prefill.cuh"
#include "cuda/device_math.cuh"
#include "cuda/launch.cuh"

namespace vavilov::cuda {

namespace {

// Block (chunk c, query tile, kv head): up to 64 queries of the kv head — the heads of the kv head of a few whole
// neighbouring rows (tile_queries) — over the c-th of `chunks` equal parts of the positions its rows chose: the union
// of the blocks of `ratio` positions the rows' indexers kept (with the trailing incomplete blocks, and every block of a
// row that keeps all) is built as a bit set in shared memory first and walked in tiles of 32 gathered positions, so
// that the block's work follows the selection budget (5 rows × 2048 positions at most at Flash-Next) and not the
// positions the rows see. Per tile (keys and values copied by cp.async one tile ahead): the 64 × 32 scores on the
// tensor cores (queries · keysᵀ), a running softmax per query over its row's chosen positions (8 threads a query), the
// 64 × head_dim weighted values on the tensor cores (weights · values). Before session 11's second round the block
// walked every position its rows saw and skipped only the tiles none of them chose (its cost grew with the prompt:
// passes past 4 × the kept positions went back to attend_kernel); before that a block took one row's 4 heads and walked
// its positions on the CUDA cores, reading each key and value row once per row and head set of the pass.
// Products are 3×TF32: each fp32 operand split into a tf32 hi and lo = x − hi, hi·hi + hi·lo + lo·hi accumulated in
// fp32 (the dropped lo·lo and lo's truncation to tf32 are ~2⁻²⁰ relative: fp32 accuracy). A query's unchosen positions
// (past its row, or in a block its indexer dropped) get weight 0; positions past the last row are zero-filled.
// Chunks write partial results that the last block of the tile to arrive merges in chunk order (deterministic).
constexpr int kQueries = 64;                  // a block's queries: 4 m-tiles of 16
constexpr int kPositions = 32;                // positions a tile: 4 n-tiles of 8
constexpr int kScoreStride = kPositions + 4;  // rows 4 banks apart: the weights' fragment loads are conflict-free
constexpr int kMaxChunks = 12;                // chunks a query tile's positions split into
constexpr int kSlotsPerSM = 5;      // blocks × chunks of a split launch, per multiprocessor (bounds the scratch)
constexpr int kMinChunkTiles = 4;   // position tiles a chunk takes at least
constexpr int kPrefillMinRows = 5;  // passes of more rows than a verify pass take this kernel

// How a block's kWarps warps share its work: m_tile_warps warps an m-tile of 16 queries; in the scores each takes
// score_n_tiles n-tiles of 8 positions, in the weighted values the 8-column output tiles ≡ its index (mod
// m_tile_warps); in the softmax query_threads threads a query take thread_positions positions each. 16 warps (one
// block a multiprocessor, its shared memory) measured as fast as 8 in the prefill.
constexpr int kWarps = 16;
struct WarpRoles {
  static constexpr int threads = 32 * kWarps, m_tile_warps = kWarps / 4, score_n_tiles = 4 / m_tile_warps;
  static constexpr int query_threads = threads / kQueries, thread_positions = kPositions / query_threads;
};

// Shared memory of a block: the queries, two stages of key and value tiles, the scores (then weights) and per query
// the tile's rescale factor and the final sum. Row strides: keys and queries ≡ 4 (mod 32) banks apart (their fragments
// read (row g, column t) over g < 8, t < 4), values ≡ 8 (mod 32) (theirs read (row t, column g)).
template <int kHd>
struct Layout {
  static constexpr int q_stride = kHd + 4, k_stride = kHd + 4, v_stride = kHd + (kHd % 16 == 0 ? 8 : 0);
  static constexpr int q_floats = kQueries * q_stride, k_floats = kPositions * k_stride;
  static constexpr int v_floats = kPositions * v_stride, s_floats = kQueries * kScoreStride;
  static constexpr size_t bytes = size_t(q_floats + 2 * k_floats + 2 * v_floats + s_floats + 2 * kQueries) * 4;
  static constexpr int warp_n_tiles = (kHd / 8 + WarpRoles::m_tile_warps - 1) / WarpRoles::m_tile_warps;
};

// Past Layout's floats: the block's chosen units (the union over its rows of the blocks of `ratio` positions they
// chose), a bit each in words of 32, and per word the chosen units of the words before it.
size_t unit_words(const AttentionShape& s, int launch_tokens) {
  return size_t((launch_tokens + s.ratio - 1) / s.ratio + 31) / 32;
}

struct Split {
  uint32_t hi, lo;
};
// x as a tf32 hi (low 13 mantissa bits cleared) and lo = x − hi (exact; the tensor cores read its top 19 bits).
__device__ inline Split split_tf32(float x) {
  const uint32_t hi = __float_as_uint(x) & 0xffffe000u;
  return {hi, __float_as_uint(x - __uint_as_float(hi))};
}

// d += A B for one m16n8k8 tf32 mma (A: a0 (g, t), a1 (g + 8, t), a2 (g, t + 4), a3 (g + 8, t + 4); B: b0 (t, g),
// b1 (t + 4, g); d: (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1), with g = lane / 4, t = lane % 4).
__device__ inline void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                           uint32_t b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The A fragment of one k-step at a (row stride `stride`), split.
__device__ inline void load_a(Split (&f)[4], const float* a, int stride) {
  f[0] = split_tf32(a[0]), f[1] = split_tf32(a[8 * stride]);
  f[2] = split_tf32(a[4]), f[3] = split_tf32(a[8 * stride + 4]);
}

// 16 bytes from global to shared memory by cp.async; zeros where !in (src is then not read but must be an address).
__device__ inline void copy16(float* shared, const float* global, bool in) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(unsigned(__cvta_generic_to_shared(shared))),
               "l"(global), "r"(in ? 16 : 0)
               : "memory");
}
__device__ inline void commit_copies() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ inline void wait_copies_but_last() { asm volatile("cp.async.wait_group 1;" ::: "memory"); }

// The factor of a running softmax with peak `peak` after a merge whose peak is `merged` (0 while it is empty).
// Peaks are in base-2 units (the queries carry log2(e)/√head_dim).
__device__ inline float merge_scale(float peak, float merged) {
  return peak == -INFINITY ? 0.0f : exp2f(peak - merged);
}

struct PrefillArgs {
  AttentionShape s;
  const float *queries, *q_gate, *keys, *values;
  const uint8_t* selected;
  const int64_t* first_position;
  int rows, stride_blocks, chunks;
  int tile_queries;  // queries of a query tile: whole rows' heads of the kv head where a row's fit (kQueries at most)
  int unit_words;    // words of the chosen units' bit set (unit_words)
  AttendScratch scratch;
  float* out;
};

// The chosen units (in bits / before, see unit_words): the position of the g-th position of their ascending list (a
// unit's `ratio` positions in a row), `end` past the list. The word of the unit is the last with fewer units before it
// than the unit's index in the list (empty words share their successor's count, so it is never an empty one).
__device__ int gathered_position(const unsigned* bits, const int* before, int words, int units, int ratio, int g,
                                 int end) {
  const int k = g / ratio;
  if (k >= units) return end;
  int lo = 0, hi = words - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (before[mid] <= k)
      lo = mid;
    else
      hi = mid - 1;
  }
  unsigned word = bits[lo];
  for (int n = k - before[lo]; n > 0; --n) word &= word - 1;  // drop the units of the word before the k-th
  return (32 * lo + __ffs(int(word)) - 1) * ratio + g % ratio;
}

constexpr int kCopyThreads = WarpRoles::threads / kPositions;  // threads a position of a tile
static_assert(WarpRoles::threads % kPositions == 0);

// Copies the key and value rows (kv head `kv`) of gathered tile `tile` (its 32 positions of the chosen units' list)
// into shared memory and their positions into `positions`; positions at or past `end` become zeros. kCopyThreads
// threads take a position (one finds it).
template <int kHd>
__device__ void copy_tile(const PrefillArgs& a, int kv, int tile, const unsigned* bits, const int* before, int units,
                          int end, float* keys, float* values, int* positions) {
  using L = Layout<kHd>;
  const int j = threadIdx.x / kCopyThreads, piece = threadIdx.x % kCopyThreads;
  const int p = gathered_position(bits, before, a.unit_words, units, a.s.ratio, tile * kPositions + j, end);
  if (piece == 0) positions[j] = p;
  const bool in = p < end;
  const size_t row = (size_t(in ? p : 0) * a.s.kv_heads + kv) * kHd;
  for (int col = 4 * piece; col < kHd; col += 4 * kCopyThreads) {
    copy16(keys + j * L::k_stride + col, a.keys + row + col, in);
    copy16(values + j * L::v_stride + col, a.values + row + col, in);
  }
}

// Exclusive prefix sum of v over the block's threads (in thread order) and the total; warp_totals: kWarps ints.
__device__ int block_exclusive_sum(int v, int* warp_totals, int& total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int x = v;
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    const int y = __shfl_up_sync(0xffffffffu, x, offset);
    if (lane >= offset) x += y;
  }
  if (lane == 31) warp_totals[warp] = x;
  __syncthreads();
  int before = x - v;
  total = 0;
  for (int w = 0; w < kWarps; ++w) {
    before += w < warp ? warp_totals[w] : 0;
    total += warp_totals[w];
  }
  __syncthreads();  // warp_totals is free again
  return before;
}

// Scores of the warp's 16 queries (m-tile mt) and its kScoreNTiles n-tiles of 8 positions (from 8·first_n) into
// `scores`; the three products of 3×TF32 in chains of their own.
template <int kHd>
__device__ void score_tile(const float* queries, const float* keys, float* scores, int mt, int first_n, int lane) {
  using L = Layout<kHd>;
  constexpr int N = WarpRoles::score_n_tiles;
  const int g = lane / 4, t = lane % 4;
  float hi_hi[N][4] = {}, lo_hi[N][4] = {}, hi_lo[N][4] = {};
  const float* qa = queries + (16 * mt + g) * L::q_stride + t;
  const float* kb = keys + (8 * first_n + g) * L::k_stride + t;
#pragma unroll 4
  for (int k0 = 0; k0 < kHd; k0 += 8) {
    Split a[4], b[N][2];
    load_a(a, qa + k0, L::q_stride);
#pragma unroll
    for (int n = 0; n < N; ++n) {
      b[n][0] = split_tf32(kb[8 * n * L::k_stride + k0]);
      b[n][1] = split_tf32(kb[8 * n * L::k_stride + k0 + 4]);
    }
#pragma unroll
    for (int n = 0; n < N; ++n) {
      mma(lo_hi[n], a[0].lo, a[1].lo, a[2].lo, a[3].lo, b[n][0].hi, b[n][1].hi);
      mma(hi_lo[n], a[0].hi, a[1].hi, a[2].hi, a[3].hi, b[n][0].lo, b[n][1].lo);
      mma(hi_hi[n], a[0].hi, a[1].hi, a[2].hi, a[3].hi, b[n][0].hi, b[n][1].hi);
    }
  }
#pragma unroll
  for (int n = 0; n < N; ++n) {
    float v[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] = hi_hi[n][e] + (lo_hi[n][e] + hi_lo[n][e]);
    float* at = scores + (16 * mt + g) * kScoreStride + 8 * (first_n + n) + 2 * t;
    *reinterpret_cast<float2*>(at) = make_float2(v[0], v[1]);
    *reinterpret_cast<float2*>(at + 8 * kScoreStride) = make_float2(v[2], v[3]);
  }
}

// Output column tile i of a warp whose index within its m-tile's warps is `lane_of_tile`.
__device__ inline int output_tile(int lane_of_tile, int i) { return lane_of_tile + WarpRoles::m_tile_warps * i; }

// acc (the warp's 16 queries × its 8-column output tiles) rescaled by the tile's factors, then += weights · values
// over the tile's 32 positions.
template <int kHd>
__device__ void value_tile(const float* weights, const float* values, const float* rescale,
                           float (&acc)[Layout<kHd>::warp_n_tiles][4], int mt, int column_warp, int lane) {
  using L = Layout<kHd>;
  constexpr int N = L::warp_n_tiles;
  const int g = lane / 4, t = lane % 4;
  const float r0 = rescale[16 * mt + g], r1 = rescale[16 * mt + g + 8];
#pragma unroll
  for (int i = 0; i < N; ++i) acc[i][0] *= r0, acc[i][1] *= r0, acc[i][2] *= r1, acc[i][3] *= r1;
  const float* pa = weights + (16 * mt + g) * kScoreStride + t;
#pragma unroll
  for (int k0 = 0; k0 < kPositions; k0 += 8) {
    Split a[4], b[N][2];
    load_a(a, pa + k0, kScoreStride);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int n0 = 8 * output_tile(column_warp, i);
      if (n0 >= kHd) break;
      b[i][0] = split_tf32(values[(k0 + t) * L::v_stride + n0 + g]);
      b[i][1] = split_tf32(values[(k0 + t + 4) * L::v_stride + n0 + g]);
    }
    // Term by term over the tiles: each tile's three mma are a chain, so its neighbours' run in between.
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (8 * output_tile(column_warp, i) < kHd)
        mma(acc[i], a[0].lo, a[1].lo, a[2].lo, a[3].lo, b[i][0].hi, b[i][1].hi);
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (8 * output_tile(column_warp, i) < kHd)
        mma(acc[i], a[0].hi, a[1].hi, a[2].hi, a[3].hi, b[i][0].lo, b[i][1].lo);
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (8 * output_tile(column_warp, i) < kHd)
        mma(acc[i], a[0].hi, a[1].hi, a[2].hi, a[3].hi, b[i][0].hi, b[i][1].hi);
  }
}

// Where a query may look: its visible positions and whether the indexer's choice applies (as in attention.cu;
// positions are within the launch's bound, an int).
struct QuerySpan {
  int visible = 0, complete = 0;
  bool all_chosen = true;
  const uint8_t* selected = nullptr;
  __device__ bool chosen(int p, int ratio) const {
    return p < visible && (all_chosen || p >= complete || selected[p / ratio]);
  }
};

template <int kHd>
__global__ void __launch_bounds__(WarpRoles::threads, 1) attend_prefill_kernel(PrefillArgs a) {
  using L = Layout<kHd>;
  using W = WarpRoles;
  constexpr int TQ = W::query_threads, TP = W::thread_positions;
  extern __shared__ __align__(16) float shared[];
  float* q_s = shared;
  float* k_s = q_s + L::q_floats;       // two stages
  float* v_s = k_s + 2 * L::k_floats;   // two stages
  float* p_s = v_s + 2 * L::v_floats;   // scores, then weights
  float* factor_s = p_s + L::s_floats;  // per query: the tile's rescale factor
  float* sum_s = factor_s + kQueries;   // per query: its sum (all chunks' in the merge) at the end
  unsigned* unit_bits = reinterpret_cast<unsigned*>(sum_s + kQueries);
  int* units_before = reinterpret_cast<int*>(unit_bits + a.unit_words);
  __shared__ int positions_s[2][kPositions];  // per stage: the tile's positions
  __shared__ int warp_totals[kWarps];
  __shared__ bool last;

  const AttentionShape& s = a.s;
  const int c = blockIdx.x, qt = blockIdx.y, kv = blockIdx.z, tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32, mt = warp / W::m_tile_warps, column_warp = warp % W::m_tile_warps;
  const int group = s.heads / s.kv_heads, queries = a.rows * group, m_first = qt * a.tile_queries;
  // Query q of the tile is the pass's m_first + q while q < tile_queries (the rest are zeros and write nothing).
  auto in_pass = [&](int q) { return q < a.tile_queries && m_first + q < queries; };
  wait_for_producers();
  allow_dependents();
  const int64_t first = *a.first_position;

  // The units any row of the tile chose (a unit of a row's complete blocks when the indexer kept it or keeps every
  // block, a unit of its trailing incomplete block when the row sees a position of it): a warp a word.
  const int first_row = m_first / group, last_row = min(a.rows - 1, (m_first + a.tile_queries - 1) / group);
  const int end = int(first + last_row + 1), unit_count = (end + s.ratio - 1) / s.ratio;
  for (int word = warp; word < a.unit_words; word += kWarps) {
    const int u = 32 * word + lane, start = u * s.ratio;
    bool chosen = false;
    for (int r = first_row; r <= last_row && !chosen && u < unit_count; ++r) {
      const int visible = int(first) + r + 1, complete = visible / s.ratio * s.ratio;
      chosen = start < visible && (complete / s.ratio <= s.keep_blocks || start >= complete ||
                                   a.selected[size_t(r) * a.stride_blocks + u]);
    }
    const unsigned bits = __ballot_sync(0xffffffffu, chosen);
    if (lane == 0) unit_bits[word] = bits;
  }
  __syncthreads();
  // Units before each word: a thread a run of consecutive words.
  const int run = (a.unit_words + W::threads - 1) / W::threads, run_begin = min(tid * run, a.unit_words);
  const int run_end = min(run_begin + run, a.unit_words);
  int run_units = 0;
  for (int w = run_begin; w < run_end; ++w) run_units += __popc(unit_bits[w]);
  int units = 0;
  int before = block_exclusive_sum(run_units, warp_totals, units);
  for (int w = run_begin; w < run_end; ++w) {
    units_before[w] = before;
    before += __popc(unit_bits[w]);
  }
  __syncthreads();

  // The chunk's tiles: its share of the gathered list's.
  const int tiles = (units * s.ratio + kPositions - 1) / kPositions;
  const int tile_begin = int(int64_t(tiles) * c / a.chunks), tile_end = int(int64_t(tiles) * (c + 1) / a.chunks);
  if (tile_begin < tile_end)
    copy_tile<kHd>(a, kv, tile_begin, unit_bits, units_before, units, end, k_s, v_s, positions_s[0]);
  commit_copies();

  // The queries, in base-2 units (as attention.cu's walk), those past the pass or the tile zeros.
  const float score_scale = 1.4426950408889634f * rsqrtf(float(kHd));
  for (int i = tid; i < kQueries * kHd / 4; i += W::threads) {
    const int q = i / (kHd / 4), col = 4 * (i % (kHd / 4)), m = m_first + q;
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (in_pass(q)) {
      v = *reinterpret_cast<const float4*>(a.queries + (size_t(m / group) * s.heads + kv * group + m % group) * kHd +
                                           col);
      v.x *= score_scale, v.y *= score_scale, v.z *= score_scale, v.w *= score_scale;
    }
    *reinterpret_cast<float4*>(q_s + q * L::q_stride + col) = v;
  }
  __syncthreads();  // the first tile's positions (copy_tile's) are read by other threads below

  // The softmax's query (TQ threads a query, TP positions of a tile each) and its running state.
  const int qi = tid / TQ, part = tid % TQ, m = m_first + qi;
  QuerySpan span;
  if (in_pass(qi)) {
    const int row = m / group;
    span.visible = int(first) + row + 1;
    span.complete = span.visible / s.ratio * s.ratio;
    span.all_chosen = span.complete / s.ratio <= s.keep_blocks;
    span.selected = a.selected + size_t(row) * a.stride_blocks;
  }
  float peak = -INFINITY, sum = 0.0f;
  float acc[L::warp_n_tiles][4] = {};

  for (int tile = tile_begin; tile < tile_end; ++tile) {
    const int stage = (tile - tile_begin) % 2;
    float* keys = k_s + stage * L::k_floats;
    float* values = v_s + stage * L::v_floats;
    if (tile + 1 < tile_end)
      copy_tile<kHd>(a, kv, tile + 1, unit_bits, units_before, units, end, k_s + (stage ^ 1) * L::k_floats,
                     v_s + (stage ^ 1) * L::v_floats, positions_s[stage ^ 1]);
    commit_copies();
    const int* positions = positions_s[stage] + TP * part;
    unsigned chosen = 0;  // of the thread's TP positions (their selection loads in flight together)
#pragma unroll
    for (int j = 0; j < TP; ++j) chosen |= unsigned(span.chosen(positions[j], s.ratio)) << j;
    wait_copies_but_last();
    // Every gathered tile holds a position some query chose, but this barrier also makes the stage's copies (each
    // thread's own, waited above) visible to all; a tile none of the block's queries chose would cost no products.
    if (!__syncthreads_or(chosen != 0)) continue;
    score_tile<kHd>(q_s, keys, p_s, mt, column_warp * W::score_n_tiles, lane);
    __syncthreads();

    float* scores = p_s + qi * kScoreStride + TP * part;
    float w[TP];
#pragma unroll
    for (int j = 0; j < TP; j += 4) {
      const float4 v = *reinterpret_cast<float4*>(scores + j);
      w[j] = v.x, w[j + 1] = v.y, w[j + 2] = v.z, w[j + 3] = v.w;
    }
    float tile_peak = -INFINITY;
#pragma unroll
    for (int j = 0; j < TP; ++j)
      if (chosen >> j & 1u) tile_peak = fmaxf(tile_peak, w[j]);
#pragma unroll
    for (int offset = 1; offset < TQ; offset *= 2)
      tile_peak = fmaxf(tile_peak, __shfl_xor_sync(0xffffffffu, tile_peak, offset));
    const float merged = fmaxf(peak, tile_peak), factor = merge_scale(peak, merged);
    float tile_sum = 0.0f;
#pragma unroll
    for (int j = 0; j < TP; ++j) {
      w[j] = chosen >> j & 1u ? exp2f(w[j] - merged) : 0.0f;
      tile_sum += w[j];
    }
#pragma unroll
    for (int offset = 1; offset < TQ; offset *= 2) tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, offset);
    sum = sum * factor + tile_sum;
    peak = merged;
#pragma unroll
    for (int j = 0; j < TP; j += 4)
      *reinterpret_cast<float4*>(scores + j) = make_float4(w[j], w[j + 1], w[j + 2], w[j + 3]);
    if (part == 0) factor_s[qi] = factor;
    __syncthreads();
    value_tile<kHd>(p_s, values, factor_s, acc, mt, column_warp, lane);
    __syncthreads();  // the stage and the weights are free for the next tile
  }

  if (part == 0) sum_s[qi] = sum;
  __syncthreads();
  const int g = lane / 4, t = lane % 4;
  // Element e of output tile i of the warp: query 16·mt + g (+8 for e ≥ 2), column 8·output_tile(i) + 2t + e % 2.
  auto output_at = [&](int q) {
    return (size_t((m_first + q) / group) * s.heads + kv * group + (m_first + q) % group);
  };
  if (a.chunks == 1) {
#pragma unroll
    for (int i = 0; i < L::warp_n_tiles; ++i) {
      const int d0 = 8 * output_tile(column_warp, i) + 2 * t;
      if (d0 >= kHd) break;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int q = 16 * mt + g + 8 * (e / 2);
        if (!in_pass(q)) continue;
        const size_t rh = output_at(q);
        a.out[rh * kHd + d0 + e % 2] =
            __fdividef(acc[i][e], sum_s[q]) * fast_sigmoid(a.q_gate[rh * 2 * kHd + d0 + e % 2]);
      }
    }
    return;
  }

  // The chunk's partial: unnormalised values and (peak, sum) per query.
  const size_t tile_slot = size_t(kv) * gridDim.y + qt, slot = tile_slot * a.chunks + c;
  float* partial = a.scratch.values + slot * kQueries * kHd;
#pragma unroll
  for (int i = 0; i < L::warp_n_tiles; ++i) {
    const int d0 = 8 * output_tile(column_warp, i) + 2 * t;
    if (d0 >= kHd) break;
    const int q = 16 * mt + g;
    *reinterpret_cast<float2*>(partial + q * kHd + d0) = make_float2(acc[i][0], acc[i][1]);
    *reinterpret_cast<float2*>(partial + (q + 8) * kHd + d0) = make_float2(acc[i][2], acc[i][3]);
  }
  if (part == 0) a.scratch.stats[slot * kQueries + qi] = make_float2(peak, sum);
  __threadfence();
  __syncthreads();
  if (tid == 0) last = atomicAdd(&a.scratch.arrivals[tile_slot], 1u) == unsigned(a.chunks) - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();

  // The last block merges the chunks in chunk order: per query the chunks' factors (in p_s) and the total sum.
  float* chunk_factor = p_s;  // [kQueries][kMaxChunks] fits in the scores' kQueries × kScoreStride
  if (part == 0) {
    const float2* stats = a.scratch.stats + tile_slot * a.chunks * kQueries + qi;
    float2 st[kMaxChunks];
#pragma unroll
    for (int k = 0; k < kMaxChunks; ++k)
      st[k] = k < a.chunks ? __ldcg(&stats[k * kQueries]) : make_float2(-INFINITY, 0.0f);
    float total_peak = -INFINITY, total = 0.0f;
#pragma unroll
    for (int k = 0; k < kMaxChunks; ++k) total_peak = fmaxf(total_peak, st[k].x);
#pragma unroll
    for (int k = 0; k < kMaxChunks; ++k) {
      if (k >= a.chunks) break;
      const float f = merge_scale(st[k].x, total_peak);
      chunk_factor[qi * kMaxChunks + k] = f;
      total += st[k].y * f;
    }
    sum_s[qi] = total;
  }
  __syncthreads();
  if (in_pass(qi)) {
    const size_t rh = output_at(qi);
    const float* parts = a.scratch.values + tile_slot * a.chunks * kQueries * kHd + size_t(qi) * kHd;
    for (int col = 4 * part; col < kHd; col += 4 * TQ) {
      float4 v[kMaxChunks];  // every chunk's values in flight at once
#pragma unroll
      for (int k = 0; k < kMaxChunks; ++k)
        if (k < a.chunks) v[k] = __ldcg(reinterpret_cast<const float4*>(parts + size_t(k) * kQueries * kHd + col));
      float4 merged = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
      for (int k = 0; k < kMaxChunks; ++k) {
        if (k >= a.chunks) break;
        const float f = chunk_factor[qi * kMaxChunks + k];
        merged.x += v[k].x * f, merged.y += v[k].y * f, merged.z += v[k].z * f, merged.w += v[k].w * f;
      }
      const float* gate = a.q_gate + rh * 2 * kHd + col;
      float* out = a.out + rh * kHd + col;
      out[0] = __fdividef(merged.x, sum_s[qi]) * fast_sigmoid(gate[0]);
      out[1] = __fdividef(merged.y, sum_s[qi]) * fast_sigmoid(gate[1]);
      out[2] = __fdividef(merged.z, sum_s[qi]) * fast_sigmoid(gate[2]);
      out[3] = __fdividef(merged.w, sum_s[qi]) * fast_sigmoid(gate[3]);
    }
  }
  if (tid == 0) a.scratch.arrivals[tile_slot] = 0;  // ready for the next launch
}

// Queries of a query tile: the heads (of one kv head) of as many whole rows as fit in kQueries (a tile's rows are
// fewer, so is the union of their choices: at Flash-Next's 12 heads 5 rows, 60 queries, in place of 64 queries over
// parts of 6 rows), or kQueries where one row's exceed them.
int tile_queries(const AttentionShape& s) {
  const int group = s.heads / s.kv_heads;
  return group <= kQueries ? kQueries / group * group : kQueries;
}

// Query tiles of one kv head in a pass of `rows` rows.
int query_tiles(const AttentionShape& s, int rows) {
  return (rows * (s.heads / s.kv_heads) + tile_queries(s) - 1) / tile_queries(s);
}

// Positions a query tile attends at most: its rows' (at most tile_queries / group + 1) kept blocks and trailing
// incomplete ones, within the launch's span.
int64_t tile_span(const AttentionShape& s, int launch_tokens) {
  const int64_t rows = tile_queries(s) / (s.heads / s.kv_heads) + 1;
  return std::min(int64_t(launch_tokens), rows * (int64_t(s.keep_blocks) + 1) * s.ratio);
}

int multiprocessors() {
  static const int count = [] {
    int device = 0, n = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
    return std::max(n, 1);
  }();
  return count;
}

// Chunks a query tile's positions split into: the count whose rounds of blocks (one a multiprocessor) leave the fewest
// idle (rounds / chunks least; the fewer chunks on a tie), each of at least kMinChunkTiles position tiles of the
// tile's span (tile_span), within kMaxChunks and kSlotsPerSM slots a multiprocessor. At Flash-Next's 13 query tiles
// (of 5 rows) a kv head of a 64-row pass on 132 multiprocessors: 5 (one round of 130 blocks); at a 512-row pass's 103:
// 3 (618 blocks, five rounds, the last 68 % full; one chunk's 206 blocks take two rounds, the last 56 % full).
int prefill_chunks(const AttentionShape& s, int rows, int launch_tokens) {
  const int sms = multiprocessors(), blocks = query_tiles(s, rows) * s.kv_heads;
  const int span_tiles = int((tile_span(s, launch_tokens) + kPositions - 1) / kPositions);
  const int most = std::min({kMaxChunks, span_tiles / kMinChunkTiles, kSlotsPerSM * sms / blocks});
  int best = 1;
  double best_cost = double((blocks + sms - 1) / sms);
  for (int c = 2; c <= most; ++c) {
    const double cost = double((blocks * c + sms - 1) / sms) / c;
    if (cost < best_cost) best = c, best_cost = cost;
  }
  return best;
}

// Shared memory a block may have besides the kernel's static arrays (positions_s, warp_totals, last).
constexpr size_t kStaticSharedReserve = 4096;  // 1360 bytes at sm_90a
size_t dynamic_shared_limit() {
  static const size_t limit = [] {
    int device = 0, optin = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    return size_t(optin) - kStaticSharedReserve;
  }();
  return limit;
}

size_t layout_bytes(int head_dim) {
  switch (head_dim) {
    case 8:
      return Layout<8>::bytes;
    case 16:
      return Layout<16>::bytes;
    case 32:
      return Layout<32>::bytes;
    case 64:
      return Layout<64>::bytes;
    case 128:
      return Layout<128>::bytes;
    default:
      return Layout<256>::bytes;
  }
}

size_t shared_bytes(const AttentionShape& s, int launch_tokens) {
  return layout_bytes(s.head_dim) + 2 * sizeof(int) * unit_words(s, launch_tokens);
}

template <int kHd>
void launch_prefill(const PrefillArgs& args, dim3 grid, size_t shared, cudaStream_t stream) {
  static const bool sized = [] {
    return cudaFuncSetAttribute(attend_prefill_kernel<kHd>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                int(dynamic_shared_limit())) == cudaSuccess;
  }();
  (void)sized;  // a failure shows as the launch's error
  launch_dependent(attend_prefill_kernel<kHd>, grid, WarpRoles::threads, shared, stream, args);
}

}  // namespace

// The kernel's work follows the union of its query tile's rows' choices (at most tile_span positions), not the
// positions they see; its shared memory holds a bit a block of `ratio` positions of the launch's span (Flash-Next: up
// to ~280k positions at head dim 256 on an H200).
bool attend_prefill_takes(const AttentionShape& s, int rows, int launch_tokens) {
  const int hd = s.head_dim;
  return rows >= kPrefillMinRows && (hd == 8 || hd == 16 || hd == 32 || hd == 64 || hd == 128 || hd == 256) &&
         shared_bytes(s, launch_tokens) <= dynamic_shared_limit();
}

// A split launch has at most kSlotsPerSM blocks × chunks a multiprocessor (prefill_chunks), whatever its rows.
size_t attend_prefill_value_floats(const AttentionShape& s) {
  return attend_prefill_stat_count(s) * size_t(s.head_dim);
}
size_t attend_prefill_stat_count(const AttentionShape& s) { return attend_prefill_arrival_count(s) * kQueries; }
size_t attend_prefill_arrival_count(const AttentionShape&) { return size_t(kSlotsPerSM) * multiprocessors(); }

void attend_prefill(const AttentionShape& s, const float* queries, const float* q_gate, const float* keys,
                    const float* values, const uint8_t* selected, int rows, const int64_t* first_position,
                    const AttentionBounds& bounds, const AttendScratch& scratch, float* out, cudaStream_t stream) {
  const PrefillArgs args{s,
                         queries,
                         q_gate,
                         keys,
                         values,
                         selected,
                         first_position,
                         rows,
                         bounds.stride_blocks(s.ratio),
                         prefill_chunks(s, rows, bounds.launch_tokens),
                         tile_queries(s),
                         int(unit_words(s, bounds.launch_tokens)),
                         scratch,
                         out};
  const dim3 grid(unsigned(args.chunks), unsigned(query_tiles(s, rows)), unsigned(s.kv_heads));
  const size_t shared = shared_bytes(s, bounds.launch_tokens);
  switch (s.head_dim) {
    case 8:
      return launch_prefill<8>(args, grid, shared, stream);
    case 16:
      return launch_prefill<16>(args, grid, shared, stream);
    case 32:
      return launch_prefill<32>(args, grid, shared, stream);
    case 64:
      return launch_prefill<64>(args, grid, shared, stream);
    case 128:
      return launch_prefill<128>(args, grid, shared, stream);
    default:
      return launch_prefill<256>(args, grid, shared, stream);
  }
}

}  // namespace vavilov::cuda
