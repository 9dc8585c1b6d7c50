#include <cuda_fp16.h>

#include <algorithm>
#include <numeric>
#include <type_traits>

#include "cuda/device_math.cuh"
#include "cuda/gemv.cuh"
#include "cuda/launch.cuh"
#include "cuda/quant_imma.cuh"
#include "cuda/quant_mma.cuh"

namespace vavilov::cuda {

namespace {

using namespace qmma;

// How the work is split (choose_split): one wave of blocks where the shape allows, since a second, partial wave
// doubles a kernel's time. Constants rather than the device's numbers, so that a shape is summed the same way
// everywhere.
constexpr int kSms = 132;             // an H200's multiprocessors
constexpr int kQuantWarpsPerSm = 16;  // resident warps of the quantized kernel on one (its registers allow 18)
constexpr int kDenseWarpsPerSm = 32;  // and of the dense kernel
constexpr int kMaxSplits = 16;        // warps of one block on one tile
constexpr int kMaxTiles = 8;          // tiles of one block
constexpr int kMaxBlocksPerSm = 32;   // Hopper's limit
// Shared memory: Hopper's per multiprocessor, its per-block opt-in limit, what the runtime reserves per block, and the
// quantized kernel's static partial sums.
constexpr size_t kSharedPerSm = 228 * 1024, kReservedShared = 1024;
constexpr size_t kStaticShared = kMaxWarps * 64 * sizeof(float);
constexpr size_t kMaxDynamicShared = 227 * 1024 - kStaticShared;

// A grouped launch's matrices in a one-dimensional grid: blocks [block_end[i - 1], block_end[i]) are matrix i's row
// blocks, so that only blocks with rows are launched (a (row blocks, matrices) grid sized by the tallest matrix has a
// block per matrix and row block of the tallest, most of them empty when the heights differ, as a GDN layer's inputs).
constexpr int kMaxFlatMatrices = 8;

// The tiles (units of work: 16 rows of a quantized matrix, one row of a dense one) of a launch's matrices: `count`
// matrices of `uniform` tiles each, or each its own (each[i]).
struct TileCounts {
  int count = 0, uniform = 0;
  const int* each = nullptr;
  int of(int i) const { return each ? each[i] : uniform; }
  int64_t total() const { return each ? std::accumulate(each, each + count, int64_t(0)) : int64_t(uniform) * count; }
  int most() const { return each ? *std::max_element(each, each + count) : uniform; }
  // Blocks of per_block tiles, each block within one matrix.
  int64_t blocks(int per_block) const {
    int64_t n = 0;
    for (int i = 0; i < (each ? count : 1); ++i) n += (of(i) + per_block - 1) / per_block;
    return each ? n : n * count;
  }
};

GemvSplit quant_split(const TileCounts& tiles, int cols, int batch, int bits);

// Dependent launches (launch.cuh): whether a grouped launch's descriptors may be read before the wait (fixed for the
// sequence's life, or written two launches back: GemvDescriptors) or only after it (written by the kernel before, e.g.
// the MoE routing). A single matrix's descriptor travels by value in the launch: nothing to wait for. flat_matrices >
// 0: the one-dimensional grid above (fixed descriptors only); 0: a (row blocks, matrices) grid.
struct LaunchPlan {
  GemvDescriptors descriptors = GemvDescriptors::fixed;
  int flat_matrices = 0;
  int block_end[kMaxFlatMatrices] = {};
};

LaunchPlan launch_plan(GemvDescriptors descriptors) { return {descriptors}; }

LaunchPlan single_matrix_plan() { return {}; }

// A descriptor that a kernel of this pass wrote, read before the wait (GemvDescriptors::written_two_back): through L2
// (ld.global.cg), never through the non-coherent or L1 paths, which may hold an earlier pass's bytes or be hoisted.
__device__ inline GemvMatrix load_descriptor_from_l2(const GemvMatrix* source) {
  static_assert(sizeof(GemvMatrix) % sizeof(unsigned long long) == 0 && alignof(GemvMatrix) >= 8);
  constexpr int kWords = sizeof(GemvMatrix) / sizeof(unsigned long long);
  unsigned long long words[kWords];
  const unsigned long long* from = reinterpret_cast<const unsigned long long*>(source);
#pragma unroll
  for (int i = 0; i < kWords; ++i) words[i] = __ldcg(from + i);
  GemvMatrix m;
  memcpy(&m, words, sizeof(m));
  return m;
}

// A grouped launch's descriptor; one that the kernel before wrote only after the wait.
__device__ inline GemvMatrix read_descriptor(const GemvMatrix* source, GemvDescriptors descriptors) {
  if (descriptors == GemvDescriptors::written_in_pass) wait_for_producers();
  if (descriptors == GemvDescriptors::written_two_back) return load_descriptor_from_l2(source);
  return *source;
}

// This block's matrix and row block.
struct BlockWork {
  GemvMatrix m;
  int row_block = 0;
};

__device__ inline BlockWork block_work(const GemvMatrix& single, const GemvMatrix* matrices, const LaunchPlan& plan) {
  if (!matrices) return {single, int(blockIdx.x)};
  if (plan.flat_matrices == 0) return {read_descriptor(matrices + blockIdx.y, plan.descriptors), int(blockIdx.x)};
  int matrix = 0, start = 0;  // constant indices into the parameter (no copy to local memory)
#pragma unroll
  for (int i = 0; i + 1 < kMaxFlatMatrices; ++i)
    if (i + 1 < plan.flat_matrices && int(blockIdx.x) >= plan.block_end[i]) matrix = i + 1, start = plan.block_end[i];
  return {matrices[matrix], int(blockIdx.x) - start};
}

// The block's activations of m: m.x, or silu(m.x)·m.x_up (GemvMatrix::x_up), into mma fragments.
template <int Bits, int B>
__device__ void stage_matrix_activations(const GemvMatrix& m, int groups, uint4* fragments, float2* group_terms) {
  const auto plain = [&](int b, int group, int t, float(&x)[16]) { load_activations(m, b, group, t, x); };
  if (!m.x_up) return stage_for_products<Bits, B>(groups, plain, fragments, group_terms, threadIdx.x, blockDim.x);
  const auto swiglu = [&](int b, int group, int t, float(&x)[16]) {
    load_activations(m, b, group, t, x);
    const float4* up = reinterpret_cast<const float4*>(m.x_up + size_t(b) * m.cols + group * kQuantGroup + 16 * t);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 v = __ldg(up + i);
      x[4 * i] = silu(x[4 * i]) * v.x, x[4 * i + 1] = silu(x[4 * i + 1]) * v.y;
      x[4 * i + 2] = silu(x[4 * i + 2]) * v.z, x[4 * i + 3] = silu(x[4 * i + 3]) * v.w;
    }
  };
  stage_for_products<Bits, B>(groups, swiglu, fragments, group_terms, threadIdx.x, blockDim.x);
}

// Block (row block, matrix): warp w works on tile w % split.tiles and column slice w / split.tiles. Each warp leaves
// its partial sums in shared memory; then each output adds those of its tile's warps in slice order.
template <int Bits, int B>
__global__ void __launch_bounds__(kMaxWarps * 32)
    gemv_quant_kernel(GemvMatrix single, const GemvMatrix* matrices, GemvSplit split, LaunchPlan plan) {
  extern __shared__ uint4 shared[];
  __shared__ float partials[kMaxWarps][64];  // [warp][r·32 + lane]: lane (g, t)'s sum for row g + 8r, batch t
  const BlockWork work = block_work(single, matrices, plan);
  const GemvMatrix& m = work.m;
  const int block_row = work.row_block * split.tiles * kTileRows;
  if (block_row >= m.rows) return wait_for_producers();  // the whole block is past this matrix's rows
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int groups = m.cols / kQuantGroup, row_words = m.cols / 32 * Bits, slice = warp / split.tiles;
  const int begin = slice_start(slice, split.splits, groups), end = slice_start(slice + 1, split.splits, groups);
  const int warp_row = block_row + (warp % split.tiles) * kTileRows;
  // Rows past the end re-read the last row; their results are never stored.
  const int row0 = min(warp_row + g, m.rows - 1), row1 = min(row0 + 8, m.rows - 1);
  const uint32_t* const codes[2] = {m.codes + size_t(row0) * row_words, m.codes + size_t(row1) * row_words};
  const __nv_bfloat16* affine = (t & 2 ? m.biases : m.scales) + size_t(t & 1 ? row1 : row0) * groups;
  const AffineWidth width = affine_width(m, groups);
  const bool has_rows = warp_row < m.rows;

  // Each warp's first weight loads come before the wait (weights never depend on the previous kernel), so that their
  // latency overlaps the previous kernel's end; the activations are staged after it. (An L2 prefetch of the block's
  // whole weight range here, per line or in bulk, measured up to 20 % slower on large products: docs/CUDA.md.)
  WarpLoads current;
  load_group_block<Bits>(current, codes, affine, begin, has_rows ? end : begin, width, t);
  wait_for_producers();  // before the trigger: the kernels after read what was written before it (two-deep rule)
  allow_dependents();
  uint4* fragments = shared;
  float2* group_terms = staged_terms<Bits, B>(fragments, groups);
  stage_matrix_activations<Bits, B>(m, groups, fragments, group_terms);
  __syncthreads();
  float acc[2] = {};
  if (has_rows)
    staged_tile_products<Bits, B>(current, codes, affine, width, begin, end, groups, fragments, group_terms, acc);
  partials[warp][lane] = acc[0];
  partials[warp][32 + lane] = acc[1];
  __syncthreads();
  const int outputs = split.tiles * kTileRows * B;  // (tile, row in tile, batch row)
  for (int i = threadIdx.x; i < outputs; i += blockDim.x) {
    const int b = i % B, row_in_tile = (i / B) % kTileRows, tile = i / (B * kTileRows);
    const int row = block_row + tile * kTileRows + row_in_tile;
    if (row >= m.rows) continue;
    const int slot = (row_in_tile / 8) * 32 + (row_in_tile % 8) * 4 + b;
    float sum = 0.0f;
    for (int part = 0; part < split.splits; ++part) sum += partials[part * split.tiles + tile][slot];
    m.y[size_t(b) * m.rows + row] = sum;
  }
}

template <int Bits, int B>
cudaError_t launch_quant(const GemvMatrix& single, const GemvMatrix* matrices, dim3 grid, int max_cols, GemvSplit split,
                         const LaunchPlan& plan, cudaStream_t stream) {
  const size_t shared = staged_bytes(Bits, max_cols / kQuantGroup, B);
  if (shared > kMaxDynamicShared) return cudaErrorInvalidValue;
  // Once for all: only a permission (occupancy follows each launch's own size), so it never changes between the
  // launches of a captured graph.
  static const cudaError_t opted_in = cudaFuncSetAttribute(
      gemv_quant_kernel<Bits, B>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kMaxDynamicShared));
  if (opted_in != cudaSuccess) return opted_in;
  return launch_dependent(gemv_quant_kernel<Bits, B>, grid, dim3(split.tiles * split.splits * 32), shared, stream,
                          single, matrices, split, plan);
}

