#include <cooperative_groups.h>

#include <algorithm>
#include <cstddef>
#include <type_traits>

#include "cuda/device_math.cuh"
#include "cuda/expert_decode.cuh"
#include "cuda/launch.cuh"
#include "cuda/quant_mma.cuh"
#include "cuda/route_keys.cuh"

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

// The expert of selection `slot` of a 1-row pass, picked as route_slots_kernel picks it: the same keys from
// probabilities of the same bits (the softmax's sum in route_slots_kernel's order: a warp sum over each run of 32
// experts, then those sums in order), hence the same top k in the same order. It reads the logits before the grid's
// wait, through L2 (launch.cuh's two-deep rule). Every thread of the block calls it.
constexpr int kRouteRuns = kSelfRoutedExperts / 32, kRunsPerWarp = kRouteRuns / kGateUpWarps;

__device__ int self_routed_expert(const ExpertDecode& p, int slot) {
  __shared__ float peaks[kGateUpWarps];
  __shared__ float run_sums[kRouteRuns];
  __shared__ unsigned long long lists[kGateUpWarps / 2][32];
  __shared__ int picked;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
  float value[kRunsPerWarp];
  float peak = -INFINITY;
#pragma unroll
  for (int c = 0; c < kRunsPerWarp; ++c) {
    const int e = (c * kGateUpWarps + warp) * 32 + lane;
    value[c] = e < p.experts ? __ldcg(p.logits + e) : -INFINITY;
    peak = fmaxf(peak, value[c]);
  }
  for (int offset = 16; offset > 0; offset >>= 1) peak = fmaxf(peak, __shfl_xor_sync(0xffffffffu, peak, offset));
  if (lane == 0) peaks[warp] = peak;
  __syncthreads();
  peak = peaks[0];
  for (int w = 1; w < kGateUpWarps; ++w) peak = fmaxf(peak, peaks[w]);
#pragma unroll
  for (int c = 0; c < kRunsPerWarp; ++c) {
    const int e = (c * kGateUpWarps + warp) * 32 + lane;
    value[c] = e < p.experts ? expf(value[c] - peak) : 0.0f;
    const float run = warp_sum(value[c]);
    if (lane == 0) run_sums[c * kGateUpWarps + warp] = run;
  }
  __syncthreads();
  float sum = run_sums[0];
  for (int r = 1; r < kRouteRuns; ++r) sum += run_sums[r];
  unsigned long long best = 0;
#pragma unroll
  for (int c = 0; c < kRunsPerWarp; ++c) {
    const int e = (c * kGateUpWarps + warp) * 32 + lane;
    const unsigned long long key = sort_warp(e < p.experts ? route_key(value[c] / sum, e) : 0ull);
    best = c == 0 ? key : merge_top(best, __shfl_sync(0xffffffffu, key, 31 - lane));
  }
  for (int half = kGateUpWarps / 2; half > 0; half /= 2) {
    if (warp >= half && warp < 2 * half) lists[warp - half][lane] = best;
    __syncthreads();
    if (warp < half) best = merge_top(best, lists[warp][31 - lane]);
    __syncthreads();  // the next level's writers wait for this level's readers
  }
  if (warp == 0 && lane == slot) picked = key_expert(best);
  __syncthreads();
  return picked;
}

