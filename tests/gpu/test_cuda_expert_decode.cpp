// The fused Q4 expert kernels of a decode step (src/cuda/expert_decode.*, moe_route_slots in moe.cu) at Flash-Next's
// widths against a double-precision evaluation of the spec's MoE on the host: softmax router, top-k renormalised,
// Σ w_e·down_e(silu(gate_e x)·up_e x) + σ(shared_gate·x)·shared(x), for 1–4 rows whose experts overlap.
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

#include "core/error.h"
#include "cuda/expert_decode.cuh"
#include "cuda/moe_block.h"
#include "device_matrices.h"
#include "late_producer.h"
#include "moe_buffers.h"
#include "moe_reference.h"

namespace vavilov {
namespace {

using test::DeviceMemory;
using test::normal_values;
using test::TestMoe;

// Flash-Next's hidden, expert and shared-expert widths and top-k; fewer experts (24), so that 4 rows of 10 picks must
// share some.
constexpr int kHidden = 2560, kInner = 640, kSharedInner = 640, kExperts = 24, kTopK = 10;
constexpr int kRows = cuda::kMaxGemvRows;

TestMoe make_q4_moe(DeviceMemory& memory, std::mt19937& rng) {
  return test::random_q4_moe(memory, rng, kHidden, kInner, kSharedInner, kExperts);
}

// Inputs whose k-th and (k+1)-th router probabilities differ by more than 1 % (fp32 cannot swap them): a common part
// plus each row's own, so that rows agree on some experts.
std::vector<float> distinct_inputs(const TestMoe& m, std::mt19937& rng, int rows, int hidden, int top_k) {
  const std::vector<float> common = normal_values(rng, size_t(hidden), 1.0f);
  std::vector<float> x(size_t(rows) * size_t(hidden));
  for (int r = 0; r < rows; ++r) {
    for (int attempt = 0;; ++attempt) {
      if (attempt == 100) {  // never met: a random draw has such a gap most of the time
        ADD_FAILURE() << "no input with distinct router scores";
        break;
      }
      const std::vector<float> own = normal_values(rng, size_t(hidden), 1.0f);
      std::vector<double> row(static_cast<size_t>(hidden));
      for (size_t c = 0; c < size_t(hidden); ++c) row[c] = x[size_t(r) * size_t(hidden) + c] = common[c] + own[c];
      const std::vector<double> p = test::router_probabilities(m, row.data());
      const std::vector<int> order = test::probability_ranking(p);
      if (p[size_t(order[size_t(top_k) - 1])] > 1.01 * p[size_t(order[size_t(top_k)])]) break;
    }
  }
  return x;
}

cuda::MoeBuffers make_buffers(DeviceMemory& memory) {
  return test::make_moe_buffers(memory, {kHidden, kInner, kSharedInner, {kExperts, kTopK, true}}, kRows);
}

// The fused path at Flash-Next's widths (kExperts experts), planned.
struct FusedMoe {
  DeviceMemory memory;
  TestMoe moe;
  cuda::MoeBuffers buffers;
  cuda::MoeShape shape{kHidden, kInner, kSharedInner, {kExperts, kTopK, true}};
  cuda::MoeDecodePlan plan;