constexpr GemvSplit kChosenSplit{0, 0};  // the split gemv_quant_split chooses

int tiles_of(int rows) { return (rows + kTileRows - 1) / kTileRows; }

// `count` matrices of max_rows rows at most in a (row blocks, matrices) grid, or, with matrix_rows (their heights on
// the host, fixed descriptors, count ≤ kMaxFlatMatrices), in the one-dimensional grid of their row blocks alone.
template <int Bits>
cudaError_t gemv_quant(const GemvMatrix& single, const GemvMatrix* matrices, const int* matrix_rows, int count,
                       int max_rows, int max_cols, int batch, GemvSplit split, LaunchPlan plan, cudaStream_t stream) {
  if (count <= 0 || max_rows <= 0 || max_cols <= 0 || max_cols % kQuantGroup != 0) return cudaErrorInvalidValue;
  const bool flat = matrix_rows && count <= kMaxFlatMatrices && plan.descriptors == GemvDescriptors::fixed;
  int tiles[kMaxFlatMatrices] = {};
  for (int i = 0; flat && i < count; ++i) {
    if (matrix_rows[i] <= 0 || matrix_rows[i] > max_rows) return cudaErrorInvalidValue;
    tiles[i] = tiles_of(matrix_rows[i]);
  }
  const TileCounts counts = flat ? TileCounts{count, 0, tiles} : TileCounts{count, tiles_of(max_rows), nullptr};
  if (split.tiles == kChosenSplit.tiles) split = quant_split(counts, max_cols, batch, Bits);
  if (split.tiles < 1 || split.splits < 1 || split.tiles * split.splits > kMaxWarps) return cudaErrorInvalidValue;
  dim3 grid(unsigned(counts.blocks(split.tiles) / count), unsigned(count));
  if (flat) {
    plan.flat_matrices = count;
    for (int i = 0, end = 0; i < count; ++i) plan.block_end[i] = end += (tiles[i] + split.tiles - 1) / split.tiles;
    grid = dim3(unsigned(plan.block_end[count - 1]), 1u);
  }
  return with_batch(batch, [&](auto b) {
    return launch_quant<Bits, decltype(b)::value>(single, matrices, grid, max_cols, split, plan, stream);
  });
}

