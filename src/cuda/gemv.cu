#include <cuda_fp16.h>

#include <algorithm>
#include <numeric>
#include <type_traits>

#include "cuda/device_math.cuh"
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
  if (!m.x_up) return stage_activations<Bits, B>(m, groups, fragments, group_terms);
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
  stage_computed_activations<Bits, B>(groups, swiglu, fragments, group_terms);
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
  stage_matrix_activations<Bits, B>(m, groups, fragments, group_terms);
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
  const bool flat = matrix_rows && count <= kMaxFlatMatrices && plan.descriptors == GemvDescriptors::fixed;
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
// Expert launches (gemv_q4_experts): descriptors written in the pass, and often more tiles than one wave of warps (a
// 4-row verify step's ~39 distinct experts: ~3120 gate/up tiles and ~6240 down tiles against 2112 resident warps),
// which quant_split would cut into several waves of short blocks, each paying a block launch, the activation staging
// after its wait, the partial-sum exchange and a tail. Here one wave of blocks of kFlatWarps warps, kFlatBlocksPerSm a
// multiprocessor, shares the launch's tiles out evenly: every block reads all descriptors into shared memory and
// numbers the tiles of those that have rows (the routing's empty slots, rows = 0, have none), and warp w of W takes
// the consecutive tiles [w·T/W, (w+1)·T/W), whole rows each: every output is one warp's sum over its groups in order,
// the bits of gemv_q4 with one slice. A warp streams its tiles' units of kUnroll groups without a break between
// tiles, kFlatDepth units of loads in flight while it sums the one before. The activations are staged once per block
// when every matrix reads the same (settled_x), else per descriptor of the block's tiles, kFlatRegions at a time.
// (Session 6–8's kernel here gave each block `rounds` runs of 8 tiles of one descriptor in a (blocks, descriptors)
// grid: its multiprocessors held 16 to 32 gate/up tiles at 4 rows, the busiest deciding, and each tile's first unit
// of loads waited alone: docs/CUDA.md.)

// Tuning knob (set with -D in a variant build): units of loads a warp keeps in flight beyond the one it sums.
#ifndef VAVILOV_EXPERT_DEPTH
#define VAVILOV_EXPERT_DEPTH 2
#endif
constexpr int kFlatDepth = VAVILOV_EXPERT_DEPTH;
// And how a warp's ring of loads turns: 1 = its slots by constant indices in a loop unrolled kFlatDepth + 1 times (no
// register copies, kFlatDepth + 1 copies of the unit's code), 0 = one copy of the code, the slots shifted down by
// register copies after each unit (as tile_products' current = next).
#ifndef VAVILOV_EXPERT_UNROLLED_RING
#define VAVILOV_EXPERT_UNROLLED_RING 1
#endif
constexpr bool kFlatUnrolledRing = VAVILOV_EXPERT_UNROLLED_RING != 0;
static_assert(kFlatDepth >= 1 && kFlatDepth <= 3);
constexpr int kFlatWarps = 8;        // warps of a block
constexpr int kFlatBlocksPerSm = 2;  // blocks a multiprocessor: 16 warps at up to 128 registers
constexpr int kFlatRegions = 4;      // descriptors whose activations a block stages at once (when not settled)

// What a gemv_quant_flat_kernel launch reads: `count` descriptors (GemvDescriptors says whether before its wait),
// staged activations in `regions` regions of region_bytes (the widest matrix's, `groups` groups), and settled_x when
// every matrix reads those activations ([batch, groups·64]) and they were written two launches back or earlier
// (launch.cuh's two-deep rule: the MoE block's input, for gate/up): then the block stages them before the wait, while
// the routing still runs. Shared memory: the regions, then the descriptors, then tile_end (plan_tiles).
struct FlatLaunch {
  int count = 0, groups = 0, regions = 1, region_bytes = 0;
  GemvDescriptors descriptors = GemvDescriptors::written_in_pass;
  const float* settled_x = nullptr;
};

size_t flat_shared_bytes(const FlatLaunch& launch) {
  return size_t(launch.regions) * size_t(launch.region_bytes) +
         size_t(launch.count) * (sizeof(GemvMatrix) + sizeof(int));
}

// settled_x's activations into region 0, staged by the whole block before the wait: read through L2 (__ldcg), the
// same fp32 values as stage_activations.
template <int Bits, int B>
__device__ void stage_settled_activations(const FlatLaunch& launch, uint4* fragments) {
  const int groups = launch.groups, cols = groups * kQuantGroup;
  float2* group_terms = reinterpret_cast<float2*>(fragments + size_t(groups) * 16 * B);
  const auto load = [&](int b, int group, int t, float(&x)[16]) {
    const float4* source =
        reinterpret_cast<const float4*>(launch.settled_x + size_t(b) * cols + group * kQuantGroup + 16 * t);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 v = __ldcg(source + i);
      x[4 * i] = v.x, x[4 * i + 1] = v.y, x[4 * i + 2] = v.z, x[4 * i + 3] = v.w;
    }
  };
  stage_computed_activations<Bits, B>(groups, load, fragments, group_terms);
}

