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

// gate/up: block (64-row group of h, slot); warp w reads tile w / (2·slices) of the group, matrix w % 2 (gate, up),
// column slice w / 2 % slices. A block owns whole groups of h, so that its epilogue can write them as the down
// product's operands; the activations it stages serve all its warps. One row: two slices keep each warp's chain short,
// and Flash-Next's grid (10 groups × 11 slots) is one wave of blocks of 16 warps (≤ 128 registers: one a
// multiprocessor). More rows: one slice, so that two blocks of 8 warps share a multiprocessor and the grid of up to 41
// slots takes half as many waves (the blocks' chains overlap instead of running one after another).
constexpr int kGateUpTiles = kQuantGroup / kTileRows;
template <int B>
constexpr int kGateUpSlices = B == 1 ? 2 : 1;
template <int B>
constexpr int kGateUpWarps = kGateUpTiles * 2 * kGateUpSlices<B>;
// down: a cluster of kDownCluster blocks of kDownWarps warps shares one 16-row output tile; its kDownWorkers warps take
// the step's experts (and then the shared expert) in turn, each over all of the expert's columns (640 at Flash-Next).
// Flash-Next's 160 tiles × 4 blocks are one wave at 5 blocks a multiprocessor.
constexpr int kDownWarps = 3, kDownCluster = 4, kDownWorkers = kDownWarps * kDownCluster, kDownBlocksPerSm = 5;
// A warp keeps the loads of kUnitsInFlight units (kUnroll groups each) of its columns in flight: these kernels are
// short, and the chain of memory round trips (one a unit with tile_products' single unit of look-ahead), not the
// bandwidth, set their time. Flash-Next: down's 10 groups are one round trip, gate/up's 20 a slice two.
constexpr int kUnitsInFlight = 3;
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

// The loads of one warp's kUnitsInFlight units, unit k holding groups first + k·kUnroll, ... (zeros past the end).
struct LoadRing {
  WarpLoads unit[kUnitsInFlight];
};

__device__ inline void issue_loads(LoadRing& ring, const TileRows& rows, int first, int end, int t) {
#pragma unroll
  for (int k = 0; k < kUnitsInFlight; ++k)
    load_group_block<4>(ring.unit[k], rows.codes, rows.affine, first + k * kUnroll, end, rows.width, t);
}

// tile_products over groups [begin, end) whose first kUnitsInFlight units' loads `ring` holds: as soon as a unit is
// used, its registers take the loads of the unit kUnitsInFlight further on (the ring's index is a compile-time
// constant, so it stays in registers). The groups are summed in order: the same bits as tile_products.
template <int B>
__device__ inline void ring_products(LoadRing& ring, const TileRows& rows, int begin, int end, const uint4* fragments,
                                     const float2* group_terms, float (&acc)[2]) {
  const int t = int(threadIdx.x) % 4;
  for (int first = begin; first < end; first += kUnitsInFlight * kUnroll) {
#pragma unroll
    for (int k = 0; k < kUnitsInFlight; ++k) {
      const int from = first + k * kUnroll;
      if (from >= end) break;
      unit_products<4, B>(ring.unit[k], from, end, rows.groups, fragments, group_terms, acc);
      load_group_block<4>(ring.unit[k], rows.codes, rows.affine, from + kUnitsInFlight * kUnroll, end, rows.width, t);
    }
  }
}

// Where slot s's h lives as mma operands for B rows (the shared expert: s = selections).
template <int B>
__device__ inline uint4* h_fragments(const ExpertDecode& p, int s, int selections) {
  return s == selections ? p.shared_h_fragments : p.h_fragments + size_t(s) * B * size_t(p.inner) / 4;
}
template <int B>
__device__ inline float2* h_terms(const ExpertDecode& p, int s, int selections) {
  return s == selections ? p.shared_h_terms : p.h_terms + size_t(s) * B * size_t(p.inner / kQuantGroup);
}

