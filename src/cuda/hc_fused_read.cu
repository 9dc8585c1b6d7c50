// The hyper-connection read of a decode pass (1–4 rows, Q4 mixers) in two kernels, with the previous layer's write
// folded in (hyper_connection.cuh). The spec's read (qwen4_exp.md §4) is
//   x̂ = grouped RMS0(R; g),  u = silu(Wd x̂ / S),  a[d] = (1/S) Σ_c σ((Wu u)[c·H + d]) · x̂[c, d],  inject = Wi x̂.
// The RMS scale of stream c is one number per (row, stream), so Wd x̂ = Σ_c scale_c · Wd_c (R_c ⊙ (1 + g_c)): a block
// can multiply its columns' weights with the unnormalised values and let the scale in once the stream's sum of squares
// is known.
//
// Both kernels are dependent launches whose weights (and the norm g) are loaded before griddepcontrol.wait, so what
// counts is the path after it: each kernel makes one round trip to L2 for what the kernel before wrote, and then works
// only in registers and shared memory (block barriers, no cluster barrier, no second global round trip). Keeping it
// one round trip takes care with what the compiler hoists or sinks (the SASS was read for each kernel): loads that
// another load's result must not delay are written ahead of it, and the arithmetic after the wait uses the hardware's
// reciprocal (device_math.cuh's fast_sigmoid and friends) rather than IEEE division, whose slow-path calls the loads
// are not moved across.
//
// hc_down_kernel: a block per (16-row tile of Wd, or Wi's one tile; stream), whose 8 warps (16 at 2–3 rows) each
// take a run of the stream's column groups of the tile. The block stages its whole stream (R + pending write, times
// 1 + g), so it knows the stream's sum of squares itself; the warps' products and sums of squares are added through
// shared memory in warp order (deterministic), and the block writes its tile's rows of the stream's scaled partial
// products. That suits 1–3 rows; at 4 rows staging the whole stream in every block costs more than it saves, and
// hc_down_sliced_kernel (a cluster per stream whose blocks each stage a slice of its columns) writes the same scratch
// instead.
// hc_up_kernel: a block per 16 hidden indices d, its warp c owning the tile of Wu's rows c·H + d (stream c's gates of
// those d): S·H/16 warps, each with its whole tile's loads in flight from its first statement. The block computes
// u = silu(Σ_c partials / S) four values a thread, stages it, and finishes the read in its epilogue: warp c applies the
// pending write to stream c's indices of the stack and normalises and gates them; the block sums the streams' terms
// through shared memory in stream order (deterministic) into the block input.
#include <cooperative_groups.h>
#include <cuda_pipeline.h>

#include "cuda/device_math.cuh"
#include "cuda/fixed_sum.cuh"
#include "cuda/hyper_connection.cuh"
#include "cuda/launch.cuh"
#include "cuda/quant_mma.cuh"

