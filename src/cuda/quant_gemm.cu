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
// A row group is an expert's rows (grouped form) or a slice of kRows consecutive rows (dense form, so that a chunk's
// slices run side by side, all reading the matrix mostly from L2). The block takes its group's rows kRows at a time (a
// pass), and their activations kChunkGroups groups of 64 columns at a time (staged as mma B fragments by the whole
// block, quant_mma.cuh). A pass reads the block's weights once however many of its rows are used; a Flash-Next chunk
// of 512 tokens gives an expert ~10 rows, one pass.
constexpr int kWarps = 8;
constexpr int kRows = 16;                  // activation rows of a pass
constexpr int kRowTiles = kRows / 4;       // mma n-tiles: 4 rows (hi and lo halves) each
constexpr int kChunkGroups = 2 * kUnroll;  // groups staged at once
constexpr int kBlockRows = kWarps * kTileRows;
static_assert(kChunkGroups % kUnroll == 0, "chunks hold whole load units");

struct Pass {
  int rows;        // activation rows used, ≤ kRows
  int chunk, end;  // groups [chunk, end) staged
};

// acc[n][r] += the products of groups [pass.chunk, pass.end) of rows g + 8r of the warp's tile with activation row
// 4n + t (lane (g, t)). `current` holds the chunk's first unit of weights on entry and the next chunk's on return, so
// that those loads are in flight while the block stages the next chunk.
template <int Bits>
__device__ inline void chunk_products(WarpLoads& current, const uint32_t* const (&codes)[2],
                                      const __nv_bfloat16* affine, AffineWidth width, int groups, const Pass& pass,
                                      const uint4* fragments, const float2* group_terms, float (&acc)[kRowTiles][2]) {
  const int lane = threadIdx.x % 32, t = lane % 4, staged = pass.end - pass.chunk;
  for (int first = pass.chunk; first < pass.end; first += kUnroll) {
    WarpLoads next;
    load_group_block<Bits>(next, codes, affine, first + kUnroll, groups, width, t);
    uint32_t scale_bias[4];  // bf16 pairs of two groups: scale row g, scale row g + 8, bias g, bias g + 8
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int group = first + u, local = group - pass.chunk;
      if (group >= pass.end) break;
      if (u % 2 == 0)
#pragma unroll
        for (int i = 0; i < 4; ++i) scale_bias[i] = __shfl_sync(0xffffffffu, current.affine[u / 2], (lane & ~3) | i);
      const auto pick = [&](uint32_t pair) { return u % 2 ? bf16_high(pair) : bf16_low(pair); };
      const float scale0 = pick(scale_bias[0]), scale1 = pick(scale_bias[1]);
      const float bias0 = pick(scale_bias[2]), bias1 = pick(scale_bias[3]);
      uint32_t a0[8], a1[8];
      decode<Bits>(current.codes[u][0], t, a0);
      decode<Bits>(current.codes[u][1], t, a1);
#pragma unroll
      for (int n = 0; n < kRowTiles; ++n) {
        if (4 * n >= pass.rows) break;  // the same for the whole warp
        const uint4 b0 = fragments[(size_t(local) * 2) * 8 * kRows + 32 * n + lane];
        const uint4 b1 = fragments[(size_t(local) * 2 + 1) * 8 * kRows + 32 * n + lane];
        const float2 terms = group_terms[(4 * n + t) * staged + local];
        float c[4] = {};
        mma_f16(c, a0[0], a1[0], a0[1], a1[1], b0.x, b0.y);
        mma_f16(c, a0[2], a1[2], a0[3], a1[3], b0.z, b0.w);
        mma_f16(c, a0[4], a1[4], a0[5], a1[5], b1.x, b1.y);
        mma_f16(c, a0[6], a1[6], a0[7], a1[7], b1.z, b1.w);
        acc[n][0] = fmaf(c[0] + c[1], scale0 * terms.y, fmaf(bias0, terms.x, acc[n][0]));
        acc[n][1] = fmaf(c[2] + c[3], scale1 * terms.y, fmaf(bias1, terms.x, acc[n][1]));
      }
    }
    current = next;
  }
}

// Where a block's rows and matrix are: the grouped form reads them from the expert's entry, the dense form takes
// slice blockIdx.y of `rows` rows.
struct RowGroups {
  const DeviceMatrix* experts = nullptr;  // device array (grouped form), or null: `dense` for every slice
  DeviceMatrix dense;
  const int* counts = nullptr;  // grouped form: rows of each expert, and where they start
  const int* offsets = nullptr;
  int rows = 0;  // dense form: rows of x
};

