// The hyper-connection read of a decode pass (1–4 rows, Q4 mixers) in two kernels, with the previous layer's write
// folded in (hyper_connection.cuh). The spec's read (qwen4_exp.md §4) is
//   x̂ = grouped RMS0(R; g),  u = silu(Wd x̂ / S),  a[d] = (1/S) Σ_c σ((Wu u)[c·H + d]) · x̂[c, d],  inject = Wi x̂.
// The RMS scale of stream c is one number per (row, stream), so Wd x̂ = Σ_c scale_c · Wd_c (R_c ⊙ (1 + g_c)): a block
// can multiply its columns' weights with the unnormalised values and let the scale in once the stream's sum of squares
// is known.
//
// hc_down_kernel: a thread-block cluster per (stream, tile set) whose blocks each take a slice of the stream's columns
// for every output row of Wd and Wi (a warp per 16-row tile). A block stages only its own slice (R + pending write,
// times 1 + g), so staging is small; the cluster adds the slices' sums of squares and products through distributed
// shared memory in rank order (deterministic) and writes the stream's scaled partial products.
// hc_up_kernel: a block per 16 hidden indices d, its warp c owning the tile of Wu's rows c·H + d (stream c's gates of
// those d): S·H/16 warps, each with its whole tile's loads in flight from its first statement. The block stages
// u = silu(Σ_c partials / S) and finishes the read in its epilogue: warp c applies the pending write to stream c's
// indices of the stack and normalises and gates them; the block sums the streams' terms through shared memory in
// stream order (deterministic) into the block input.
#include <cooperative_groups.h>

#include "cuda/device_math.cuh"
#include "cuda/hyper_connection.cuh"
#include "cuda/launch.cuh"
#include "cuda/quant_mma.cuh"

namespace vavilov::cuda {

namespace {

namespace cg = cooperative_groups;
using namespace qmma;

constexpr int kMaxStreams = 4;
constexpr int kMaxCluster = 8;    // portable cluster size: slices of one stream's columns
constexpr int kDownTiles = 4;     // tiles (warps) of one hc_down block: Flash-Next's 21 tiles in 6 sets, 192 blocks
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
  float* scratch;
  int streams, hidden, slice_groups, down_tiles, tiles, outputs, stride;  // stride: of the partials' rows
  float eps;
};

struct UpParams {
  GemvMatrix up;  // x and y unused
  float* stack;
  const float* norm;
  const float* pending_y;  // null: no pending write
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

// 16 consecutive floats from 16-byte aligned memory, as four independent loads.
__device__ inline void load16(const float* from, float (&to)[16]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(from) + i);
    to[4 * i] = v.x, to[4 * i + 1] = v.y, to[4 * i + 2] = v.z, to[4 * i + 3] = v.w;
  }
}

// A warp's weights for groups [0, groups) of its tile: the first two units are loaded before anything else, so that
// their latency overlaps the staging; tile_products loads any further ones itself.
struct TileLoads {
  WarpLoads first, second;
};
__device__ inline void load_tile(TileLoads& loads, const TileRows& rows, AffineWidth width, int groups, int t) {
  load_group_block<4>(loads.first, rows.codes, rows.affine, 0, min(groups, kUnroll), width, t);
  load_group_block<4>(loads.second, rows.codes, rows.affine, kUnroll, groups, width, t);
}
template <int B>
__device__ inline void tile_sum(TileLoads& loads, const TileRows& rows, AffineWidth width, int groups,
                                const uint4* fragments, const float2* group_terms, float (&acc)[2]) {
  tile_products<4, B>(loads.first, rows.codes, rows.affine, width, 0, min(groups, kUnroll), groups, fragments,
                      group_terms, acc);
  if (groups > kUnroll)
    tile_products<4, B>(loads.second, rows.codes, rows.affine, width, kUnroll, groups, groups, fragments, group_terms,
                        acc);
}