namespace vavilov::cuda {

namespace {

namespace cg = cooperative_groups;
using namespace qmma;

constexpr int kMaxStreams = 4;
// Warps of one hc_down block of B rows: runs of the stream's column groups. Two or three rows: 16, a whole
// multiprocessor's registers (their shorter runs made the 1-draft step 4.62-4.65 -> 4.56-4.59 ms, and at three rows
// this kernel beat the sliced clusters, 2 drafts 6.16-6.23 -> 6.12-6.19 ms; at four it lost, 6.94-7.01 -> 7.10-7.16);
// one row: 8, so that the next kernel's blocks fit beside one (16 gained nothing there).
template <int B>
constexpr int kDownWarps = B == 1 ? 8 : 16;
constexpr size_t kMaxDownShared = 200 * 1024;  // dynamic shared memory hc_down_kernel opts into
constexpr int kBlockDownRows = 3;              // the most rows hc_down_kernel reads; more: hc_down_sliced_kernel
constexpr int kMaxCluster = 8;                 // portable cluster size: hc_down_sliced_kernel's slices of a stream
constexpr int kSlicedTiles = 4;   // tiles (warps) of an hc_down_sliced_kernel block: Flash-Next's 21 in 6 sets
constexpr int kScratchHead = 32;  // gates [4 rows][4 streams], then RMS scales [4][4]

// What hc_up's warps hand the block's sum over the streams: per (stream, batch row, index) σ(gate logit) and the
// normalised value.
using UpTerms = float2[kMaxStreams][kMaxGemvRows][kTileRows];

// Scratch layout (floats): gates, scales, then partial products [stream][row (4)][outputs, padded to a multiple of 4].
template <typename T>
__device__ inline T* gates_of(T* scratch) {
  return scratch;
}
template <typename T>
__device__ inline T* scales_of(T* scratch) {
  return scratch + 16;
}
template <typename T>
__device__ inline T* partials_of(T* scratch) {
  return scratch + kScratchHead;
}

struct DownParams {
  GemvMatrix down, inject;      // inject.codes null when the read has none; x and y unused
  const float* stack;           // [rows, S·H]
  const float* norm;            // g [S·H]
  const float* pending_inject;  // the previous read's raw inject projections [rows, S], null: no pending write
  const float* pending_y;       // [rows, H]
  const unsigned long long* pending_fixed;  // [H]: the pending y in fixed point (Fixed kernels)
  float* scratch;
  int streams, hidden, down_tiles, outputs, stride;  // stride: of the partials' rows
  float eps;
};

struct UpParams {
  GemvMatrix up;  // x and y unused
  float* stack;
  const float* norm;
  const float* pending_y;             // null: no pending write
  unsigned long long* pending_fixed;  // [H]: the pending y in fixed point (Fixed kernels), cleared once read
  const float* scratch;
  float* inject;  // the raw inject projections [rows, inject_rows] (written when inject_rows > 0)
  float* input;   // [rows, H]
  int streams, hidden, rank, stride, inject_rows;
};

// How a block may read the scale and bias rows of groups [first, first + count) of every row (AffineWidth of
// quant_mma.cuh): 8 bytes at a time only when every row's run starts 8-byte aligned, and so on.
__device__ inline AffineWidth slice_affine_width(const GemvMatrix& m, int first, int count) {
  const int groups = m.cols / kQuantGroup;
  const uintptr_t base = reinterpret_cast<uintptr_t>(m.scales) | reinterpret_cast<uintptr_t>(m.biases);
  if (count % 4 == 0 && first % 4 == 0 && groups % 4 == 0 && base % 8 == 0) return AffineWidth::k8;
  if (count % 2 == 0 && first % 2 == 0 && groups % 2 == 0 && base % 4 == 0) return AffineWidth::k4;
  return AffineWidth::k2;
}

// A warp's pointers into rows tile_row + g and + 8 of m (past the end: the last row, never stored), from group
// `first` on.
struct TileRows {
  const uint32_t* codes[2];
  const __nv_bfloat16* affine;
};
__device__ inline TileRows tile_rows(const GemvMatrix& m, int tile_row, int first, int g, int t) {
  const int groups = m.cols / kQuantGroup, row_words = m.cols / 8;
  const int row0 = min(tile_row + g, m.rows - 1), row1 = min(tile_row + g + 8, m.rows - 1);
  return {{m.codes + size_t(row0) * row_words + 8 * first, m.codes + size_t(row1) * row_words + 8 * first},
          (t & 2 ? m.biases : m.scales) + size_t(t & 1 ? row1 : row0) * groups + first};
}

// A warp's weights for groups [begin, end) of its tile: the first two units are loaded before the wait, so that their
// latency overlaps the kernel before; tile_sum loads any further ones itself.
struct TileLoads {
  WarpLoads first, second;
};
__device__ inline void load_tile(TileLoads& loads, const TileRows& rows, AffineWidth width, int begin, int end, int t) {
  load_group_block<4>(loads.first, rows.codes, rows.affine, begin, min(end, begin + kUnroll), width, t);
  load_group_block<4>(loads.second, rows.codes, rows.affine, begin + kUnroll, end, width, t);
}
template <int B>
__device__ inline void tile_sum(TileLoads& loads, const TileRows& rows, AffineWidth width, int begin, int end,
                                int groups, const uint4* fragments, const float2* group_terms, float (&acc)[2]) {
  tile_products<4, B>(loads.first, rows.codes, rows.affine, width, begin, min(end, begin + kUnroll), groups, fragments,
                      group_terms, acc);
  if (end > begin + kUnroll)
    tile_products<4, B>(loads.second, rows.codes, rows.affine, width, begin + kUnroll, end, groups, fragments,
                        group_terms, acc);
}

// values[b][i] of a block's staging buffer ([B][width], 16-byte aligned) as the 16 floats stage_fragments asks for.
__device__ inline void load_staged(const float* values, int width, int b, int group, int column, float (&x)[16]) {
  const float4* from = reinterpret_cast<const float4*>(values + size_t(b) * width + group * kQuantGroup + 16 * column);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 v = from[i];
    x[4 * i] = v.x, x[4 * i + 1] = v.y, x[4 * i + 2] = v.z, x[4 * i + 3] = v.w;
  }
}

// x[k] for a batch index known only at run time, without indexing a register array (which would put it in local
// memory).
template <int B>
__device__ inline float pick(const float (&x)[B], int b) {
  float chosen = x[0];
#pragma unroll
  for (int k = 1; k < B; ++k)
    if (k == b) chosen = x[k];
  return chosen;
}

// The batch row of item i of B rows of `per_row` items each, by comparisons (no integer division on the path after the
// wait).
template <int B>
__device__ inline int row_of(int i, int per_row) {
  int b = 0;
#pragma unroll
  for (int k = 1; k < B; ++k) b += i >= k * per_row ? 1 : 0;
  return b;
}

__device__ inline float dot4(float4 v) { return fmaf(v.x, v.x, fmaf(v.y, v.y, fmaf(v.z, v.z, v.w * v.w))); }

// Values 4·quad … 4·quad + 3 of a fixed-point sum (written by the kernels before: through L2).
__device__ inline float4 fixed_quad(const unsigned long long* sums, int quad) {
  const ulonglong2* at = reinterpret_cast<const ulonglong2*>(sums) + 2 * quad;
  const ulonglong2 low = __ldcg(at), high = __ldcg(at + 1);
  return make_float4(fixed_to_float(low.x), fixed_to_float(low.y), fixed_to_float(high.x), fixed_to_float(high.y));
}

// The read's arithmetic after the wait uses device_math.cuh's fast_sigmoid, fast_silu and rms_scale; divisions by S
// become products with 1/S, computed before the wait (exact for S a power of two).

// Stream s of every batch row with the pending write applied, times 1 + g (g in `norm`, shared memory whose cp.async
// copies this waits for), into values [B][H] of shared memory, four values a thread at a time, every load of a pass in
// flight together; squares[b] gets this thread's sum of squares of row b's R + pending write, gate[b] the pending
// write's gate of row b (0: none). Fixed: y is read from pending_fixed (one row).
//
// The first pass's loads are issued before the pending write's gates are even loaded: the gates are loop-invariant,
// and with their load and division ahead of the loop (as the compiler hoists them) the stack's loads waited for the
// inject logit's round trip to L2 and the division — two dependent round trips after the wait instead of one.
template <int B, bool Fixed>
__device__ void stage_stream(const DownParams& p, int s, float inverse_streams, const float* norm, float* values,
                             float (&squares)[B], float (&gate)[B]) {
  static_assert(!Fixed || B == 1, "a fixed-point y is one row's");
  constexpr int kBatch = B == 1 ? 3 : 5;  // float4s a thread loads at once: Flash-Next's 640·B in one pass up to B = 2
  // float4 offsets below: int arithmetic, one wide add a load. What the kernels before wrote is read with coherent
  // loads: the compiler may move a non-coherent (__ldg) one across the wait.
  const int quads = p.hidden / 4, items = B * quads;
  const float4* stack = reinterpret_cast<const float4*>(p.stack) + s * quads;
  const float4* pending_y = reinterpret_cast<const float4*>(p.pending_y);
  const auto load_pass = [&](int base, float4(&r)[kBatch], float4(&y)[kBatch]) {
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int i = base + k * int(blockDim.x), b = row_of<B>(i, quads), q = i - b * quads;
      r[k] = y[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      if (i >= items) continue;
      r[k] = __ldcg(stack + b * p.streams * quads + q);
      if constexpr (Fixed)
        y[k] = fixed_quad(p.pending_fixed, i);
      else if (pending_y)
        y[k] = __ldcg(pending_y + i);
    }
  };
  const auto store_pass = [&](int base, const float4(&r)[kBatch], const float4(&y)[kBatch], const float(&gate)[B]) {
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int i = base + k * int(blockDim.x), b = row_of<B>(i, quads), q = i - b * quads;
      if (i >= items) continue;
      const float gb = pick(gate, b);
      const float4 v = make_float4(fmaf(gb, y[k].x, r[k].x), fmaf(gb, y[k].y, r[k].y), fmaf(gb, y[k].z, r[k].z),
                                   fmaf(gb, y[k].w, r[k].w));
      const float sum = dot4(v);
#pragma unroll
      for (int c = 0; c < B; ++c)
        if (c == b) squares[c] += sum;
      const float4 g = reinterpret_cast<const float4*>(norm)[q];
      reinterpret_cast<float4*>(values)[i] =
          make_float4(v.x * (1.0f + g.x), v.y * (1.0f + g.y), v.z * (1.0f + g.z), v.w * (1.0f + g.w));
    }
  };
  float4 r[kBatch], y[kBatch];
  load_pass(int(threadIdx.x), r, y);
  // After the first pass's loads in program order, so that they do not wait for the gates; every logit loaded
  // before the first division (a division's slow path is a call, which the loads would not be moved across) and
  // before the barrier below.
  float logit[B];
#pragma unroll
  for (int b = 0; b < B; ++b) logit[b] = p.pending_inject ? __ldcg(p.pending_inject + b * p.streams + s) : 0.0f;
  __pipeline_wait_prior(0);  // the norm's copies (hc_down_kernel), with this thread's loads in flight
  __syncthreads();           // other threads' copies
#pragma unroll
  for (int b = 0; b < B; ++b) gate[b] = p.pending_inject ? 2.0f * fast_sigmoid(logit[b] * inverse_streams) : 0.0f;
  store_pass(int(threadIdx.x), r, y, gate);
  for (int base = int(threadIdx.x) + kBatch * int(blockDim.x); base < items; base += kBatch * int(blockDim.x)) {
    load_pass(base, r, y);
    store_pass(base, r, y, gate);
  }
}