// ---------------------------------------------------------------------------------------------------------------
// Expert launches (gemv_q4_experts): descriptors written in the pass, and often more tiles than one wave of warps (a
// 4-row verify step's 40 experts: 3200 gate/up tiles and 6560 down tiles against 2112 resident warps), which
// quant_split then cuts into several waves of short blocks, each paying a block launch, the activation staging after
// its wait, the partial-sum exchange and a tail. Here a block of kMaxTiles warps, one slice (whole rows) each, walks
// `rounds` runs of kMaxTiles consecutive tiles in turn: it stages its activations once, its warps never wait for each
// other after that, and one wave of such blocks covers the launch. Each output is one warp's sum over the groups in
// order, as with one slice in gemv_quant_kernel.

// A warp's next tile into L2 while it works on the current one: the first `lines` 128-byte lines of each of its 16
// code rows and the start of its scale and bias rows (lane: row lane % 16; lanes 0–15 the even lines and the scales,
// 16–31 the odd lines and the biases), so that the next run's loads wait for L2, not for memory. The prefetches hold
// no registers: they keep more bytes in flight than the warp's own loads can.
__device__ inline void prefetch_tile(const GemvMatrix& m, int tile_row, int row_words, int groups, int lines) {
  if (tile_row >= m.rows) return;
  constexpr int kLineWords = 128 / sizeof(uint32_t);
  const int lane = threadIdx.x % 32, row = min(tile_row + lane % 16, m.rows - 1);
  const int row_lines = min(lines, (row_words + kLineWords - 1) / kLineWords);
  const uint32_t* codes = m.codes + size_t(row) * row_words;
  for (int line = lane / 16; line < row_lines; line += 2)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(codes + line * kLineWords));
  asm volatile("prefetch.global.L2 [%0];" ::"l"((lane < 16 ? m.scales : m.biases) + size_t(row) * groups));
}