template <int B>
__global__ void __launch_bounds__(kDownTiles * 32) hc_down_kernel(DownParams p) {
  extern __shared__ uint4 shared[];
  __shared__ float partials[kDownTiles][64];  // [warp][r·32 + lane]: lane (g, t)'s sum for row g + 8r, batch t
  __shared__ float squares[B];
  const cg::cluster_group cluster = cg::this_cluster();
  const int rank = int(cluster.block_rank()), slices = int(cluster.num_blocks());
  const int s = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int h = p.hidden, sh = p.streams * h, groups = p.slice_groups;
  const int first_group = (s * h) / kQuantGroup + rank * groups, first_col = first_group * kQuantGroup;

  // This warp's tile: Wd's tiles, then Wi's (one tile of S rows).
  const int tile = blockIdx.z * kDownTiles + warp;
  const bool has_rows = tile < p.tiles;
  const bool is_inject = has_rows && tile >= p.down_tiles;
  const GemvMatrix m = is_inject ? p.inject : p.down;
  const TileRows rows = tile_rows(m, is_inject ? 0 : tile * kTileRows, first_group, g, t);
  const AffineWidth width = slice_affine_width(m, first_group, groups);
  TileLoads loads;
  load_tile(loads, rows, width, has_rows ? groups : 0, t);
  // Weights only before the wait (launch.cuh's rule): their loads are in flight while the kernel before finishes.
  wait_for_producers();
  allow_dependents();

  // The pending write's inject logits: loaded here, their gates computed where they are used, so that the staging's
  // loads go out without waiting for these.
  float logit[B];
#pragma unroll
  for (int b = 0; b < B; ++b) logit[b] = p.pending_inject ? p.pending_inject[b * p.streams + s] : 0.0f;
  const auto gate_of = [&](int b) {
    float chosen = 0.0f;
#pragma unroll
    for (int k = 0; k < B; ++k)
      if (k == b) chosen = logit[k];
    return p.pending_inject ? 2.0f * sigmoid(chosen / float(p.streams)) : 0.0f;
  };

  // The slice's activations R + pending write times 1 + g, and per item its sum of squares of R + pending write.
  uint4* fragments = shared;
  float2* group_terms = reinterpret_cast<float2*>(fragments + size_t(groups) * 16 * B);
  float* item_squares = reinterpret_cast<float*>(group_terms + size_t(groups) * B);  // [b][group][column]
  stage_computed_activations<4, B>(
      groups,
      [&](int b, int group, int column, float(&x)[16]) {
        const int col = first_col + group * kQuantGroup + 16 * column;
        float weight[16], out[16] = {};
        load16(p.stack + size_t(b) * sh + col, x);
        load16(p.norm + col, weight);
        if (p.pending_y) load16(p.pending_y + size_t(b) * h + (col - s * h), out);
        const float gate = gate_of(b);
        float sum = 0.0f;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const float v = fmaf(gate, out[i], x[i]);
          sum = fmaf(v, v, sum);
          x[i] = v * (1.0f + weight[i]);
        }
        item_squares[(b * groups + group) * 4 + column] = sum;
      },
      fragments, group_terms);
  __syncthreads();
  // Batch row b's sum of squares over the slice, by warp b: its lanes add strided items, then a fixed butterfly (a
  // few dependent steps instead of one per item).
  for (int b = warp; b < B; b += kDownTiles) {
    float sum = 0.0f;
    for (int i = lane; i < groups * 4; i += 32) sum += item_squares[b * groups * 4 + i];
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (lane == 0) squares[b] = sum;
  }
  float acc[2] = {};
  if (has_rows) tile_sum<B>(loads, rows, width, groups, fragments, group_terms, acc);
  partials[warp][lane] = acc[0];
  partials[warp][32 + lane] = acc[1];
  cluster.sync();

  // The stream's RMS scales, and the cluster's sums, each output added over the slices in rank order by one thread
  // of the cluster.
  float scale[B];
#pragma unroll
  for (int b = 0; b < B; ++b) {
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < kMaxCluster; ++k)
      if (k < slices) sum += cluster.map_shared_rank(squares, k)[b];
    scale[b] = rms_scale(sum, h, p.eps);
  }
  float* out = partials_of(p.scratch);
  const int outputs = kDownTiles * kTileRows * B;  // (warp, row in tile, batch row)
  for (int i = rank * int(blockDim.x) + threadIdx.x; i < outputs; i += slices * int(blockDim.x)) {
    const int b = i % B, row_in_tile = (i / B) % kTileRows, w = i / (B * kTileRows);
    const int at = blockIdx.z * kDownTiles + w;
    const int row = at < p.down_tiles ? at * kTileRows + row_in_tile : p.down.rows + row_in_tile;
    if (at >= p.tiles || (at < p.down_tiles ? row >= p.down.rows : row >= p.outputs)) continue;
    const int slot = w * 64 + (row_in_tile / 8) * 32 + (row_in_tile % 8) * 4 + b;
    float parts[kMaxCluster];
#pragma unroll
    for (int k = 0; k < kMaxCluster; ++k) parts[k] = k < slices ? cluster.map_shared_rank(&partials[0][0], k)[slot] : 0;
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < kMaxCluster; ++k) sum += parts[k];
    out[(size_t(s) * kMaxGemvRows + b) * p.stride + row] = sum * scale[b];
  }
  if (rank == 0 && blockIdx.z == 0)
