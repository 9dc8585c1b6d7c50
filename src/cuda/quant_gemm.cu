#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cuda/device_math.cuh"
#include "cuda/launch.cuh"
#include "cuda/quant_gemm.cuh"
#include "cuda/quant_mma.cuh"

namespace vavilov::cuda {

namespace {

using namespace qmma;

// Block (row block, row group): each of kWarps warps owns one 16-row tile of the matrix and walks all its columns.
// A row group is an expert's rows (grouped form) or a slice of up to kRows consecutive rows (dense form, so that a
// chunk's slices run side by side, all reading the matrix mostly from L2; slice_rows_for says how many). The block
// takes its group's rows kRows at a time (a pass), and their activations kChunkGroups groups of 64 columns at a time
// (staged as mma B fragments by the whole block, quant_mma.cuh), only as many rows as the pass's n-tiles use. A pass
// reads the block's weights once however many of its rows are used; a Flash-Next chunk of 512 tokens gives an expert
// ~10 rows, one pass of 3 n-tiles.
constexpr int kWarps = 8;
constexpr int kRows = 16;                  // activation rows of a pass
constexpr int kRowTiles = kRows / 4;       // mma n-tiles: 4 rows (hi and lo halves) each
constexpr int kChunkGroups = 2 * kUnroll;  // groups staged at once
constexpr int kBlockRows = kWarps * kTileRows;
static_assert(kChunkGroups % kUnroll == 0, "chunks hold whole load units");

// The affine terms of one group for lane (g, t): scales and biases of rows g and g + 8.
struct GroupAffine {
  float scale0, scale1, bias0, bias1;
};

// acc[n][r] += one group's products of rows g + 8r of the warp's tile with activation rows 4n + t (lane (g, t)),
// n < Tiles, in straight-line code so that the n-tiles' mma chains overlap (each chain keeps its order: the sums are
// those of one n-tile at a time). Staged: the rows the fragments were staged for (their stride).
template <int Bits, int Tiles, int Staged>
__device__ __forceinline__ void group_products(const uint2 (&raw)[2], int local, int staged, const GroupAffine& f,
                                               const uint4* fragments, const float2* group_terms,
                                               float (&acc)[kRowTiles][2]) {
  const int lane = threadIdx.x % 32, t = lane % 4;
  uint32_t a0[8], a1[8];
  decode<Bits>(raw[0], t, a0);
  decode<Bits>(raw[1], t, a1);
  float c[Tiles][4];
#pragma unroll
  for (int n = 0; n < Tiles; ++n) {
    const uint4 b0 = fragments[(size_t(local) * 2) * 8 * Staged + 32 * n + lane];
    c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.0f;
    mma_f16(c[n], a0[0], a1[0], a0[1], a1[1], b0.x, b0.y);
    mma_f16(c[n], a0[2], a1[2], a0[3], a1[3], b0.z, b0.w);
  }
#pragma unroll
  for (int n = 0; n < Tiles; ++n) {
    const uint4 b1 = fragments[(size_t(local) * 2 + 1) * 8 * Staged + 32 * n + lane];
    mma_f16(c[n], a0[4], a1[4], a0[5], a1[5], b1.x, b1.y);
    mma_f16(c[n], a0[6], a1[6], a0[7], a1[7], b1.z, b1.w);
  }
#pragma unroll
  for (int n = 0; n < Tiles; ++n) {
    const float2 terms = group_terms[(4 * n + t) * staged + local];
    acc[n][0] = fmaf(c[n][0] + c[n][1], f.scale0 * terms.y, fmaf(f.bias0, terms.x, acc[n][0]));
    acc[n][1] = fmaf(c[n][2] + c[n][3], f.scale1 * terms.y, fmaf(f.bias1, terms.x, acc[n][1]));
  }
}

// Groups local, local + 1, ..., local + Count - 1 of the chunk: one load unit (`current`), whole or the chunk's end.
template <int Bits, int Tiles, int Staged, int Count>
__device__ __forceinline__ void unit_products(const WarpLoads& current, int local, int staged, const uint4* fragments,
                                              const float2* group_terms, float (&acc)[kRowTiles][2]) {
  const int lane = threadIdx.x % 32;
  uint32_t scale_bias[4];  // bf16 pairs of two groups: scale row g, scale row g + 8, bias g, bias g + 8
#pragma unroll
  for (int u = 0; u < Count; ++u) {
    if (u % 2 == 0)
#pragma unroll
      for (int i = 0; i < 4; ++i) scale_bias[i] = __shfl_sync(0xffffffffu, current.affine[u / 2], (lane & ~3) | i);
    const auto pick = [&](uint32_t pair) { return u % 2 ? bf16_high(pair) : bf16_low(pair); };
    const GroupAffine f{pick(scale_bias[0]), pick(scale_bias[1]), pick(scale_bias[2]), pick(scale_bias[3])};
    group_products<Bits, Tiles, Staged>(current.codes[u], local + u, staged, f, fragments, group_terms, acc);
  }
}

// The rows of one warp's tile: codes and scale/bias rows, as the loads of quant_mma.cuh take them.
struct WarpTile {
  const uint32_t* codes[2];
  const __nv_bfloat16* affine;
  AffineWidth width;
  int groups;
};

// acc[n][r] += the products of groups [chunk, end) of rows g + 8r of the warp's tile with activation row 4n + t
// (lane (g, t)). `current` holds the chunk's first unit of weights on entry and the next chunk's on return, so that
// those loads are in flight while the block stages the next chunk.
template <int Bits, int Tiles, int Staged>
__device__ inline void chunk_products(WarpLoads& current, const WarpTile& tile, int chunk, int end,
                                      const uint4* fragments, const float2* group_terms, float (&acc)[kRowTiles][2]) {
  const int t = threadIdx.x % 4, staged = end - chunk;
  for (int first = chunk; first < end; first += kUnroll) {
    WarpLoads next;
    load_group_block<Bits>(next, tile.codes, tile.affine, first + kUnroll, tile.groups, tile.width, t);
    const int local = first - chunk;
    switch (min(end - first, kUnroll)) {  // whole units in straight-line code, a chunk's last groups apart
      case 1:
        unit_products<Bits, Tiles, Staged, 1>(current, local, staged, fragments, group_terms, acc);
        break;
      case 2:
        unit_products<Bits, Tiles, Staged, 2>(current, local, staged, fragments, group_terms, acc);
        break;
      case 3:
        unit_products<Bits, Tiles, Staged, 3>(current, local, staged, fragments, group_terms, acc);
        break;
      default:
        unit_products<Bits, Tiles, Staged, kUnroll>(current, local, staged, fragments, group_terms, acc);
    }
    current = next;
  }
}

// Where a dense pass's activation rows are: row b of the pass is x's row first + b.
struct PassRows {
  const float* x;
  int cols;
  int first;

