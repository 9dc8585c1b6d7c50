#include <algorithm>
#include <cstdint>
#include <vector>

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

// The activations of rows [0, rows) of rows_in (row stride cols), groups [chunk, end), staged for the Staged rows that
// the pass's n-tiles read (zeros past `rows`: they add nothing and are never stored).
template <int Bits, int Staged>
__device__ __forceinline__ void stage_chunk(const float* rows_in, int cols, int rows, int chunk, int end,
                                            uint4* fragments, float2* group_terms) {
  stage_computed_activations<Bits, Staged>(
      end - chunk,
      [&](int b, int group, int lane_column, float(&v)[16]) {
        if (b >= rows) return;
        const float4* source = reinterpret_cast<const float4*>(rows_in + size_t(b) * size_t(cols) +
                                                               size_t(chunk + group) * kQuantGroup + 16 * lane_column);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float4 q = __ldg(source + i);
          v[4 * i] = q.x, v[4 * i + 1] = q.y, v[4 * i + 2] = q.z, v[4 * i + 3] = q.w;
        }
      },
      fragments, group_terms);
}

// Where a block's rows and matrix are: the grouped form reads them from the expert's entry, the dense form takes
// slice blockIdx.y (slice_rows rows each) of `rows` rows.
struct RowGroups {
  const DeviceMatrix* experts = nullptr;  // device array (grouped form), or null: `dense` for every slice
  DeviceMatrix dense;
  const int* counts = nullptr;  // grouped form: rows of each expert, and where they start
  const int* offsets = nullptr;
  int rows = 0;  // dense form: rows of x, and of a slice (≤ kRows)
  int slice_rows = kRows;
};

// Two resident blocks a multiprocessor (128 registers a thread, ≤ 64 bytes of spills); built for three (80
// registers, spilling more), the 8-layer Flash-Next prefill measured 17 % slower.
constexpr int kMinBlocks = 2;