// blockIdx.y: a slot (blocks of empty slots leave at once) or, at `selections`, the shared expert. Before the wait
// (launch.cuh's two-deep rule: route_slots_kernel, the kernel before, triggers only after its own wait, so what the
// kernels before it wrote is final when this grid starts) a block stages the input's activations (read through L2) and,
// where it knows its matrices, issues their first loads: the shared expert's (arguments), and in a 1-row pass the
// slot's expert, which the block picks itself (self_routed_expert). Other slots read their descriptor (route_slots'
// output) after the wait.
template <int B>
__global__ void __launch_bounds__(kGateUpWarps * 32) gate_up_kernel(ExpertDecode p, int selections) {
  extern __shared__ uint4 staged[];
  __shared__ float partials[kGateUpWarps][64];
  const int slot = int(blockIdx.y);
  const bool shared_expert = slot == selections, self_routed = B == 1 && p.logits != nullptr && !shared_expert;
  const int inner = shared_expert ? p.shared_inner : p.inner, first_row = int(blockIdx.x) * kTileRows;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, t = lane % 4, slice = warp / 2;
  const int groups = p.hidden / kQuantGroup;
  float2* group_terms = reinterpret_cast<float2*>(staged + size_t(groups) * 16 * B);
  GemvMatrix m;
  TileRows rows;
  int begin = 0, end = 0;
  WarpLoads current;
  const auto load_first_unit = [&] {
    rows = tile_rows(m, first_row);
    begin = slice_start(slice, kGateUpSlices, rows.groups);
    end = slice_start(slice + 1, kGateUpSlices, rows.groups);
    load_group_block<4>(current, rows.codes, rows.affine, begin, end, rows.width, t);
  };
  if (first_row < inner) {
    if (shared_expert)
      m = gemv_matrix(warp % 2 ? p.shared_up : p.shared_gate, p.x, nullptr);
    else if (self_routed)
      m = gemv_matrix((warp % 2 ? p.expert_up : p.expert_gate)[self_routed_expert(p, slot)], p.x, nullptr);
    if (shared_expert || self_routed) load_first_unit();
    const auto load_input = [&](int b, int group, int lane_t, float(&x)[16]) {
      const float4* source =
          reinterpret_cast<const float4*>(p.x + size_t(b) * size_t(p.hidden) + group * kQuantGroup + 16 * lane_t);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float4 v = __ldcg(source + i);
        x[4 * i] = v.x, x[4 * i + 1] = v.y, x[4 * i + 2] = v.z, x[4 * i + 3] = v.w;
      }
    };
    stage_computed_activations<4, B>(groups, load_input, staged, group_terms);
  }
  // The wait comes before the trigger and before every exit: down_kernel reads the slots (route_slots_kernel's) before
  // its own wait, which is legal only because this grid lets it start after route_slots_kernel has completed.
  wait_for_producers();
  allow_dependents();
  if (first_row >= inner) return;
  if (!shared_expert && !self_routed) {
    m = p.slot_matrices[3 * slot + warp % 2];  // one read of the slot's descriptor, then the weights
    if (m.rows == 0) return;  // a slot past the step's distinct experts (gate and up alike: the whole block)
    load_first_unit();
  }
  __syncthreads();  // the staged activations
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

// A down warp holds the first kDownHeldUnits units of its expert's tile in registers (8 of Flash-Next's 10 groups),
// loaded before the expert's activations are staged (for its first expert before the grid's wait); the rest of the
// tile streams after the staging. kDownBlocksPerSm bounds the registers (126–128, 4 bytes spilled) so that the grid
// (640 blocks at Flash-Next) fits one wave: unbounded, ptxas takes ~158 and 4 blocks a multiprocessor. Holding all 10
// groups (3 units: 72 bytes spilled at that bound) measured the same (H200, 12 layers).
constexpr int kDownHeldUnits = 2, kDownHeldGroups = kDownHeldUnits * kUnroll;
constexpr int kDownBlocksPerSm = 5;

// Slot s's down descriptor (codes, affine rows, shape; x set to the slot's h), or the shared expert's at s =
// selections. The slot descriptors come from route_slots_kernel, two launches back, and are read before
// down_kernel's wait: through L2 (ld.global.cg, launch.cuh's two-deep rule), never from a line L1 may hold or by a
// non-coherent load the compiler could move.
template <int B>
__device__ inline GemvMatrix down_matrix(const ExpertDecode& p, int s, int selections) {
  if (s == selections) return gemv_matrix(p.shared_down, p.shared_h, nullptr);
  const GemvMatrix* d = p.slot_matrices + 3 * s + 2;
  GemvMatrix m;
  m.codes = reinterpret_cast<const uint32_t*>(__ldcg(reinterpret_cast<const unsigned long long*>(&d->codes)));
  m.scales = reinterpret_cast<const __nv_bfloat16*>(__ldcg(reinterpret_cast<const unsigned long long*>(&d->scales)));
  m.biases = reinterpret_cast<const __nv_bfloat16*>(__ldcg(reinterpret_cast<const unsigned long long*>(&d->biases)));
  static_assert(offsetof(GemvMatrix, cols) == offsetof(GemvMatrix, rows) + sizeof(int), "rows and cols in one load");
  const int2 shape = __ldcg(reinterpret_cast<const int2*>(&d->rows));
  m.rows = shape.x;
  m.cols = shape.y;
  m.x = p.h + size_t(s) * B * size_t(p.inner);
  return m;
}