  __device__ const float* row(int b) const { return x + size_t(first + b) * size_t(cols); }
};

// The activations of rows [0, rows) of the pass, groups [chunk, end), staged for the Staged rows that the pass's
// n-tiles read (zeros past `rows`: they add nothing and are never stored).
template <int Bits, int Staged>
__device__ __forceinline__ void stage_chunk(const PassRows& rows_in, int rows, int chunk, int end, uint4* fragments,
                                            float2* group_terms) {
  stage_computed_activations<Bits, Staged>(
      end - chunk,
      [&](int b, int group, int lane_column, float(&v)[16]) {
        if (b >= rows) return;
        const float4* source =
            reinterpret_cast<const float4*>(rows_in.row(b) + size_t(chunk + group) * kQuantGroup + 16 * lane_column);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float4 q = __ldg(source + i);
          v[4 * i] = q.x, v[4 * i + 1] = q.y, v[4 * i + 2] = q.z, v[4 * i + 3] = q.w;
        }
      },
      fragments, group_terms);
}

// The dense form's slices: slice blockIdx.y holds rows [blockIdx.y · slice_rows, ...) of x's `rows` rows.
struct DenseSlices {
  DeviceMatrix matrix;
  int rows = 0;
  int slice_rows = kRows;  // ≤ kRows
};

// Grouped form: an expert's codes come from memory and are read once. Each warp asks L2 for its whole tile — rows
// [tile_row, end) of the codes, scales and biases, contiguous in each — before it starts, so that its later units find
// them in L2 instead of each waiting for memory with one unit of loads in flight. The prefetches hold no registers.
__device__ inline void prefetch_expert_tile(const uint32_t* codes, const __nv_bfloat16* scales,
                                            const __nv_bfloat16* biases, int tile_row, int end, int row_words,
                                            int groups) {
  constexpr int kLine = 128;
  const int lane = int(threadIdx.x) % 32, rows = end - tile_row;
  const char* code_rows = reinterpret_cast<const char*>(codes + size_t(tile_row) * row_words);
  const size_t code_bytes = size_t(rows) * row_words * sizeof(uint32_t), affine_bytes = size_t(rows) * groups * 2;
  for (size_t at = size_t(lane) * kLine; at < code_bytes; at += 32 * kLine)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(code_rows + at));
  const char* scale_rows = reinterpret_cast<const char*>(scales + size_t(tile_row) * groups);
  const char* bias_rows = reinterpret_cast<const char*>(biases + size_t(tile_row) * groups);
  for (size_t at = size_t(lane) * kLine; at < affine_bytes; at += 32 * kLine) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(scale_rows + at));
    asm volatile("prefetch.global.L2 [%0];" ::"l"(bias_rows + at));
  }
}

// Two resident blocks a multiprocessor (128 registers a thread, ≤ 64 bytes of spills); built for three (80
// registers, spilling more), the 8-layer Flash-Next prefill measured 17 % slower.
constexpr int kMinBlocks = 2;

// The warp tile of rows [tile_row, tile_row + 16) of m (rows past rows_out re-read the last row; their results are
// never stored) for lane (g, t).
template <int Bits>
__device__ inline WarpTile warp_tile(const DeviceMatrix& m, int rows_out, int cols, int tile_row, int g, int t) {
  const int groups = cols / kQuantGroup, row_words = cols / 32 * Bits;
  const int row0 = min(tile_row + g, rows_out - 1), row1 = min(row0 + 8, rows_out - 1);
  const uint32_t* weights = static_cast<const uint32_t*>(m.data);
  const auto* scales = reinterpret_cast<const __nv_bfloat16*>(m.scales);
  const auto* biases = reinterpret_cast<const __nv_bfloat16*>(m.biases);
  const GemvMatrix view{.scales = scales, .biases = biases};
  return WarpTile{{weights + size_t(row0) * row_words, weights + size_t(row1) * row_words},
                  (t & 2 ? biases : scales) + size_t(t & 1 ? row1 : row0) * groups,
                  affine_width(view, groups),
                  groups};
}

// y's rows of a pass's activation rows b < rows (row p = first + b of the products, written to y's row y_rows[p], or p
// without a map): the warp tile's sums for lane (g, t).
__device__ inline void store_pass(const float (&acc)[kRowTiles][2], float* y, int rows_out, int tile_row, int first,
                                  int rows, const int* y_rows) {
  const int lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int n = 0; n < kRowTiles; ++n) {
    const int b = 4 * n + t;
    if (b >= rows) continue;
    const int p = first + b;
    float* row_out = y + size_t(y_rows ? y_rows[p] : p) * size_t(rows_out);
    if (tile_row + g < rows_out) row_out[tile_row + g] = acc[n][0];
    if (tile_row + g + 8 < rows_out) row_out[tile_row + g + 8] = acc[n][1];
  }
}