// blockIdx.y: a slot (blocks of empty slots leave at once) or, at `selections`, the shared expert. The epilogue adds
// each tile's slices in order, applies SwiGLU, and stages the block's 64 rows of h (one group of the down product's
// columns) into that product's operands: the same bits as quant_mma.cuh's staging of h read back from memory.
template <int B>
__global__ void __launch_bounds__(kGateUpWarps<B> * 32, 16 / kGateUpWarps<B>)
    gate_up_kernel(ExpertDecode p, int selections) {
  constexpr int kSlices = kGateUpSlices<B>;
  wait_for_producers();
  allow_dependents();
  extern __shared__ uint4 staged[];
  __shared__ float partials[kGateUpWarps<B>][64];
  __shared__ float h[B][kQuantGroup];
  __shared__ float2 terms[B];
  const int slot = int(blockIdx.y), group = int(blockIdx.x);
  const bool shared_expert = slot == selections;
  const int inner = shared_expert ? p.shared_inner : p.inner;
  if (group * kQuantGroup >= inner) return;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, t = lane % 4;
  const int tile = warp / (2 * kSlices), slice = warp / 2 % kSlices;
  GemvMatrix m;  // one read of the slot's descriptor, then the weights
  if (shared_expert)
    m = gemv_matrix(warp % 2 ? p.shared_up : p.shared_gate, p.x, nullptr);
  else
    m = p.slot_matrices[3 * slot + warp % 2];
  if (m.rows == 0) return;  // a slot past the step's distinct experts (gate and up alike: the whole block)
  m.x = p.x;
  const TileRows rows = tile_rows(m, group * kQuantGroup + tile * kTileRows);
  const int begin = slice_start(slice, kSlices, rows.groups);
  const int end = slice_start(slice + 1, kSlices, rows.groups);

  LoadRing ring;  // issued before staging, so that the activations' latency overlaps theirs
  issue_loads(ring, rows, begin, end, t);
  float2* group_terms = reinterpret_cast<float2*>(staged + size_t(rows.groups) * 16 * B);
  stage_activations<4, B>(m, rows.groups, staged, group_terms);
  __syncthreads();
  float acc[2] = {};
  ring_products<B>(ring, rows, begin, end, staged, group_terms, acc);
  partials[warp][lane] = acc[0];
  partials[warp][32 + lane] = acc[1];
  __syncthreads();
  for (int i = int(threadIdx.x); i < kQuantGroup * B; i += int(blockDim.x)) {
    const int b = i % B, row = i / B, first = row / kTileRows * 2 * kSlices, at = tile_slot(row % kTileRows, b);
    float gate = 0.0f, up = 0.0f;
    for (int s = 0; s < kSlices; ++s) gate += partials[first + 2 * s][at], up += partials[first + 2 * s + 1][at];
    h[b][row] = silu(gate) * up;
  }
  __syncthreads();
  // This group's fragments sit where a staging of all of h's groups puts them; its terms go to [b, group].
  stage_computed_activations<4, B>(
      1,
      [&](int b, int, int lane_t, float(&x)[16]) {
#pragma unroll
        for (int i = 0; i < 16; ++i) x[i] = h[b][16 * lane_t + i];
      },
      h_fragments<B>(p, slot, selections) + size_t(group) * 16 * B, terms);
  __syncthreads();
  if (int(threadIdx.x) < B)
    h_terms<B>(p, slot, selections)[threadIdx.x * (inner / kQuantGroup) + group] = terms[threadIdx.x];
}

// Copies `count` uint4 from global to shared memory by lane `lane` of a warp, through L2 only (the previous kernel of
// the pass wrote them), without waiting: the copies are in flight together with the warp's weight loads.
__device__ inline void copy_to_shared(uint4* shared, const uint4* global, int count, int lane) {
  for (int i = lane; i < count; i += 32) {
    const unsigned address = unsigned(__cvta_generic_to_shared(shared + i));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(address), "l"(global + i) : "memory");
  }
}

__device__ inline void wait_shared_copies() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Block (16-row output tile, cluster rank). Worker q = rank·kDownWarps + warp sums slots q, q + kDownWorkers, ...
// (empty ones skipped; slot rows·top_k is the shared expert), each weighted per batch row; the block adds its warps'
// sums in warp order and the cluster's first block adds the blocks' in rank order. Each warp copies its own expert's
// h operands (written by gate_up_kernel) while its weight loads are in flight.
template <int B>
__global__ void __cluster_dims__(1, kDownCluster, 1) __launch_bounds__(kDownWarps * 32, kDownBlocksPerSm)
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
  const auto descriptor = [&](int s) {
    return s == selections ? gemv_matrix(p.shared_down, nullptr, nullptr) : p.slot_matrices[3 * s + 2];
  };
  const int first = int(cluster.block_rank()) * kDownWarps + warp;
  GemvMatrix next;
  if (first <= selections) next = descriptor(first);
  for (int s = first; s <= selections; s += kDownWorkers) {
    const bool shared_expert = s == selections;
    const GemvMatrix m = next;
    if (s + kDownWorkers <= selections) next = descriptor(s + kDownWorkers);  // read while this slot's work runs
    if (m.rows == 0) continue;                                                // a slot past the step's distinct experts
    const TileRows rows = tile_rows(m, first_row);
    LoadRing ring;
    issue_loads(ring, rows, 0, rows.groups, t);
    float weight = 0.0f;
    if (t < B) weight = shared_expert ? sigmoid(p.shared_scale[t]) : p.slot_weights[s * kMaxGemvRows + t];
    float2* group_terms = reinterpret_cast<float2*>(fragments + size_t(rows.groups) * 16 * B);
    copy_to_shared(fragments, h_fragments<B>(p, s, selections), rows.groups * 16 * B, lane);
    const float2* terms = h_terms<B>(p, s, selections);
    for (int i = lane; i < rows.groups * B; i += 32) group_terms[i] = __ldcg(terms + i);
    wait_shared_copies();
    __syncwarp();
    float acc[2] = {};
    ring_products<B>(ring, rows, 0, rows.groups, fragments, group_terms, acc);
    total[0] = fmaf(weight, acc[0], total[0]);
    total[1] = fmaf(weight, acc[1], total[1]);
    __syncwarp();  // the next expert's copies overwrite these fragments
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
  const int groups = std::max(p.inner, p.shared_inner) / kQuantGroup;
  launch_dependent(gate_up_kernel<B>, dim3(unsigned(groups), unsigned(selections + 1)), kGateUpWarps<B> * 32, shared,
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