// At most 128 registers a thread: at one row two blocks an SM, so that hc_up's blocks fit beside one while it runs.
template <int B, bool Fixed>
__global__ void __launch_bounds__(kDownWarps<B> * 32, 16 / kDownWarps<B>) hc_down_kernel(DownParams p) {
  extern __shared__ uint4 shared[];
  __shared__ float partials[kDownWarps<B>][64];  // [warp][r·32 + lane]: lane (g, t)'s sum for row g + 8r, batch t
  __shared__ float warp_squares[kDownWarps<B>][B];
  const int tile = blockIdx.x, s = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4,
            t = lane % 4;
  const int h = p.hidden, groups = h / kQuantGroup;
  // Shared memory: g of the stream [H], the staged values [B][H], then the fragments and group terms.
  float* norm_weight = reinterpret_cast<float*>(shared);
  float* values = norm_weight + h;
  uint4* fragments = reinterpret_cast<uint4*>(values + size_t(B) * h);
  float2* group_terms = reinterpret_cast<float2*>(fragments + size_t(groups) * 16 * B);

  // This warp's run of the stream's groups of the block's tile: a Wd tile, or Wi's (S rows).
  const bool is_inject = tile >= p.down_tiles;
  const GemvMatrix m = is_inject ? p.inject : p.down;
  const TileRows rows = tile_rows(m, is_inject ? 0 : tile * kTileRows, s * groups, g, t);
  const int begin = warp * groups / kDownWarps<B>, end = (warp + 1) * groups / kDownWarps<B>;
  const AffineWidth width = slice_affine_width(m, s * groups + begin, end - begin);
  TileLoads loads;
  load_tile(loads, rows, width, begin, end, t);
  // The norm is a weight too: g of the stream copied into shared memory with cp.async while the kernel before finishes
  // (shared memory is the block's own; launch.cuh's rule is about what other kernels see). The staging waits for the
  // copies only once its own loads are out, so a block that starts late (its SM still held by the kernel before) does
  // not put the norm's trip to memory ahead of the stack's.
  const float4* norm = reinterpret_cast<const float4*>(p.norm + size_t(s) * h);
  for (int q = threadIdx.x; q < h / 4; q += blockDim.x)
    __pipeline_memcpy_async(reinterpret_cast<float4*>(norm_weight) + q, norm + q, sizeof(float4));
  __pipeline_commit();
  const float inverse_streams = 1.0f / float(p.streams), inverse_width = 1.0f / float(h);
  __syncthreads();  // keeps the weight loads above ahead of the wait (it waits for none of them)
  wait_for_producers();
  allow_dependents();

  float squares[B] = {}, gate[B];
  stage_stream<B, Fixed>(p, s, inverse_streams, norm_weight, values, squares, gate);
#pragma unroll
  for (int b = 0; b < B; ++b) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) squares[b] += __shfl_xor_sync(0xffffffffu, squares[b], offset);
    if (lane == 0) warp_squares[warp][b] = squares[b];
  }
  __syncthreads();
  stage_computed_activations<4, B>(
      groups, [&](int b, int group, int column, float(&x)[16]) { load_staged(values, h, b, group, column, x); },
      fragments, group_terms);
  __syncthreads();
  float acc[2] = {};
  tile_sum<B>(loads, rows, width, begin, end, groups, fragments, group_terms, acc);
  partials[warp][lane] = acc[0];
  partials[warp][32 + lane] = acc[1];
  // The stream's RMS scales: the warps' sums of squares in warp order (every block of the stream gets the same bits).
  float scale[B];