// The code rows and the scale/bias row that lane (g, t) reads for the tile at warp_row; rows past the end re-read the
// last row (their results are never stored).
struct TileRows {
  const uint32_t* codes[2];
  const __nv_bfloat16* affine;
};

__device__ inline TileRows tile_rows(const GemvMatrix& m, int warp_row, int row_words, int groups) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int row0 = min(warp_row + g, m.rows - 1), row1 = min(row0 + 8, m.rows - 1);
  return {{m.codes + size_t(row0) * row_words, m.codes + size_t(row1) * row_words},
          (t & 2 ? m.biases : m.scales) + size_t(t & 1 ? row1 : row0) * groups};
}

// What a gemv_quant_rounds_kernel launch sums (rounds), prefetches (prefetch_tile's lines) and may read before its
// wait: its descriptors (GemvDescriptors), and settled_x when every matrix reads those activations
// ([batch, settled_cols]) and they were written two launches back or earlier (launch.cuh's two-deep rule: the MoE
// block's input, for gate/up): then the block stages them before the wait, while the routing still runs.
struct RoundsLaunch {
  int rounds = 1, prefetch_lines = 0;
  GemvDescriptors descriptors = GemvDescriptors::written_in_pass;
  const float* settled_x = nullptr;
  int settled_cols = 0;
};

// settled_x's activations (RoundsLaunch), staged by the whole block before the wait: read through L2 (__ldcg), the
// same fp32 values as stage_matrix_activations.
template <int Bits, int B>
__device__ void stage_settled_activations(const RoundsLaunch& launch, uint4* fragments) {
  const int groups = launch.settled_cols / kQuantGroup;
  float2* group_terms = staged_terms<Bits, B>(fragments, groups);
  const auto load = [&](int b, int group, int t, float(&x)[16]) {
    const float4* source = reinterpret_cast<const float4*>(launch.settled_x + size_t(b) * launch.settled_cols +
                                                           group * kQuantGroup + 16 * t);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 v = __ldcg(source + i);
      x[4 * i] = v.x, x[4 * i + 1] = v.y, x[4 * i + 2] = v.z, x[4 * i + 3] = v.w;
    }
  };
  stage_for_products<Bits, B>(groups, load, fragments, group_terms, threadIdx.x, blockDim.x);
}