// One down warp's expert: its tile's rows, and the loads of the tile's first kDownHeldGroups groups.
struct DownTile {
  TileRows rows;
  WarpLoads held[kDownHeldUnits];
};

__device__ inline void load_down_tile(DownTile& tile, const GemvMatrix& m, int first_row) {
  const int t = int(threadIdx.x) % 4;
  tile.rows = tile_rows(m, first_row);
#pragma unroll
  for (int u = 0; u < kDownHeldUnits; ++u)
    load_group_block<4>(tile.held[u], tile.rows.codes, tile.rows.affine, u * kUnroll, tile.rows.groups, tile.rows.width,
                        t);
}

// The tile's products with m's activations (staged into this warp's `fragments`): acc as tile_products'.
template <int B>
__device__ inline void down_products(DownTile& tile, const GemvMatrix& m, uint4* fragments, float (&acc)[2]) {
  const TileRows& rows = tile.rows;
  float2* group_terms = reinterpret_cast<float2*>(fragments + size_t(rows.groups) * 16 * B);
  stage_activations_by<4, B>(m, rows.groups, fragments, group_terms, int(threadIdx.x) % 32, 32);
  __syncwarp();
#pragma unroll
  for (int u = 0; u < kDownHeldUnits; ++u)
    unit_products<4, B>(tile.held[u], u * kUnroll, rows.groups, rows.groups, fragments, group_terms, acc);
  if (rows.groups > kDownHeldGroups) {  // wider experts than Flash-Next's: the rest streams as in tile_products
    WarpLoads current;
    load_group_block<4>(current, rows.codes, rows.affine, kDownHeldGroups, rows.groups, rows.width,
                        int(threadIdx.x) % 4);
    tile_products<4, B>(current, rows.codes, rows.affine, rows.width, kDownHeldGroups, rows.groups, rows.groups,
                        fragments, group_terms, acc);
  }
}

// Block (16-row output tile, cluster rank). Worker q = rank·kDownWarps + warp sums slots q, q + kDownWorkers, ...
// (empty ones skipped; slot rows·top_k is the shared expert), each weighted per batch row; the block adds its warps'
// sums in warp order and the cluster's first block adds the blocks' in rank order. Each warp stages its own expert's h.
// A warp's first expert's descriptor and weights are loaded before the wait (gate_up_kernel triggers only after its
// own wait, so the slots are final when this grid starts at all), and only h is staged after it.
template <int B>
__global__ void __cluster_dims__(1, kDownCluster, 1) __launch_bounds__(kDownWarps * 32, kDownBlocksPerSm)
    down_kernel(ExpertDecode p, int warp_stage_words) {
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, t = lane % 4;
  const int first_row = int(blockIdx.x) * kTileRows, selections = B * p.top_k;
  cg::cluster_group cluster = cg::this_cluster();
  int s = int(cluster.block_rank()) * kDownWarps + warp;
  GemvMatrix m;
  DownTile tile;
  if (s <= selections) m = down_matrix<B>(p, s, selections);
  if (m.rows != 0) load_down_tile(tile, m, first_row);
  wait_for_producers();
  allow_dependents();
  extern __shared__ uint4 staged[];
  __shared__ float partials[kDownWarps][64];
  __shared__ float block_total[64];
  uint4* fragments = staged + size_t(warp) * size_t(warp_stage_words);
  float total[2] = {};
  while (s <= selections) {
    if (m.rows != 0) {  // else a slot past the step's distinct experts
      float acc[2] = {};
      down_products<B>(tile, m, fragments, acc);
      float weight = 0.0f;
      if (t < B) weight = s == selections ? sigmoid(p.shared_scale[t]) : p.slot_weights[s * kMaxGemvRows + t];
      total[0] = fmaf(weight, acc[0], total[0]);
      total[1] = fmaf(weight, acc[1], total[1]);
      __syncwarp();  // the next expert's staging overwrites these fragments
    }
    s += kDownWorkers;
    if (s > selections) break;
    m = down_matrix<B>(p, s, selections);
    if (m.rows != 0) load_down_tile(tile, m, first_row);
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