// Every descriptor into shared memory (through L2 when written two launches back) and tile_end[d] = the tiles (16
// rows) of descriptors 0..d, numbered by warp 0 32 at a time; returns their total.
__device__ int plan_tiles(const GemvMatrix* matrices, const FlatLaunch& launch, GemvMatrix* descriptors,
                          int* tile_end) {
  for (int d = int(threadIdx.x); d < launch.count; d += int(blockDim.x))
    descriptors[d] =
        launch.descriptors == GemvDescriptors::written_two_back ? load_descriptor_from_l2(matrices + d) : matrices[d];
  __syncthreads();
  if (threadIdx.x < 32) {
    const int lane = int(threadIdx.x);
    int carry = 0;
    for (int base = 0; base < launch.count; base += 32) {
      const int d = base + lane;
      int tiles = d < launch.count ? (descriptors[d].rows + kTileRows - 1) / kTileRows : 0;
#pragma unroll
      for (int offset = 1; offset < 32; offset <<= 1) {
        const int before = __shfl_up_sync(0xffffffffu, tiles, offset);
        if (lane >= offset) tiles += before;
      }
      if (d < launch.count) tile_end[d] = carry + tiles;
      carry += __shfl_sync(0xffffffffu, tiles, 31);
    }
  }
  __syncthreads();
  return tile_end[launch.count - 1];
}

// The descriptor that holds tile `tile` (below the total): the number of descriptors whose tiles end at or before it.
// The whole warp calls it.
__device__ inline int descriptor_of(int tile, const int* tile_end, int count) {
  int d = 0;
  for (int base = 0; base < count; base += 32) {
    const int i = base + int(threadIdx.x % 32);
    d += __popc(__ballot_sync(0xffffffffu, i < count && tile_end[i] <= tile));
  }
  return d;
}

__device__ inline int first_tile_of(int d, const int* tile_end) { return d > 0 ? tile_end[d - 1] : 0; }

// The code rows and the scale/bias row that lane (g, t) reads for the tile at warp_row; rows past the end re-read the
// last row (their results are never stored).
struct TileRows {
  const uint32_t* codes[2];
  const __nv_bfloat16* affine;
};

template <int Bits>
__device__ inline TileRows tile_rows(const GemvMatrix& m, int warp_row, int groups) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, row_words = m.cols / 32 * Bits;
  const int row0 = min(warp_row + g, m.rows - 1), row1 = min(row0 + 8, m.rows - 1);
  return {{m.codes + size_t(row0) * row_words, m.codes + size_t(row1) * row_words},
          (t & 2 ? m.biases : m.scales) + size_t(t & 1 ? row1 : row0) * groups};
}

// Where a warp's loads stand: the next unit to load (tile, first group) of its tiles up to `end`, and that tile's rows.
struct UnitLoads {
  int tile = 0, end = 0, descriptor = 0, group = 0, groups = 0;
  TileRows rows;
  AffineWidth width = AffineWidth::k8;
};

template <int Bits>
__device__ inline void loads_at_tile(UnitLoads& c, const GemvMatrix* descriptors, const int* tile_end) {
  while (tile_end[c.descriptor] <= c.tile) ++c.descriptor;
  const GemvMatrix& m = descriptors[c.descriptor];
  c.groups = m.cols / kQuantGroup;
  c.rows = tile_rows<Bits>(m, (c.tile - first_tile_of(c.descriptor, tile_end)) * kTileRows, c.groups);
  c.width = affine_width(m, c.groups);
  c.group = 0;
}

// The next unit's loads into `loads` (nothing past the warp's last tile), and the cursor past it.
template <int Bits>
__device__ inline void issue_unit(WarpLoads& loads, UnitLoads& c, const GemvMatrix* descriptors, const int* tile_end) {
  if (c.tile >= c.end) return;
  load_group_block<Bits>(loads, c.rows.codes, c.rows.affine, c.group, c.groups, c.width, int(threadIdx.x % 4));
  c.group += kUnroll;
  if (c.group < c.groups) return;
  if (++c.tile < c.end) loads_at_tile<Bits>(c, descriptors, tile_end);
}

// Where a warp's sums stand: the next unit to sum, its tile's output rows and staged activations, the running sums.
struct UnitSums {
  int tile = 0, end = 0, descriptor = 0, group = 0, groups = 0, row = 0, rows = 0;
  float* y = nullptr;
  const uint4* b_lane = nullptr;
  const float2* terms_row = nullptr;
  float acc[2] = {};
};