template <int Bits>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks)
    quant_gemm_kernel(DenseSlices slices, int rows_out, int cols, const float* x, float* y) {
  allow_dependents();
  __shared__ uint4 fragments[kChunkGroups * 2 * 8 * kRows];
  __shared__ float2 group_terms[kRows * kChunkGroups];
  const int offset = int(blockIdx.y) * slices.slice_rows;
  const int count = min(slices.slice_rows, slices.rows - offset);
  if (count <= 0) return;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
  const int groups = cols / kQuantGroup;
  const int tile_row = int(blockIdx.x) * kBlockRows + warp * kTileRows;
  const bool has_rows = tile_row < rows_out;  // warps past the end still help staging
  const WarpTile tile = warp_tile<Bits>(slices.matrix, rows_out, cols, tile_row, g, t);

  for (int first_row = 0; first_row < count; first_row += kRows) {
    const int rows = min(kRows, count - first_row), tiles = (rows + 3) / 4;  // the same for the whole block
    const PassRows rows_in{x, cols, offset + first_row};
    float acc[kRowTiles][2] = {};
    WarpLoads current;  // the first weights' loads go out before the activations are staged
    if (has_rows) load_group_block<Bits>(current, tile.codes, tile.affine, 0, groups, tile.width, t);
    for (int chunk = 0; chunk < groups; chunk += kChunkGroups) {
      const int end = min(chunk + kChunkGroups, groups);
      __syncthreads();  // the previous chunk's fragments are used up
      switch (tiles) {
        case 1:
          stage_chunk<Bits, 4>(rows_in, rows, chunk, end, fragments, group_terms);
          break;
        case 2:
          stage_chunk<Bits, 8>(rows_in, rows, chunk, end, fragments, group_terms);
          break;
        case 3:
          stage_chunk<Bits, 12>(rows_in, rows, chunk, end, fragments, group_terms);
          break;
        default:
          stage_chunk<Bits, kRows>(rows_in, rows, chunk, end, fragments, group_terms);
      }
      __syncthreads();
      if (!has_rows) continue;
      switch (tiles) {
        case 1:
          chunk_products<Bits, 1, 4>(current, tile, chunk, end, fragments, group_terms, acc);
          break;
        case 2:
          chunk_products<Bits, 2, 8>(current, tile, chunk, end, fragments, group_terms, acc);
          break;
        case 3:
          chunk_products<Bits, 3, 12>(current, tile, chunk, end, fragments, group_terms, acc);
          break;
        default:
          chunk_products<Bits, kRowTiles, kRows>(current, tile, chunk, end, fragments, group_terms, acc);
      }
    }
    if (has_rows) store_pass(acc, y, rows_out, tile_row, offset + first_row, rows, nullptr);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Grouped (routed expert) products from split rows. Every row block of every expert reads its rows' activations, so
// they are split once a chunk (quant_split_rows: split_activations, as stage_fragments does) into records of one
// (row, group) each: its 16 B-fragment entries in stage_fragments' order within a (group, half, row) — [half][hi/lo][t]
// — then its terms (Σx, 2^e) in a 17th entry. A block then only copies its pass's records into shared memory by
// cp.async, chunk after chunk into two stages: the next chunk's copies are in flight while the warps multiply the
// current one, one barrier a chunk, no staging arithmetic. The products are chunk_products (or, two m-tiles a warp,
// the same sums: pair_unit_products), on the same fragments and terms the dense staging writes, so every result has
// the bits of the dense warp tiles.
constexpr int kSplitEntries = 2 * 8 + 1;  // uint4 entries of a (row, group) record

// How a launch cuts the grouped products: matrix m-tiles a warp owns (1, or 2: two m-tiles a warp, below; blocks keep
// 128 matrix rows), groups a block copies at once (two chunks' worth of shared memory), and whether each warp asks L2
// for its whole tile at its start (prefetch_expert_tile). The best cut differs by the rows' length (H200, 512 experts,
// 512 tokens × 10 picks, bench/results/2026-12-01-h200-prefill-products-s11.json, each cut a separate build then):
// gate/up (2560 columns) one m-tile, 8-group chunks, no prefetch 316 µs (334 with the prefetch, 337 with 4-group
// chunks, 406 with two m-tiles); down (640) two m-tiles, 4-group chunks, prefetch 356 µs (400 with one m-tile).
template <int WarpMTiles, int ChunkGroups, bool Prefetch>
struct ExpertCut {
  static_assert(WarpMTiles == 1 || WarpMTiles == 2, "one or two m-tiles a warp");
  static_assert(ChunkGroups % kUnroll == 0, "chunks hold whole load units");
  static constexpr int kWarpMTiles = WarpMTiles, kChunkGroups = ChunkGroups, kThreads = kWarps / WarpMTiles * 32;
  static constexpr bool kPrefetch = Prefetch;
};
using LongRowCut = ExpertCut<1, 8, false>;
using ShortRowCut = ExpertCut<2, 4, true>;
constexpr int kShortRowGroups = 16;  // rows of at most this many groups of 64 take ShortRowCut

// The records of rows [0, rows) of x, or of silu(x) · up where up is given (the experts' swiglu, computed as moe.cu's
// swiglu kernel computes it): thread per (row, group, lane column t), whole warps (split_activations' shuffles take
// the four lanes of an item and every lane of the warp).
template <int Bits>
__global__ void __launch_bounds__(256)
    quant_split_kernel(const float* x, const float* up, int rows, int cols, uint4* split) {
  allow_dependents();
  const int groups = cols / kQuantGroup;
  const long long item = (long long)blockIdx.x * blockDim.x + threadIdx.x, items = (long long)rows * groups * 4;
  const bool active = item < items;
  const int t = int(item & 3);
  const long long record = item >> 2;  // row · groups + group
  float v[16] = {};
  if (active) {
    const float4* source = reinterpret_cast<const float4*>(x + record * kQuantGroup + 16 * t);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 q = __ldg(source + i);
      v[4 * i] = q.x, v[4 * i + 1] = q.y, v[4 * i + 2] = q.z, v[4 * i + 3] = q.w;
    }
    if (up) {
      const float4* up_source = reinterpret_cast<const float4*>(up + record * kQuantGroup + 16 * t);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float4 q = __ldg(up_source + i);
        v[4 * i] = silu(v[4 * i]) * q.x, v[4 * i + 1] = silu(v[4 * i + 1]) * q.y;
        v[4 * i + 2] = silu(v[4 * i + 2]) * q.z, v[4 * i + 3] = silu(v[4 * i + 3]) * q.w;
      }
    }
  }
  uint32_t hi[8], lo[8];
  const float2 terms = split_activations<Bits>(v, hi, lo);
  if (!active) return;
  uint4* entries = split + record * kSplitEntries;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    entries[8 * half + t] = make_uint4(hi[4 * half], hi[4 * half + 1], hi[4 * half + 2], hi[4 * half + 3]);
    entries[8 * half + 4 + t] = make_uint4(lo[4 * half], lo[4 * half + 1], lo[4 * half + 2], lo[4 * half + 3]);
  }
  if (t == 0) entries[2 * 8] = make_uint4(__float_as_uint(terms.x), __float_as_uint(terms.y), 0u, 0u);
}