// The settled activations (if any) and the descriptor first (after the wait when the kernel before wrote it, else
// before), then each warp's first tile: its first weight loads and the L2 prefetch of that tile's next lines and of
// the next round's tile, all before the wait when the descriptors allow it (the weights never depend on the previous
// kernel), then the staging of the activations that are not settled.
template <int Bits, int B>
__global__ void __launch_bounds__(kMaxTiles * 32, 2)
    gemv_quant_rounds_kernel(const GemvMatrix* matrices, RoundsLaunch launch) {
  extern __shared__ uint4 shared[];
  uint4* fragments = shared;
  if (launch.settled_x) stage_settled_activations<Bits, B>(launch, fragments);
  const GemvMatrix m = read_descriptor(matrices + blockIdx.y, launch.descriptors);
  const int rounds = launch.rounds, prefetch_lines = launch.prefetch_lines;
  const int first_row = int(blockIdx.x) * rounds * kMaxTiles * kTileRows;
  // The whole block is past this matrix's rows (rows = 0: an empty descriptor); a second wait returns at once.
  if (first_row >= m.rows) return wait_for_producers();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int groups = m.cols / kQuantGroup, row_words = m.cols / 32 * Bits;
  const AffineWidth width = affine_width(m, groups);
  const int run_rows = kMaxTiles * kTileRows;
  int warp_row = first_row + warp * kTileRows;
  TileRows tile = tile_rows(m, warp_row, row_words, groups);
  WarpLoads current;
  prefetch_tile(m, warp_row, row_words, groups, prefetch_lines);
  load_group_block<Bits>(current, tile.codes, tile.affine, 0, warp_row < m.rows ? groups : 0, width, t);
  if (rounds > 1) prefetch_tile(m, warp_row + run_rows, row_words, groups, prefetch_lines);
  wait_for_producers();
  allow_dependents();
  float2* group_terms = staged_terms<Bits, B>(fragments, groups);
  if (!launch.settled_x) stage_matrix_activations<Bits, B>(m, groups, fragments, group_terms);
  __syncthreads();
  for (int round = 0; round < rounds; ++round, warp_row += run_rows) {
    if (warp_row >= m.rows) break;
    if (round > 0) {
      if (round + 1 < rounds) prefetch_tile(m, warp_row + run_rows, row_words, groups, prefetch_lines);
      tile = tile_rows(m, warp_row, row_words, groups);
      load_group_block<Bits>(current, tile.codes, tile.affine, 0, groups, width, t);
    }
    float acc[2] = {};
    staged_tile_products<Bits, B>(current, tile.codes, tile.affine, width, 0, groups, groups, fragments, group_terms,
                                  acc);
    if (t >= B) continue;
    if (warp_row + g < m.rows) m.y[size_t(t) * m.rows + warp_row + g] = acc[0];
    if (warp_row + g + 8 < m.rows) m.y[size_t(t) * m.rows + warp_row + g + 8] = acc[1];
  }
}

// Lines of each code row of a warp's next tile that gemv_quant_rounds_kernel prefetches: the two its first two loads
// of 4 groups read (H200, 3-draft step: 8.66 ms with 2, 9.00 ms with the whole row, whose prefetches crowd out the
// current tile's loads; bench/results/2026-11-30-h200-moe-verify-s6.json).
constexpr int kExpertPrefetchLines = 2;

template <int Bits, int B>
cudaError_t launch_rounds(const GemvMatrix* matrices, dim3 grid, int max_cols, const RoundsLaunch& launch,
                          cudaStream_t stream) {
  const size_t shared = staged_bytes(Bits, max_cols / kQuantGroup, B);
  if (shared > kMaxDynamicShared) return cudaErrorInvalidValue;
  static const cudaError_t opted_in = cudaFuncSetAttribute(
      gemv_quant_rounds_kernel<Bits, B>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kMaxDynamicShared));
  if (opted_in != cudaSuccess) return opted_in;
  return launch_dependent(gemv_quant_rounds_kernel<Bits, B>, grid, dim3(kMaxTiles * 32), shared, stream, matrices,
                          launch);
}

