#include <algorithm>
#include <type_traits>

#include "cuda/device_math.cuh"
#include "cuda/expert_decode.cuh"
#include "cuda/fixed_sum.cuh"
#include "cuda/launch.cuh"
#include "cuda/quant_imma.cuh"
#include "cuda/route_block.cuh"

namespace vavilov::cuda {

namespace {

using namespace qmma;

// Dynamic shared memory a block may opt into (Hopper: 227 KB, less the static arrays and some room).
constexpr int kMaxDynamicShared = 200 * 1024;
// expert_combine: a block of kCombineWarps warps per 32 output columns and batch row.
constexpr int kCombineWarps = 16;
constexpr int kMaxSlots = kMaxGemvRows * kMaxMoeTopK + 1;  // with the shared expert's

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

// Block (group of 64 rows of h, slot; the shared expert at slot `selections`), kSliceWarps warps. Warp w reads matrix
// w % 2 (gate, up) of h tile w / 4 over column slice (w / 2) % 2 (the per-warp work of the former gate/up kernel, which
// had one tile a block); the block then holds its 64 values of h = silu(gate)·up, which are exactly one group of down's
// columns, and writes the product of down's rows with that group alone: each output row's partial for (slot, group),
// which combine_kernel adds up. No h leaves the block and no launch sits between gate/up and down.
constexpr int kSliceWarps = 16;
constexpr int kSliceTiles = kQuantGroup / kTileRows;            // tiles of h rows a block
constexpr int kSliceColumns = kSliceWarps / (2 * kSliceTiles);  // column slices of gate and up
constexpr int kDownTilesInFlight = 5;                           // down tiles whose loads a warp holds
static_assert(kSliceColumns * 2 * kSliceTiles == kSliceWarps, "every warp one (tile, matrix, slice)");

// What a warp loads of down's group for kDownTilesInFlight of its 16-row tiles: lane (g, t) the codes of rows g and
// g + 8, and one bf16 (t = 0: scale of row g, 1: scale of row g + 8, 2: bias of row g, 3: bias of row g + 8).
struct DownLoads {
  uint2 codes[kDownTilesInFlight][2];
  uint32_t affine[kDownTilesInFlight];
};

// Tiles first, first + kSliceWarps, ... (kDownTilesInFlight of them, those below `tiles`).
__device__ inline void load_down_tiles(DownLoads& loads, const GemvMatrix& down, int group, int first, int tiles) {
  const int lane = int(threadIdx.x) % 32;
#pragma unroll
  for (int i = 0; i < kDownTilesInFlight; ++i) {
    const int tile = first + i * kSliceWarps;
    if (tile >= tiles) continue;
    const TileRows rows = tile_rows(down, tile * kTileRows);
    loads.codes[i][0] = load_codes<4>(rows.codes[0], group, lane % 4);
    loads.codes[i][1] = load_codes<4>(rows.codes[1], group, lane % 4);
    loads.affine[i] = __ldg(reinterpret_cast<const unsigned short*>(rows.affine + group));
  }
}

// The partial products of the tiles load_down_tiles loaded, with the block's h staged as one group of B rows.
// store(b, row, value) takes batch row b's product of output row `row`.
template <int B, typename Store>
__device__ inline void down_tile_products(const DownLoads& loads, int first, int tiles, const uint4* h_fragments,
                                          const float2* h_terms, int hidden, const Store& store) {
  const int lane = int(threadIdx.x) % 32, g = lane / 4, t = lane % 4;
  if constexpr (kQ4Digits<4, B>) {
    const DigitLane<B> digits(h_fragments, h_terms, 1);
#pragma unroll
    for (int i = 0; i < kDownTilesInFlight; ++i) {
      const int tile = first + i * kSliceWarps;
      if (tile >= tiles) break;
      float affine[4];
#pragma unroll
      for (int k = 0; k < 4; ++k)
        affine[k] = __uint_as_float(__shfl_sync(0xffffffffu, loads.affine[i], (lane & ~3) | k) << 16);
      float sums[DigitLane<B>::kTiles][2] = {}, acc[2] = {};
      digit_group<B>(digits, 0, loads.codes[i][0], loads.codes[i][1], {affine[0], affine[1]}, {affine[2], affine[3]},
                     sums);
      digit_totals<B>(sums, acc);
      const int row = tile * kTileRows + g;
      if (t < B && row < hidden) store(t, row, acc[0]);
      if (t < B && row + 8 < hidden) store(t, row + 8, acc[1]);
    }
    return;
  }
  const uint4* b_lane = h_fragments + min(lane, 8 * B - 1);
  const uint4 b_fragment[2] = {b_lane[0], b_lane[8 * B]};
  const float2 terms = h_terms[min(t, B - 1)];
#pragma unroll
  for (int i = 0; i < kDownTilesInFlight; ++i) {
    const int tile = first + i * kSliceWarps;
    if (tile >= tiles) break;
    uint32_t a0[8], a1[8];
    decode<4>(loads.codes[i][0], t, a0);
    decode<4>(loads.codes[i][1], t, a1);
    float c[4] = {};
    mma_f16(c, a0[0], a1[0], a0[1], a1[1], b_fragment[0].x, b_fragment[0].y);
    mma_f16(c, a0[2], a1[2], a0[3], a1[3], b_fragment[0].z, b_fragment[0].w);
    mma_f16(c, a0[4], a1[4], a0[5], a1[5], b_fragment[1].x, b_fragment[1].y);
    mma_f16(c, a0[6], a1[6], a0[7], a1[7], b_fragment[1].z, b_fragment[1].w);
    float affine[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      affine[k] = __uint_as_float(__shfl_sync(0xffffffffu, loads.affine[i], (lane & ~3) | k) << 16);
    const int row = tile * kTileRows + g;
    if (t < B && row < hidden) store(t, row, fmaf(c[0] + c[1], affine[0] * terms.y, affine[2] * terms.x));
    if (t < B && row + 8 < hidden) store(t, row + 8, fmaf(c[2] + c[3], affine[1] * terms.y, affine[3] * terms.x));
  }
}

// partials: [slot, h group, batch row, hidden] with `groups` h groups a slot (the widest expert's). With Route (a 1-row
// pass), each expert block routes the row itself (route_block.cuh: the picks of moe_route_slots, in the same order)
// and takes its slot's expert from the tables; each slot's group-0 block writes the slot's weight for the combine, and
// block (0, 0) also the picks and the count. With Fixed (Route only), each block adds its partials times the slot's
// weight (σ(shared gate) for the shared expert) into y_fixed instead (fixed_sum.cuh), so no combine runs.
template <int B, bool Route, bool Fixed>
__global__ void __launch_bounds__(kSliceWarps * 32) products_kernel(ExpertDecode p, int selections, int groups) {
  static_assert(!Route || (B == 1 && kSliceWarps == route_block::kRouteBlockWarps), "one row, routed by the block");
  static_assert(!Fixed || Route, "the fixed-point output is the 1-row routed pass's");
  extern __shared__ uint4 staged[];
  const int x_groups = p.hidden / kQuantGroup;  // gate and up read x whole
  float2* group_terms = staged_terms<4, B>(staged, x_groups);
  const auto stage_x = [&](bool settled) {
    stage_for_products<4, B>(
        x_groups,
        [&](int b, int g, int column_t, float(&x)[16]) {
          const float4* source =
              reinterpret_cast<const float4*>(p.x + size_t(b) * p.hidden + g * kQuantGroup) + 4 * column_t;
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float4 v = settled ? __ldcg(source + i) : __ldg(source + i);
            x[4 * i] = v.x, x[4 * i + 1] = v.y, x[4 * i + 2] = v.z, x[4 * i + 3] = v.w;
          }
        },
        staged, group_terms, int(threadIdx.x), int(blockDim.x));
  };
  if constexpr (Route) {
    route_block::prefetch_expert_tables(p.slots.gate, p.slots.up, p.slots.down, p.route.experts);
    // x was written two launches back (the router product between triggers only after its own wait): launch.cuh's
    // two-deep rule lets it be staged before the wait, through L2, while the router product still runs.
    stage_x(true);
  }
  wait_for_producers();
  allow_dependents();
  __shared__ float sums[kSliceWarps][64];  // each warp's gate or up sums
  __shared__ float h[B][kQuantGroup];
  constexpr size_t kHStagedWords = (staged_bytes(4, 1, B) + sizeof(uint4) - 1) / sizeof(uint4);
  __shared__ uint4 h_staged[kHStagedWords];
  const int slot = int(blockIdx.y), group = int(blockIdx.x);
  const bool shared_expert = slot == selections;
  const int inner = shared_expert ? p.shared_inner : p.inner, first_h = group * kQuantGroup;
  if (first_h >= inner) return;
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, t = lane % 4;
  const int matrix = warp % 2, slice = (warp / 2) % kSliceColumns, tile = warp / (2 * kSliceColumns);
  GemvMatrix m, down;        // one read of the slot's descriptors, then the weights
  float slot_weight = 0.0f;  // Fixed: what the block's partials are weighed with
  if (shared_expert) {
    m = gemv_matrix(matrix ? p.shared_up : p.shared_gate, nullptr, nullptr);
    down = gemv_matrix(p.shared_down, nullptr, nullptr);
    if constexpr (Fixed) slot_weight = sigmoid(__ldcg(p.shared_scale));
  } else if constexpr (Route) {
    __shared__ int picked[kMaxMoeTopK];
    __shared__ float picked_weight[kMaxMoeTopK];
    const bool writes_picks = slot == 0 && group == 0;
    route_block::route_row_by_block<1>(p.route, p.logits, writes_picks ? p.route_ids : nullptr,
                                       writes_picks ? p.route_weights : nullptr, picked, picked_weight);
    __syncthreads();
    if (!Fixed && group == 0 && threadIdx.x == 0) {
      p.slots.weights[slot * kMaxGemvRows] = picked_weight[slot];
      if (slot == 0) *p.slots.count = p.route.top_k;  // one row's picks are distinct experts
    }
    slot_weight = picked_weight[slot];
    const int expert = picked[slot];
    m = gemv_matrix(matrix ? p.slots.up[expert] : p.slots.gate[expert], nullptr, nullptr);
    down = gemv_matrix(p.slots.down[expert], nullptr, nullptr);
  } else {
    m = p.slots.matrices[3 * slot + matrix];
    down = p.slots.matrices[3 * slot + 2];
  }
  if (m.rows == 0) return;  // a slot past the step's distinct experts (gate and up alike: the whole block)
  const TileRows rows = tile_rows(m, first_h + tile * kTileRows);
  const int begin = slice_start(slice, kSliceColumns, rows.groups);
  const int end = slice_start(slice + 1, kSliceColumns, rows.groups);

  WarpLoads current;  // issued before staging, so that the activations' latency overlaps theirs
  load_group_block<4>(current, rows.codes, rows.affine, begin, end, rows.width, t);
  if constexpr (!Route) stage_x(false);
  __syncthreads();
  float acc[2] = {};
  staged_tile_products<4, B>(current, rows.codes, rows.affine, rows.width, begin, end, rows.groups, staged, group_terms,
                             acc);
  const int down_tiles = (p.hidden + kTileRows - 1) / kTileRows;
  DownLoads next;  // down's first tiles, in flight while h is summed and staged
  load_down_tiles(next, down, group, warp, down_tiles);
  sums[warp][lane] = acc[0];
  sums[warp][32 + lane] = acc[1];
  __syncthreads();
  for (int i = int(threadIdx.x); i < kQuantGroup * B; i += int(blockDim.x)) {  // the slices' sums in slice order
    const int b = i % B, row = i / B, at = tile_slot(row % kTileRows, b);
    const int first_warp = (row / kTileRows) * 2 * kSliceColumns;
    float gate = 0.0f, up = 0.0f;
    for (int s = 0; s < kSliceColumns; ++s)
      gate += sums[first_warp + 2 * s][at], up += sums[first_warp + 2 * s + 1][at];
    h[b][row] = silu(gate) * up;
  }
  __syncthreads();
  float2* h_terms = staged_terms<4, B>(h_staged, 1);
  if (warp == 0)
    stage_for_products<4, B>(
        1,
        [&](int b, int, int column_t, float(&x)[16]) {
#pragma unroll
          for (int i = 0; i < 16; ++i) x[i] = h[b][16 * column_t + i];
        },
        h_staged, h_terms, lane, 32);
  __syncthreads();
  float* out = p.partials + (size_t(slot) * groups + group) * B * size_t(p.hidden);
  const auto store = [&](int b, int row, float value) {
    if constexpr (Fixed)
      add_fixed(p.y_fixed + row, value * slot_weight);
    else
      out[size_t(b) * p.hidden + row] = value;
  };
  constexpr int kStride = kSliceWarps * kDownTilesInFlight;
  for (int first = warp; first < down_tiles; first += kStride) {
    const DownLoads loads = next;
    if (first + kStride < down_tiles) load_down_tiles(next, down, group, first + kStride, down_tiles);
    down_tile_products<B>(loads, first, down_tiles, h_staged, h_terms, p.hidden, store);
  }
}

// Block (32 output columns, batch row b). Warp w sums slots w, w + kCombineWarps, ... (the shared expert counted as
// slot `count`) over their groups in order; warp 0 then adds the slots in order, each times row b's routing weight
// (σ(shared gate) for the shared expert). What the products wrote is read in one round trip after the wait: a row's
// picks are distinct, so one row's count is its selections (no load of the count before the partials), and warp 0
// stages the weights and the shared gate while the warps sum.
template <int B>
__global__ void __launch_bounds__(kCombineWarps * 32) combine_kernel(ExpertDecode p, int selections, int groups) {
  wait_for_producers();
  allow_dependents();
  __shared__ float sums[kMaxSlots][32];
  __shared__ float slot_weights[kMaxSlots];
  const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32, b = int(blockIdx.y);
  const int column = int(blockIdx.x) * 32 + lane;
  const bool inside = column < p.hidden;
  const int count = B == 1 ? selections : *p.slots.count;
  float shared_scale = 0.0f;
  if (warp == 0) {
    shared_scale = p.shared_scale[b];
    for (int s = lane; s < count; s += 32) slot_weights[s] = p.slots.weights[s * kMaxGemvRows + b];
  }
  for (int s = warp; s <= count; s += kCombineWarps) {
    const bool shared_expert = s == count;
    const int slot = shared_expert ? selections : s, used = (shared_expert ? p.shared_inner : p.inner) / kQuantGroup;
    const float* from = p.partials + (size_t(slot) * groups * B + b) * p.hidden + column;
    float sum = 0.0f;
    if (inside)
      for (int j = 0; j < used; ++j) sum += from[size_t(j) * B * p.hidden];
    sums[s][lane] = sum;
  }
  __syncthreads();
  if (warp != 0 || !inside) return;
  float y = 0.0f;
  for (int s = 0; s < count; ++s) y = fmaf(slot_weights[s], sums[s][lane], y);
  y = fmaf(sigmoid(shared_scale), sums[count][lane], y);
  p.y[size_t(b) * p.hidden + column] = y;
}

int slot_groups(const ExpertDecode& p) { return std::max(p.inner, p.shared_inner) / kQuantGroup; }

bool routes_inside(const ExpertDecode& p, int rows) { return rows == 1 && p.route.experts <= kMaxRouteInsideExperts; }

template <int B, bool Route, bool Fixed = false>
cudaError_t launch_products(const ExpertDecode& p, int selections, cudaStream_t stream) {
  const size_t shared = staged_bytes(4, p.hidden / kQuantGroup, B);
  if (shared > size_t(kMaxDynamicShared)) return cudaErrorInvalidValue;
  // Once for all: only a permission, so it never changes between the launches of a captured graph.
  static const cudaError_t opted_in = cudaFuncSetAttribute(
      products_kernel<B, Route, Fixed>, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxDynamicShared);
  if (opted_in != cudaSuccess) return opted_in;
  const int groups = slot_groups(p);
  launch_dependent(products_kernel<B, Route, Fixed>, dim3(unsigned(groups), unsigned(selections + 1)), kSliceWarps * 32,
                   shared, stream, p, selections, groups);
  return cudaGetLastError();
}

template <int B>
cudaError_t launch_combine(const ExpertDecode& p, int selections, cudaStream_t stream) {
  if (selections + 1 > kMaxSlots) return cudaErrorInvalidValue;
  launch_dependent(combine_kernel<B>, dim3(unsigned((p.hidden + 31) / 32), unsigned(B)), kCombineWarps * 32, 0, stream,
                   p, selections, slot_groups(p));
  return cudaGetLastError();
}

}  // namespace

bool expert_decode_takes_fixed(const ExpertDecode& p, int rows) { return routes_inside(p, rows); }

cudaError_t expert_decode(const ExpertDecode& p, int rows, cudaStream_t stream) {
  static_assert(kMaxRouteInsideExperts == route_block::kRouteBlockThreads, "an expert a thread");
  const int selections = rows * p.route.top_k;
  const bool inside = routes_inside(p, rows);
  if (p.y_fixed) return inside ? launch_products<1, true, true>(p, selections, stream) : cudaErrorInvalidValue;
  if (!inside) moe_route_slots(p.route, p.logits, rows, p.route_ids, p.route_weights, p.slots, stream);
  const cudaError_t products = with_batch(rows, [&](auto b) {
    constexpr int kRows = decltype(b)::value;
    return inside ? launch_products<kRows, kRows == 1>(p, selections, stream)
                  : launch_products<kRows, false>(p, selections, stream);
  });
  if (products != cudaSuccess) return products;
  return with_batch(rows, [&](auto b) { return launch_combine<decltype(b)::value>(p, selections, stream); });
}

size_t expert_partial_count(int top_k, int inner, int shared_inner, int hidden) {
  return (size_t(kMaxGemvRows) * top_k + 1) * size_t(std::max(inner, shared_inner) / kQuantGroup) * kMaxGemvRows *
         size_t(hidden);
}

}  // namespace vavilov::cuda