// The staged activations of descriptor d: region 0 when settled (region_first < 0), else region d − region_first.
struct Regions {
  const char* base;
  int bytes, first;
};

template <int B>
__device__ inline void sums_at_tile(UnitSums& s, const GemvMatrix* descriptors, const int* tile_end,
                                    const Regions& regions) {
  while (tile_end[s.descriptor] <= s.tile) ++s.descriptor;
  const GemvMatrix& m = descriptors[s.descriptor];
  s.groups = m.cols / kQuantGroup;
  s.rows = m.rows;
  s.y = m.y;
  s.row = (s.tile - first_tile_of(s.descriptor, tile_end)) * kTileRows;
  const int region = regions.first < 0 ? 0 : s.descriptor - regions.first;
  const uint4* fragments = reinterpret_cast<const uint4*>(regions.base + size_t(region) * regions.bytes);
  s.b_lane = lane_fragments<B>(fragments);
  s.terms_row = lane_terms<B>(reinterpret_cast<const float2*>(fragments + size_t(s.groups) * 16 * B), s.groups);
  s.group = 0;
}

// Sums the unit in `loads`; at its tile's last unit, stores the tile's outputs (lane (g, t): rows g and g + 8, batch
// row t < B) and moves to the next tile.
template <int Bits, int B>
__device__ inline void sum_unit(const WarpLoads& loads, UnitSums& s, const GemvMatrix* descriptors, const int* tile_end,
                                const Regions& regions) {
  unit_products<Bits, B>(loads, s.group, s.groups, s.b_lane, s.terms_row, s.acc);
  s.group += kUnroll;
  if (s.group < s.groups) return;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  if (t < B) {
    if (s.row + g < s.rows) s.y[size_t(t) * s.rows + s.row + g] = s.acc[0];
    if (s.row + g + 8 < s.rows) s.y[size_t(t) * s.rows + s.row + g + 8] = s.acc[1];
  }
  s.acc[0] = s.acc[1] = 0.0f;
  if (++s.tile < s.end) sums_at_tile<B>(s, descriptors, tile_end, regions);
}

// Block: the settled activations first (before the wait), then the plan (before the wait when the descriptors allow
// it) and each warp's first kFlatDepth units of loads, then, pass by pass over the block's descriptors, the staging of
// the activations that are not settled and the warps' streams of units.
template <int Bits, int B>
__global__ void __launch_bounds__(kFlatWarps * 32, kFlatBlocksPerSm)
    gemv_quant_flat_kernel(const GemvMatrix* matrices, FlatLaunch launch) {
  extern __shared__ uint4 shared[];
  char* const region_base = reinterpret_cast<char*>(shared);
  GemvMatrix* const descriptors =
      reinterpret_cast<GemvMatrix*>(region_base + size_t(launch.regions) * size_t(launch.region_bytes));
  int* const tile_end = reinterpret_cast<int*>(descriptors + launch.count);
  const bool settled = launch.settled_x != nullptr;
  if (settled) stage_settled_activations<Bits, B>(launch, shared);
  const bool early = launch.descriptors != GemvDescriptors::written_in_pass;
  if (!early) wait_for_producers(), allow_dependents();
  const int total = plan_tiles(matrices, launch, descriptors, tile_end);

  // Warp w of W: tiles [w·T/W, (w+1)·T/W); the block's are its warps' together.
  const int warp = int(threadIdx.x) / 32;
  const int64_t warps = int64_t(gridDim.x) * kFlatWarps, block_warp = int64_t(blockIdx.x) * kFlatWarps;
  const auto share = [&](int64_t w) { return int(w * total / warps); };
  const int block_first = share(block_warp), block_end = share(block_warp + kFlatWarps);
  const int warp_first = share(block_warp + warp), warp_end = share(block_warp + warp + 1);
  const int first_descriptor = block_first < block_end ? descriptor_of(block_first, tile_end, launch.count) : 0;
  const int last_descriptor = block_first < block_end ? descriptor_of(block_end - 1, tile_end, launch.count) : -1;
  const int per_pass = settled ? launch.count : launch.regions;
  // The warp's tiles among the descriptors [d, d + per_pass).
  const auto pass_end = [&](int d) { return min(warp_end, tile_end[min(d + per_pass, last_descriptor + 1) - 1]); };
  const auto pass_first = [&](int d) { return max(warp_first, first_tile_of(d, tile_end)); };

  WarpLoads ring[kFlatDepth + 1];
  UnitLoads loads;
  const auto start_loads = [&](int d) {
    loads.tile = pass_first(d), loads.end = pass_end(d), loads.descriptor = d;
    if (loads.tile < loads.end) loads_at_tile<Bits>(loads, descriptors, tile_end);
#pragma unroll
    for (int i = 0; i < kFlatDepth; ++i) issue_unit<Bits>(ring[i], loads, descriptors, tile_end);
  };
  if (first_descriptor <= last_descriptor) start_loads(first_descriptor);
  if (early) wait_for_producers(), allow_dependents();

  for (int d = first_descriptor; d <= last_descriptor; d += per_pass) {
    if (d != first_descriptor) start_loads(d);
    const Regions regions{region_base, launch.region_bytes, settled ? -1 : d};
    if (!settled) {
      for (int r = d; r < min(d + per_pass, last_descriptor + 1); ++r) {
        const GemvMatrix& m = descriptors[r];
        if (m.rows <= 0) continue;
        const int groups = m.cols / kQuantGroup;
        uint4* fragments = reinterpret_cast<uint4*>(region_base + size_t(r - d) * launch.region_bytes);
        stage_matrix_activations<Bits, B>(m, groups, fragments,
                                          reinterpret_cast<float2*>(fragments + size_t(groups) * 16 * B));
      }
    }
    __syncthreads();
    UnitSums sums;
    sums.tile = pass_first(d), sums.end = pass_end(d), sums.descriptor = d;
    if (sums.tile < sums.end) sums_at_tile<B>(sums, descriptors, tile_end, regions);
    if constexpr (kFlatUnrolledRing) {
      // The ring's slots by constant indices (registers): slot s is summed while slot s + kFlatDepth is loaded.
      while (sums.tile < sums.end) {
#pragma unroll
        for (int s = 0; s <= kFlatDepth; ++s) {
          if (sums.tile >= sums.end) break;
          issue_unit<Bits>(ring[(s + kFlatDepth) % (kFlatDepth + 1)], loads, descriptors, tile_end);
          sum_unit<Bits, B>(ring[s], sums, descriptors, tile_end, regions);
        }
      }
    } else {
      // Slot 0 is summed while slot kFlatDepth is loaded; then the slots move down one.
#pragma unroll 1
      while (sums.tile < sums.end) {
        issue_unit<Bits>(ring[kFlatDepth], loads, descriptors, tile_end);
        sum_unit<Bits, B>(ring[0], sums, descriptors, tile_end, regions);
#pragma unroll
        for (int i = 0; i < kFlatDepth; ++i) ring[i] = ring[i + 1];
      }
    }
    if (d + per_pass <= last_descriptor) __syncthreads();  // the next pass restages the regions
  }
}

