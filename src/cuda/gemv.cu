#include <cuda_fp16.h>

#include <algorithm>
#include <numeric>
#include <type_traits>

#include "cuda/gemv.cuh"
#include "cuda/launch.cuh"
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

GemvSplit quant_split(const TileCounts& tiles, int cols, int batch);

// Dependent launches (launch.cuh): whether a grouped launch's descriptors may be read before the wait (fixed for the
// sequence's life) or only after it (written by the kernel before, e.g. the MoE routing). A single matrix's descriptor
// travels by value in the launch: nothing to wait for. flat_matrices > 0: the one-dimensional grid above (fixed
// descriptors only); 0: a (row blocks, matrices) grid.
struct LaunchPlan {
  bool fixed_descriptors = true;
  int flat_matrices = 0;
  int block_end[kMaxFlatMatrices] = {};
};

LaunchPlan launch_plan(GemvDescriptors descriptors) { return {descriptors == GemvDescriptors::fixed}; }

LaunchPlan single_matrix_plan() { return {}; }

// This block's matrix and row block; a grouped launch's descriptor, when written in the pass, only after the wait.
struct BlockWork {
  GemvMatrix m;
  int row_block = 0;
};

__device__ inline BlockWork block_work(const GemvMatrix& single, const GemvMatrix* matrices, const LaunchPlan& plan) {
  if (!matrices) return {single, int(blockIdx.x)};
  if (!plan.fixed_descriptors) wait_for_producers();
  if (plan.flat_matrices == 0) return {matrices[blockIdx.y], int(blockIdx.x)};
  int matrix = 0, start = 0;  // constant indices into the parameter (no copy to local memory)
#pragma unroll
  for (int i = 0; i + 1 < kMaxFlatMatrices; ++i)
    if (i + 1 < plan.flat_matrices && int(blockIdx.x) >= plan.block_end[i]) matrix = i + 1, start = plan.block_end[i];
  return {matrices[matrix], int(blockIdx.x) - start};
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
  wait_for_producers();
  allow_dependents();
  uint4* fragments = shared;
  float2* group_terms = reinterpret_cast<float2*>(fragments + size_t(groups) * 16 * B);
  stage_activations<Bits, B>(m, groups, fragments, group_terms);
  __syncthreads();
  float acc[2] = {};
  if (has_rows) tile_products<Bits, B>(current, codes, affine, width, begin, end, groups, fragments, group_terms, acc);
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
  const size_t shared = quant_shared_bytes(max_cols / kQuantGroup, B);
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
  const bool flat = matrix_rows && count <= kMaxFlatMatrices && plan.fixed_descriptors;
  int tiles[kMaxFlatMatrices] = {};
  for (int i = 0; flat && i < count; ++i) {
    if (matrix_rows[i] <= 0 || matrix_rows[i] > max_rows) return cudaErrorInvalidValue;
    tiles[i] = tiles_of(matrix_rows[i]);
  }
  const TileCounts counts = flat ? TileCounts{count, 0, tiles} : TileCounts{count, tiles_of(max_rows), nullptr};
  if (split.tiles == kChosenSplit.tiles) split = quant_split(counts, max_cols, batch);
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
// Dense (BF16, F32): each row is split among split.splits warps (16-byte weight loads, fp32 FMA), whose sums are
// added in warp order; a block holds split.tiles rows. One warp per row already runs at the copy bandwidth when there
// are enough rows.

__device__ inline float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

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
  wait_for_producers();  // its weight loads are interleaved with the activations'; only the launch comes early
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

GemvSplit quant_split(const TileCounts& tiles, int cols, int batch) {
  const int groups = cols / kQuantGroup, units = (groups + kUnroll - 1) / kUnroll;
  const size_t block_shared = quant_shared_bytes(groups, batch) + kStaticShared + kReservedShared;
  const int blocks_per_sm = int(std::max<size_t>(1, kSharedPerSm / block_shared));
  return choose_split(tiles, std::max(units, 1), kQuantWarpsPerSm, blocks_per_sm);
}

}  // namespace

GemvSplit gemv_quant_split(int rows, int cols, int count, int batch) {
  return quant_split(TileCounts{count, tiles_of(rows), nullptr}, cols, batch);
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