#pragma unroll
  for (int b = 0; b < B; ++b) {
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kDownWarps<B>; ++w) sum += warp_squares[w][b];
    scale[b] = rms_scale(sum, inverse_width, p.eps);
  }
  __syncthreads();

  // Each output: the warps' products in warp order, times the stream's scale.
  float* out = partials_of(p.scratch);
  const int first_row = is_inject ? p.down.rows : tile * kTileRows;
  const int tile_outputs = is_inject ? p.outputs - p.down.rows : min(kTileRows, p.down.rows - first_row);
  for (int i = threadIdx.x; i < kTileRows * B; i += blockDim.x) {
    const int row_in_tile = i / B, b = i % B;
    if (row_in_tile >= tile_outputs) continue;
    const int slot = (row_in_tile / 8) * 32 + (row_in_tile % 8) * 4 + b;
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kDownWarps<B>; ++w) sum += partials[w][slot];
    out[(size_t(s) * kMaxGemvRows + b) * p.stride + first_row + row_in_tile] = sum * pick(scale, b);
  }
  if (tile == 0 && threadIdx.x < B) {  // the gates from the staging's registers: no load at the block's tail
    const int b = threadIdx.x;
    scales_of(p.scratch)[b * kMaxStreams + s] = pick(scale, b);
    gates_of(p.scratch)[b * kMaxStreams + s] = pick(gate, b);
  }
}