// The rounds of an expert launch: 1 (gemv_quant's split) while its tiles fit one wave of warps, else the fewest for
// which its blocks of kMaxTiles warps fit one wave (two blocks a multiprocessor, or fewer where the staged activations
// fill its shared memory).
int expert_rounds(int count, int tiles_per_matrix, int cols, int batch) {
  if (int64_t(count) * tiles_per_matrix <= int64_t(kSms) * kQuantWarpsPerSm) return 1;
  const size_t block_shared = staged_bytes(4, cols / kQuantGroup, batch) + kReservedShared;
  const int blocks_per_sm = std::max(1, std::min(kQuantWarpsPerSm / kMaxTiles, int(kSharedPerSm / block_shared)));
  const int most = (tiles_per_matrix + kMaxTiles - 1) / kMaxTiles;
  for (int rounds = 1; rounds < most; ++rounds) {
    const int blocks = (tiles_per_matrix + rounds * kMaxTiles - 1) / (rounds * kMaxTiles);
    if (int64_t(count) * blocks <= int64_t(kSms) * blocks_per_sm) return rounds;
  }
  return most;
}

// ---------------------------------------------------------------------------------------------------------------
// Dense (BF16, F32): each row is split among split.splits warps (16-byte weight loads, fp32 FMA), whose sums are
// added in warp order; a block holds split.tiles rows. One warp per row already runs at the copy bandwidth when there
// are enough rows.

template <typename T>
__device__ inline const T* dense_rows(const GemvMatrix& m) {
  if constexpr (sizeof(T) == 2)
    return m.dense;
  else
    return m.dense_f32;
}