// 16 and 8 bytes from global to shared memory, asynchronously; zeros where !copy (nothing is read then).
__device__ __forceinline__ void copy_async_16(void* to, const void* from, bool copy) {
  const auto address = static_cast<uint32_t>(__cvta_generic_to_shared(to));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(address), "l"(from), "r"(copy ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void copy_async_8(void* to, const void* from, bool copy) {
  const auto address = static_cast<uint32_t>(__cvta_generic_to_shared(to));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(address), "l"(from), "r"(copy ? 8 : 0) : "memory");
}

// One chunk's activations in shared memory, as stage_fragments lays them out for Staged rows.
template <int ChunkGroups>
struct ExpertStage {
  uint4 fragments[ChunkGroups * 2 * 8 * kRows];
  float2 terms[kRows * ChunkGroups];
};

// Starts copying groups [chunk, end) of the pass's rows into `stage` (records[b]: where the split records of the
// pass's row b start, in uint4 entries; past the pass's rows, its first row's: those columns' sums are never stored,
// and an mma column's sums depend on its own B values only), by the whole block, as one cp.async group. A thread
// copies the same entry of a (row, group) record for rows b0, b0 + kStep, ... (its entry, group and destination fixed,
// each row's start read from shared memory), and at most one row's terms.
template <typename Cut, int Staged>
__device__ __forceinline__ void copy_chunk(ExpertStage<Cut::kChunkGroups>& stage, const uint4* split,
                                           const long long* records, int chunk, int end) {
  constexpr int kRowEntries = Cut::kChunkGroups * 2 * 8;  // a row's entries of a whole chunk
  static_assert(Cut::kThreads % kRowEntries == 0 && Staged % (Cut::kThreads / kRowEntries) == 0,
                "whole rows of entries a pass over the block");
  static_assert(kRows * Cut::kChunkGroups <= Cut::kThreads, "one item of terms a thread at most");
  constexpr int kStep = Cut::kThreads / kRowEntries;
  const int staged = end - chunk, thread = int(threadIdx.x);
  const int entry = thread % kRowEntries, local = entry / 16, within = entry % 16, first_b = thread / kRowEntries;
  if (local < staged) {
    uint4* to = stage.fragments + (local * 2 + within / 8) * 8 * Staged + 8 * first_b + within % 8;
    const uint4* from = split + (chunk + local) * kSplitEntries + within;
#pragma unroll
    for (int i = 0; i < Staged / kStep; ++i) {
      copy_async_16(to + 8 * kStep * i, from + records[first_b + kStep * i], true);
    }
  }
  const int b = thread / Cut::kChunkGroups, term = thread % Cut::kChunkGroups;
  if (b < Staged && term < staged) {
    copy_async_8(stage.terms + b * staged + term, split + records[b] + (chunk + term) * kSplitEntries + 2 * 8, true);
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// pass(std::integral_constant<int, Tiles>{}) for a pass of `tiles` 4-row tiles: 1–3 or the full kRowTiles, each its
// own instantiation, so that a short pass stages and multiplies only the rows it has (4 · Tiles).
template <typename Pass>
__device__ __forceinline__ void with_row_tiles(int tiles, const Pass& pass) {
  switch (tiles) {
    case 1:
      pass(std::integral_constant<int, 1>{});
      break;
    case 2:
      pass(std::integral_constant<int, 2>{});
      break;
    case 3:
      pass(std::integral_constant<int, 3>{});
      break;
    default:
      pass(std::integral_constant<int, kRowTiles>{});
  }
}

// One pass of an expert's rows: chunk after chunk, the next chunk's copies in flight during the current one's
// products (products(chunk, end, fragments, terms): groups [chunk, end) from the chunk's stage). Every thread of the
// block calls it (copies and barriers); warps without matrix rows only copy.
template <int Staged, typename Cut, typename Products>
__device__ __forceinline__ void expert_pass(int groups, bool has_rows, const uint4* split, const long long* records,
                                            ExpertStage<Cut::kChunkGroups>* stages, Products products) {
  copy_chunk<Cut, Staged>(stages[0], split, records, 0, min(Cut::kChunkGroups, groups));
  for (int chunk = 0, k = 0; chunk < groups; chunk += Cut::kChunkGroups, ++k) {
    const int end = min(chunk + Cut::kChunkGroups, groups);
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();  // every thread's copies of this chunk have landed; the other stage is used up
    if (end < groups)
      copy_chunk<Cut, Staged>(stages[(k + 1) & 1], split, records, end, min(end + Cut::kChunkGroups, groups));
    if (has_rows) products(chunk, end, stages[k & 1].fragments, stages[k & 1].terms);
  }
}

// Two m-tiles a warp (ExpertCut<2, ...>): a warp owns 32 matrix rows and multiplies each B
// fragment it reads from shared memory with both m-tiles' decoded codes, so the block's shared-memory reads per weight
// halve; blocks of 4 warps keep 128 rows. The weights load two groups at a time (a unit), scales and biases as bf16
// pairs. Every output is the same sum as group_products' (per group four chained mma from zero in the same order, then
// the same affine step), so the bits are those of the dense warp tiles.
constexpr int kPairUnit = 2;  // groups of a load unit

// A warp's two m-tiles: rows g and g + 8 of m-tile m for lane (g, t), and lane t's scale or bias row of each.
struct PairTile {
  const uint32_t* codes[2][2];  // [m][r]
  const uint16_t* affine[2];    // [m]
  int groups;
  bool pairs;  // scale and bias rows read two groups at a time (4 bytes)
};

// What a warp loads for one unit: the codes of both m-tiles' rows, and a bf16 pair (groups u = 0, 1) of lane t's
// scale or bias row of each m-tile.
struct PairLoads {
  uint2 codes[kPairUnit][2][2];  // [u][m][r]
  uint32_t affine[2];            // [m]
};

template <int Bits>
__device__ inline PairTile pair_tile(const DeviceMatrix& m, int rows_out, int cols, int tile_row, int g, int t) {
  const int groups = cols / kQuantGroup, row_words = cols / 32 * Bits;
  const uint32_t* codes = static_cast<const uint32_t*>(m.data);
  PairTile tile;
  tile.groups = groups;
  tile.pairs =
      groups % 2 == 0 && (reinterpret_cast<uintptr_t>(m.scales) | reinterpret_cast<uintptr_t>(m.biases)) % 4 == 0;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row0 = min(tile_row + kTileRows * i + g, rows_out - 1), row1 = min(row0 + 8, rows_out - 1);
    tile.codes[i][0] = codes + size_t(row0) * row_words;
    tile.codes[i][1] = codes + size_t(row1) * row_words;
    tile.affine[i] = (t & 2 ? m.biases : m.scales) + size_t(t & 1 ? row1 : row0) * groups;
  }
  return tile;
}

// Loads groups [first, first + kPairUnit) ∩ [.., groups); first is even. What lies past the end is left as it was
// (never read).
template <int Bits>
__device__ __forceinline__ void load_pair_unit(PairLoads& loads, const PairTile& tile, int first, int t) {
#pragma unroll
  for (int u = 0; u < kPairUnit; ++u)
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int r = 0; r < 2; ++r)
        if (first + u < tile.groups) loads.codes[u][i][r] = load_codes<Bits>(tile.codes[i][r], first + u, t);
  if (first >= tile.groups) return;
#pragma unroll
  for (int i = 0; i < 2; ++i)
    if (tile.pairs)
      loads.affine[i] = __ldg(reinterpret_cast<const uint32_t*>(tile.affine[i] + first));
    else
      loads.affine[i] = uint32_t(__ldg(tile.affine[i] + first)) |
                        (first + 1 < tile.groups ? uint32_t(__ldg(tile.affine[i] + first + 1)) << 16 : 0u);
}

// acc[i][n][r] += the products of groups local, local + 1, ..., local + Count - 1 of the chunk (one unit: `current`)
// with rows g + 8r of m-tile i and activation rows 4n + t (lane (g, t)).
template <int Bits, int Tiles, int Staged, int Count>
__device__ __forceinline__ void pair_unit_products(const PairLoads& current, int local, int staged,
                                                   const uint4* fragments, const float2* group_terms,
                                                   float (&acc)[2][kRowTiles][2]) {
  const int lane = threadIdx.x % 32, t = lane % 4;
  uint32_t scale_bias[2][4];  // [m]: bf16 pairs of the unit's groups: scale row g, scale row g + 8, bias g, bias g + 8
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int k = 0; k < 4; ++k) scale_bias[i][k] = __shfl_sync(0xffffffffu, current.affine[i], (lane & ~3) | k);
#pragma unroll
  for (int u = 0; u < Count; ++u) {
    const int group = local + u;
    uint32_t a[2][2][8];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int r = 0; r < 2; ++r) decode<Bits>(current.codes[u][i][r], t, a[i][r]);
    const auto pick = [&](uint32_t pair) { return u % 2 ? bf16_high(pair) : bf16_low(pair); };
#pragma unroll
    for (int n = 0; n < Tiles; ++n) {
      const uint4 b0 = fragments[(size_t(group) * 2) * 8 * Staged + 32 * n + lane];
      const uint4 b1 = fragments[(size_t(group) * 2 + 1) * 8 * Staged + 32 * n + lane];
      const float2 terms = group_terms[(4 * n + t) * staged + group];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const uint32_t(&a0)[8] = a[i][0];
        const uint32_t(&a1)[8] = a[i][1];
        float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        mma_f16(c, a0[0], a1[0], a0[1], a1[1], b0.x, b0.y);
        mma_f16(c, a0[2], a1[2], a0[3], a1[3], b0.z, b0.w);
        mma_f16(c, a0[4], a1[4], a0[5], a1[5], b1.x, b1.y);
        mma_f16(c, a0[6], a1[6], a0[7], a1[7], b1.z, b1.w);
        acc[i][n][0] =
            fmaf(c[0] + c[1], pick(scale_bias[i][0]) * terms.y, fmaf(pick(scale_bias[i][2]), terms.x, acc[i][n][0]));
        acc[i][n][1] =
            fmaf(c[2] + c[3], pick(scale_bias[i][1]) * terms.y, fmaf(pick(scale_bias[i][3]), terms.x, acc[i][n][1]));
      }
    }
  }
}