#pragma unroll
    for (int b = 0; b < B; ++b)
      if (threadIdx.x == b) {
        scales_of(p.scratch)[b * kMaxStreams + s] = scale[b];
        gates_of(p.scratch)[b * kMaxStreams + s] = gate_of(b);
      }
  cluster.sync();  // no block leaves while another reads its shared memory
}

template <int B>
__global__ void __launch_bounds__(kMaxStreams * 32) hc_up_kernel(UpParams p) {
  // Weights only before the wait (launch.cuh's rule): their loads are in flight while the down kernel finishes.
  const int c = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int h = p.hidden, sh = p.streams * h, groups = p.rank / kQuantGroup;
  const int first = blockIdx.x * kTileRows;  // this block's hidden indices first..first + 15, warp c's stream c
  const AffineWidth width = slice_affine_width(p.up, 0, groups);
  const TileRows rows = tile_rows(p.up, c * h + first, 0, g, t);
  TileLoads loads;
  load_tile(loads, rows, width, groups, t);
  wait_for_producers();
  allow_dependents();
  extern __shared__ uint4 shared[];
  __shared__ UpTerms terms;

  // The epilogue's operands, loaded together with the staging's partials: lane (g, t) finishes indices first + g
  // and first + g + 8 of batch row t in stream c.
  const bool finishes = t < B;
  float stack[2] = {}, weight[2] = {}, y[2] = {}, gate = 0.0f, scale = 0.0f;
  if (finishes) {
    gate = gates_of(p.scratch)[t * kMaxStreams + c];
    scale = scales_of(p.scratch)[t * kMaxStreams + c];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      stack[r] = p.stack[size_t(t) * sh + size_t(c) * h + first + g + 8 * r];
      weight[r] = __ldg(p.norm + c * h + first + g + 8 * r);
      if (p.pending_y) y[r] = p.pending_y[size_t(t) * h + first + g + 8 * r];
    }
  }
  // u = silu(Σ_c partials / S), the streams' partial products added in stream order.
  const float* partials = partials_of(p.scratch);
  if (blockIdx.x == 0)
    for (int i = threadIdx.x; i < B * p.inject_rows; i += blockDim.x) {
      const int b = i / p.inject_rows, j = p.rank + i % p.inject_rows;
      float sum = 0.0f;
      for (int k = 0; k < p.streams; ++k) sum += partials[(size_t(k) * kMaxGemvRows + b) * p.stride + j];
      p.inject[i] = sum;
    }
  uint4* fragments = shared;
  float2* group_terms = reinterpret_cast<float2*>(fragments + size_t(groups) * 16 * B);
  stage_computed_activations<4, B>(
      groups,
      [&](int b, int group, int column, float(&x)[16]) {
        float part[kMaxStreams][16];
#pragma unroll
        for (int k = 0; k < kMaxStreams; ++k)
          if (k < p.streams)
            load16(partials + (size_t(k) * kMaxGemvRows + b) * p.stride + group * kQuantGroup + 16 * column, part[k]);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          float sum = 0.0f;
#pragma unroll
          for (int k = 0; k < kMaxStreams; ++k)
            if (k < p.streams) sum += part[k][i];
          x[i] = silu(sum / float(p.streams));
        }
      },
      fragments, group_terms);
  __syncthreads();
  float acc[2] = {};
  tile_sum<B>(loads, rows, width, groups, fragments, group_terms, acc);
  if (finishes)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float v = fmaf(gate, y[r], stack[r]);
      if (p.pending_y) p.stack[size_t(t) * sh + size_t(c) * h + first + g + 8 * r] = v;
      terms[c][t][g + 8 * r] = make_float2(sigmoid(acc[r]), v * scale * (1.0f + weight[r]));
    }
  __syncthreads();
  // The gated sum over the streams, in stream order, one thread per (batch row, index).
  for (int item = threadIdx.x; item < B * kTileRows; item += blockDim.x) {
    const int b = item / kTileRows, i = item % kTileRows;
    float sum = 0.0f;
    for (int k = 0; k < p.streams; ++k) sum = fmaf(terms[k][b][i].x, terms[k][b][i].y, sum);
    p.input[size_t(b) * h + first + i] = sum / float(p.streams);
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

// Slices of a stream's column groups: the most (up to a portable cluster) that divide them evenly.
int stream_slices(int hidden) {
  const int groups = hidden / kQuantGroup;
  for (int slices = kMaxCluster; slices > 1; --slices)
    if (groups % slices == 0) return slices;
  return 1;
}

// Partial products' rows start 16-byte aligned (hc_up_kernel reads them as float4).
int partial_stride(int outputs) { return (outputs + 3) / 4 * 4; }

// hc_down_kernel's dynamic shared memory: the staged slice and its items' sums of squares.
size_t down_shared_bytes(int slice_groups, int batch) {
  return quant_shared_bytes(slice_groups, batch) + size_t(batch) * slice_groups * 4 * sizeof(float);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <int B>
cudaError_t launch(const HcFusedRead& w, float* stack, bool pending, const float* y, float* inject, float* scratch,
                   float* input, cudaStream_t stream) {
  const bool has_inject = w.inject.data != nullptr;
  const int slices = stream_slices(w.hidden), down_tiles = (w.mix_down.rows + kTileRows - 1) / kTileRows;
  DownParams down{q4_matrix(w.mix_down),
                  has_inject ? q4_matrix(w.inject) : GemvMatrix{},
                  stack,
                  w.norm,
                  pending ? inject : nullptr,
                  pending ? y : nullptr,
                  scratch,
                  w.streams,
                  w.hidden,
                  w.hidden / kQuantGroup / slices,
                  down_tiles,
                  down_tiles + (has_inject ? 1 : 0),
                  w.mix_down.rows + (has_inject ? w.inject.rows : 0),
                  partial_stride(w.mix_down.rows + (has_inject ? w.inject.rows : 0)),
                  w.eps};
  const dim3 grid(unsigned(slices), unsigned(w.streams), unsigned((down.tiles + kDownTiles - 1) / kDownTiles));
  const cudaError_t error =
      launch_clustered(hc_down_kernel<B>, grid, dim3(kDownTiles * 32), down_shared_bytes(down.slice_groups, B), stream,
                       dim3(unsigned(slices), 1, 1), true, down);
  if (error != cudaSuccess) return error;

  const UpParams up{q4_matrix(w.mix_up),
                    stack,
                    w.norm,
                    pending ? y : nullptr,
                    scratch,
                    inject,
                    input,
                    w.streams,
                    w.hidden,
                    w.mix_up.cols,
                    down.stride,
                    has_inject ? w.inject.rows : 0};
  const size_t shared = quant_shared_bytes(w.mix_up.cols / kQuantGroup, B);
  launch_dependent(hc_up_kernel<B>, w.hidden / kTileRows, w.streams * 32, shared, stream, up);
  return cudaGetLastError();
}

}  // namespace

bool hc_fused_read_fits(const DeviceMatrix& mix_down, const DeviceMatrix& mix_up, const DeviceMatrix* inject,
                        const float* norm, int streams, int hidden, int rows) {
  const int rank = mix_down.rows;
  const bool shapes = streams >= 1 && streams <= kMaxStreams && hidden % kQuantGroup == 0 &&
                      mix_down.cols == streams * hidden && mix_up.rows == streams * hidden && mix_up.cols == rank &&
                      (!inject || (inject->cols == streams * hidden && inject->rows <= kTileRows));
  // Staged activations of one hc_up block (rank columns) and one hc_down block (a slice) must fit the default 48 KB.
  const bool fits = quant_shared_bytes(rank / kQuantGroup, kMaxGemvRows) + sizeof(UpTerms) <= 48 * 1024 &&
                    down_shared_bytes(hidden / kQuantGroup / stream_slices(hidden), kMaxGemvRows) <= 48 * 1024;
  return rows >= 1 && rows <= kMaxGemvRows && shapes && fits && aligned16(norm) && q4_readable(mix_down) &&
         q4_readable(mix_up) && (!inject || q4_readable(*inject));
}

size_t hc_fused_read_scratch_floats(int outputs) {
  return kScratchHead + size_t(kMaxStreams) * kMaxGemvRows * size_t(partial_stride(outputs));
}

cudaError_t hc_fused_read(const HcFusedRead& read, int rows, float* stack, bool pending, const float* y, float* inject,
                          float* scratch, float* input, cudaStream_t stream) {
  for (const void* p : {static_cast<const void*>(stack), static_cast<const void*>(y), static_cast<const void*>(scratch),
                        static_cast<const void*>(input), static_cast<const void*>(read.norm)})
    if (!aligned16(p)) return cudaErrorMisalignedAddress;
  switch (rows) {
    case 1:
      return launch<1>(read, stack, pending, y, inject, scratch, input, stream);
    case 2:
      return launch<2>(read, stack, pending, y, inject, scratch, input, stream);
    case 3:
      return launch<3>(read, stack, pending, y, inject, scratch, input, stream);
    case 4:
      return launch<4>(read, stack, pending, y, inject, scratch, input, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace vavilov::cuda