template <int Bits>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks)
    quant_gemm_kernel(RowGroups groups_of_rows, int rows_out, int cols, const float* x, float* y) {
  allow_dependents();
  __shared__ uint4 fragments[kChunkGroups * 2 * 8 * kRows];
  __shared__ float2 group_terms[kRows * kChunkGroups];
  const int group = int(blockIdx.y);
  const bool grouped = groups_of_rows.experts != nullptr;
  const int offset = grouped ? groups_of_rows.offsets[group] : group * groups_of_rows.slice_rows;
  const int count =
      grouped ? groups_of_rows.counts[group] : min(groups_of_rows.slice_rows, groups_of_rows.rows - offset);
  if (count <= 0) return;
  const DeviceMatrix m = grouped ? groups_of_rows.experts[group] : groups_of_rows.dense;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
  const int groups = cols / kQuantGroup, row_words = cols / 32 * Bits;
  const int tile_row = int(blockIdx.x) * kBlockRows + warp * kTileRows;
  const bool has_rows = tile_row < rows_out;  // warps past the end still help staging
  // Rows past the end re-read the last row; their results are never stored.
  const int row0 = min(tile_row + g, rows_out - 1), row1 = min(row0 + 8, rows_out - 1);
  const uint32_t* weights = static_cast<const uint32_t*>(m.data);
  const auto* scales = reinterpret_cast<const __nv_bfloat16*>(m.scales);
  const auto* biases = reinterpret_cast<const __nv_bfloat16*>(m.biases);
  const GemvMatrix view{.scales = scales, .biases = biases};
  const WarpTile tile{{weights + size_t(row0) * row_words, weights + size_t(row1) * row_words},
                      (t & 2 ? biases : scales) + size_t(t & 1 ? row1 : row0) * groups,
                      affine_width(view, groups),
                      groups};

  for (int first_row = 0; first_row < count; first_row += kRows) {
    const int rows = min(kRows, count - first_row), tiles = (rows + 3) / 4;  // the same for the whole block
    const float* rows_in = x + size_t(offset + first_row) * size_t(cols);
    float acc[kRowTiles][2] = {};
    WarpLoads current;  // the first weights' loads go out before the activations are staged
    if (has_rows) load_group_block<Bits>(current, tile.codes, tile.affine, 0, groups, tile.width, t);
    for (int chunk = 0; chunk < groups; chunk += kChunkGroups) {
      const int end = min(chunk + kChunkGroups, groups);
      __syncthreads();  // the previous chunk's fragments are used up
      switch (tiles) {
        case 1:
          stage_chunk<Bits, 4>(rows_in, cols, rows, chunk, end, fragments, group_terms);
          break;
        case 2:
          stage_chunk<Bits, 8>(rows_in, cols, rows, chunk, end, fragments, group_terms);
          break;
        case 3:
          stage_chunk<Bits, 12>(rows_in, cols, rows, chunk, end, fragments, group_terms);
          break;
        default:
          stage_chunk<Bits, kRows>(rows_in, cols, rows, chunk, end, fragments, group_terms);
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
    if (!has_rows) continue;
    float* out = y + size_t(offset + first_row) * size_t(rows_out);
#pragma unroll
    for (int n = 0; n < kRowTiles; ++n) {
      const int b = 4 * n + t;
      if (b >= rows) continue;
      float* row_out = out + size_t(b) * size_t(rows_out);
      if (tile_row + g < rows_out) row_out[tile_row + g] = acc[n][0];
      if (tile_row + g + 8 < rows_out) row_out[tile_row + g + 8] = acc[n][1];
    }
  }
}

template <int Bits>
cudaError_t launch(const RowGroups& groups, int count, int rows_out, int cols, const float* x, float* y,
                   cudaStream_t stream) {
  const dim3 grid(unsigned((rows_out + kBlockRows - 1) / kBlockRows), unsigned(count));
  quant_gemm_kernel<Bits><<<grid, kWarps * 32, 0, stream>>>(groups, rows_out, cols, x, y);
  return cudaGetLastError();
}

cudaError_t launch_format(WeightFormat format, const RowGroups& groups, int count, int rows_out, int cols,
                          const float* x, float* y, cudaStream_t stream) {
  if (!quant_gemm_takes(format) || count <= 0 || count > 65535 || rows_out <= 0 || cols <= 0 || cols % kQuantGroup != 0)
    return cudaErrorInvalidValue;
  switch (format) {
    case WeightFormat::Q4:
      return launch<4>(groups, count, rows_out, cols, x, y, stream);
    case WeightFormat::Q3:
      return launch<3>(groups, count, rows_out, cols, x, y, stream);
    default:
      return launch<2>(groups, count, rows_out, cols, x, y, stream);
  }
}

// Dense slices of 16 rows, or of 8 or 4 where a matrix has so few row blocks that 16-row slices would leave resident
// block slots empty (mix_down: 320 rows, 3 row blocks × 32 slices of a 512-row chunk = 96 blocks for 132
// multiprocessors). A row's sums are the same in any slice; only the staging is repeated per slice.
int slice_rows_for(int row_blocks, int x_rows) {
  int device = 0, multiprocessors = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return kRows;
  int rows = kRows;
  while (rows > 4 && row_blocks * ((x_rows + rows - 1) / rows) < kMinBlocks * multiprocessors) rows /= 2;
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

cudaError_t quant_gemm(const DeviceMatrix& w, const float* x, int x_rows, float* y, cudaStream_t stream) {
  if (!quant_gemm_reads(w) || reinterpret_cast<uintptr_t>(x) % 16 != 0) return cudaErrorInvalidValue;
  if (x_rows <= 0) return cudaSuccess;
  RowGroups groups;
  groups.dense = w;
  groups.rows = x_rows;
  groups.slice_rows = slice_rows_for((w.rows + kBlockRows - 1) / kBlockRows, x_rows);
  return launch_format(w.format, groups, (x_rows + groups.slice_rows - 1) / groups.slice_rows, w.rows, w.cols, x, y,
                       stream);
}

cudaError_t quant_expert_gemm(const DeviceMatrix* experts, WeightFormat format, int experts_count, int rows_out,
                              int cols, const int* counts, const int* offsets, const float* x, float* y,
                              cudaStream_t stream) {
  RowGroups groups;
  groups.experts = experts;
  groups.counts = counts;
  groups.offsets = offsets;
  return launch_format(format, groups, experts_count, rows_out, cols, x, y, stream);
}

}  // namespace vavilov::cuda