// acc += the products of groups [chunk, end) (end - chunk even but at the matrix's end); `current` holds the chunk's
// first unit on entry and the next chunk's on return.
template <int Bits, int Tiles, int Staged>
__device__ inline void pair_chunk_products(PairLoads& current, const PairTile& tile, int chunk, int end,
                                           const uint4* fragments, const float2* group_terms,
                                           float (&acc)[2][kRowTiles][2]) {
  const int t = threadIdx.x % 4, staged = end - chunk;
  for (int first = chunk; first < end; first += kPairUnit) {
    PairLoads next;
    load_pair_unit<Bits>(next, tile, first + kPairUnit, t);
    if (end - first >= kPairUnit)
      pair_unit_products<Bits, Tiles, Staged, kPairUnit>(current, first - chunk, staged, fragments, group_terms, acc);
    else
      pair_unit_products<Bits, Tiles, Staged, 1>(current, first - chunk, staged, fragments, group_terms, acc);
    current = next;
  }
}

// Where a block's expert and rows are.
struct ExpertRows {
  const DeviceMatrix* experts;  // device array
  const int* counts;            // rows of each expert, and where they start among the grouped rows
  const int* offsets;
  GroupedRowMap map;  // where the grouped rows are read and written (identity when null)
};

// Block (row block, expert): each of the block's warps owns Cut::kWarpMTiles 16-row tiles of the expert's matrix (128
// rows a block) and walks all its columns, the expert's rows kRows at a time (a pass), as quant_gemm_kernel does.
template <int Bits, typename Cut>
__global__ void __launch_bounds__(Cut::kThreads, kMinBlocks* Cut::kWarpMTiles)
    quant_expert_kernel(ExpertRows experts, int rows_out, int cols, const uint4* split, float* y) {
  allow_dependents();
  extern __shared__ uint4 expert_shared[];
  auto* stages = reinterpret_cast<ExpertStage<Cut::kChunkGroups>*>(expert_shared);
  __shared__ long long pass_rows[kRows];  // where each of the pass's rows' split records start (copy_chunk)
  const int expert = int(blockIdx.y);
  const int offset = experts.offsets[expert], count = experts.counts[expert];
  if (count <= 0) return;
  const DeviceMatrix m = experts.experts[expert];
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
  const int groups = cols / kQuantGroup, row_words = cols / 32 * Bits;
  const int tile_row = int(blockIdx.x) * kBlockRows + warp * kTileRows * Cut::kWarpMTiles;
  const bool has_rows = tile_row < rows_out;  // warps past the end still copy
  if (Cut::kPrefetch && has_rows)
    prefetch_expert_tile(static_cast<const uint32_t*>(m.data), reinterpret_cast<const __nv_bfloat16*>(m.scales),
                         reinterpret_cast<const __nv_bfloat16*>(m.biases), tile_row,
                         min(tile_row + kTileRows * Cut::kWarpMTiles, rows_out), row_words, groups);
  // Where the split records of each of the pass's rows start (the map folded in); past its rows, its first row's.
  const auto find_rows = [&](int first_row, int rows) {
    __syncthreads();  // the previous pass is done with the stages and pass_rows
    if (threadIdx.x < kRows) {
      const int b = int(threadIdx.x), p = offset + first_row + b;
      const int* order = experts.map.x_rows;
      const int q = b < rows ? p : offset + first_row;  // past the pass's rows: its first row
      const int row = order ? __ldg(order + q) / experts.map.x_divisor : q;
      pass_rows[b] = (long long)row * groups * kSplitEntries;
    }
    __syncthreads();
  };

  if constexpr (Cut::kWarpMTiles == 1) {
    const WarpTile tile = warp_tile<Bits>(m, rows_out, cols, tile_row, g, t);
    for (int first_row = 0; first_row < count; first_row += kRows) {
      const int rows = min(kRows, count - first_row), tiles = (rows + 3) / 4;  // the same for the whole block
      WarpLoads current;  // the first weights' loads go out before the activations are copied
      if (has_rows) load_group_block<Bits>(current, tile.codes, tile.affine, 0, groups, tile.width, t);
      find_rows(first_row, rows);
      float acc[kRowTiles][2] = {};
      with_row_tiles(tiles, [&](auto row_tiles) {
        constexpr int Tiles = decltype(row_tiles)::value;
        expert_pass<4 * Tiles, Cut>(groups, has_rows, split, pass_rows, stages,
                                    [&](int chunk, int end, const uint4* fragments, const float2* terms) {
                                      chunk_products<Bits, Tiles, 4 * Tiles>(current, tile, chunk, end, fragments,
                                                                             terms, acc);
                                    });
      });
      if (has_rows) store_pass(acc, y, rows_out, tile_row, offset + first_row, rows, experts.map.y_rows);
    }
  } else {
    const PairTile tile = pair_tile<Bits>(m, rows_out, cols, tile_row, g, t);
    for (int first_row = 0; first_row < count; first_row += kRows) {
      const int rows = min(kRows, count - first_row), tiles = (rows + 3) / 4;  // the same for the whole block
      PairLoads current;  // the first weights' loads go out before the activations are copied
      if (has_rows) load_pair_unit<Bits>(current, tile, 0, t);
      find_rows(first_row, rows);
      float acc[2][kRowTiles][2] = {};
      with_row_tiles(tiles, [&](auto row_tiles) {
        constexpr int Tiles = decltype(row_tiles)::value;
        expert_pass<4 * Tiles, Cut>(groups, has_rows, split, pass_rows, stages,
                                    [&](int chunk, int end, const uint4* fragments, const float2* terms) {
                                      pair_chunk_products<Bits, Tiles, 4 * Tiles>(current, tile, chunk, end, fragments,
                                                                                  terms, acc);
                                    });
      });
      if (!has_rows) continue;
#pragma unroll
      for (int i = 0; i < 2; ++i)
        store_pass(acc[i], y, rows_out, tile_row + kTileRows * i, offset + first_row, rows, experts.map.y_rows);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Block tiles (dense products of many rows): a block owns kTiledRows matrix rows × kTiledTokens activation rows and
// walks the columns one group of 64 at a time. Each warp decodes its own kWarpMTiles m-tiles' codes into registers as
// quant_gemm_kernel's warps do (the affine terms by shuffles, as unit_products), so only the activations pass through
// shared memory: the block splits them into fp16 hi/lo B fragments once (split_activations, as stage_fragments), and
// every warp multiplies its m-tiles × kWarpNTiles n-tiles from there. The next group's codes are loaded at a step's
// top into registers; its activations were copied (cp.async) a step earlier, so no load waits; one barrier a group.
//
// Every output is the same sum as quant_gemm_kernel's: per group the same four chained mma steps with the same
// k-slot → column map from zero, then acc = fma(hi + lo, scale·2^e, fma(bias, Σx, acc)), groups in order. So the
// two forms give the same bits (CudaQuantGemm.BlockTilesGiveTheWarpTilesBits).
//
// Tuning knobs (-D in a variant build of bench/cuda/quant_gemm_bench.cu, which checks every variant's bits against the
// warp tiles): m-tiles and activation rows of a block, m-tiles of a warp. Measured at 512 rows on the H200
// (bench/results/2026-12-01-h200-quant-gemm-tiled-s10.json), in_qkv: warp tiles 400 µs, these defaults (256 × 64
// blocks, 4 m-tiles a warp, one block of 8 warps at 255 registers an SM) 289; a form that decoded each group once a
// block into shared memory as A fragments took 306–378 µs and was removed.
#ifndef VAVILOV_TILED_MTILES
#define VAVILOV_TILED_MTILES 16
#endif
#ifndef VAVILOV_TILED_TOKENS
#define VAVILOV_TILED_TOKENS 64
#endif
#ifndef VAVILOV_TILED_WARP_MTILES
#define VAVILOV_TILED_WARP_MTILES 4
#endif
constexpr int kTiledMTiles = VAVILOV_TILED_MTILES;                       // 16-row m-tiles of a block
constexpr int kTiledRows = kTiledMTiles * kTileRows;                     // matrix rows of a block
constexpr int kTiledTokens = VAVILOV_TILED_TOKENS;                       // activation rows of a block
constexpr int kTiledNTiles = kTiledTokens / 4;                           // n-tiles of 4 rows (hi and lo halves)
constexpr int kWarpMTiles = VAVILOV_TILED_WARP_MTILES, kWarpNTiles = 8;  // a warp's sub-tile
constexpr int kWarpsAlongM = kTiledMTiles / kWarpMTiles;  // the warps: kWarpsAlongM × kTiledNTiles / kWarpNTiles
constexpr int kTiledWarps = kWarpsAlongM * (kTiledNTiles / kWarpNTiles);
static_assert(kTiledMTiles % kWarpMTiles == 0 && kTiledNTiles % kWarpNTiles == 0, "the warps cover the block tile");
static_assert(kTiledTokens * 4 <= kTiledWarps * 32, "at most one staging item (row, lane column) a thread");

// One group's activations in shared memory (two of these: the step being multiplied and the next).
struct TiledActivationStage {
  uint4 b[2][8 * kTiledTokens];  // B fragments, stage_fragments' layout for one group
  float2 terms[kTiledTokens];    // Σx and 2^e of each activation row
};
// Each thread's staging items of the next two groups (16 activations each), copied by cp.async so that no registers
// hold them during the products: [buffer][i][thread], each thread reading back only what it copied.
using TiledRaw = float4[4][kTiledWarps * 32];
constexpr size_t kTiledShared = 2 * sizeof(TiledActivationStage) + 2 * sizeof(TiledRaw);

// Starts copying the thread's item of `group` (x_item: its row and lane column) into raw; zeros where !copy.
__device__ __forceinline__ void tiled_copy(TiledRaw& raw, const float* x_item, bool copy, int group) {
  const float* source = x_item + size_t(copy ? group : 0) * kQuantGroup;
#pragma unroll
  for (int i = 0; i < 4; ++i) copy_async_16(&raw[i][threadIdx.x], source + 4 * i, copy);
  asm volatile("cp.async.commit_group;" ::: "memory");
}

// The thread's copied item (activation row b, lane column t) as the stage's hi/lo B fragments and terms.
template <int Bits>
__device__ __forceinline__ void tiled_split(TiledActivationStage& stage, const TiledRaw& raw, int b, int t) {
  if (kTiledTokens * 4 < kTiledWarps * 32 && b >= kTiledTokens) return;  // warp-uniform: items are whole warps
  float x[16];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 v = raw[i][threadIdx.x];
    x[4 * i] = v.x, x[4 * i + 1] = v.y, x[4 * i + 2] = v.z, x[4 * i + 3] = v.w;
  }
  uint32_t hi[8], lo[8];
  const float2 terms = split_activations<Bits>(x, hi, lo);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    uint4* entry = stage.b[half] + 4 * (2 * b) + t;
    entry[0] = make_uint4(hi[4 * half], hi[4 * half + 1], hi[4 * half + 2], hi[4 * half + 3]);
    entry[4] = make_uint4(lo[4 * half], lo[4 * half + 1], lo[4 * half + 2], lo[4 * half + 3]);
  }
  if (t == 0) stage.terms[b] = terms;
}

// A warp's weights of one group: the A fragments of its m-tiles and their scales and biases.
struct TiledWeights {
  uint4 a[kWarpMTiles][4];
  float4 f[kWarpMTiles];
};

// acc[m][n][r] += one group's products of rows g + 8r of the warp's m-tile m with activation row 4n + t of its n-tiles.
__device__ __forceinline__ void tiled_products(const TiledWeights& w, const TiledActivationStage& stage, int warp,
                                               int lane, float (&acc)[kWarpMTiles][kWarpNTiles][2]) {
  const int t = lane % 4, first_n = (warp / kWarpsAlongM) * kWarpNTiles;
  const auto& a = w.a;
  const auto& f = w.f;
#pragma unroll
  for (int n = 0; n < kWarpNTiles; ++n) {
    const uint4 b0 = stage.b[0][32 * (first_n + n) + lane], b1 = stage.b[1][32 * (first_n + n) + lane];
    const float2 terms = stage.terms[4 * (first_n + n) + t];
#pragma unroll
    for (int m = 0; m < kWarpMTiles; ++m) {
      float c[4] = {};
      mma_f16(c, a[m][0].x, a[m][0].y, a[m][0].z, a[m][0].w, b0.x, b0.y);
      mma_f16(c, a[m][1].x, a[m][1].y, a[m][1].z, a[m][1].w, b0.z, b0.w);
      mma_f16(c, a[m][2].x, a[m][2].y, a[m][2].z, a[m][2].w, b1.x, b1.y);
      mma_f16(c, a[m][3].x, a[m][3].y, a[m][3].z, a[m][3].w, b1.z, b1.w);
      acc[m][n][0] = fmaf(c[0] + c[1], f[m].x * terms.y, fmaf(f[m].z, terms.x, acc[m][n][0]));
      acc[m][n][1] = fmaf(c[2] + c[3], f[m].y * terms.y, fmaf(f[m].w, terms.x, acc[m][n][1]));
    }
  }
}

// y[token, row] = the warp's sums, for the tokens and rows that exist.
__device__ __forceinline__ void tiled_store(const float (&acc)[kWarpMTiles][kWarpNTiles][2], float* y, int rows_out,
                                            int x_rows, int block_row, int first_token, int warp, int lane) {
  const int g = lane / 4, t = lane % 4;
  const int first_m = (warp % kWarpsAlongM) * kWarpMTiles, first_n = (warp / kWarpsAlongM) * kWarpNTiles;
#pragma unroll
  for (int n = 0; n < kWarpNTiles; ++n) {
    const int token = first_token + 4 * (first_n + n) + t;
    if (token >= x_rows) continue;
    float* out = y + size_t(token) * size_t(rows_out);
#pragma unroll
    for (int i = 0; i < kWarpMTiles; ++i)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = block_row + (first_m + i) * kTileRows + g + 8 * r;
        if (row < rows_out) out[row] = acc[i][n][r];
      }
  }
}

