#include <cooperative_groups.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
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

// Both kernels copy each warp's weights into shared memory with cp.async before reading any: a warp's whole share is
// then one memory latency away instead of one per unit of register loads (five in turn for a gate/up warp), and the
// copies hold no registers. Per warp the 16 rows of its tile over its groups [begin, begin + count): codes as 16-byte
// chunks (row r's chunk c at r·2·count + swizzled(r, c)), then scales and biases as bf16 [2][16][count].
struct StagedLayout {
  int activation_words = 0;  // uint4s of the activations' fragments (gate/up: the block's; down: each warp's)
  int code_words = 0;        // uint4s of one warp's codes
  int warp_words = 0;        // uint4s of one warp's region
};

// The tile's 16 rows × count groups (max_count at most) after `activation_bytes` of activations.
StagedLayout staged_layout(size_t activation_bytes, int max_count) {
  const auto words = [](size_t bytes) { return int((bytes + sizeof(uint4) - 1) / sizeof(uint4)); };
  StagedLayout layout;
  layout.activation_words = words(activation_bytes);
  layout.code_words = words(size_t(kTileRows) * size_t(max_count) * 32);
  layout.warp_words = layout.code_words + words(2 * size_t(kTileRows) * size_t(max_count) * sizeof(uint16_t));
  return layout;
}

// Lane (g, t) reads 8 bytes of rows g and g + 8 at once; rows of a multiple of 128 bytes would put all eight rows of a
// half-warp on the same banks. XOR-ing the chunk index with 2·(row mod 4) inside each whole run of 8 chunks spreads
// them (rows g and g + 4 still share, which two wavefronts of 8-byte loads need anyway).
__device__ inline int swizzled(int row, int chunk, int chunks) {
  return (chunk | 7) < chunks ? chunk ^ ((row & 3) << 1) : chunk;
}

__device__ inline void copy_async(void* shared, const void* global, std::integral_constant<int, 16>) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(unsigned(__cvta_generic_to_shared(shared))),
               "l"(global)
               : "memory");
}
template <int Bytes>
__device__ inline void copy_async(void* shared, const void* global, std::integral_constant<int, Bytes>) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(unsigned(__cvta_generic_to_shared(shared))),
               "l"(global), "n"(Bytes)
               : "memory");
}
__device__ inline void wait_copies() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// One warp issues the copies of its tile (rows past the matrix's end repeat its last one, as tile_products' loads
// do). Codes are 8-byte aligned (gemv_reads); scales and biases go in 4-byte pairs of groups where they are aligned
// so (Flash-Next), else one at a time. The caller waits with wait_copies() and a barrier over the warp.
__device__ void stage_tile(const GemvMatrix& m, int first_row, int begin, int count, uint4* codes, uint16_t* affine) {
  const int lane = int(threadIdx.x) % 32, groups = m.cols / kQuantGroup, chunks = 2 * count;
  const size_t row_bytes = size_t(m.cols) / 2;
  const char* source = reinterpret_cast<const char*>(m.codes) + size_t(begin) * 32;
  const bool aligned = reinterpret_cast<uintptr_t>(m.codes) % 16 == 0;  // row_bytes is a multiple of 32
  for (int i = lane; i < kTileRows * chunks; i += 32) {
    const int r = i / chunks, c = i % chunks;
    const char* from = source + size_t(min(first_row + r, m.rows - 1)) * row_bytes + size_t(c) * 16;
    char* to = reinterpret_cast<char*>(codes + r * chunks + swizzled(r, c, chunks));
    if (aligned) {
      copy_async(to, from, std::integral_constant<int, 16>{});
    } else {
      copy_async(to, from, std::integral_constant<int, 8>{});
      copy_async(to + 8, from + 8, std::integral_constant<int, 8>{});
    }
  }
  const auto affine_row = [&](int which, int r) {
    return reinterpret_cast<const uint16_t*>(which ? m.biases : m.scales) +
           size_t(min(first_row + r, m.rows - 1)) * groups + begin;
  };
  const uintptr_t affine_bases = reinterpret_cast<uintptr_t>(m.scales) | reinterpret_cast<uintptr_t>(m.biases);
  if (count % 2 == 0 && begin % 2 == 0 && groups % 2 == 0 && affine_bases % 4 == 0) {  // pairs of groups
    const int pairs = count / 2;
    for (int i = lane; i < 2 * kTileRows * pairs; i += 32) {
      const int which = i / (kTileRows * pairs), r = i / pairs % kTileRows, pair = i % pairs;
      copy_async(affine + (which * kTileRows + r) * count + 2 * pair, affine_row(which, r) + 2 * pair,
                 std::integral_constant<int, 4>{});
    }
  } else {  // an odd number of groups or unaligned rows: one at a time, through registers
    for (int i = lane; i < 2 * kTileRows * count; i += 32) {
      const int which = i / (kTileRows * count), r = i / count % kTileRows, group = i % count;
      affine[i] = __ldg(affine_row(which, r) + group);
    }
  }
}

