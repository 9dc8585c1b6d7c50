#include <cooperative_groups.h>

#include <cmath>

#include "cuda/device_math.cuh"
#include "cuda/launch.cuh"
#include "cuda/moe.cuh"
#include "cuda/route_block.cuh"

namespace vavilov::cuda {

namespace {

using namespace route_block;
namespace cg = cooperative_groups;

constexpr int kRouteWarps = 4;  // rows routed by one block, a warp each

// Probabilities of taken experts (and of the lanes' slots past the last expert) are set to this; real ones are ≥ 0
// or NaN.
constexpr float kTaken = -INFINITY;

// Experts a lane holds in registers: e = lane + 32·i for i < PerLane (route_row).
constexpr int route_slots_per_lane(int experts) { return experts <= 512 ? 16 : kMaxMoeExperts / 32; }

// The lane's best untaken expert among its own: highest probability, the lower index on ties (the scan goes up and
// replaces only on a strictly higher value). Without one (all NaN or taken): value −1, index `experts`.
template <int PerLane>
__device__ inline void lane_best(const float (&prob)[PerLane], int experts, int lane, float& value, int& index) {
  value = -1.0f;
  index = experts;
#pragma unroll
  for (int i = 0; i < PerLane; ++i)
    if (prob[i] > value) value = prob[i], index = lane + 32 * i;
}

// The lowest untaken expert, for when every remaining probability is NaN (the CPU's order is then unspecified).
template <int PerLane>
__device__ inline int lowest_untaken(const float (&prob)[PerLane], int experts, int lane) {
  int first = experts;
#pragma unroll
  for (int i = PerLane - 1; i >= 0; --i)
    if (prob[i] != kTaken) first = lane + 32 * i;
  return int(__reduce_min_sync(kFullMask, unsigned(first)));
}

// One warp routes one row: softmax as the CPU computes it (exp(l − max) / Σ), then top_k picks. Each lane keeps the
// probabilities of its experts in registers (fully unrolled loops, so no local memory); a pick is the warp-wide best
// of the lanes' bests, found by two warp reductions — the highest probability (non-negative floats order as their
// bits), then the lowest index among the lanes holding it — and only the lane that owned the pick rescans its
// registers. Selection j is kept by lane j, so the renormalising total is summed in selection order like the CPU's.
template <int PerLane>
__device__ void route_row(const RouteShape& s, const float* logits, int* ids, float* weights, int* ids_copy,
                          float* weights_copy = nullptr) {
  const int lane = int(threadIdx.x) % 32;
  float prob[PerLane];
  float peak = -INFINITY;
#pragma unroll
  for (int i = 0; i < PerLane; ++i) {
    const int e = lane + 32 * i;
    prob[i] = e < s.experts ? logits[e] : kTaken;
    peak = fmaxf(peak, prob[i]);
  }
  peak = warp_max(peak);
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < PerLane; ++i) {
    if (lane + 32 * i >= s.experts) continue;
    prob[i] = expf(prob[i] - peak);
    sum += prob[i];
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int i = 0; i < PerLane; ++i)
    if (lane + 32 * i < s.experts) prob[i] /= sum;
  float best;
  int best_index;
  lane_best(prob, s.experts, lane, best, best_index);
  float kept_value = 0.0f;
  int kept_id = 0;
  for (int j = 0; j < s.top_k; ++j) {
    // 0 for a lane without a candidate, else the probability's bits + 1 (≤ +inf's + 1: no overflow).
    const unsigned key = best_index < s.experts ? __float_as_uint(best) + 1u : 0u;
    const unsigned top = __reduce_max_sync(kFullMask, key);
    int index = int(__reduce_min_sync(kFullMask, key == top ? unsigned(best_index) : ~0u));
    float picked = __uint_as_float(top - 1u);
    if (top == 0) {  // every remaining probability is NaN: the lowest untaken expert, its (NaN) probability
      index = lowest_untaken(prob, s.experts, lane);
      float mine = 0.0f;
#pragma unroll
      for (int i = 0; i < PerLane; ++i)
        if (lane + 32 * i == index) mine = prob[i];
      picked = __shfl_sync(kFullMask, mine, index % 32);
    }
    if (lane == j) kept_value = picked, kept_id = index;
    if (lane == index % 32) {
#pragma unroll
      for (int i = 0; i < PerLane; ++i)
        if (lane + 32 * i == index) prob[i] = kTaken;
      lane_best(prob, s.experts, lane, best, best_index);
    }
  }
  float total = 0.0f;
  for (int j = 0; j < s.top_k; ++j) total += __shfl_sync(kFullMask, kept_value, j);
  if (lane < s.top_k) {
    ids[lane] = kept_id;
    const float weight = s.norm_topk ? kept_value / total : kept_value;
    weights[lane] = weight;
    if (ids_copy) ids_copy[lane] = kept_id;
    if (weights_copy) weights_copy[lane] = weight;
  }
}

// After routing (`selected` holds every row's picks): slots for the distinct experts in first-come order, then the
// descriptors of their products (see ExpertPlan), a thread a selection and no serial pass. Selection i opens a slot
// when it is the first to pick its expert (the lowest selection index, by a shared atomicMin); an opener's slot is the
// number of openers before it (ballots), and every selection takes the slot of its expert's opener.
// Every thread of a block of kRoutePlanWarps warps calls it.
constexpr int kRoutePlanWarps = 8;
static_assert(kRoutePlanWarps * 32 >= kMaxGemvRows * kMaxMoeTopK, "a thread a selection");
__device__ void write_plan(const RouteShape& s, int rows, const int* selected, const ExpertPlan& plan) {
  __shared__ int first_pick[kMaxMoeExperts];   // per expert: the lowest selection that picked it
  __shared__ unsigned opens[kRoutePlanWarps];  // bit i % 32 of word i / 32: selection i opens a slot
  const int i = int(threadIdx.x), selections = rows * s.top_k;
  for (int e = i; e < s.experts; e += int(blockDim.x)) first_pick[e] = selections;
  __syncthreads();
  const int expert = i < selections ? selected[i] : 0;
  if (i < selections) atomicMin(first_pick + expert, i);
  __syncthreads();
  const int first = i < selections ? first_pick[expert] : -1;  // -1: no selection
  const unsigned mask = __ballot_sync(kFullMask, first == i);
  if (i % 32 == 0) opens[i / 32] = mask;
  __syncthreads();
  const auto openers_before = [&](int selection) {
    int n = __popc(opens[selection / 32] & ((1u << (selection % 32)) - 1u));
    for (int w = 0; w < selection / 32; ++w) n += __popc(opens[w]);
    return n;
  };
  int count = 0;
  for (int w = 0; w < kRoutePlanWarps; ++w) count += __popc(opens[w]);
  if (i < selections) plan.slot_of[i] = openers_before(first);
  if (i == 0) {
    plan.slot_of[selections] = count;
    if (plan.shared_down.rows > 0) plan.down_products[selections] = plan.shared_down;
  }
  if (i >= count && i < selections) {  // slot i is empty: rows = 0, no work
    plan.gate_up[2 * i] = plan.gate_up[2 * i + 1] = plan.down_products[i] = GemvMatrix{};
  }
  if (i >= selections || first != i) return;
  const int slot = openers_before(i);
  const size_t gate_block = size_t(rows) * size_t(plan.inner), down_block = size_t(rows) * size_t(plan.hidden);
  float *gate_out = plan.gate_out + slot * gate_block, *up_out = plan.up_out + slot * gate_block;
  GemvMatrix down = gemv_matrix(plan.down[expert], gate_out, plan.down_out + slot * down_block);
  if (plan.swiglu_in_down) down.x_up = up_out;
  plan.gate_up[2 * slot] = gemv_matrix(plan.gate[expert], plan.x, gate_out);
  plan.gate_up[2 * slot + 1] = gemv_matrix(plan.up[expert], plan.x, up_out);
  plan.down_products[slot] = down;
}

template <int PerLane>
__global__ void __launch_bounds__(kRouteWarps * 32)
    route_kernel(RouteShape s, const float* logits, int rows, int* ids, float* weights) {
  wait_for_producers();
  allow_dependents();
  const int row = int(blockIdx.x) * kRouteWarps + int(threadIdx.x) / 32;
  if (row < rows)
    route_row<PerLane>(s, logits + size_t(row) * size_t(s.experts), ids + size_t(row) * s.top_k,
                       weights + size_t(row) * s.top_k, nullptr);
}

// Routing and the plan of a pass of 1–4 rows: a cluster of a block a row, each routing its row with the whole block
// as the 1-row products do (route_row_by_block: a sort and a merge tree, where route_row makes ten dependent picks),
// then block 0 numbering every row's picks, read from the other blocks' shared memory, into the plan (write_plan).
// Eight warps a block: as fast as the products' 16 in the step (docs/CUDA.md, MoE block), with half the registers and
// shared memory.
template <int PerThread>
__global__ void __launch_bounds__(kRoutePlanWarps * 32)
    route_plan_kernel(RouteShape s, const float* logits, int* ids, float* weights, ExpertPlan plan) {
  const cg::cluster_group cluster = cg::this_cluster();
  const int row = int(cluster.block_rank()), rows = int(cluster.num_blocks());
  if (row == 0) prefetch_expert_tables(plan.gate, plan.up, plan.down, s.experts);
  wait_for_producers();
  allow_dependents();
  __shared__ int picked[kMaxMoeTopK];
  __shared__ float picked_weight[kMaxMoeTopK];
  __shared__ int selected[kMaxGemvRows * kMaxMoeTopK];
  route_row_by_block<PerThread, kRoutePlanWarps>(s, logits + size_t(row) * size_t(s.experts),
                                                 ids + size_t(row) * s.top_k, weights + size_t(row) * s.top_k, picked,
                                                 picked_weight);
  cluster.sync();  // every row's picks in its block's shared memory
  const int selections = rows * s.top_k;
  if (row == 0)
    for (int i = int(threadIdx.x); i < selections; i += int(blockDim.x))
      selected[i] = cluster.map_shared_rank(picked, i / s.top_k)[i % s.top_k];
  cluster.sync();  // block 0 has read them: the others may exit
  if (row == 0) write_plan(s, rows, selected, plan);
}

void launch_route_plan(const RouteShape& s, const float* logits, int rows, int* ids, float* weights,
                       const ExpertPlan& plan, cudaStream_t stream) {
  constexpr int kThreads = kRoutePlanWarps * 32, kMostPerThread = kMaxMoeExperts / kThreads;
  const dim3 cluster(unsigned(rows), 1, 1);
  if (s.experts <= 2 * kThreads)
    launch_clustered(route_plan_kernel<2>, dim3(unsigned(rows)), dim3(kThreads), 0, stream, cluster, true, s, logits,
                     ids, weights, plan);
  else
    launch_clustered(route_plan_kernel<kMostPerThread>, dim3(unsigned(rows)), dim3(kThreads), 0, stream, cluster, true,
                     s, logits, ids, weights, plan);
}

// Slot j's gate, up and down descriptors (x and y unset) at matrices[3j + 0, 1, 2]; rows = 0 for an empty slot.
__device__ void write_slot_matrices(const ExpertSlots& slots, int slot, int expert) {
  if (!slots.matrices) return;
  GemvMatrix gate, up, down;
  if (expert >= 0) {
    gate = gemv_matrix(slots.gate[expert], nullptr, nullptr);
    up = gemv_matrix(slots.up[expert], nullptr, nullptr);
    down = gemv_matrix(slots.down[expert], nullptr, nullptr);
  }
  slots.matrices[3 * slot] = gate;
  slots.matrices[3 * slot + 1] = up;
  slots.matrices[3 * slot + 2] = down;
}

// Routing, then the step's distinct experts in parallel: selection i (row i / top_k) opens a slot when no earlier row
// picked its expert (a row's own picks are distinct), and its slot is the number of openers before it — the
// first-come order of write_plan, from ballots. Each opener gathers every row's weight of its expert and writes its
// slot's descriptors. One row is routed by the whole block; up to 512 experts, more rows by a warp each at the same
// time (route_row: the same picks, and no row waits for the one before); past 512 experts (a lane would hold 64 of
// them, spilled in a block of this size) the block routes the rows in turn.
template <int PerThread>
__global__ void __launch_bounds__(kRouteBlockThreads)
    route_slots_kernel(RouteShape s, const float* logits, int rows, int* ids, float* weights, ExpertSlots slots) {
  if (slots.matrices) prefetch_expert_tables(slots.gate, slots.up, slots.down, s.experts);
  wait_for_producers();
  allow_dependents();
  __shared__ int selected[kMaxGemvRows * kMaxMoeTopK];
  __shared__ float selected_weight[kMaxGemvRows * kMaxMoeTopK];
  __shared__ unsigned opens[kMaxGemvRows * kMaxMoeTopK / 32];
  if (PerThread == 1 && rows > 1) {
    static_assert(16 * 32 == kRouteBlockThreads, "route_row<16> holds the up to 512 experts of route_slots_kernel<1>");
    if (const int r = int(threadIdx.x) / 32; r < rows)
      route_row<16>(s, logits + size_t(r) * size_t(s.experts), ids + size_t(r) * s.top_k, weights + size_t(r) * s.top_k,
                    selected + r * s.top_k, selected_weight + r * s.top_k);
    __syncthreads();
  } else {
    for (int r = 0; r < rows; ++r) {
      route_row_by_block<PerThread>(s, logits + size_t(r) * size_t(s.experts), ids + size_t(r) * s.top_k,
                                    weights + size_t(r) * s.top_k, selected + r * s.top_k,
                                    selected_weight + r * s.top_k);
      __syncthreads();
    }
  }
  const int i = int(threadIdx.x), selections = rows * s.top_k, row = i / max(s.top_k, 1);
  constexpr int kSelectionWarps = kMaxGemvRows * kMaxMoeTopK / 32;
  const int expert = i < selections ? selected[i] : -1;
  bool first = i < selections;
  for (int earlier = 0; earlier < row * s.top_k && first; ++earlier) first = selected[earlier] != expert;
  if (i < 32 * kSelectionWarps) {
    const unsigned mask = __ballot_sync(kFullMask, first);
    if (i % 32 == 0) opens[i / 32] = mask;
  }
  __syncthreads();
  if (i >= 32 * kSelectionWarps) return;
  int count = 0, slot = __popc(opens[i / 32] & ((1u << (i % 32)) - 1u));
  for (int w = 0; w < kSelectionWarps; ++w) {
    count += __popc(opens[w]);
    if (w < i / 32) slot += __popc(opens[w]);
  }
  if (i == 0) *slots.count = count;
  if (i >= count && i < selections) write_slot_matrices(slots, i, -1);
  if (!first) return;
  slots.expert[slot] = expert;
  for (int b = 0; b < kMaxGemvRows; ++b) {
    float weight = b == row ? selected_weight[i] : 0.0f;
    for (int j = 0; b > row && b < rows && j < s.top_k; ++j)
      if (selected[b * s.top_k + j] == expert) weight = selected_weight[b * s.top_k + j];
    slots.weights[slot * kMaxGemvRows + b] = weight;
  }
  write_slot_matrices(slots, slot, expert);
}

__global__ void swiglu_kernel(float* gate, const float* up, int64_t n) {
  wait_for_producers();
  allow_dependents();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) gate[i] = silu(gate[i]) * up[i];
}