// What a warp loads for one group: its m-tiles' codes (rows g and g + 8, lane t's columns) and one bf16 of the
// scales and biases each.
struct WarpCodes {
  uint2 codes[kWarpMTiles][2];
  uint32_t affine[kWarpMTiles];
};

// Block (row block, activation-row block) of y = W · x for x_rows rows. A step multiplies group k with the codes in
// registers and the activations from one stage while the next group's codes load and its activations are split into
// the other stage; the activations of group k + 2 are copied meanwhile. The step has no branches (past the last group
// it copies zeros and re-reads the last codes), so that ptxas can interleave the staging's arithmetic with the
// products.
template <int Bits>
__global__ void __launch_bounds__(kTiledWarps * 32, 1)
    quant_gemm_tiled_kernel(DeviceMatrix m, const float* x, int x_rows, float* y) {
  allow_dependents();
  extern __shared__ uint4 tiled_shared[];
  TiledActivationStage* stages = reinterpret_cast<TiledActivationStage*>(tiled_shared);
  TiledRaw* raw = reinterpret_cast<TiledRaw*>(stages + 2);
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
  const int rows_out = m.rows, cols = m.cols, groups = cols / kQuantGroup, row_words = cols / 32 * Bits;
  const int block_row = int(blockIdx.x) * kTiledRows, first_token = int(blockIdx.y) * kTiledTokens;
  const int first_m = (warp % kWarpsAlongM) * kWarpMTiles;
  const uint32_t* codes = static_cast<const uint32_t*>(m.data);
  const uint16_t* affine = t & 2 ? m.biases : m.scales;
  int code_rows[kWarpMTiles][2], affine_rows[kWarpMTiles];  // offsets in words / bf16s (clamped rows)
#pragma unroll
  for (int i = 0; i < kWarpMTiles; ++i) {
    const int tile_row = block_row + (first_m + i) * kTileRows;
    const int row0 = min(tile_row + g, rows_out - 1), row1 = min(tile_row + g + 8, rows_out - 1);
    code_rows[i][0] = row0 * row_words, code_rows[i][1] = row1 * row_words;
    affine_rows[i] = (t & 1 ? row1 : row0) * groups;
  }
  const auto load = [&](WarpCodes& w, int group) {
#pragma unroll
    for (int i = 0; i < kWarpMTiles; ++i) {
#pragma unroll
      for (int r = 0; r < 2; ++r) w.codes[i][r] = load_codes<Bits>(codes + code_rows[i][r], group, t);
      w.affine[i] = __ldg(affine + affine_rows[i] + group);
    }
  };
  const int item_row = int(threadIdx.x) / 4;
  const bool has_item = item_row < kTiledTokens && first_token + item_row < x_rows;
  const float* x_item = x + size_t(has_item ? first_token + item_row : 0) * size_t(cols) + 16 * t;

  float acc[kWarpMTiles][kWarpNTiles][2] = {};
  WarpCodes current, next_codes;
  load(current, 0);
  tiled_copy(raw[0], x_item, has_item, 0);
  tiled_copy(raw[1], x_item, has_item && groups > 1, 1);
  asm volatile("cp.async.wait_group 1;" ::: "memory");
  tiled_split<Bits>(stages[0], raw[0], item_row, t);
  __syncthreads();
  for (int group = 0; group < groups; ++group) {
    const int next = (group + 1) & 1;
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    tiled_copy(raw[group & 1], x_item, has_item && group + 2 < groups, group + 2);
    load(next_codes, min(group + 1, groups - 1));
    TiledWeights weights;
#pragma unroll
    for (int i = 0; i < kWarpMTiles; ++i) {
      uint32_t a0[8], a1[8];
      decode<Bits>(current.codes[i][0], t, a0);
      decode<Bits>(current.codes[i][1], t, a1);
#pragma unroll
      for (int j = 0; j < 4; ++j) weights.a[i][j] = make_uint4(a0[2 * j], a1[2 * j], a0[2 * j + 1], a1[2 * j + 1]);
      float f[4];
#pragma unroll
      for (int k = 0; k < 4; ++k)
        f[k] = __uint_as_float(__shfl_sync(0xffffffffu, current.affine[i], (lane & ~3) | k) << 16);
      weights.f[i] = make_float4(f[0], f[1], f[2], f[3]);
    }
    tiled_products(weights, stages[group & 1], warp, lane, acc);
    tiled_split<Bits>(stages[next], raw[next], item_row, t);
    current = next_codes;
    __syncthreads();
  }
  tiled_store(acc, y, rows_out, x_rows, block_row, first_token, warp, lane);
}