__device__ inline float bf16_value(uint16_t bits) { return __uint_as_float(uint32_t(bits) << 16); }

// tile_products' sums (the same operations in the same order) from a staged tile: acc[r] = row g + 8r's product with
// batch row t (lane (g, t), t < B) over the staged groups, which are groups group0.. of the activations.
template <int B>
__device__ inline void staged_products(const uint4* codes, const uint16_t* affine, int count, int group0, int groups,
                                       const uint4* fragments, const float2* group_terms, float (&acc)[2]) {
  const int lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4, chunks = 2 * count;
  const uint2* row0 = reinterpret_cast<const uint2*>(codes + g * chunks);
  const uint2* row1 = reinterpret_cast<const uint2*>(codes + (g + 8) * chunks);
  const uint16_t* scale0 = affine + g * count;
  const uint16_t* scale1 = affine + (g + 8) * count;
  const uint16_t* bias0 = affine + (kTileRows + g) * count;
  const uint16_t* bias1 = affine + (kTileRows + g + 8) * count;
#pragma unroll 4
  for (int i = 0; i < count; ++i) {
    const int group = group0 + i, chunk = 2 * i + (t >> 1);
    uint4 b_fragment[2] = {};
    if (lane < 8 * B) {
      b_fragment[0] = fragments[(size_t(group) * 2) * 8 * B + lane];
      b_fragment[1] = fragments[(size_t(group) * 2 + 1) * 8 * B + lane];
    }
    const float2 terms = t < B ? group_terms[t * groups + group] : make_float2(0.0f, 0.0f);
    uint32_t a0[8], a1[8];
    decode<4>(row0[2 * swizzled(g, chunk, chunks) + (t & 1)], t, a0);
    decode<4>(row1[2 * swizzled(g + 8, chunk, chunks) + (t & 1)], t, a1);
    float c[4] = {};
    mma_f16(c, a0[0], a1[0], a0[1], a1[1], b_fragment[0].x, b_fragment[0].y);
    mma_f16(c, a0[2], a1[2], a0[3], a1[3], b_fragment[0].z, b_fragment[0].w);
    mma_f16(c, a0[4], a1[4], a0[5], a1[5], b_fragment[1].x, b_fragment[1].y);
    mma_f16(c, a0[6], a1[6], a0[7], a1[7], b_fragment[1].z, b_fragment[1].w);
    acc[0] = fmaf(c[0] + c[1], bf16_value(scale0[i]) * terms.y, fmaf(bf16_value(bias0[i]), terms.x, acc[0]));
    acc[1] = fmaf(c[2] + c[3], bf16_value(scale1[i]) * terms.y, fmaf(bf16_value(bias1[i]), terms.x, acc[1]));
  }
}