// hc_down for 3–4 rows: a thread-block cluster per (stream, set of kSlicedTiles tiles) whose blocks each take a slice
// of the stream's column groups for every tile of the set (a warp per tile). At 3–4 rows a block that staged its
// whole stream would read 60–80 KB of it from L2 (hc_down_kernel); a slice is up to an eighth of that (Flash-Next: an
// eighth). The cluster adds the slices' sums of squares and products through distributed shared memory in rank order
// (deterministic) and writes the stream's scaled partial products in hc_down_kernel's scratch format.
template <int B>
__global__ void __launch_bounds__(kSlicedTiles * 32) hc_down_sliced_kernel(DownParams p) {
  extern __shared__ uint4 shared[];
  __shared__ float partials[kSlicedTiles][64];  // [warp][r·32 + lane]: lane (g, t)'s sum for row g + 8r, batch t
  __shared__ float squares[B];
  const cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank()), slices = int(cluster.num_blocks());
  const int s = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int h = p.hidden, groups = h / kQuantGroup / slices;  // groups of the slice
  const int first_group = s * (h / kQuantGroup) + rank * groups, first_col = first_group * kQuantGroup;
  // Shared memory: 1 + g of the slice, the fragments and group terms, then the items' sums of squares
  // [b][group][column].
  float* weight = reinterpret_cast<float*>(shared);
  uint4* fragments = reinterpret_cast<uint4*>(weight + groups * kQuantGroup);
  float2* group_terms = reinterpret_cast<float2*>(fragments + size_t(groups) * 16 * B);
  float* item_squares = reinterpret_cast<float*>(group_terms + size_t(groups) * B);

  // This warp's tile: Wd's tiles, then Wi's (one tile of S rows).
  const int tiles = p.down_tiles + (p.inject.codes ? 1 : 0), tile = blockIdx.z * kSlicedTiles + warp;
  const bool has_rows = tile < tiles, is_inject = has_rows && tile >= p.down_tiles;
  const GemvMatrix m = is_inject ? p.inject : p.down;
  const TileRows rows = tile_rows(m, is_inject ? 0 : tile * kTileRows, first_group, g, t);
  const AffineWidth width = slice_affine_width(m, first_group, groups);
  TileLoads loads;
  load_tile(loads, rows, width, 0, has_rows ? groups : 0, t);
  // 1 + g of the slice into shared memory before the wait (a weight; shared memory is the block's own).
  for (int q = threadIdx.x; q < groups * kQuantGroup / 4; q += blockDim.x) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(p.norm + first_col) + q);
    reinterpret_cast<float4*>(weight)[q] = make_float4(1.0f + v.x, 1.0f + v.y, 1.0f + v.z, 1.0f + v.w);
  }
  const float inverse_streams = 1.0f / float(p.streams), inverse_width = 1.0f / float(h);
  __syncthreads();  // before the wait: the staging reads other threads' factors
  wait_for_producers();
  allow_dependents();

  // The pending write's inject logits: loaded here, their gates computed where they are used, so that the staging's
  // loads go out without waiting for these.
  float logit[B];
#pragma unroll
  for (int b = 0; b < B; ++b) logit[b] = p.pending_inject ? p.pending_inject[b * p.streams + s] : 0.0f;
  const auto gate_of = [&](int b) {
    return p.pending_inject ? 2.0f * fast_sigmoid(pick(logit, b) * inverse_streams) : 0.0f;
  };
  // The slice's activations R + pending write times 1 + g, and per item its sum of squares of R + pending write. What
  // the kernels before wrote is read with coherent loads (the compiler may move a non-coherent one across the wait).
  stage_computed_activations<4, B>(
      groups,
      [&](int b, int group, int column, float(&x)[16]) {
        const int col = group * kQuantGroup + 16 * column;  // in the slice
        const float4* stack = reinterpret_cast<const float4*>(p.stack + size_t(b) * p.streams * h + first_col + col);
        const float4* pending_y =
            p.pending_y ? reinterpret_cast<const float4*>(p.pending_y + size_t(b) * h + (first_col - s * h) + col)
                        : nullptr;
        float4 r[4], y[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          r[i] = __ldcg(stack + i);
          y[i] = p.pending_y ? __ldcg(pending_y + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
        const float gate = gate_of(b);
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float4 v = make_float4(fmaf(gate, y[i].x, r[i].x), fmaf(gate, y[i].y, r[i].y),
                                       fmaf(gate, y[i].z, r[i].z), fmaf(gate, y[i].w, r[i].w));
          sum += dot4(v);
          const float4 w = reinterpret_cast<const float4*>(weight + col)[i];
          x[4 * i] = v.x * w.x, x[4 * i + 1] = v.y * w.y, x[4 * i + 2] = v.z * w.z, x[4 * i + 3] = v.w * w.w;
        }
        item_squares[(b * groups + group) * 4 + column] = sum;
      },
      fragments, group_terms);
  __syncthreads();
  // Batch row b's sum of squares over the slice, by warp b: its lanes add strided items, then a fixed butterfly.
  for (int b = warp; b < B; b += kSlicedTiles) {
    float sum = 0.0f;
    for (int i = lane; i < groups * 4; i += 32) sum += item_squares[b * groups * 4 + i];
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) squares[b] = sum;
  }
  float acc[2] = {};
  if (has_rows) tile_sum<B>(loads, rows, width, 0, groups, groups, fragments, group_terms, acc);
  partials[warp][lane] = acc[0];
  partials[warp][32 + lane] = acc[1];
  cluster.sync();

  // The stream's RMS scales, and the cluster's sums, each output added over the slices in rank order by one thread of
  // the cluster.
  // Every slice's sums are loaded before the first scale is computed: a scale's division has a slow path (a call) that
  // the loads of the next batch row would otherwise wait behind, one round trip to the cluster's shared memory each.
  float slice_squares[B][kMaxCluster];
#pragma unroll
  for (int k = 0; k < kMaxCluster; ++k) {
    const float* remote = k < slices ? cluster.map_shared_rank(squares, k) : nullptr;
#pragma unroll
    for (int b = 0; b < B; ++b) slice_squares[b][k] = remote ? remote[b] : 0.0f;
  }
  float scale[B];