template <int Bits>
cudaError_t launch_tiled(const DeviceMatrix& w, const float* x, int x_rows, float* y, cudaStream_t stream) {
  const auto kernel = quant_gemm_tiled_kernel<Bits>;
  const size_t shared = kTiledShared;
  static const cudaError_t allowed =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared));
  if (allowed != cudaSuccess) return allowed;
  const dim3 grid(unsigned((w.rows + kTiledRows - 1) / kTiledRows),
                  unsigned((x_rows + kTiledTokens - 1) / kTiledTokens));
  kernel<<<grid, kTiledWarps * 32, shared, stream>>>(w, x, x_rows, y);
  return cudaGetLastError();
}

cudaError_t launch_tiled_format(const DeviceMatrix& w, const float* x, int x_rows, float* y, cudaStream_t stream) {
  if ((x_rows + kTiledTokens - 1) / kTiledTokens > 65535) return cudaErrorInvalidValue;
  switch (w.format) {
    case WeightFormat::Q4:
      return launch_tiled<4>(w, x, x_rows, y, stream);
    case WeightFormat::Q3:
      return launch_tiled<3>(w, x, x_rows, y, stream);
    default:
      return launch_tiled<2>(w, x, x_rows, y, stream);
  }
}

int multiprocessor_count() {
  int device = 0, multiprocessors = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return 0;
  return multiprocessors;
}

// The automatic choice: block tiles where a chunk has enough rows for whole tiles and at least one block for every
// two multiprocessors; the warp tiles, which slice the rows finer, elsewhere. Measured at 512 rows on the H200
// (bench/results/2026-12-01-h200-quant-gemm-tiled-s10.json, register-A 256 × 64 blocks): faster from 80 blocks up
// (GDN out, attention o, shared down), slower at 16–24 (mix_down, attention k/v, shared gate/up).
bool block_tiles_pay(const DeviceMatrix& w, int x_rows) {
  const int blocks = (w.rows + kTiledRows - 1) / kTiledRows * ((x_rows + kTiledTokens - 1) / kTiledTokens);
  return x_rows >= kTiledTokens && 2 * blocks >= multiprocessor_count();
}

template <int Bits>
cudaError_t launch_dense(const DenseSlices& slices, int count, const float* x, float* y, cudaStream_t stream) {
  const int rows_out = slices.matrix.rows;
  const dim3 grid(unsigned((rows_out + kBlockRows - 1) / kBlockRows), unsigned(count));
  quant_gemm_kernel<Bits><<<grid, kWarps * 32, 0, stream>>>(slices, rows_out, slices.matrix.cols, x, y);
  return cudaGetLastError();
}