template <int Bits, int B>
cudaError_t launch_flat(const GemvMatrix* matrices, FlatLaunch launch, cudaStream_t stream) {
  launch.region_bytes = int((quant_shared_bytes(launch.groups, B) + 15) / 16 * 16);
  while (launch.regions > 1 && flat_shared_bytes(launch) > kMaxDynamicShared) --launch.regions;
  const size_t shared = flat_shared_bytes(launch);
  if (shared > kMaxDynamicShared) return cudaErrorInvalidValue;
  static const cudaError_t opted_in = cudaFuncSetAttribute(
      gemv_quant_flat_kernel<Bits, B>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kMaxDynamicShared));
  if (opted_in != cudaSuccess) return opted_in;
  const int blocks_per_sm = std::max(1, std::min(kFlatBlocksPerSm, int(kSharedPerSm / (shared + kReservedShared))));
  return launch_dependent(gemv_quant_flat_kernel<Bits, B>, dim3(unsigned(kSms * blocks_per_sm)), dim3(kFlatWarps * 32),
                          shared, stream, matrices, launch);
}

// Whether an expert launch takes gemv_quant_flat_kernel: when its tiles do not fit one wave of warps.
bool experts_flat(int count, int tiles_per_matrix) {
  return int64_t(count) * tiles_per_matrix > int64_t(kSms) * kQuantWarpsPerSm;
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

bool gemv_experts_flat(int count, int max_rows) { return experts_flat(count, tiles_of(max_rows)); }

cudaError_t gemv_q4_experts(const GemvMatrix* matrices, int count, int max_rows, int max_cols, int batch,
                            cudaStream_t stream, GemvDescriptors descriptors, const float* settled_x) {
  if (count <= 0 || max_rows <= 0 || max_cols <= 0 || max_cols % kQuantGroup != 0) return cudaErrorInvalidValue;
  if (!experts_flat(count, tiles_of(max_rows)))
    return gemv_q4(matrices, count, max_rows, max_cols, batch, stream, descriptors);
  FlatLaunch launch;
  launch.count = count, launch.groups = max_cols / kQuantGroup, launch.descriptors = descriptors;
  launch.regions = settled_x ? 1 : kFlatRegions, launch.settled_x = settled_x;
  return with_batch(batch, [&](auto b) { return launch_flat<4, decltype(b)::value>(matrices, launch, stream); });
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