#pragma unroll
  for (int b = 0; b < B; ++b) {
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < kMaxCluster; ++k)
      if (k < slices) sum += slice_squares[b][k];
    scale[b] = rms_scale(sum, inverse_width, p.eps);
  }
  float* out = partials_of(p.scratch);
  const int outputs = kSlicedTiles * kTileRows * B;  // (warp, row in tile, batch row)
  for (int i = rank * int(blockDim.x) + threadIdx.x; i < outputs; i += slices * int(blockDim.x)) {
    const int b = i % B, row_in_tile = (i / B) % kTileRows, w = i / (B * kTileRows);
    const int at = blockIdx.z * kSlicedTiles + w;
    const int row = at < p.down_tiles ? at * kTileRows + row_in_tile : p.down.rows + row_in_tile;
    if (at >= tiles || (at < p.down_tiles ? row >= p.down.rows : row >= p.outputs)) continue;
    const int slot = w * 64 + (row_in_tile / 8) * 32 + (row_in_tile % 8) * 4 + b;
    float parts[kMaxCluster];
#pragma unroll
    for (int k = 0; k < kMaxCluster; ++k) parts[k] = k < slices ? cluster.map_shared_rank(&partials[0][0], k)[slot] : 0;
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < kMaxCluster; ++k) sum += parts[k];
    out[(size_t(s) * kMaxGemvRows + b) * p.stride + row] = sum * pick(scale, b);
  }
  if (rank == 0 && blockIdx.z == 0 && threadIdx.x < B) {
    const int b = threadIdx.x;
    scales_of(p.scratch)[b * kMaxStreams + s] = pick(scale, b);
    gates_of(p.scratch)[b * kMaxStreams + s] = gate_of(b);
  }
  cluster.sync();  // no block leaves while another reads its shared memory
}

// u = silu(Σ_c partials / S) (the streams' partial products added in stream order) for every batch row and rank
// index, four values a thread, into u [B][rank] of shared memory, every load of a pass in flight together.
template <int B>
__device__ void compute_low(const UpParams& p, float inverse_streams, float* u) {
  constexpr int kBatch = B == 1 ? 1 : 3;  // float4s of a pass: Flash-Next's 80·B on 128 threads in one pass
  const int quads = p.rank / 4, items = B * quads, row_quads = p.stride / 4;  // float4 offsets: int arithmetic
  const float4* partials = reinterpret_cast<const float4*>(partials_of(p.scratch));
  for (int base = int(threadIdx.x); base < items; base += kBatch * int(blockDim.x)) {
    float4 part[kBatch][kMaxStreams];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int i = base + k * int(blockDim.x), b = row_of<B>(i, quads), q = i - b * quads;
#pragma unroll
      for (int c = 0; c < kMaxStreams; ++c)
        part[k][c] = i < items && c < p.streams ? __ldcg(partials + (c * kMaxGemvRows + b) * row_quads + q)
                                                : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int k = 0; k < kBatch; ++k) {
      const int i = base + k * int(blockDim.x);
      if (i >= items) continue;
      float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
      for (int c = 0; c < kMaxStreams; ++c)
        if (c < p.streams) sum.x += part[k][c].x, sum.y += part[k][c].y, sum.z += part[k][c].z, sum.w += part[k][c].w;
      reinterpret_cast<float4*>(u)[i] =
          make_float4(fast_silu(sum.x * inverse_streams), fast_silu(sum.y * inverse_streams),
                      fast_silu(sum.z * inverse_streams), fast_silu(sum.w * inverse_streams));
    }
  }
}

template <int B, bool Fixed>
__global__ void __launch_bounds__(kMaxStreams * 32) hc_up_kernel(UpParams p) {
  static_assert(!Fixed || B == 1, "a fixed-point y is one row's");
  // Weights only before the wait (launch.cuh's rule): their loads are in flight while the down kernel finishes.
  const int c = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int h = p.hidden, sh = p.streams * h, groups = p.rank / kQuantGroup;
  const int first = blockIdx.x * kTileRows;  // this block's hidden indices first..first + 15, warp c's stream c
  const AffineWidth width = slice_affine_width(p.up, 0, groups);
  const TileRows rows = tile_rows(p.up, c * h + first, 0, g, t);
  TileLoads loads;
  load_tile(loads, rows, width, 0, groups, t);
  // Lane (g, t) finishes indices first + g and first + g + 8 of batch row t in stream c. Their norm weights are
  // weights too: into shared memory before the wait (the barrier keeps the compiler from sinking the loads past it;
  // shared memory is the block's own, launch.cuh's rule is about what other kernels see).
  const bool finishes = t < B;
  const int stack_at = t * sh + c * h + first + g, y_at = t * h + first + g;  // offsets computed before the wait
  __shared__ float norm_weight[kMaxStreams][kTileRows];
  if (lane < kTileRows) norm_weight[c][lane] = __ldg(p.norm + c * h + first + lane);
  __syncthreads();
  // Block 0 also adds the inject projections over the streams: thread (b, j) of them.
  const bool injects = blockIdx.x == 0 && int(threadIdx.x) < B * p.inject_rows;
  const int inject_row = row_of<B>(threadIdx.x, p.inject_rows);
  const int inject_at = inject_row * p.stride + p.rank + int(threadIdx.x) - inject_row * p.inject_rows;
  const float inverse_streams = 1.0f / float(p.streams);
  wait_for_producers();
  allow_dependents();
  extern __shared__ uint4 shared[];
  __shared__ UpTerms terms;

  // The epilogue's operands, loaded together with the staging's partials.
  float stack[2] = {}, y[2] = {}, gate = 0.0f, scale = 0.0f;
  if (finishes) {
    gate = gates_of(p.scratch)[t * kMaxStreams + c];
    scale = scales_of(p.scratch)[t * kMaxStreams + c];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      stack[r] = p.stack[stack_at + 8 * r];
      if constexpr (Fixed)
        y[r] = fixed_to_float(__ldcg(p.pending_fixed + y_at + 8 * r));
      else if (p.pending_y)
        y[r] = p.pending_y[y_at + 8 * r];
    }
  }
  // The inject sums' operands: loaded here, stored once the staging is done (a store before the staging's loads would
  // hold them back).
  const float* partials = partials_of(p.scratch);
  float inject_parts[kMaxStreams] = {};
  if (injects)