template <int Bits, typename Cut>
cudaError_t launch_experts(const ExpertRows& experts, int count, int rows_out, int cols, const void* split, float* y,
                           cudaStream_t stream) {
  const auto kernel = quant_expert_kernel<Bits, Cut>;
  constexpr size_t shared = 2 * sizeof(ExpertStage<Cut::kChunkGroups>);
  static const cudaError_t allowed =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared));
  if (allowed != cudaSuccess) return allowed;
  const dim3 grid(unsigned((rows_out + kBlockRows - 1) / kBlockRows), unsigned(count));
  kernel<<<grid, Cut::kThreads, shared, stream>>>(experts, rows_out, cols, static_cast<const uint4*>(split), y);
  return cudaGetLastError();
}

template <int Bits>
cudaError_t launch_experts_cut(const ExpertRows& experts, int count, int rows_out, int cols, const void* split,
                               float* y, cudaStream_t stream) {
  if (cols / kQuantGroup <= kShortRowGroups)
    return launch_experts<Bits, ShortRowCut>(experts, count, rows_out, cols, split, y, stream);
  return launch_experts<Bits, LongRowCut>(experts, count, rows_out, cols, split, y, stream);
}

template <int Bits>
cudaError_t launch_split(const float* x, const float* up, int rows, int cols, void* split, cudaStream_t stream) {
  const long long items = (long long)rows * (cols / kQuantGroup) * 4;
  const long long blocks = (items + 255) / 256;
  if (blocks > 0x7fffffffLL) return cudaErrorInvalidValue;
  quant_split_kernel<Bits><<<unsigned(blocks), 256, 0, stream>>>(x, up, rows, cols, static_cast<uint4*>(split));
  return cudaGetLastError();
}

cudaError_t split_format(WeightFormat format, const float* x, const float* up, int rows, int cols, void* split,
                         cudaStream_t stream) {
  const auto misaligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 != 0; };
  if (!quant_gemm_takes(format) || rows < 0 || cols <= 0 || cols % kQuantGroup != 0 || misaligned(x) ||
      misaligned(up) || misaligned(split))
    return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  switch (format) {
    case WeightFormat::Q4:
      return launch_split<4>(x, up, rows, cols, split, stream);
    case WeightFormat::Q3:
      return launch_split<3>(x, up, rows, cols, split, stream);
    default:
      return launch_split<2>(x, up, rows, cols, split, stream);
  }
}

// Dense slices of 16 rows, or of 8 or 4 where a matrix has so few row blocks that 16-row slices would leave
// multiprocessors without a block (mix_down: 320 rows, 3 row blocks × 32 slices of a 512-row chunk = 96 blocks for 132
// multiprocessors: slices of 8, 192 blocks). A row's sums are the same in any slice; only the staging and the decode
// are repeated per slice, so narrower slices cost work. Filling both resident block slots (kMinBlocks a
// multiprocessor; mix_down in slices of 4, the router and attention k/v 4, the shared expert's gate/up 8) measured
// 3 % slower over an 8-layer Flash-Next prefill than filling one
// (bench/results/2026-12-01-h200-prefill-breakdown-s10.json).
constexpr int kSliceFillBlocks = 1;
int slice_rows_for(int row_blocks, int x_rows) {
  int device = 0, multiprocessors = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return kRows;
  int rows = kRows;
  while (rows > 4 && row_blocks * ((x_rows + rows - 1) / rows) < kSliceFillBlocks * multiprocessors) rows /= 2;
  return rows;
}

}  // namespace

bool quant_gemm_takes(WeightFormat format) {
  return format == WeightFormat::Q4 || format == WeightFormat::Q3 || format == WeightFormat::Q2;
}

bool quant_gemm_reads(const DeviceMatrix& m) {
  const auto address = reinterpret_cast<uintptr_t>(m.data);
  return quant_gemm_takes(m.format) && m.cols % kQuantGroup == 0 &&
         address % (m.format == WeightFormat::Q4 ? 8 : 4) == 0;
}

bool quant_gemm_reads_all(const DeviceMatrix* device, int count, WeightFormat format, int rows, int cols) {
  std::vector<DeviceMatrix> host(static_cast<size_t>(count));
  if (!device || count <= 0 ||
      cudaMemcpy(host.data(), device, host.size() * sizeof(DeviceMatrix), cudaMemcpyDeviceToHost) != cudaSuccess)
    return false;
  return std::all_of(host.begin(), host.end(), [&](const DeviceMatrix& m) {
    return m.format == format && m.rows == rows && m.cols == cols && quant_gemm_reads(m);
  });
}

cudaError_t quant_gemm(const DeviceMatrix& w, const float* x, int x_rows, float* y, cudaStream_t stream,
                       QuantGemmTiles tiles) {
  if (!quant_gemm_reads(w) || reinterpret_cast<uintptr_t>(x) % 16 != 0) return cudaErrorInvalidValue;
  if (x_rows <= 0) return cudaSuccess;
  if (tiles == QuantGemmTiles::block || (tiles == QuantGemmTiles::automatic && block_tiles_pay(w, x_rows)))
    return launch_tiled_format(w, x, x_rows, y, stream);
  DenseSlices slices;
  slices.matrix = w;
  slices.rows = x_rows;
  slices.slice_rows = slice_rows_for((w.rows + kBlockRows - 1) / kBlockRows, x_rows);
  const int count = (x_rows + slices.slice_rows - 1) / slices.slice_rows;
  if (count > 65535) return cudaErrorInvalidValue;
  switch (w.format) {
    case WeightFormat::Q4:
      return launch_dense<4>(slices, count, x, y, stream);
    case WeightFormat::Q3:
      return launch_dense<3>(slices, count, x, y, stream);
    default:
      return launch_dense<2>(slices, count, x, y, stream);
  }
}

size_t quant_split_bytes(int rows, int cols) {
  return size_t(std::max(rows, 0)) * size_t(std::max(cols, 0) / kQuantGroup) * kSplitEntries * sizeof(uint4);
}

cudaError_t quant_split_rows(WeightFormat format, const float* x, int rows, int cols, void* split,
                             cudaStream_t stream) {
  return split_format(format, x, nullptr, rows, cols, split, stream);
}

cudaError_t quant_split_swiglu_rows(WeightFormat format, const float* gate, const float* up, int rows, int cols,
                                    void* split, cudaStream_t stream) {
  if (!up) return cudaErrorInvalidValue;
  return split_format(format, gate, up, rows, cols, split, stream);
}

cudaError_t quant_expert_gemm(const DeviceMatrix* experts, WeightFormat format, int experts_count, int rows_out,
                              int cols, const int* counts, const int* offsets, const void* split_x, float* y,
                              cudaStream_t stream, const GroupedRowMap& map) {
  if (!quant_gemm_takes(format) || experts_count <= 0 || experts_count > 65535 || rows_out <= 0 || cols <= 0 ||
      cols % kQuantGroup != 0 || (map.x_rows && map.x_divisor < 1) || reinterpret_cast<uintptr_t>(split_x) % 16 != 0)
    return cudaErrorInvalidValue;
  const ExpertRows rows{experts, counts, offsets, map};
  switch (format) {
    case WeightFormat::Q4:
      return launch_experts_cut<4>(rows, experts_count, rows_out, cols, split_x, y, stream);
    case WeightFormat::Q3:
      return launch_experts_cut<3>(rows, experts_count, rows_out, cols, split_x, y, stream);
    default:
      return launch_experts_cut<2>(rows, experts_count, rows_out, cols, split_x, y, stream);
  }
}

}  // namespace vavilov::cuda
