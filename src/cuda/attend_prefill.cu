#include <algorithm>

#include "cuda/attend_prefill.cuh"
#include "cuda/device_math.cuh"
#include "cuda/launch.cuh"

namespace vavilov::cuda {

namespace {

// Block (chunk c, query tile, kv head): 64 queries of the kv head — query m is head kv·group + m % group of the pass's
// row m / group, so that a tile holds the heads of a few neighbouring rows — over the c-th of `chunks` equal parts of
// the position tiles its last row sees. Per tile of 32 positions (keys and values copied by cp.async one tile ahead):
// the 64 × 32 scores on the tensor cores (queries · keysᵀ), a running softmax per query over its row's chosen
// positions (8 threads a query), the 64 × head_dim weighted values on the tensor cores (weights · values); a tile that
// no query of the block chose is skipped. Before, a block took one row's 4 heads and walked its positions on the CUDA
// cores, so each key and value row was read once per row and head set of the pass (64 × 3 times a kv head at 64
// rows) and every multiply-add was a scalar one.
// Products are 3×TF32: each fp32 operand split into a tf32 hi and lo = x − hi, hi·hi + hi·lo + lo·hi accumulated in
// fp32 (the dropped lo·lo and lo's truncation to tf32 are ~2⁻²⁰ relative: fp32 accuracy). A query's unchosen positions
// (past its row, or in a block its indexer dropped) get weight 0; positions past the last row are zero-filled.
// Chunks write partial results that the last block of the tile to arrive merges in chunk order (deterministic).
constexpr int kQueries = 64;                  // a block's queries: 4 m-tiles of 16
constexpr int kPositions = 32;                // positions a tile: 4 n-tiles of 8
constexpr int kScoreStride = kPositions + 4;  // rows 4 banks apart: the weights' fragment loads are conflict-free
constexpr int kMaxChunks = 12;                // chunks a query tile's positions split into
constexpr int kSlotsPerSM = 3;      // blocks × chunks of a split launch, per multiprocessor (bounds the scratch)
constexpr int kMinChunkTiles = 4;   // position tiles a chunk takes at least
constexpr int kPrefillMinRows = 5;  // passes of more rows than a verify pass take this kernel
constexpr int kDenseSpan = 4;       // ... while a row sees at most this many times the positions its indexer keeps

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
  AttendScratch scratch;
  float* out;
};

// Copies the key and value rows (kv head `kv`) of the tile from `first` into shared memory; rows at or past `end`
// become zeros.
template <int kHd>
__device__ void copy_tile(const PrefillArgs& a, int kv, int first, int end, float* keys, float* values) {
  using L = Layout<kHd>;
  constexpr int quads = kHd / 4;  // 16-byte pieces of a row
  for (int i = threadIdx.x; i < 2 * kPositions * quads; i += WarpRoles::threads) {
    const bool value = i >= kPositions * quads;
    const int j = i % (kPositions * quads) / quads, col = 4 * (i % quads), p = first + j;
    const bool in = p < end;
    const float* source = (value ? a.values : a.keys) + (size_t(in ? p : 0) * a.s.kv_heads + kv) * kHd + col;
    copy16(value ? values + j * L::v_stride + col : keys + j * L::k_stride + col, source, in);
  }
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
  __shared__ bool last;

  const AttentionShape& s = a.s;
  const int c = blockIdx.x, qt = blockIdx.y, kv = blockIdx.z, tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32, mt = warp / W::m_tile_warps, column_warp = warp % W::m_tile_warps;
  const int group = s.heads / s.kv_heads, queries = a.rows * group, m_first = qt * kQueries;
  wait_for_producers();
  allow_dependents();
  const int64_t first = *a.first_position;

  // The chunk's position tiles: its share of those the tile's last row sees.
  const int last_row = min(a.rows - 1, (m_first + kQueries - 1) / group);
  const int end = int(first + last_row + 1), tiles = (end + kPositions - 1) / kPositions;
  const int tile_begin = int(int64_t(tiles) * c / a.chunks), tile_end = int(int64_t(tiles) * (c + 1) / a.chunks);
  if (tile_begin < tile_end) copy_tile<kHd>(a, kv, tile_begin * kPositions, end, k_s, v_s);
  commit_copies();

  // The queries, in base-2 units (as attention.cu's walk), rows past the pass's zeros.
  const float score_scale = 1.4426950408889634f * rsqrtf(float(kHd));
  for (int i = tid; i < kQueries * kHd / 4; i += W::threads) {
    const int q = i / (kHd / 4), col = 4 * (i % (kHd / 4)), m = m_first + q;
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (m < queries) {
      v = *reinterpret_cast<const float4*>(a.queries + (size_t(m / group) * s.heads + kv * group + m % group) * kHd +
                                           col);
      v.x *= score_scale, v.y *= score_scale, v.z *= score_scale, v.w *= score_scale;
    }
    *reinterpret_cast<float4*>(q_s + q * L::q_stride + col) = v;
  }

  // The softmax's query (TQ threads a query, TP positions of a tile each) and its running state.
  const int qi = tid / TQ, part = tid % TQ, m = m_first + qi;
  QuerySpan span;
  if (m < queries) {
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
      copy_tile<kHd>(a, kv, (tile + 1) * kPositions, end, k_s + (stage ^ 1) * L::k_floats,
                     v_s + (stage ^ 1) * L::v_floats);
    commit_copies();
    const int p0 = tile * kPositions + TP * part;
    unsigned chosen = 0;  // of the thread's TP positions (their selection loads in flight together)
#pragma unroll
    for (int j = 0; j < TP; ++j) chosen |= unsigned(span.chosen(p0 + j, s.ratio)) << j;
    wait_copies_but_last();
    // A tile none of the block's queries chose costs no products: its copy was in flight, nothing reads it, and the
    // running softmaxes stay as they are.
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
        if (m_first + q >= queries) continue;
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
  if (m < queries) {
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

// Query tiles of one kv head in a pass of `rows` rows.
int query_tiles(const AttentionShape& s, int rows) { return (rows * (s.heads / s.kv_heads) + kQueries - 1) / kQueries; }

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
// launch's span, within kMaxChunks and kSlotsPerSM slots a multiprocessor. At Flash-Next's 24 query tiles of a 64-row
// pass on 132 multiprocessors: 11 (two full rounds); at a 512-row pass's 192: 2 (three rounds, the last 91 % full).
int prefill_chunks(const AttentionShape& s, int rows, int launch_tokens) {
  const int sms = multiprocessors(), blocks = query_tiles(s, rows) * s.kv_heads;
  const int most = std::min(
      {kMaxChunks, (launch_tokens + kPositions - 1) / kPositions / kMinChunkTiles, kSlotsPerSM * sms / blocks});
  int best = 1;
  double best_cost = double((blocks + sms - 1) / sms);
  for (int c = 2; c <= most; ++c) {
    const double cost = double((blocks * c + sms - 1) / sms) / c;
    if (cost < best_cost) best = c, best_cost = cost;
  }
  return best;
}

template <int kHd>
void launch_prefill(const PrefillArgs& args, dim3 grid, cudaStream_t stream) {
  static const bool sized = [] {
    return cudaFuncSetAttribute(attend_prefill_kernel<kHd>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                int(Layout<kHd>::bytes)) == cudaSuccess;
  }();
  (void)sized;  // a failure shows as the launch's error
  launch_dependent(attend_prefill_kernel<kHd>, grid, WarpRoles::threads, Layout<kHd>::bytes, stream, args);
}

}  // namespace

// The kernel's work grows with every position a row sees, chosen or not (a tile is skipped only when no query of the
// block chose it); attend_kernel's with the chosen ones. On the H200 (synthetic Flash-Next, 512-row passes) this kernel
// took 162 µs a pass at 512 positions and 2526 at 8192 against attend_kernel's 409 and 2623, which stays at ~2.6 ms
// from 4096 on: past kDenseSpan × the kept positions (8192 at Flash-Next's 2048) attend_kernel is the faster.
bool attend_prefill_takes(const AttentionShape& s, int rows, int launch_tokens) {
  const int hd = s.head_dim;
  return rows >= kPrefillMinRows && int64_t(launch_tokens) <= int64_t(kDenseSpan) * s.keep_blocks * s.ratio &&
         (hd == 8 || hd == 16 || hd == 32 || hd == 64 || hd == 128 || hd == 256);
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
                         scratch,
                         out};
  const dim3 grid(unsigned(args.chunks), unsigned(query_tiles(s, rows)), unsigned(s.kv_heads));
  switch (s.head_dim) {
    case 8:
      return launch_prefill<8>(args, grid, stream);
    case 16:
      return launch_prefill<16>(args, grid, stream);
    case 32:
      return launch_prefill<32>(args, grid, stream);
    case 64:
      return launch_prefill<64>(args, grid, stream);
    case 128:
      return launch_prefill<128>(args, grid, stream);
    default:
      return launch_prefill<256>(args, grid, stream);
  }
}

}  // namespace vavilov::cuda