// blockIdx.y: a slot (skipped past the distinct count), or `slots` for the shared expert.
__global__ void swiglu_slots_kernel(float* expert_gate, const float* expert_up, int64_t block, const int* slot_of,
                                    int slots, float* shared_gate, const float* shared_up, int64_t shared) {
  wait_for_producers();
  allow_dependents();
  const int slot = int(blockIdx.y);
  float* gate = shared_gate;
  const float* up = shared_up;
  int64_t n = shared;
  if (slot < slots) {
    if (slot >= slot_of[slots]) return;
    gate = expert_gate + slot * block;
    up = expert_up + slot * block;
    n = block;
  }
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    gate[i] = silu(gate[i]) * up[i];
}

__global__ void moe_combine_kernel(float* y, const float* shared_gate, const float* weights, const float* expert_out,
                                   int rows, int top_k, int hidden) {
  wait_for_producers();
  allow_dependents();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(rows) * hidden) return;
  const int64_t r = i / hidden, d = i % hidden;
  float value = y[i] * sigmoid(shared_gate[r]);
  for (int j = 0; j < top_k; ++j) value += weights[r * top_k + j] * expert_out[(r * top_k + j) * hidden + d];
  y[i] = value;
}

__global__ void moe_combine_slots_kernel(float* y, const float* shared_gate, const float* weights, const int* slot_of,
                                         const float* expert_out, int rows, int top_k, int hidden) {
  wait_for_producers();
  allow_dependents();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(rows) * hidden) return;
  const int64_t r = i / hidden, d = i % hidden;
  float value = y[i] * sigmoid(shared_gate[r]);
  for (int j = 0; j < top_k; ++j) {
    const int64_t slot = slot_of[r * top_k + j];
    value += weights[r * top_k + j] * expert_out[(slot * rows + r) * hidden + d];
  }
  y[i] = value;
}

}  // namespace