#pragma unroll
    for (int k = 0; k < kMaxStreams; ++k)
      if (k < p.streams) inject_parts[k] = partials[k * kMaxGemvRows * p.stride + inject_at];
  float* u = reinterpret_cast<float*>(shared);
  uint4* fragments = reinterpret_cast<uint4*>(u + size_t(B) * p.rank);
  float2* group_terms = reinterpret_cast<float2*>(fragments + size_t(groups) * 16 * B);
  compute_low<B>(p, inverse_streams, u);
  __syncthreads();
  // Every warp has read the block's indices of y above the barrier, and hc_down (done before the wait) all of it: the
  // next pass adds into zeros.
  if constexpr (Fixed)
    if (c == 0 && finishes)
#pragma unroll
      for (int r = 0; r < 2; ++r) p.pending_fixed[y_at + 8 * r] = 0;
  stage_computed_activations<4, B>(
      groups, [&](int b, int group, int column, float(&x)[16]) { load_staged(u, p.rank, b, group, column, x); },
      fragments, group_terms);
  __syncthreads();
  if (injects) {
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < kMaxStreams; ++k)
      if (k < p.streams) sum += inject_parts[k];
    p.inject[threadIdx.x] = sum;
  }
  float acc[2] = {};
  tile_sum<B>(loads, rows, width, 0, groups, groups, fragments, group_terms, acc);
  if (finishes)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float v = fmaf(gate, y[r], stack[r]);
      if (Fixed || p.pending_y) p.stack[stack_at + 8 * r] = v;
      terms[c][t][g + 8 * r] = make_float2(fast_sigmoid(acc[r]), v * scale * (1.0f + norm_weight[c][g + 8 * r]));
    }
  __syncthreads();
  // The gated sum over the streams, in stream order, one thread per (batch row, index).
  for (int item = threadIdx.x; item < B * kTileRows; item += blockDim.x) {
    const int b = item / kTileRows, i = item % kTileRows;
    float sum = 0.0f;
    for (int k = 0; k < p.streams; ++k) sum = fmaf(terms[k][b][i].x, terms[k][b][i].y, sum);
    p.input[size_t(b) * h + first + i] = sum * inverse_streams;
  }
}

GemvMatrix q4_matrix(const DeviceMatrix& m) {
  GemvMatrix g;
  g.codes = static_cast<const uint32_t*>(m.data);
  g.scales = reinterpret_cast<const __nv_bfloat16*>(m.scales);
  g.biases = reinterpret_cast<const __nv_bfloat16*>(m.biases);
  g.rows = m.rows;
  g.cols = m.cols;
  return g;
}

bool q4_readable(const DeviceMatrix& m) {
  return m.format == WeightFormat::Q4 && m.group == kQuantGroup && m.cols % kQuantGroup == 0 &&
         reinterpret_cast<uintptr_t>(m.data) % 8 == 0;
}

// Partial products' rows start 16-byte aligned (hc_up_kernel reads them as float4).
int partial_stride(int outputs) { return (outputs + 3) / 4 * 4; }

// hc_down_kernel's dynamic shared memory: 1 + g of a stream, the stream's values and their fragments.
size_t down_shared_bytes(int hidden, int batch) {
  return size_t(1 + batch) * hidden * sizeof(float) + quant_shared_bytes(hidden / kQuantGroup, batch);
}

// hc_up_kernel's dynamic shared memory: u and its fragments.
size_t up_shared_bytes(int rank, int batch) {
  return size_t(batch) * rank * sizeof(float) + quant_shared_bytes(rank / kQuantGroup, batch);
}

// Slices of a stream's column groups for hc_down_sliced_kernel: the most (up to a portable cluster) that divide them
// evenly.
int stream_slices(int hidden) {
  const int groups = hidden / kQuantGroup;
  for (int slices = kMaxCluster; slices > 1; --slices)
    if (groups % slices == 0) return slices;
  return 1;
}