// The weights of one 16-byte load as fp32.
__device__ inline void widen(uint4 packed, const __nv_bfloat16*, float (&w)[8]) {
  const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[2 * i] = __uint_as_float(words[i] << 16);
    w[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}
__device__ inline void widen(uint4 packed, const float*, float (&w)[4]) {
  w[0] = __uint_as_float(packed.x), w[1] = __uint_as_float(packed.y), w[2] = __uint_as_float(packed.z);
  w[3] = __uint_as_float(packed.w);
}

template <typename T, int B>
__global__ void __launch_bounds__(kMaxWarps * 32)
    gemv_dense_kernel(GemvMatrix single, const GemvMatrix* matrices, GemvSplit split, LaunchPlan plan) {
  constexpr int kPerLoad = 16 / sizeof(T);
  __shared__ float partials[kMaxWarps][kMaxGemvRows];
  const GemvMatrix m = block_work(single, matrices, plan).m;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, part = warp / split.tiles;
  const int block_row = blockIdx.x * split.tiles, row = block_row + warp % split.tiles;
  if (block_row >= m.rows) return wait_for_producers();  // the whole block is past this matrix's rows
  // Its weight loads are interleaved with the activations', so only the launch comes early; the wait stays before the
  // trigger (launch.cuh's two-deep rule: the MoE block's next launches rely on it).
  wait_for_producers();
  allow_dependents();
  const int chunks = m.cols / kPerLoad;
  const int begin = part * chunks / split.splits, end = (part + 1) * chunks / split.splits;
  float acc[B] = {};
  if (row < m.rows) {
    const T* rows = dense_rows<T>(m);
    const uint4* weights = reinterpret_cast<const uint4*>(rows + size_t(row) * m.cols);
    for (int c = begin + lane; c < end; c += 32) {
      float w[kPerLoad];
      widen(__ldg(weights + c), rows, w);
#pragma unroll
      for (int b = 0; b < B; ++b) {
        const float4* x = reinterpret_cast<const float4*>(m.x + size_t(b) * m.cols + size_t(c) * kPerLoad);
#pragma unroll
        for (int q = 0; q < kPerLoad / 4; ++q) {
          const float4 v = __ldg(x + q);
          acc[b] += w[4 * q] * v.x + w[4 * q + 1] * v.y + w[4 * q + 2] * v.z + w[4 * q + 3] * v.w;
        }
      }
    }
  }
#pragma unroll
  for (int b = 0; b < B; ++b) {
    const float sum = warp_sum(acc[b]);
    if (lane == 0) partials[warp][b] = sum;
  }
  __syncthreads();
  if (part != 0 || lane >= B || row >= m.rows) return;
  float sum = 0.0f;
  for (int p = 0; p < split.splits; ++p) sum += partials[p * split.tiles + warp][lane];
  m.y[size_t(lane) * m.rows + row] = sum;
}

template <typename T, int B>
cudaError_t launch_dense(const GemvMatrix& single, const GemvMatrix* matrices, int count, int max_rows, int max_cols,
                         LaunchPlan plan, cudaStream_t stream) {
  const GemvSplit split = gemv_dense_split(max_rows, max_cols, count);
  const dim3 grid(unsigned((max_rows + split.tiles - 1) / split.tiles), unsigned(count));
  return launch_dependent(gemv_dense_kernel<T, B>, grid, dim3(split.tiles * split.splits * 32), 0, stream, single,
                          matrices, split, plan);
}

template <typename T>
cudaError_t gemv_dense(const GemvMatrix& single, const GemvMatrix* matrices, int count, int max_rows, int max_cols,
                       int batch, LaunchPlan plan, cudaStream_t stream) {
  if (count <= 0 || max_rows <= 0 || max_cols <= 0 || max_cols % (16 / sizeof(T)) != 0) return cudaErrorInvalidValue;
  return with_batch(batch, [&](auto b) {
    return launch_dense<T, decltype(b)::value>(single, matrices, count, max_rows, max_cols, plan, stream);
  });
}

// The most column slices (at most `units`) that still let every warp be resident at once (`warps_per_sm`, and at most
// `blocks_per_sm` blocks, on each of kSms); for those, the most tiles a block that keeps the single wave over 90 % of
// the multiprocessors — two tiles a block already at 60 %: every block stages the whole activation row, and one tile
// a block stages it for 16 rows only (2560-row products of 640-6144 columns measured 5-20 % faster with two, at 1-4
// rows) — or else the fewest tiles a block that fit. Shapes with too many tiles for one wave get blocks of kMaxTiles
// tiles, one slice each, in several waves.
GemvSplit choose_split(const TileCounts& tiles, int units, int warps_per_sm, int blocks_per_sm) {
  const int64_t tile_count = tiles.total(), resident_warps = int64_t(kSms) * warps_per_sm;
  for (int slices = std::min(units, kMaxSplits); slices >= 1; --slices) {
    if (tile_count * slices > resident_warps) continue;
    int fitting = 0;  // the fewest tiles a block seen so far that fit in one wave
    for (int per_block = std::min({kMaxTiles, kMaxWarps / slices, tiles.most()}); per_block >= 1; --per_block) {
      const int64_t blocks = tiles.blocks(per_block);
      const int64_t resident_blocks = int64_t(kSms) * std::min(warps_per_sm / (per_block * slices), blocks_per_sm);
      if (blocks > resident_blocks) continue;
      if (10 * blocks >= (per_block == 2 ? 6 : 9) * kSms) return {per_block, slices};
      fitting = per_block;
    }
    if (fitting > 0) return {fitting, slices};
  }
  return {std::min(kMaxTiles, tiles.most()), 1};
}

GemvSplit quant_split(const TileCounts& tiles, int cols, int batch, int bits) {
  const int groups = cols / kQuantGroup, units = (groups + kUnroll - 1) / kUnroll;
  const size_t block_shared = staged_bytes(bits, groups, batch) + kStaticShared + kReservedShared;
  const int blocks_per_sm = int(std::max<size_t>(1, kSharedPerSm / block_shared));
  return choose_split(tiles, std::max(units, 1), kQuantWarpsPerSm, blocks_per_sm);
}

}  // namespace

GemvSplit gemv_quant_split(int rows, int cols, int count, int batch) {
  return quant_split(TileCounts{count, tiles_of(rows), nullptr}, cols, batch, 4);
}

GemvSplit gemv_dense_split(int rows, int cols, int count) {
  // Slices of at least 256 columns: one 16-byte load a lane (BF16), two (F32).
  return choose_split(TileCounts{count, rows, nullptr}, std::max(1, cols / 256), kDenseWarpsPerSm, kMaxBlocksPerSm);
}

cudaError_t gemv_q4(const GemvMatrix* matrices, int count, int max_rows, int max_cols, int batch, cudaStream_t stream,
                    GemvDescriptors descriptors) {
  return gemv_quant<4>(GemvMatrix{}, matrices, nullptr, count, max_rows, max_cols, batch, kChosenSplit,
                       launch_plan(descriptors), stream);
}

int gemv_expert_rounds(int count, int max_rows, int max_cols, int batch) {
  return expert_rounds(count, tiles_of(max_rows), max_cols, batch);
}

