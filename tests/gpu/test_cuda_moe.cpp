// The GPU MoE block of a decode step (src/cuda/moe_block.*, moe.cu) against a double-precision evaluation of the
// same weights on the host, and the GPU router's top-k against the CPU's ordering rule (src/cpu/moe.cpp).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "core/dtype.h"
#include "cuda/moe_block.h"
#include "device_matrices.h"
#include "late_producer.h"
#include "moe_buffers.h"
#include "moe_reference.h"

namespace vavilov {
namespace {

using cuda::WeightFormat;
using test::DeviceMemory;
using test::make_matrix;
using test::normal_values;
using test::TestMoe;

struct Formats {
  WeightFormat router, shared, gate_up, down;
};

// Small geometry with every kind of width: hidden 256, expert inner 128, shared inner 192, 16 experts, top 4.
constexpr int kHidden = 256, kInner = 128, kSharedInner = 192, kExperts = 16, kTopK = 4, kRows = 4;
constexpr float kRouteBoost = 10.0f;

// Each row strongly prefers its own set of experts (router diagonal × a boosted input coordinate) so that the
// selection is far from ties: rows 0 and 1 share experts 2 and 3, row 2 picks row 0's experts with other inputs,
// row 3 picks experts no other row picks.
const int kPreferred[kRows][kTopK] = {{0, 1, 2, 3}, {2, 3, 4, 5}, {0, 1, 2, 3}, {9, 10, 11, 12}};

TestMoe make_moe(DeviceMemory& memory, const Formats& f, std::mt19937& rng) {
  TestMoe m;
  std::vector<float> router = normal_values(rng, size_t(kExperts) * kHidden, 0.05f);
  for (int e = 0; e < kExperts; ++e) router[size_t(e) * kHidden + size_t(e)] += 3.0f;
  m.router = make_matrix(memory, f.router, router, kExperts, kHidden);
  m.shared_gate =
      make_matrix(memory, f.shared, normal_values(rng, size_t(kSharedInner) * kHidden, 0.1f), kSharedInner, kHidden);
  m.shared_up =
      make_matrix(memory, f.shared, normal_values(rng, size_t(kSharedInner) * kHidden, 0.1f), kSharedInner, kHidden);
  m.shared_down =
      make_matrix(memory, f.shared, normal_values(rng, size_t(kHidden) * kSharedInner, 0.1f), kHidden, kSharedInner);
  m.shared_scale = make_matrix(memory, f.shared, normal_values(rng, kHidden, 0.05f), 1, kHidden);
  for (int e = 0; e < kExperts; ++e) {
    m.gate.push_back(
        make_matrix(memory, f.gate_up, normal_values(rng, size_t(kInner) * kHidden, 0.1f), kInner, kHidden));
    m.up.push_back(make_matrix(memory, f.gate_up, normal_values(rng, size_t(kInner) * kHidden, 0.1f), kInner, kHidden));
    m.down.push_back(make_matrix(memory, f.down, normal_values(rng, size_t(kHidden) * kInner, 0.1f), kHidden, kInner));
  }
  test::describe_on_device(m, memory, f.gate_up, f.down);
  return m;
}

cuda::MoeBuffers make_buffers(DeviceMemory& memory) {
  return test::make_moe_buffers(memory, {kHidden, kInner, kSharedInner, {kExperts, kTopK, true}}, kRows);
}

class CudaMoeDecode : public ::testing::TestWithParam<Formats> {};

// Three chained fp32 products (the Q4 ones on tensor cores with ~22-bit activations) and an fp32 softmax: each
// output is off by rounding only, a few 1e-6 of the magnitude of its terms, up to ~30x more where silu(gate)·up
// cancels. The bound, 1e-3 of that magnitude, is far below what a wrong expert, row, slot or weight gives (order 1).
// All-Q4 experts take both paths at every row count: the six launches and the fused kernels (expert_decode.cuh),
// here with an odd number of 64-column groups in the shared expert (3) and another in the experts (2).
TEST_P(CudaMoeDecode, MatchesDoublePrecisionForOneToFourRows) {
  const Formats formats = GetParam();
  std::mt19937 rng(29);
  DeviceMemory memory;
  const TestMoe moe = make_moe(memory, formats, rng);
  const cuda::MoeBuffers buffers = make_buffers(memory);
  cuda::MoeShape shape;
  shape.hidden = kHidden;
  shape.inner = kInner;
  shape.shared_inner = kSharedInner;
  shape.route = {kExperts, kTopK, true};
  cuda::MoeDecodePlan plan = cuda::plan_moe_decode(moe.device, shape, buffers);
  ASSERT_TRUE(plan.decodes);
  ASSERT_EQ(plan.fused, formats.gate_up == WeightFormat::Q4 && formats.down == WeightFormat::Q4 &&
                            formats.shared == WeightFormat::Q4);
  for (const int fused_rows : {0, kRows}) {
    if (fused_rows > 0 && !plan.fused) continue;
    plan.fused_max_rows = fused_rows;
    const char* path = fused_rows ? "fused" : "six launches";
    for (int rows = 1; rows <= kRows; ++rows) {
      std::vector<float> x = normal_values(rng, size_t(rows) * kHidden, 1.0f);
      for (int r = 0; r < rows; ++r)
        for (int e : kPreferred[r]) x[size_t(r) * kHidden + size_t(e)] += kRouteBoost;
      ASSERT_EQ(cudaMemcpy(const_cast<float*>(buffers.input), x.data(), x.size() * 4, cudaMemcpyHostToDevice),
                cudaSuccess);
      cuda::moe_decode(moe.device, shape, plan, buffers, rows, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      std::vector<float> y(x.size());
      std::vector<int> ids(size_t(rows) * kTopK);
      ASSERT_EQ(cudaMemcpy(y.data(), buffers.output, y.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      ASSERT_EQ(cudaMemcpy(ids.data(), buffers.route_ids, ids.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      const test::MoeReference ref = test::reference_moe(moe, std::vector<double>(x.begin(), x.end()), rows, kTopK);
      for (int r = 0; r < rows; ++r) {
        // The fixture's premise: the k-th and (k+1)-th probabilities are far apart, so fp32 cannot pick differently.
        EXPECT_GT(ref.pick_margin[size_t(r)], 100.0) << "row " << r;
        const std::set<int> picked(ids.begin() + r * kTopK, ids.begin() + (r + 1) * kTopK);
        EXPECT_EQ(picked, ref.picks[size_t(r)]) << path << ", " << rows << " rows, row " << r;
        EXPECT_EQ(picked, std::set<int>(std::begin(kPreferred[r]), std::end(kPreferred[r]))) << "the fixture's premise";
      }
      for (size_t i = 0; i < y.size(); ++i)
        ASSERT_NEAR(y[i], ref.y[i], 1e-3 * ref.magnitude[i])
            << path << ", " << rows << " rows, row " << i / kHidden << ", column " << i % kHidden;
    }
  }
}

const Formats kAllQ4{WeightFormat::Q4, WeightFormat::Q4, WeightFormat::Q4, WeightFormat::Q4};
const Formats kAllBf16{WeightFormat::BF16, WeightFormat::BF16, WeightFormat::BF16, WeightFormat::BF16};
// The router in its own GEMV launch, the shared expert through linear(), down in another format than gate and up.
const Formats kMixed{WeightFormat::BF16, WeightFormat::F32, WeightFormat::Q4, WeightFormat::BF16};
// Q4 down (SwiGLU staged by its kernel) after BF16 gate and up, with the shared expert through linear() (its SwiGLU
// a launch of its own).
const Formats kQ4Down{WeightFormat::BF16, WeightFormat::F32, WeightFormat::BF16, WeightFormat::Q4};

std::string formats_name(const ::testing::TestParamInfo<Formats>& info) {
  static const char* const names[] = {"all_q4", "all_bf16", "mixed", "q4_down"};
  return names[info.index];
}

INSTANTIATE_TEST_SUITE_P(Formats, CudaMoeDecode, ::testing::Values(kAllQ4, kAllBf16, kMixed, kQ4Down), formats_name);

TEST(CudaMoeDecodePlan, F32ExpertsTakeTheGeneralPath) {
  std::mt19937 rng(3);
  DeviceMemory memory;
  const TestMoe moe = make_moe(memory, {WeightFormat::Q4, WeightFormat::Q4, WeightFormat::F32, WeightFormat::F32}, rng);
  cuda::MoeShape shape{kHidden, kInner, kSharedInner, {kExperts, kTopK, true}};
  EXPECT_FALSE(cuda::plan_moe_decode(moe.device, shape, make_buffers(memory)).decodes);
}

// A Q4 matrix of random codes, scales and biases (finite weights of order 0.1), without the host values: for tests
// that compare the GPU with itself.
cuda::DeviceMatrix random_q4(DeviceMemory& memory, int rows, int cols, std::mt19937& rng) {
  std::uniform_int_distribution<uint32_t> word;
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  const size_t n = size_t(rows) * size_t(cols);
  std::vector<uint32_t> codes(n / 8);
  for (uint32_t& c : codes) c = word(rng);
  std::vector<uint16_t> scales(n / 64), biases(n / 64);
  for (uint16_t& v : scales) v = f32_to_bf16(0.01f * uniform(rng));
  for (uint16_t& v : biases) v = f32_to_bf16(0.05f * uniform(rng));
  cuda::DeviceMatrix m;
  m.format = WeightFormat::Q4;
  m.rows = rows;
  m.cols = cols;
  m.bits = 4;
  m.data = memory.copy(codes);
  m.scales = memory.copy(scales);
  m.biases = memory.copy(biases);
  return m;
}

// The MoE block of a 1–4-row pass (at 2–4 rows the six launches; Flash-Next's widths, 40 Q4 experts, top 10, so that
// the expert launches take gemv_quant_rounds_kernel) after a producer that writes the block's input late. The expert
// down launch reads its descriptors, which the routing writes two launches back, and gate/up (at one row the fused
// products, whose output is also checked as fixed-point sums) stages the block's input, before their waits: correct
// only because the launches in between let their dependents start after their own waits. Descriptors and slots are
// zeroed first (rows = 0: no work), the input, the expert buffers and the output poisoned (NaN), so a read of any of
// them before its writer finished shows in the output.
TEST(CudaDependentLaunch, MoeBlockAfterLateInputMatchesFinishedInput) {
  constexpr int kHidden = 2560, kInner = 640, kSharedInner = 640, kExperts = 40, kTopK = 10;
  std::mt19937 rng(23);
  std::normal_distribution<float> normal;
  DeviceMemory memory;
  const auto q4 = [&](int rows, int cols) { return random_q4(memory, rows, cols, rng); };
  cuda::DeviceMoe moe;
  moe.router = q4(kExperts, kHidden);
  moe.shared_gate = q4(1, kHidden);
  moe.shared = {q4(kSharedInner, kHidden), q4(kSharedInner, kHidden), q4(kHidden, kSharedInner)};
  std::vector<cuda::DeviceMatrix> gate, up, down;
  for (int e = 0; e < kExperts; ++e) {
    gate.push_back(q4(kInner, kHidden));
    up.push_back(q4(kInner, kHidden));
    down.push_back(q4(kHidden, kInner));
  }
  moe.expert_gate = memory.copy(gate);
  moe.expert_up = memory.copy(up);
  moe.expert_down = memory.copy(down);
  moe.gate_up_format = moe.down_format = WeightFormat::Q4;
  const cuda::MoeShape shape{kHidden, kInner, kSharedInner, {kExperts, kTopK, true}};
  const cuda::MoeBuffers buffers = test::make_moe_buffers(memory, shape, cuda::kMaxGemvRows);
  const cuda::MoeDecodePlan plan = cuda::plan_moe_decode(moe, shape, buffers);
  ASSERT_TRUE(plan.decodes);
  ASSERT_EQ(plan.fused_max_rows, 1);  // 2–4 rows take the six launches
  ASSERT_TRUE(cuda::moe_decode_takes_fixed(plan, 1));
  ASSERT_GT(cuda::gemv_expert_rounds(2 * 4 * kTopK, kInner, kHidden, 4), 1) << "the premise: the rounds kernel";
  const size_t slot_rows = size_t(cuda::kMaxGemvRows) * kTopK * cuda::kMaxGemvRows;  // [slot, row] of the buffers
  unsigned long long* sums = memory.zeros<unsigned long long>(kHidden);
  for (int rows = 1; rows <= cuda::kMaxGemvRows; ++rows) {
    std::vector<float> x(size_t(rows) * kHidden);
    for (float& v : x) v = normal(rng);
    float* final_x = memory.copy(x);
    float* input = const_cast<float*>(buffers.input);
    const size_t x_bytes = x.size() * sizeof(float), outputs = x.size();
    ASSERT_EQ(cudaMemcpy(input, final_x, x_bytes, cudaMemcpyDeviceToDevice), cudaSuccess);
    cuda::moe_decode(moe, shape, plan, buffers, rows, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<float> expected = test::download(buffers.output, outputs);
    for (bool graph : {false, true}) {
      ASSERT_EQ(cudaMemset(input, 0xff, x_bytes), cudaSuccess);
      ASSERT_EQ(cudaMemset(buffers.output, 0xff, outputs * sizeof(float)), cudaSuccess);
      ASSERT_EQ(cudaMemset(buffers.descriptors, 0, cuda::moe_descriptor_count(kTopK) * sizeof(cuda::GemvMatrix)),
                cudaSuccess);
      ASSERT_EQ(cudaMemset(buffers.slot_of, 0, cuda::moe_slot_count(kTopK) * sizeof(int)), cudaSuccess);
      for (float* expert : {buffers.expert_gate, buffers.expert_up})
        ASSERT_EQ(cudaMemset(expert, 0xff, slot_rows * kInner * sizeof(float)), cudaSuccess);
      ASSERT_EQ(cudaMemset(buffers.expert_out, 0xff, slot_rows * kHidden * sizeof(float)), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      test::after_late_producer(final_x, input, x_bytes, graph, [&](cudaStream_t stream) {
        cuda::moe_decode(moe, shape, plan, buffers, rows, stream);
      });
      EXPECT_EQ(std::memcmp(test::download(buffers.output, outputs).data(), expected.data(), outputs * sizeof(float)),
                0)
          << rows << " rows, graph " << graph;
    }
    if (rows > 1) continue;
    // One row's output as fixed-point sums (the decode step's, expert_decode.cuh): the same sums after the late input.
    ASSERT_EQ(cudaMemcpy(input, final_x, x_bytes, cudaMemcpyDeviceToDevice), cudaSuccess);
    cuda::moe_decode(moe, shape, plan, buffers, 1, nullptr, sums);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<unsigned long long> expected_sums = test::download(sums, kHidden);
    for (bool graph : {false, true}) {
      ASSERT_EQ(cudaMemset(input, 0xff, x_bytes), cudaSuccess);
      ASSERT_EQ(cudaMemset(sums, 0, kHidden * sizeof(unsigned long long)), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      test::after_late_producer(final_x, input, x_bytes, graph, [&](cudaStream_t stream) {
        cuda::moe_decode(moe, shape, plan, buffers, 1, stream, sums);
      });
      EXPECT_EQ(test::download(sums, kHidden), expected_sums) << "fixed-point sums, graph " << graph;
    }
  }
}

// 512 experts, top 10 (Flash-Next's router) over logits on a 1/4 grid, so that many are exactly equal: equal logits
// give bit-equal probabilities on both sides, and unequal ones differ by a factor e^(1/4), so the CPU's order
// (probability descending, then index ascending: src/cpu/moe.cpp's partial_sort) is the only right answer. Rows
// span two blocks; one row is all ties, one has its winners at the highest indices. Also the kernel's other register
// layout (2048 experts, the most, with top 32, the most) and an expert count that is no multiple of 32. moe_route_slots
// (a block a row: per-warp sorts merged in a tree) must give the same picks and weights.
class CudaMoeRoute : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(CudaMoeRoute, TopKMatchesTheCpuOrderWithTies) {
  const auto [experts, top_k] = GetParam();
  constexpr int rows = 6;
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> level(0, 23);
  std::vector<float> logits(size_t(rows) * experts);
  for (float& v : logits) v = float(level(rng)) / 4.0f;
  std::fill(logits.begin() + 2 * experts, logits.begin() + 3 * experts, 1.5f);
  for (int e = experts - 12; e < experts; ++e) logits[size_t(3) * experts + size_t(e)] = 9.0f;
  DeviceMemory memory;
  const float* device_logits = memory.copy(logits);
  int* ids = memory.zeros<int>(size_t(rows) * top_k);
  float* weights = memory.zeros<float>(size_t(rows) * top_k);
  cuda::ExpertSlots slots;
  slots.expert = memory.zeros<int>(cuda::moe_slot_count(top_k));
  slots.count = memory.zeros<int>(1);
  slots.weights = memory.zeros<float>(cuda::moe_slot_weight_count(top_k));
  // moe_route (a warp a row) over every row, and moe_route_slots over the first row (the block a row) and over the
  // first kMaxGemvRows, the most it takes (up to 512 experts a warp a row, past that the block a row): the same
  // answers.
  struct Case {
    bool norm_topk, route_slots;
    int checked;  // rows
  };
  for (const auto& [norm_topk, route_slots, checked] :
       {Case{true, false, rows}, Case{false, false, rows}, Case{true, true, 1}, Case{false, true, 1},
        Case{true, true, cuda::kMaxGemvRows}, Case{false, true, cuda::kMaxGemvRows}}) {
    ASSERT_EQ(cudaMemset(ids, 0xff, size_t(rows) * top_k * sizeof(int)), cudaSuccess);
    if (route_slots)
      cuda::moe_route_slots({experts, top_k, norm_topk}, device_logits, checked, ids, weights, slots, nullptr);
    else
      cuda::moe_route({experts, top_k, norm_topk}, device_logits, rows, ids, weights, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<int> got_ids(size_t(rows) * top_k);
    std::vector<float> got_weights(got_ids.size());
    ASSERT_EQ(cudaMemcpy(got_ids.data(), ids, got_ids.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(got_weights.data(), weights, got_weights.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    for (int r = 0; r < checked; ++r) {
      const float* row = logits.data() + size_t(r) * experts;
      std::vector<int> order(experts);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return row[a] > row[b]; });
      double sum = 0, total = 0;
      for (int e = 0; e < experts; ++e) sum += std::exp(double(row[e]) - 5.75);
      for (int j = 0; j < top_k; ++j) total += std::exp(double(row[order[size_t(j)]]) - 5.75) / sum;
      for (int j = 0; j < top_k; ++j) {
        const size_t at = size_t(r) * top_k + size_t(j);
        EXPECT_EQ(got_ids[at], order[size_t(j)]) << "row " << r << ", pick " << j << (route_slots ? " (slots)" : "");
        const double p = std::exp(double(row[order[size_t(j)]]) - 5.75) / sum;
        // fp32 exp and a ≤ 2048-term fp32 sum: a few 1e-7 relative (the sum cancels in the renormalised weights).
        EXPECT_NEAR(got_weights[at], norm_topk ? p / total : p, 1e-5 * p / (norm_topk ? total : 1.0))
            << "row " << r << ", pick " << j << (route_slots ? " (slots)" : "");
      }
    }
  }
}

// moe_route_and_plan (the 2–4-row path): on the same tied logits, the distinct experts of 2–4 rows numbered in
// first-come order of the CPU's picks, each selection's slot, the count, and each slot's gate, up and down descriptors
// (the expert's matrices, the slot's activations and outputs); slots from the count to rows·top_k empty (rows = 0),
// the shared expert's down after the selections. Row 1 repeats two thirds of row 0's logits so that rows share experts.
TEST_P(CudaMoeRoute, PlanNumbersDistinctExpertsFirstCome) {
  const auto [experts, top_k] = GetParam();
  constexpr int rows = cuda::kMaxGemvRows, inner = 64, hidden = 128;
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> level(0, 23);
  std::vector<float> logits(size_t(rows) * experts);
  for (float& v : logits) v = float(level(rng)) / 4.0f;
  for (int e = 0; e < experts; ++e)
    if (e % 3 != 0) logits[size_t(experts) + size_t(e)] = logits[size_t(e)];
  std::fill(logits.begin() + 2 * experts, logits.begin() + 3 * experts, 1.5f);
  for (int e = experts - 12; e < experts; ++e) logits[size_t(3) * experts + size_t(e)] = 9.0f;
  DeviceMemory memory;
  const float* device_logits = memory.copy(logits);
  std::vector<cuda::DeviceMatrix> tables[3];  // gate, up, down: only their fields are copied, never dereferenced
  for (int which = 0; which < 3; ++which)
    for (int e = 0; e < experts; ++e) {
      cuda::DeviceMatrix m;
      m.format = WeightFormat::Q4;
      m.rows = which == 2 ? hidden : inner;
      m.cols = which == 2 ? inner : hidden;
      m.data = reinterpret_cast<const void*>(uintptr_t(0x100000) * (which + 1) + uintptr_t(e) * 0x100);
      tables[which].push_back(m);
    }
  const size_t slots = size_t(cuda::kMaxGemvRows) * size_t(top_k);
  cuda::ExpertPlan plan;
  plan.gate = memory.copy(tables[0]);
  plan.up = memory.copy(tables[1]);
  plan.down = memory.copy(tables[2]);
  plan.inner = inner;
  plan.hidden = hidden;
  plan.x = memory.zeros<float>(size_t(rows) * hidden);
  plan.gate_out = memory.zeros<float>(slots * rows * inner);
  plan.up_out = memory.zeros<float>(slots * rows * inner);
  plan.down_out = memory.zeros<float>(slots * rows * hidden);
  plan.gate_up = memory.zeros<cuda::GemvMatrix>(cuda::moe_descriptor_count(top_k));
  plan.down_products = plan.gate_up + 2 * slots;
  plan.slot_of = memory.zeros<int>(cuda::moe_slot_count(top_k));
  plan.swiglu_in_down = true;
  plan.shared_down.rows = 7;
  int* ids = memory.zeros<int>(size_t(rows) * top_k);
  float* weights = memory.zeros<float>(size_t(rows) * top_k);
  for (int pass_rows = 1; pass_rows <= rows; ++pass_rows) {
    ASSERT_EQ(cudaMemset(plan.gate_up, 0xff, cuda::moe_descriptor_count(top_k) * sizeof(cuda::GemvMatrix)),
              cudaSuccess);
    ASSERT_EQ(cudaMemset(plan.slot_of, 0xff, cuda::moe_slot_count(top_k) * sizeof(int)), cudaSuccess);
    cuda::moe_route_and_plan({experts, top_k, true}, device_logits, pass_rows, ids, weights, plan, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    // The CPU's picks (probability descending, then index ascending), numbered first come.
    const int selections = pass_rows * top_k;
    std::vector<int> expected_slot, expert_of_slot;
    for (int r = 0; r < pass_rows; ++r) {
      const float* row = logits.data() + size_t(r) * experts;
      std::vector<int> order(experts);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return row[a] > row[b]; });
      for (int j = 0; j < top_k; ++j) {
        const int e = order[size_t(j)];
        const auto known = std::find(expert_of_slot.begin(), expert_of_slot.end(), e);
        expected_slot.push_back(int(known - expert_of_slot.begin()));
        if (known == expert_of_slot.end()) expert_of_slot.push_back(e);
      }
    }
    // Each row's picks in the CPU's order, and their weights: the renormalised softmax in double. In fp32 the
    // softmax's total cancels out of a weight, leaving two expf (≤ 2 ulp each), three roundings and the picked sum's
    // top_k − 1: ≤ 3e-6 relative at top 32 (2^-23 = 1.2e-7 an ulp).
    const std::vector<int> got_ids = test::download(ids, size_t(selections));
    const std::vector<float> got_weights = test::download(weights, size_t(selections));
    for (int r = 0; r < pass_rows; ++r) {
      const float* row = logits.data() + size_t(r) * experts;
      std::vector<int> order(experts);
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return row[a] > row[b]; });
      const double peak = row[order[0]];
      double picked_sum = 0.0;
      for (int j = 0; j < top_k; ++j) picked_sum += std::exp(double(row[order[size_t(j)]]) - peak);
      for (int j = 0; j < top_k; ++j) {
        const size_t at = size_t(r) * top_k + size_t(j);
        EXPECT_EQ(got_ids[at], order[size_t(j)]) << "row " << r << " pick " << j;
        const double want = std::exp(double(row[order[size_t(j)]]) - peak) / picked_sum;
        EXPECT_NEAR(got_weights[at], want, 3e-6 * want) << "row " << r << " pick " << j;
      }
    }
    const int count = int(expert_of_slot.size());
    if (pass_rows == rows) {
      EXPECT_LT(count, selections) << "the premise: rows share experts";
    }
    const std::vector<int> slot_of = test::download(plan.slot_of, size_t(selections) + 1);
    EXPECT_EQ(std::vector<int>(slot_of.begin(), slot_of.end() - 1), expected_slot) << pass_rows << " rows";
    EXPECT_EQ(slot_of.back(), count) << pass_rows << " rows";
    const std::vector<cuda::GemvMatrix> got = test::download(plan.gate_up, cuda::moe_descriptor_count(top_k));
    const size_t gate_block = size_t(pass_rows) * inner, down_block = size_t(pass_rows) * hidden;
    for (int j = 0; j < selections; ++j) {
      const cuda::GemvMatrix &gate = got[2 * size_t(j)], &up = got[2 * size_t(j) + 1],
                             &down = got[2 * slots + size_t(j)];
      if (j >= count) {
        EXPECT_EQ(gate.rows, 0) << "slot " << j;
        EXPECT_EQ(up.rows, 0) << "slot " << j;
        EXPECT_EQ(down.rows, 0) << "slot " << j;
        continue;
      }
      const int e = expert_of_slot[size_t(j)];
      EXPECT_EQ(static_cast<const void*>(gate.codes), tables[0][size_t(e)].data) << "slot " << j;
      EXPECT_EQ(static_cast<const void*>(up.codes), tables[1][size_t(e)].data) << "slot " << j;
      EXPECT_EQ(static_cast<const void*>(down.codes), tables[2][size_t(e)].data) << "slot " << j;
      EXPECT_EQ(gate.rows, inner);
      EXPECT_EQ(down.rows, hidden);
      EXPECT_EQ(gate.x, plan.x);
      EXPECT_EQ(up.x, plan.x);
      EXPECT_EQ(gate.y, plan.gate_out + j * gate_block) << "slot " << j;
      EXPECT_EQ(up.y, plan.up_out + j * gate_block) << "slot " << j;
      EXPECT_EQ(down.x, plan.gate_out + j * gate_block) << "slot " << j;
      EXPECT_EQ(down.x_up, plan.up_out + j * gate_block) << "slot " << j;
      EXPECT_EQ(down.y, plan.down_out + j * down_block) << "slot " << j;
    }
    EXPECT_EQ(got[2 * slots + size_t(selections)].rows, 7) << "the shared expert's down";
  }
}

INSTANTIATE_TEST_SUITE_P(Experts, CudaMoeRoute,
                         ::testing::Values(std::pair{512, 10}, std::pair{2048, 32}, std::pair{100, 8}),
                         [](const auto& info) {
                           return std::to_string(info.param.first) + "_top" + std::to_string(info.param.second);
                         });

}  // namespace
}  // namespace vavilov