// hc_down_sliced_kernel's dynamic shared memory: 1 + g of a slice, the slice's fragments and its items' sums of
// squares.
size_t sliced_shared_bytes(int hidden, int batch) {
  const int groups = hidden / kQuantGroup / stream_slices(hidden);
  return size_t(groups) * kQuantGroup * sizeof(float) + quant_shared_bytes(groups, batch) +
         size_t(batch) * groups * 4 * sizeof(float);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <int B, bool Fixed>
cudaError_t launch(const HcFusedRead& w, float* stack, bool pending, const float* y, unsigned long long* y_fixed,
                   float* inject, float* scratch, float* input, cudaStream_t stream) {
  const bool has_inject = w.inject.data != nullptr;
  const int down_tiles = (w.mix_down.rows + kTileRows - 1) / kTileRows;
  const int outputs = w.mix_down.rows + (has_inject ? w.inject.rows : 0);
  const DownParams down{q4_matrix(w.mix_down),
                        has_inject ? q4_matrix(w.inject) : GemvMatrix{},
                        stack,
                        w.norm,
                        pending ? inject : nullptr,
                        pending ? y : nullptr,
                        y_fixed,
                        scratch,
                        w.streams,
                        w.hidden,
                        down_tiles,
                        outputs,
                        partial_stride(outputs),
                        w.eps};
  const int tiles = down_tiles + (has_inject ? 1 : 0);
  cudaError_t error = cudaSuccess;
  if constexpr (B <= kBlockDownRows) {
    // Once for all: only a permission (occupancy follows each launch's own size), so it never changes between the
    // launches of a captured graph.
    static const cudaError_t opted_in = cudaFuncSetAttribute(
        hc_down_kernel<B, Fixed>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kMaxDownShared));
    if (opted_in != cudaSuccess) return opted_in;
    error = launch_dependent(hc_down_kernel<B, Fixed>, dim3(unsigned(tiles), unsigned(w.streams)),
                             dim3(kDownWarps<B> * 32), down_shared_bytes(w.hidden, B), stream, down);
  } else {
    static_assert(!Fixed, "a fixed-point y is one row's");
    const unsigned slices = unsigned(stream_slices(w.hidden));
    const dim3 grid(slices, unsigned(w.streams), unsigned((tiles + kSlicedTiles - 1) / kSlicedTiles));
    error = launch_clustered(hc_down_sliced_kernel<B>, grid, dim3(kSlicedTiles * 32), sliced_shared_bytes(w.hidden, B),
                             stream, dim3(slices, 1, 1), true, down);
  }
  if (error != cudaSuccess) return error;

  const UpParams up{q4_matrix(w.mix_up),
                    stack,
                    w.norm,
                    pending ? y : nullptr,
                    y_fixed,
                    scratch,
                    inject,
                    input,
                    w.streams,
                    w.hidden,
                    w.mix_up.cols,
                    down.stride,
                    has_inject ? w.inject.rows : 0};
  launch_dependent(hc_up_kernel<B, Fixed>, w.hidden / kTileRows, w.streams * 32, up_shared_bytes(w.mix_up.cols, B),
                   stream, up);
  return cudaGetLastError();
}

}  // namespace

bool hc_fused_read_fits(const DeviceMatrix& mix_down, const DeviceMatrix& mix_up, const DeviceMatrix* inject,
                        const float* norm, int streams, int hidden, int rows) {
  const int rank = mix_down.rows;
  const bool shapes = streams >= 1 && streams <= kMaxStreams && hidden % kQuantGroup == 0 &&
                      mix_down.cols == streams * hidden && mix_up.rows == streams * hidden && mix_up.cols == rank &&
                      (!inject || (inject->cols == streams * hidden && inject->rows <= kTileRows));
  // What one hc_up block stages (rank columns) must fit the default 48 KB, what one hc_down_kernel block stages (a
  // stream) the shared memory it opts into, what one hc_down_sliced_kernel block stages (a slice) the default.
  const bool fits =
      up_shared_bytes(rank, kMaxGemvRows) + sizeof(UpTerms) <= 48 * 1024 &&
      down_shared_bytes(hidden, kBlockDownRows) <= kMaxDownShared &&
      sliced_shared_bytes(hidden, kMaxGemvRows) + sizeof(float) * (kSlicedTiles * 64 + kMaxGemvRows) <= 48 * 1024;
  return rows >= 1 && rows <= kMaxGemvRows && shapes && fits && aligned16(norm) && q4_readable(mix_down) &&
         q4_readable(mix_up) && (!inject || q4_readable(*inject));
}

size_t hc_fused_read_scratch_floats(int outputs) {
  return kScratchHead + size_t(kMaxStreams) * kMaxGemvRows * size_t(partial_stride(outputs));
}

cudaError_t hc_fused_read(const HcFusedRead& read, int rows, float* stack, bool pending, const float* y, float* inject,
                          float* scratch, float* input, cudaStream_t stream, unsigned long long* y_fixed) {
  for (const void* p :
       {static_cast<const void*>(stack), static_cast<const void*>(y), static_cast<const void*>(scratch),
        static_cast<const void*>(input), static_cast<const void*>(read.norm), static_cast<const void*>(y_fixed)})
    if (!aligned16(p)) return cudaErrorMisalignedAddress;
  if (y_fixed)
    return pending && rows == 1 ? launch<1, true>(read, stack, pending, y, y_fixed, inject, scratch, input, stream)
                                : cudaErrorInvalidValue;
  switch (rows) {
    case 1:
      return launch<1, false>(read, stack, pending, y, nullptr, inject, scratch, input, stream);
    case 2:
      return launch<2, false>(read, stack, pending, y, nullptr, inject, scratch, input, stream);
    case 3:
      return launch<3, false>(read, stack, pending, y, nullptr, inject, scratch, input, stream);
    case 4:
      return launch<4, false>(read, stack, pending, y, nullptr, inject, scratch, input, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace vavilov::cuda