// Two resident blocks a multiprocessor (~120 registers a thread, no spills); built for three (80 registers, spilling),
// the 8-layer Flash-Next prefill measured 17 % slower.
constexpr int kMinBlocks = 2;

template <int Bits>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks)
    quant_gemm_kernel(RowGroups groups_of_rows, int rows_out, int cols, const float* x, float* y) {
  allow_dependents();
  __shared__ uint4 fragments[kChunkGroups * 2 * 8 * kRows];
  __shared__ float2 group_terms[kRows * kChunkGroups];
  const int group = int(blockIdx.y);
  const bool grouped = groups_of_rows.experts != nullptr;
  const int offset = grouped ? groups_of_rows.offsets[group] : group * kRows;
  const int count = grouped ? groups_of_rows.counts[group] : min(kRows, groups_of_rows.rows - offset);
  if (count <= 0) return;
  const float* rows_in = x + size_t(offset) * size_t(cols);
  float* rows_out_at = y + size_t(offset) * size_t(rows_out);
  const DeviceMatrix m = grouped ? groups_of_rows.experts[group] : groups_of_rows.dense;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
  const int groups = cols / kQuantGroup, row_words = cols / 32 * Bits;
  const int tile_row = int(blockIdx.x) * kBlockRows + warp * kTileRows;
  const bool has_rows = tile_row < rows_out;  // warps past the end still help staging
  // Rows past the end re-read the last row; their results are never stored.
  const int row0 = min(tile_row + g, rows_out - 1), row1 = min(row0 + 8, rows_out - 1);
  const uint32_t* weights = static_cast<const uint32_t*>(m.data);
  const uint32_t* const codes[2] = {weights + size_t(row0) * row_words, weights + size_t(row1) * row_words};
  const auto* scales = reinterpret_cast<const __nv_bfloat16*>(m.scales);
  const auto* biases = reinterpret_cast<const __nv_bfloat16*>(m.biases);
  const __nv_bfloat16* affine = (t & 2 ? biases : scales) + size_t(t & 1 ? row1 : row0) * groups;
  const GemvMatrix view{.scales = scales, .biases = biases};
  const AffineWidth width = affine_width(view, groups);

  for (int first_row = 0; first_row < count; first_row += kRows) {
    Pass pass{min(kRows, count - first_row), 0, 0};
    float acc[kRowTiles][2] = {};
    WarpLoads current;  // the first weights' loads go out before the activations are staged
    if (has_rows) load_group_block<Bits>(current, codes, affine, 0, groups, width, t);
    for (pass.chunk = 0; pass.chunk < groups; pass.chunk += kChunkGroups) {
      pass.end = min(pass.chunk + kChunkGroups, groups);
      __syncthreads();  // the previous chunk's fragments are used up
      stage_computed_activations<Bits, kRows>(
          pass.end - pass.chunk,
          [&](int b, int group, int lane_column, float(&v)[16]) {
            if (b >= pass.rows) return;  // zeros: they add nothing and are never stored
            const float4* source =
                reinterpret_cast<const float4*>(rows_in + size_t(first_row + b) * size_t(cols) +
                                                size_t(pass.chunk + group) * kQuantGroup + 16 * lane_column);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const float4 q = __ldg(source + i);
              v[4 * i] = q.x, v[4 * i + 1] = q.y, v[4 * i + 2] = q.z, v[4 * i + 3] = q.w;
            }
          },
          fragments, group_terms);
      __syncthreads();
      if (has_rows) chunk_products<Bits>(current, codes, affine, width, groups, pass, fragments, group_terms, acc);
    }
    if (!has_rows) continue;
#pragma unroll
    for (int n = 0; n < kRowTiles; ++n) {
      const int b = 4 * n + t;
      if (b >= pass.rows) continue;
      float* out = rows_out_at + size_t(first_row + b) * size_t(rows_out);
      if (tile_row + g < rows_out) out[tile_row + g] = acc[n][0];
      if (tile_row + g + 8 < rows_out) out[tile_row + g + 8] = acc[n][1];
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
  return launch_format(w.format, groups, (x_rows + kRows - 1) / kRows, w.rows, w.cols, x, y, stream);
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