cudaError_t gemv_q4_experts(const GemvMatrix* matrices, int count, int max_rows, int max_cols, int batch,
                            cudaStream_t stream, GemvDescriptors descriptors, const float* settled_x) {
  if (count <= 0 || max_rows <= 0 || max_cols <= 0 || max_cols % kQuantGroup != 0) return cudaErrorInvalidValue;
  const int tiles = tiles_of(max_rows), rounds = expert_rounds(count, tiles, max_cols, batch);
  if (rounds == 1) return gemv_q4(matrices, count, max_rows, max_cols, batch, stream, descriptors);
  const dim3 grid(unsigned((tiles + rounds * kMaxTiles - 1) / (rounds * kMaxTiles)), unsigned(count));
  RoundsLaunch launch{rounds, kExpertPrefetchLines, descriptors};
  if (settled_x) launch.settled_x = settled_x, launch.settled_cols = max_cols;
  return with_batch(
      batch, [&](auto b) { return launch_rounds<4, decltype(b)::value>(matrices, grid, max_cols, launch, stream); });
}

cudaError_t gemv_q4_fixed(const GemvMatrix* matrices, const int* matrix_rows, int count, int max_rows, int max_cols,
                          int batch, cudaStream_t stream) {
  return gemv_quant<4>(GemvMatrix{}, matrices, matrix_rows, count, max_rows, max_cols, batch, kChosenSplit,
                       launch_plan(GemvDescriptors::fixed), stream);
}

cudaError_t gemv_q3(const GemvMatrix* matrices, int count, int max_rows, int max_cols, int batch, cudaStream_t stream,
                    GemvDescriptors descriptors) {
  return gemv_quant<3>(GemvMatrix{}, matrices, nullptr, count, max_rows, max_cols, batch, kChosenSplit,
                       launch_plan(descriptors), stream);
}

cudaError_t gemv_q2(const GemvMatrix* matrices, int count, int max_rows, int max_cols, int batch, cudaStream_t stream,
                    GemvDescriptors descriptors) {
  return gemv_quant<2>(GemvMatrix{}, matrices, nullptr, count, max_rows, max_cols, batch, kChosenSplit,
                       launch_plan(descriptors), stream);
}

cudaError_t gemv_bf16(const GemvMatrix* matrices, int count, int max_rows, int max_cols, int batch, cudaStream_t stream,
                      GemvDescriptors descriptors) {
  return gemv_dense<__nv_bfloat16>(GemvMatrix{}, matrices, count, max_rows, max_cols, batch, launch_plan(descriptors),
                                   stream);
}

cudaError_t gemv_q4(const GemvMatrix& matrix, int batch, cudaStream_t stream) {
  return gemv_quant<4>(matrix, nullptr, nullptr, 1, matrix.rows, matrix.cols, batch, kChosenSplit, single_matrix_plan(),
                       stream);
}

cudaError_t gemv_q4(const GemvMatrix& matrix, int batch, GemvSplit split, cudaStream_t stream) {
  return gemv_quant<4>(matrix, nullptr, nullptr, 1, matrix.rows, matrix.cols, batch, split, single_matrix_plan(),
                       stream);
}

cudaError_t gemv_q3(const GemvMatrix& matrix, int batch, cudaStream_t stream) {
  return gemv_quant<3>(matrix, nullptr, nullptr, 1, matrix.rows, matrix.cols, batch, kChosenSplit, single_matrix_plan(),
                       stream);
}

cudaError_t gemv_q2(const GemvMatrix& matrix, int batch, cudaStream_t stream) {
  return gemv_quant<2>(matrix, nullptr, nullptr, 1, matrix.rows, matrix.cols, batch, kChosenSplit, single_matrix_plan(),
                       stream);
}

cudaError_t gemv_bf16(const GemvMatrix& matrix, int batch, cudaStream_t stream) {
  return gemv_dense<__nv_bfloat16>(matrix, nullptr, 1, matrix.rows, matrix.cols, batch, single_matrix_plan(), stream);
}

cudaError_t gemv_f32(const GemvMatrix& matrix, int batch, cudaStream_t stream) {
  return gemv_dense<float>(matrix, nullptr, 1, matrix.rows, matrix.cols, batch, single_matrix_plan(), stream);
}

}  // namespace vavilov::cuda
