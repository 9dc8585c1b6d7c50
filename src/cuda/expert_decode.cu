#include <cooperative_groups.h>

#include <algorithm>
#include <type_traits>

#include "cuda/device_math.cuh"
#include "cuda/expert_decode.cuh"
#include "cuda/launch.cuh"
#include "cuda/quant_mma.cuh"

namespace vavilov::cuda {

namespace {

using namespace qmma;
namespace cg = cooperative_groups;

// gate/up: block (16-row tile, slot); warp w reads matrix w % 2 (gate, up) over column slice w / 2. Two slices keep
// the grid (40 tiles × 11 slots at Flash-Next's one row) in one wave of small blocks with enough loads in flight.
constexpr int kGateUpSlices = 2;
constexpr int kGateUpWarps = 2 * kGateUpSlices;
// down: a cluster of kDownCluster blocks of kDownWarps warps shares one 16-row output tile; its kDownWorkers warps take
// the step's experts (and then the shared expert) in turn, each over all of the expert's columns (640 at Flash-Next).
constexpr int kDownWarps = 3, kDownCluster = 4, kDownWorkers = kDownWarps * kDownCluster;
// Dynamic shared memory a block may opt into (Hopper: 227 KB, less the static arrays and some room).
constexpr int kMaxDynamicShared = 200 * 1024;

// Where the mma leaves row `row_in_tile` of a tile for batch row b in a warp's [64] sums (lane (g, t) holds rows g and
// g + 8 for batch row t).
__device__ inline int tile_slot(int row_in_tile, int b) { return (row_in_tile / 8) * 32 + (row_in_tile % 8) * 4 + b; }

// What lane (g, t) reads of the 16-row Q4 tile that starts at first_row (rows past the end re-read the last one).
struct TileRows {
  const uint32_t* codes[2];
  const __nv_bfloat16* affine;
  AffineWidth width;
  int groups;
};

__device__ inline TileRows tile_rows(const GemvMatrix& m, int first_row) {
  const int lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
  TileRows r;
  r.groups = m.cols / kQuantGroup;
  const int row_words = m.cols / 8, row0 = min(first_row + g, m.rows - 1), row1 = min(row0 + 8, m.rows - 1);
  r.codes[0] = m.codes + size_t(row0) * row_words;
  r.codes[1] = m.codes + size_t(row1) * row_words;
  r.affine = (t & 2 ? m.biases : m.scales) + size_t(t & 1 ? row1 : row0) * r.groups;
  r.width = affine_width(m, r.groups);
  return r;
}

// blockIdx.y: a slot (blocks of empty slots leave at once) or, at `selections`, the shared expert.
template <int B>
__global__ void __launch_bounds__(kGateUpWarps * 32) gate_up_kernel(ExpertDecode p, int selections) {
  wait_for_producers();
  allow_dependents();
  extern __shared__ uint4 staged[];
  __shared__ float partials[kGateUpWarps][64];
  const int slot = int(blockIdx.y);
  const bool shared_expert = slot == selections;
  const int inner = shared_expert ? p.shared_inner : p.inner, first_row = int(blockIdx.x) * kTileRows;
  if (first_row >= inner) return;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, t = lane % 4, slice = warp / 2;
  GemvMatrix m;  // one read of the slot's descriptor, then the weights
  if (shared_expert)
    m = gemv_matrix(warp % 2 ? p.shared_up : p.shared_gate, p.x, nullptr);
  else
    m = p.slot_matrices[3 * slot + warp % 2];
  if (m.rows == 0) return;  // a slot past the step's distinct experts (gate and up alike: the whole block)
  m.x = p.x;
  const TileRows rows = tile_rows(m, first_row);
  const int begin = slice_start(slice, kGateUpSlices, rows.groups);
  const int end = slice_start(slice + 1, kGateUpSlices, rows.groups);

  WarpLoads current;  // issued before staging, so that the activations' latency overlaps theirs
  load_group_block<4>(current, rows.codes, rows.affine, begin, end, rows.width, t);
  float2* group_terms = reinterpret_cast<float2*>(staged + size_t(rows.groups) * 16 * B);
  stage_activations<4, B>(m, rows.groups, staged, group_terms);
  __syncthreads();
  float acc[2] = {};
  tile_products<4, B>(current, rows.codes, rows.affine, rows.width, begin, end, rows.groups, staged, group_terms, acc);
  partials[warp][lane] = acc[0];
  partials[warp][32 + lane] = acc[1];
  __syncthreads();
  float* out = shared_expert ? p.shared_h : p.h + size_t(slot) * B * size_t(p.inner);
  for (int i = int(threadIdx.x); i < kTileRows * B; i += int(blockDim.x)) {
    const int b = i % B, row_in_tile = i / B, row = first_row + row_in_tile, at = tile_slot(row_in_tile, b);
    if (row >= inner) continue;
    float gate = 0.0f, up = 0.0f;
    for (int s = 0; s < kGateUpSlices; ++s) gate += partials[2 * s][at], up += partials[2 * s + 1][at];
    out[size_t(b) * inner + row] = silu(gate) * up;
  }
}

// Block (16-row output tile, cluster rank). Worker q = rank·kDownWarps + warp sums slots q, q + kDownWorkers, ...
// (empty ones skipped; slot rows·top_k is the shared expert), each weighted per batch row; the block adds its warps'
// sums in warp order and the cluster's first block adds the blocks' in rank order. Each warp stages its own expert's h.
template <int B>
__global__ void __cluster_dims__(1, kDownCluster, 1) __launch_bounds__(kDownWarps * 32)
    down_kernel(ExpertDecode p, int warp_stage_words) {
  wait_for_producers();
  allow_dependents();
  extern __shared__ uint4 staged[];
  __shared__ float partials[kDownWarps][64];
  __shared__ float block_total[64];
  cg::cluster_group cluster = cg::this_cluster();
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, t = lane % 4;
  const int first_row = int(blockIdx.x) * kTileRows, selections = B * p.top_k;
  uint4* fragments = staged + size_t(warp) * size_t(warp_stage_words);
  float total[2] = {};
  for (int s = int(cluster.block_rank()) * kDownWarps + warp; s <= selections; s += kDownWorkers) {
    const bool shared_expert = s == selections;
    GemvMatrix m;
    if (shared_expert) {
      m = gemv_matrix(p.shared_down, p.shared_h, nullptr);
    } else {
      m = p.slot_matrices[3 * s + 2];
      if (m.rows == 0) continue;  // a slot past the step's distinct experts
      m.x = p.h + size_t(s) * B * size_t(p.inner);
    }
    const TileRows rows = tile_rows(m, first_row);
    WarpLoads current;
    load_group_block<4>(current, rows.codes, rows.affine, 0, rows.groups, rows.width, t);
    float2* group_terms = reinterpret_cast<float2*>(fragments + size_t(rows.groups) * 16 * B);
    stage_activations_by<4, B>(m, rows.groups, fragments, group_terms, lane, 32);
    __syncwarp();
    float acc[2] = {};
    tile_products<4, B>(current, rows.codes, rows.affine, rows.width, 0, rows.groups, rows.groups, fragments,
                        group_terms, acc);
    float weight = 0.0f;
    if (t < B) weight = shared_expert ? sigmoid(p.shared_scale[t]) : p.slot_weights[s * kMaxGemvRows + t];
    total[0] = fmaf(weight, acc[0], total[0]);
    total[1] = fmaf(weight, acc[1], total[1]);
    __syncwarp();  // the next expert's staging overwrites these fragments
  }
  partials[warp][lane] = total[0];
  partials[warp][32 + lane] = total[1];
  __syncthreads();
  for (int i = int(threadIdx.x); i < 64; i += int(blockDim.x)) {
    float sum = 0.0f;
    for (int w = 0; w < kDownWarps; ++w) sum += partials[w][i];
    block_total[i] = sum;
  }
  cluster.sync();
  if (cluster.block_rank() == 0) {
    for (int i = int(threadIdx.x); i < kTileRows * B; i += int(blockDim.x)) {
      const int b = i % B, row_in_tile = i / B, row = first_row + row_in_tile;
      if (row >= p.hidden) continue;
      float sum = 0.0f;
      for (unsigned r = 0; r < kDownCluster; ++r)
        sum += cluster.map_shared_rank(block_total, r)[tile_slot(row_in_tile, b)];
      p.y[size_t(b) * p.hidden + row] = sum;
    }
  }
  cluster.sync();  // no block leaves while the first still reads its block_total
}

template <int B>
cudaError_t launch_gate_up(const ExpertDecode& p, int selections, cudaStream_t stream) {
  const size_t shared = quant_shared_bytes(p.hidden / kQuantGroup, B);
  if (shared > size_t(kMaxDynamicShared)) return cudaErrorInvalidValue;
  // Once for all: only a permission, so it never changes between the launches of a captured graph.
  static const cudaError_t opted_in =
      cudaFuncSetAttribute(gate_up_kernel<B>, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxDynamicShared);
  if (opted_in != cudaSuccess) return opted_in;
  const int tiles = (std::max(p.inner, p.shared_inner) + kTileRows - 1) / kTileRows;
  launch_dependent(gate_up_kernel<B>, dim3(unsigned(tiles), unsigned(selections + 1)), kGateUpWarps * 32, shared,
                   stream, p, selections);
  return cudaGetLastError();
}

template <int B>
cudaError_t launch_down(const ExpertDecode& p, cudaStream_t stream) {
  const int groups = std::max(p.inner, p.shared_inner) / kQuantGroup;
  const int warp_stage_words = int((quant_shared_bytes(groups, B) + sizeof(uint4) - 1) / sizeof(uint4));
  const size_t shared = size_t(kDownWarps) * size_t(warp_stage_words) * sizeof(uint4);
  if (shared > size_t(kMaxDynamicShared)) return cudaErrorInvalidValue;
  static const cudaError_t opted_in =
      cudaFuncSetAttribute(down_kernel<B>, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxDynamicShared);
  if (opted_in != cudaSuccess) return opted_in;
  const int tiles = (p.hidden + kTileRows - 1) / kTileRows;
  launch_dependent(down_kernel<B>, dim3(unsigned(tiles), kDownCluster), kDownWarps * 32, shared, stream, p,
                   warp_stage_words);
  return cudaGetLastError();
}

}  // namespace

cudaError_t expert_gate_up(const ExpertDecode& p, int rows, int selections, cudaStream_t stream) {
  return with_batch(rows, [&](auto b) { return launch_gate_up<decltype(b)::value>(p, selections, stream); });
}

cudaError_t expert_down(const ExpertDecode& p, int rows, cudaStream_t stream) {
  return with_batch(rows, [&](auto b) { return launch_down<decltype(b)::value>(p, stream); });
}

}  // namespace vavilov::cuda