// blockIdx.y: a slot (blocks of empty slots leave at once) or, at `selections`, the shared expert. Shared memory: the
// block's activations (after the products: the warps' partial sums), then each warp's staged tile slice.
template <int B>
__global__ void __launch_bounds__(kGateUpWarps * 32)
    gate_up_kernel(ExpertDecode p, int selections, StagedLayout layout) {
  wait_for_producers();
  allow_dependents();
  extern __shared__ uint4 staged[];
  const int slot = int(blockIdx.y);
  const bool shared_expert = slot == selections;
  const int inner = shared_expert ? p.shared_inner : p.inner, first_row = int(blockIdx.x) * kTileRows;
  if (first_row >= inner) return;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, slice = warp / 2;
  GemvMatrix m;  // one read of the slot's descriptor, then the weights
  if (shared_expert)
    m = gemv_matrix(warp % 2 ? p.shared_up : p.shared_gate, p.x, nullptr);
  else
    m = p.slot_matrices[3 * slot + warp % 2];
  if (m.rows == 0) return;  // a slot past the step's distinct experts (gate and up alike: the whole block)
  m.x = p.x;
  const int groups = m.cols / kQuantGroup, begin = slice_start(slice, kGateUpSlices, groups);
  const int count = slice_start(slice + 1, kGateUpSlices, groups) - begin;
  uint4* codes = staged + layout.activation_words + size_t(warp) * size_t(layout.warp_words);
  uint16_t* affine = reinterpret_cast<uint16_t*>(codes + layout.code_words);
  stage_tile(m, first_row, begin, count, codes, affine);  // before the activations: their latencies overlap
  float2* group_terms = reinterpret_cast<float2*>(staged + size_t(groups) * 16 * B);
  stage_activations<4, B>(m, groups, staged, group_terms);
  wait_copies();
  __syncthreads();
  float acc[2] = {};
  staged_products<B>(codes, affine, count, begin, groups, staged, group_terms, acc);
  __syncthreads();  // every warp is done with the activations: their place takes the partial sums
  float(*partials)[64] = reinterpret_cast<float(*)[64]>(staged);
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
// sums in warp order and the cluster's first block adds the blocks' in rank order. Each warp stages its own expert's h
// and tile in its own region of shared memory.
template <int B>
__global__ void __cluster_dims__(1, kDownCluster, 1) __launch_bounds__(kDownWarps * 32)
    down_kernel(ExpertDecode p, StagedLayout layout) {
  wait_for_producers();
  allow_dependents();
  extern __shared__ uint4 staged[];
  __shared__ float partials[kDownWarps][64];
  __shared__ float block_total[64];
  cg::cluster_group cluster = cg::this_cluster();
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, t = lane % 4;
  const int first_row = int(blockIdx.x) * kTileRows, selections = B * p.top_k;
  uint4* fragments = staged + size_t(warp) * size_t(layout.activation_words + layout.warp_words);
  uint4* codes = fragments + layout.activation_words;
  uint16_t* affine = reinterpret_cast<uint16_t*>(codes + layout.code_words);
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
    const int groups = m.cols / kQuantGroup;
    stage_tile(m, first_row, 0, groups, codes, affine);
    float2* group_terms = reinterpret_cast<float2*>(fragments + size_t(groups) * 16 * B);
    stage_activations_by<4, B>(m, groups, fragments, group_terms, lane, 32);
    wait_copies();
    __syncwarp();
    float acc[2] = {};
    staged_products<B>(codes, affine, groups, 0, groups, fragments, group_terms, acc);
    float weight = 0.0f;
    if (t < B) weight = shared_expert ? sigmoid(p.shared_scale[t]) : p.slot_weights[s * kMaxGemvRows + t];
    total[0] = fmaf(weight, acc[0], total[0]);
    total[1] = fmaf(weight, acc[1], total[1]);
    __syncwarp();  // the next expert's staging overwrites these fragments and this tile
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

// Groups of the larger of the two column slices of a gate/up warp.
int largest_slice(int groups) {
  const int units = (groups + kUnroll - 1) / kUnroll;
  return groups - std::min(units / kGateUpSlices * kUnroll, groups);
}

template <int B>
cudaError_t launch_gate_up(const ExpertDecode& p, int selections, cudaStream_t stream) {
  static_assert(kGateUpSlices == 2, "largest_slice: the second slice is the larger");
  const int groups = p.hidden / kQuantGroup;
  const size_t partial_bytes = size_t(kGateUpWarps) * 64 * sizeof(float);
  const StagedLayout layout =
      staged_layout(std::max(quant_shared_bytes(groups, B), partial_bytes), largest_slice(groups));
  const size_t shared = (size_t(layout.activation_words) + size_t(kGateUpWarps) * layout.warp_words) * sizeof(uint4);
  if (shared > size_t(kMaxDynamicShared)) return cudaErrorInvalidValue;
  // Once for all: only a permission, so it never changes between the launches of a captured graph.
  static const cudaError_t opted_in =
      cudaFuncSetAttribute(gate_up_kernel<B>, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxDynamicShared);
  if (opted_in != cudaSuccess) return opted_in;
  // VAVILOV_MOE_CARVEOUT (measurement only): ask for the largest shared-memory carveout, in case the driver's own
  // choice left fewer than 4 of these blocks a multiprocessor (ncu: it did not; the step was the same).
  static const cudaError_t carveout =
      std::getenv("VAVILOV_MOE_CARVEOUT")
          ? cudaFuncSetAttribute(gate_up_kernel<B>, cudaFuncAttributePreferredSharedMemoryCarveout, 100)
          : cudaSuccess;
  if (carveout != cudaSuccess) return carveout;
  const int tiles = (std::max(p.inner, p.shared_inner) + kTileRows - 1) / kTileRows;
  launch_dependent(gate_up_kernel<B>, dim3(unsigned(tiles), unsigned(selections + 1)), kGateUpWarps * 32, shared,
                   stream, p, selections, layout);
  return cudaGetLastError();
}

template <int B>
cudaError_t launch_down(const ExpertDecode& p, cudaStream_t stream) {
  const int groups = std::max(p.inner, p.shared_inner) / kQuantGroup;
  const StagedLayout layout = staged_layout(quant_shared_bytes(groups, B), groups);
  const size_t shared = size_t(kDownWarps) * size_t(layout.activation_words + layout.warp_words) * sizeof(uint4);
  if (shared > size_t(kMaxDynamicShared)) return cudaErrorInvalidValue;
  static const cudaError_t opted_in =
      cudaFuncSetAttribute(down_kernel<B>, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxDynamicShared);
  if (opted_in != cudaSuccess) return opted_in;
  const int tiles = (p.hidden + kTileRows - 1) / kTileRows;
  launch_dependent(down_kernel<B>, dim3(unsigned(tiles), kDownCluster), kDownWarps * 32, shared, stream, p, layout);
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