  explicit FusedMoe(std::mt19937& rng)
      : moe(make_q4_moe(memory, rng)),
        buffers(make_buffers(memory)),
        plan(cuda::plan_moe_decode(moe.device, shape, buffers)) {}
};

std::vector<float> run_decode(const TestMoe& moe, const cuda::MoeShape& shape, const cuda::MoeDecodePlan& plan,
                              const cuda::MoeBuffers& buffers, const std::vector<float>& x, int rows,
                              std::vector<int>& ids) {
  EXPECT_EQ(cudaMemcpy(const_cast<float*>(buffers.input), x.data(), x.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  cuda::moe_decode(moe.device, shape, plan, buffers, rows, nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> y(x.size());
  ids.resize(size_t(rows) * size_t(shape.route.top_k));
  EXPECT_EQ(cudaMemcpy(y.data(), buffers.output, y.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(ids.data(), buffers.route_ids, ids.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  return y;
}

// Q4 products on tensor cores with ~22-bit activations, fp32 sums and an fp32 softmax: each output is off by rounding
// only, a few 1e-6 of the magnitude of its terms (more where silu(gate)·up cancels). The bound, 1e-3 of that
// magnitude, is far below what a wrong expert, row, slot, group of h or weight gives (order 1). A second run must give
// the same bits (fixed summation order).
void expect_fused_matches_double_precision(const cuda::MoeShape& shape, unsigned seed) {
  std::mt19937 rng(seed);
  DeviceMemory memory;
  const TestMoe moe =
      test::random_q4_moe(memory, rng, shape.hidden, shape.inner, shape.shared_inner, shape.route.experts);
  const cuda::MoeBuffers buffers = test::make_moe_buffers(memory, shape, kRows);
  cuda::MoeDecodePlan plan = cuda::plan_moe_decode(moe.device, shape, buffers);
  ASSERT_TRUE(plan.decodes);
  ASSERT_TRUE(plan.fused);
  plan.fused_max_rows = kRows;  // the kernels at every row count, not only those the engine sends them
  const int hidden = shape.hidden, top_k = shape.route.top_k;
  for (int rows = 1; rows <= kRows; ++rows) {
    const std::vector<float> x = distinct_inputs(moe, rng, rows, hidden, top_k);
    std::vector<int> ids, again_ids;
    const std::vector<float> y = run_decode(moe, shape, plan, buffers, x, rows, ids);
    const test::MoeReference ref = test::reference_moe(moe, std::vector<double>(x.begin(), x.end()), rows, top_k);
    std::set<int> all;
    for (int r = 0; r < rows; ++r) {
      const std::set<int> picked(ids.begin() + r * top_k, ids.begin() + (r + 1) * top_k);
      EXPECT_EQ(picked, ref.picks[size_t(r)]) << rows << " rows, row " << r;
      all.insert(picked.begin(), picked.end());
    }
    if (rows > 1) {  // the premise: the rows share some experts and not all
      EXPECT_LT(all.size(), size_t(rows * top_k));
      EXPECT_GT(all.size(), size_t(top_k));
    }
    for (size_t i = 0; i < y.size(); ++i)
      ASSERT_NEAR(y[i], ref.y[i], 1e-3 * ref.magnitude[i])
          << rows << " rows, row " << i / size_t(hidden) << ", column " << i % size_t(hidden);
    const std::vector<float> again = run_decode(moe, shape, plan, buffers, x, rows, again_ids);
    EXPECT_EQ(again_ids, ids);
    EXPECT_EQ(0, std::memcmp(again.data(), y.data(), y.size() * sizeof(float))) << rows << " rows: not reproducible";
  }
}

TEST(CudaExpertDecode, FusedQ4MatchesDoublePrecisionForOneToFourRows) {
  expect_fused_matches_double_precision({kHidden, kInner, kSharedInner, {kExperts, kTopK, true}}, 41);
}

// Experts and a shared expert of different widths (2 and 3 groups of h, so the shared expert's partials reach past
// the experts'), a hidden width of 20 output tiles (fewer than a block's warps take in one round of down tiles) that
// is no multiple of the combine's 32 columns, and top 4 of 12.
TEST(CudaExpertDecode, FusedQ4MatchesDoublePrecisionAtSmallUnevenWidths) {
  expect_fused_matches_double_precision({320, 128, 192, {12, 4, true}}, 47);
}

// A 1-row pass given a fixed-point output (the decode step's, read by the hyper-connection read after it): each
// products block adds its weighted partials into it as 64-bit integers, with no combine launch. The sums must match
// the spec's MoE as the float output does (same bound), differ from the float combine only by rounding (each path is
// within a few 1e-6 of the magnitude, so 1e-5 of it; a wrong weight or a lost block is of order one), and add: a
// second pass into the same sums doubles them exactly, whatever order the blocks arrive in. The picks are written as
// in the float pass.
TEST(CudaExpertDecode, OneRowFixedPointOutputAddsTheCombinedSums) {
  std::mt19937 rng(59);
  FusedMoe fused(rng);
  const TestMoe& moe = fused.moe;
  const cuda::MoeDecodePlan& plan = fused.plan;
  ASSERT_TRUE(plan.fused);
  EXPECT_TRUE(cuda::moe_decode_takes_fixed(plan, 1));
  EXPECT_FALSE(cuda::moe_decode_takes_fixed(plan, 2)) << "several rows take the combine";
  const std::vector<float> x = distinct_inputs(moe, rng, 1, kHidden, kTopK);
  std::vector<int> ids;
  const std::vector<float> combined = run_decode(moe, fused.shape, plan, fused.buffers, x, 1, ids);
  const test::MoeReference ref = test::reference_moe(moe, std::vector<double>(x.begin(), x.end()), 1, kTopK);
  unsigned long long* sums = fused.memory.zeros<unsigned long long>(kHidden);
  ASSERT_EQ(cudaMemset(fused.buffers.route_ids, 0xff, kTopK * sizeof(int)), cudaSuccess);
  std::vector<std::vector<unsigned long long>> passes;
  for (int pass = 0; pass < 2; ++pass) {
    cuda::moe_decode(moe.device, fused.shape, plan, fused.buffers, 1, nullptr, sums);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    passes.push_back(test::download(sums, kHidden));
  }
  EXPECT_EQ(test::download(fused.buffers.route_ids, kTopK), ids);
  for (int i = 0; i < kHidden; ++i) {
    const size_t at = size_t(i);
    const double y = double(static_cast<long long>(passes[0][at])) / 4294967296.0;
    ASSERT_NEAR(y, ref.y[at], 1e-3 * ref.magnitude[at]) << "column " << i;
    ASSERT_NEAR(y, combined[at], 1e-5 * ref.magnitude[at]) << "column " << i;
    ASSERT_EQ(passes[1][at], 2 * passes[0][at]) << "column " << i << ": the second pass does not add the same sums";
  }
  EXPECT_THROW(cuda::moe_decode(moe.device, fused.shape, plan, fused.buffers, 2, nullptr, sums), Error)
      << "two rows cannot leave fixed-point sums";
}

// The step's slots: first-come over the rows' picks in order, each row's weight of each slot's expert (0 where it did
// not pick it), each slot's gate/up/down descriptors copied from the expert tables (rows 0 for empty slots), at
// Flash-Next's 512 experts and top 10. Logits are a random permutation of distinct values, and rows 2 and 3 repeat
// parts of rows 0 and 1, so that picks repeat across rows.
TEST(CudaExpertDecode, RouteSlotsListTheDistinctExpertsInFirstComeOrder) {
  constexpr int experts = 512, top_k = 10, rows = cuda::kMaxGemvRows;
  std::mt19937 rng(13);
  std::vector<float> logits(size_t(rows) * experts);
  for (int r = 0; r < rows; ++r) {
    std::vector<int> rank(experts);
    std::iota(rank.begin(), rank.end(), 0);
    std::shuffle(rank.begin(), rank.end(), rng);
    for (int e = 0; e < experts; ++e) logits[size_t(r) * experts + size_t(e)] = float(rank[size_t(e)]) / 64.0f;
  }
  for (int e = 0; e < experts; e += 2) {  // row 2: row 0's even experts; row 3: row 1's odd ones
    logits[size_t(2) * experts + size_t(e)] = logits[size_t(e)];
    logits[size_t(3) * experts + size_t(e + 1)] = logits[size_t(experts + e + 1)];
  }
  DeviceMemory memory;
  const float* device_logits = memory.copy(logits);
  int* ids = memory.zeros<int>(size_t(rows) * top_k);
  float* weights = memory.zeros<float>(size_t(rows) * top_k);
  int* slot_of = memory.zeros<int>(cuda::moe_slot_count(top_k));
  float* slot_weights = memory.zeros<float>(cuda::moe_slot_weight_count(top_k));
  // Expert tables whose entries tell the experts apart (the kernel copies them, it never reads what they point to).
  std::vector<cuda::DeviceMatrix> tables[3];
  for (int m = 0; m < 3; ++m)
    for (int e = 0; e < experts; ++e) {
      cuda::DeviceMatrix d;
      d.format = cuda::WeightFormat::Q4;
      d.rows = 100 * (m + 1);
      d.cols = 64 * (m + 1);
      const uintptr_t base = uintptr_t(0x10000000) * uintptr_t(m + 1) + uintptr_t(e) * 0x1000;
      d.data = reinterpret_cast<const void*>(base);
      d.scales = reinterpret_cast<const uint16_t*>(base + 0x100);
      d.biases = reinterpret_cast<const uint16_t*>(base + 0x200);
      tables[m].push_back(d);
    }
  cuda::GemvMatrix* matrices = memory.zeros<cuda::GemvMatrix>(cuda::moe_descriptor_count(top_k));
  cuda::ExpertSlots slots{slot_of, slot_of + rows * top_k, slot_weights};
  slots.gate = memory.copy(tables[0]);
  slots.up = memory.copy(tables[1]);
  slots.down = memory.copy(tables[2]);
  slots.matrices = matrices;
  for (int used = 1; used <= rows; ++used) {
    ASSERT_EQ(cudaMemset(matrices, 0xff, cuda::moe_descriptor_count(top_k) * sizeof(cuda::GemvMatrix)), cudaSuccess);
    cuda::moe_route_slots({experts, top_k, true}, device_logits, used, ids, weights, slots, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<int> got_slots(cuda::moe_slot_count(top_k));
    std::vector<float> got_weights(cuda::moe_slot_weight_count(top_k));
    std::vector<cuda::GemvMatrix> got_matrices(cuda::moe_descriptor_count(top_k));
    ASSERT_EQ(cudaMemcpy(got_slots.data(), slot_of, got_slots.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(got_weights.data(), slot_weights, got_weights.size() * 4, cudaMemcpyDeviceToHost),
              cudaSuccess);
    ASSERT_EQ(cudaMemcpy(got_matrices.data(), matrices, got_matrices.size() * sizeof(cuda::GemvMatrix),
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    std::vector<int> expected_slots;
    std::vector<std::vector<double>> expected_weights;  // [slot][row]
    for (int r = 0; r < used; ++r) {
      const float* row = logits.data() + size_t(r) * experts;
      std::vector<double> p(row, row + experts);
      const double peak = *std::max_element(p.begin(), p.end());
      double sum = 0, total = 0;
      for (double& v : p) sum += (v = std::exp(v - peak));
      const std::vector<int> order = test::probability_ranking(p);
      for (int j = 0; j < top_k; ++j) total += p[size_t(order[size_t(j)])];
      for (int j = 0; j < top_k; ++j) {
        const int e = order[size_t(j)];
        auto at = std::find(expected_slots.begin(), expected_slots.end(), e);
        if (at == expected_slots.end()) {
          expected_slots.push_back(e);
          expected_weights.emplace_back(size_t(cuda::kMaxGemvRows), 0.0);
          at = expected_slots.end() - 1;
        }
        expected_weights[size_t(at - expected_slots.begin())][size_t(r)] = p[size_t(e)] / total;
      }
    }
    if (used > 2) {
      EXPECT_LT(expected_slots.size(), size_t(used * top_k)) << "the premise: rows share experts";
    }
    ASSERT_EQ(got_slots[size_t(rows * top_k)], int(expected_slots.size())) << used << " rows";
    for (size_t j = 0; j < size_t(used * top_k); ++j)  // slot j's gate, up, down; empty past the distinct count
      for (int m = 0; m < 3; ++m) {
        const cuda::GemvMatrix& got = got_matrices[3 * j + size_t(m)];
        if (j >= expected_slots.size()) {
          EXPECT_EQ(got.rows, 0) << used << " rows, empty slot " << j << ", matrix " << m;
          continue;
        }
        const cuda::DeviceMatrix& want = tables[m][size_t(expected_slots[j])];
        EXPECT_EQ(got.rows, want.rows) << used << " rows, slot " << j << ", matrix " << m;
        EXPECT_EQ(got.cols, want.cols) << used << " rows, slot " << j << ", matrix " << m;
        EXPECT_EQ(static_cast<const void*>(got.codes), want.data) << used << " rows, slot " << j << ", matrix " << m;
        EXPECT_EQ(static_cast<const void*>(got.scales), static_cast<const void*>(want.scales));
        EXPECT_EQ(static_cast<const void*>(got.biases), static_cast<const void*>(want.biases));
      }
    for (size_t j = 0; j < expected_slots.size(); ++j) {
      EXPECT_EQ(got_slots[j], expected_slots[j]) << used << " rows, slot " << j;
      // fp32 exp over 512 terms and the renormalisation: a few 1e-7 relative.
      for (int b = 0; b < cuda::kMaxGemvRows; ++b)
        EXPECT_NEAR(got_weights[j * cuda::kMaxGemvRows + size_t(b)], expected_weights[j][size_t(b)], 1e-5)
            << used << " rows, slot " << j << ", row " << b;
    }
  }
}

// The fused path's launches after the router product (as moe_block.cpp's decode_fused): routing (a launch of its own
// from 2 rows), products and combine, on the logits and the shared-expert gate logits already in `buffers`.
void fused_chain(const cuda::MoeDecodePlan& plan, int rows, cudaStream_t stream) {
  ASSERT_EQ(cuda::expert_decode(plan.experts, rows, stream), cudaSuccess);
}

// The fused MoE experts of a decode pass as dependent launches: the routing (route_slots_kernel, or each products block
// in a 1-row pass) takes the router logits, the products and the combine the slots (descriptors, weights). A producer
// writes the logits late over a previous step's (whose slots, other experts, are still in the buffers); the chain's
// output must equal, bit for bit, the same chain on the finished logits: no kernel of it may take the slots or the
// logits before they are final (a kernel that reads them before its wait, as launch.cuh's two-deep rule allows,
// included).
TEST(CudaExpertDecode, ChainAfterLateLogitsMatchesFinishedLogits) {
  constexpr int hidden = 2560, inner = 640, experts = 64, top_k = 10;
  std::mt19937 rng(23);
  DeviceMemory memory;
  const TestMoe moe = test::random_q4_moe(memory, rng, hidden, inner, inner, experts);
  const cuda::MoeShape shape{hidden, inner, inner, {experts, top_k, true}};
  const cuda::MoeBuffers buffers = test::make_moe_buffers(memory, shape, cuda::kMaxGemvRows);
  const cuda::MoeDecodePlan plan = cuda::plan_moe_decode(moe.device, shape, buffers);
  ASSERT_TRUE(plan.fused);
  const std::vector<float> x = test::normal_values(rng, size_t(cuda::kMaxGemvRows) * hidden, 1.0f);
  const std::vector<float> scale = test::normal_values(rng, cuda::kMaxGemvRows, 1.0f);
  ASSERT_EQ(cudaMemcpy(const_cast<float*>(buffers.input), x.data(), x.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(buffers.shared_scale, scale.data(), scale.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  const size_t logit_count = size_t(cuda::kMaxGemvRows) * experts;
  const std::vector<float> previous = test::normal_values(rng, logit_count, 1.0f);  // the previous step's logits
  const float* final_logits = memory.copy(test::normal_values(rng, logit_count, 1.0f));
  for (int rows = 1; rows <= cuda::kMaxGemvRows; rows += 3) {
    const size_t outputs = size_t(rows) * hidden;
    const auto chain = [&](cudaStream_t stream) { fused_chain(plan, rows, stream); };
    const auto run_on = [&](const float* logits) {  // the chain on logits in place, and its picks
      ASSERT_EQ(cudaMemcpy(buffers.router, logits, logit_count * 4, cudaMemcpyDefault), cudaSuccess);
      chain(nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    };
    run_on(final_logits);
    const std::vector<float> expected = test::download(buffers.output, outputs);
    const std::vector<int> expected_ids = test::download(buffers.route_ids, size_t(rows) * top_k);
    for (bool graph : {false, true}) {
      run_on(previous.data());  // the slots, h and y of another step
      ASSERT_NE(test::download(buffers.route_ids, size_t(rows) * top_k), expected_ids) << "the premise: other experts";
      ASSERT_EQ(cudaMemset(buffers.output, 0xff, outputs * sizeof(float)), cudaSuccess);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      test::after_late_producer(final_logits, buffers.router, logit_count * sizeof(float), graph, chain);
      EXPECT_EQ(test::download(buffers.route_ids, size_t(rows) * top_k), expected_ids)
          << rows << " rows, graph " << graph;
      EXPECT_EQ(std::memcmp(test::download(buffers.output, outputs).data(), expected.data(), outputs * sizeof(float)),
                0)
          << rows << " rows, graph " << graph;
    }
  }
}

// A 1-row pass whose router probabilities tie across the top-k boundary: the slots' experts must be the CPU's picks in
// its order (ties to the lower index), and gate/up and down must take the same expert for each slot (one that took
// another would pair one expert's h with another's down). Router logits of four levels (many exact ties) and all
// equal: the picks, and the output against the spec's MoE over them.
TEST(CudaExpertDecode, OneRowPassOnTiedRouterScoresPicksAsTheCpu) {
  std::mt19937 rng(43);
  const FusedMoe fused(rng);
  const TestMoe& moe = fused.moe;
  const cuda::MoeBuffers& buffers = fused.buffers;
  const cuda::MoeDecodePlan& plan = fused.plan;
  ASSERT_TRUE(plan.fused);
  const std::vector<float> x = normal_values(rng, kHidden, 1.0f);
  const float scale = 0.3f;
  ASSERT_EQ(cudaMemcpy(const_cast<float*>(buffers.input), x.data(), x.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(buffers.shared_scale, &scale, 4, cudaMemcpyHostToDevice), cudaSuccess);
  const std::vector<double> xd(x.begin(), x.end());
  std::uniform_int_distribution<int> level(0, 3);
  for (int levels : {4, 4, 4, 1}) {
    std::vector<float> logits(kExperts);
    for (float& l : logits) l = levels == 1 ? 0.5f : 0.5f * float(level(rng));
    ASSERT_EQ(cudaMemcpy(buffers.router, logits.data(), logits.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    fused_chain(plan, 1, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<double> p(logits.begin(), logits.end());
    const double peak = *std::max_element(p.begin(), p.end());
    double sum = 0, total = 0;
    for (double& v : p) sum += (v = std::exp(v - peak));
    const std::vector<int> order = test::probability_ranking(p);
    for (int j = 0; j < kTopK; ++j) total += p[size_t(order[size_t(j)])];
    EXPECT_EQ(test::download(buffers.route_ids, kTopK), std::vector<int>(order.begin(), order.begin() + kTopK));
    std::vector<double> y(kHidden, 0.0), magnitude(kHidden, 0.0);
    for (int j = 0; j < kTopK; ++j) {
      const size_t e = size_t(order[size_t(j)]);
      test::add_feed_forward(moe.gate[e], moe.up[e], moe.down[e], xd.data(), p[e] / total, y.data(), magnitude.data());
    }
    test::add_feed_forward(moe.shared_gate, moe.shared_up, moe.shared_down, xd.data(), 1.0 / (1.0 + std::exp(-scale)),
                           y.data(), magnitude.data());
    const std::vector<float> got = test::download(buffers.output, kHidden);
    for (int i = 0; i < kHidden; ++i)  // as FusedQ4MatchesDoublePrecisionForOneToFourRows
      ASSERT_NEAR(got[size_t(i)], y[size_t(i)], 1e-3 * magnitude[size_t(i)]) << levels << " levels, column " << i;
  }
}

// A 1-row pass routes inside its products blocks (route_block.cuh, the function moe_route_slots runs): its picks and
// weights, and the weights and count it leaves for the combine, must be moe_route_slots' bit for bit, on random
// logits and on logits with many exact ties.
TEST(CudaExpertDecode, OneRowRoutingInsideTheProductsIsRouteSlots) {
  std::mt19937 rng(53);
  const FusedMoe fused(rng);
  const cuda::MoeBuffers& buffers = fused.buffers;
  const cuda::MoeShape& shape = fused.shape;
  const cuda::MoeDecodePlan& plan = fused.plan;
  ASSERT_TRUE(plan.fused);
  const cuda::ExpertSlots& slots = plan.experts.slots;
  std::uniform_int_distribution<int> level(0, 3);
  for (bool ties : {false, true}) {
    std::vector<float> logits = normal_values(rng, kExperts, 2.0f);
    if (ties)
      for (float& l : logits) l = 0.5f * float(level(rng));
    ASSERT_EQ(cudaMemcpy(buffers.router, logits.data(), logits.size() * 4, cudaMemcpyHostToDevice), cudaSuccess);
    cuda::moe_route_slots(shape.route, buffers.router, 1, buffers.route_ids, buffers.route_weights, slots, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<int> ids = test::download(buffers.route_ids, kTopK);
    const std::vector<float> weights = test::download(buffers.route_weights, kTopK);
    const std::vector<float> slot_weights = test::download(buffers.slot_weights, size_t(kTopK) * cuda::kMaxGemvRows);
    // What the pass must write again: NaN weights, ids and count −1.
    ASSERT_EQ(cudaMemset(buffers.route_ids, 0xff, kTopK * sizeof(int)), cudaSuccess);
    ASSERT_EQ(cudaMemset(buffers.route_weights, 0xff, kTopK * sizeof(float)), cudaSuccess);
    ASSERT_EQ(cudaMemset(buffers.slot_weights, 0xff, slot_weights.size() * sizeof(float)), cudaSuccess);
    ASSERT_EQ(cudaMemset(slots.count, 0xff, sizeof(int)), cudaSuccess);
    fused_chain(plan, 1, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(test::download(buffers.route_ids, kTopK), ids) << "ties " << ties;
    const std::vector<float> got_weights = test::download(buffers.route_weights, kTopK);
    const std::vector<float> got_slot_weights =
        test::download(buffers.slot_weights, size_t(kTopK) * cuda::kMaxGemvRows);
    EXPECT_EQ(test::download(slots.count, 1), std::vector<int>{kTopK}) << "ties " << ties;
    for (int j = 0; j < kTopK; ++j) {
      EXPECT_EQ(std::memcmp(&got_weights[size_t(j)], &weights[size_t(j)], 4), 0) << "ties " << ties << ", pick " << j;
      EXPECT_EQ(std::memcmp(&got_slot_weights[size_t(j) * cuda::kMaxGemvRows],
                            &slot_weights[size_t(j) * cuda::kMaxGemvRows], 4),
                0)
          << "ties " << ties << ", slot " << j;
    }
  }
}

}  // namespace
}  // namespace vavilov