void moe_route(const RouteShape& shape, const float* logits, int rows, int* ids, float* weights, cudaStream_t stream) {
  if (rows == 0) return;
  const int blocks = blocks_for(rows, kRouteWarps);
  if (route_slots_per_lane(shape.experts) == 16)
    launch_dependent(route_kernel<16>, blocks, kRouteWarps * 32, 0, stream, shape, logits, rows, ids, weights);
  else
    launch_dependent(route_kernel<kMaxMoeExperts / 32>, blocks, kRouteWarps * 32, 0, stream, shape, logits, rows, ids,
                     weights);
}

void moe_route_and_plan(const RouteShape& shape, const float* logits, int rows, int* ids, float* weights,
                        const ExpertPlan& plan, cudaStream_t stream) {
  if (rows > 0) launch_route_plan(shape, logits, rows, ids, weights, plan, stream);
}

void moe_route_slots(const RouteShape& shape, const float* logits, int rows, int* ids, float* weights,
                     const ExpertSlots& slots, cudaStream_t stream) {
  static_assert(kRouteBlockThreads >= kMaxGemvRows * kMaxMoeTopK, "a thread a selection");
  static_assert(kRouteBlockThreads * 4 >= kMaxMoeExperts, "4 experts a thread at most");
  if (shape.experts <= kRouteBlockThreads)
    launch_dependent(route_slots_kernel<1>, 1, kRouteBlockThreads, 0, stream, shape, logits, rows, ids, weights, slots);
  else
    launch_dependent(route_slots_kernel<4>, 1, kRouteBlockThreads, 0, stream, shape, logits, rows, ids, weights, slots);
}

void swiglu(float* gate, const float* up, int64_t n, cudaStream_t stream) {
  if (n) launch_dependent(swiglu_kernel, blocks_for(n, 256), 256, 0, stream, gate, up, n);
}

void swiglu_slots(float* expert_gate, const float* expert_up, int64_t block, const int* slot_of, int slots,
                  float* shared_gate, const float* shared_up, int64_t shared, cudaStream_t stream) {
  const dim3 grid(unsigned(blocks_for(block > shared ? block : shared, 256)), unsigned(slots + 1));
  launch_dependent(swiglu_slots_kernel, grid, 256, 0, stream, expert_gate, expert_up, block, slot_of, slots,
                   shared_gate, shared_up, shared);
}

void moe_combine(float* y, const float* shared_gate, const float* weights, const float* expert_out, int rows, int top_k,
                 int hidden, cudaStream_t stream) {
  const int64_t n = int64_t(rows) * hidden;
  if (n)
    launch_dependent(moe_combine_kernel, blocks_for(n, 256), 256, 0, stream, y, shared_gate, weights, expert_out, rows,
                     top_k, hidden);
}

void moe_combine_slots(float* y, const float* shared_gate, const float* weights, const int* slot_of,
                       const float* expert_out, int rows, int top_k, int hidden, cudaStream_t stream) {
  const int64_t n = int64_t(rows) * hidden;
  if (n)
    launch_dependent(moe_combine_slots_kernel, blocks_for(n, 256), 256, 0, stream, y, shared_gate, weights, slot_of,
                     expert_out, rows, top_k, hidden);
}

}  // namespace vavilov::cuda
