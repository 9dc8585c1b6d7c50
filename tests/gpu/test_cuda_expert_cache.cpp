// Routed experts in host memory behind a bounded device cache (src/cuda/expert_cache.*): whatever the cache holds —
// nothing (every expert read over the bus), a few slots that churn every round, or every expert — the kernels read
// the same bytes, so logits, greedy ids and speculative decoding are bit-identical to every weight on the device.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "cuda/backend.h"
#include "cuda/device_model.h"
#include "cuda/expert_cache.h"
#include "cuda/synthetic.h"
#include "engine/generate.h"
#include "engine/speculative.h"
#include "fixture_paths.h"
#include "flash_next_config.h"
#include "model/config.h"
#include "model/weights.h"
#include "reference_logits.h"

namespace vavilov {
namespace {

struct Outputs {
  std::vector<float> logits;
  std::vector<int32_t> ids;
};

void expect_identical(const Outputs& cached, const Outputs& resident, const std::string& what) {
  ASSERT_EQ(cached.logits.size(), resident.logits.size()) << what;
  EXPECT_EQ(std::memcmp(cached.logits.data(), resident.logits.data(), cached.logits.size() * sizeof(float)), 0)
      << what << ": logits differ";
  EXPECT_EQ(cached.ids, resident.ids) << what << ": greedy ids differ";
}

// Budgets: none (every expert from host memory), two experts (slots change hands every round), every expert.
std::vector<std::pair<std::string, int64_t>> budgets(int64_t expert_bytes, int64_t all_experts) {
  return {{"0 MB", 0}, {"two experts", 2 * expert_bytes}, {"every expert", all_experts * expert_bytes}};
}

void expect_cache_worked(cuda::ExpertCache& cache, const std::string& budget) {
  const cuda::ExpertCacheStats s = cache.stats();
  EXPECT_GT(s.expert_reads, 0u) << budget;
  EXPECT_LE(double(s.resident) * double(s.slot_bytes), double(s.budget_bytes)) << budget;
  if (s.budget_bytes == 0) {
    EXPECT_EQ(s.hits, 0u) << budget;
    EXPECT_EQ(s.promotions, 0u) << budget;
  } else {
    EXPECT_GT(s.hits, 0u) << budget;
    EXPECT_GT(s.promotions, 0u) << budget;
  }
  if (s.slots == 2) {
    EXPECT_GT(s.evictions, 0u) << budget << ": the small cache never churned";
  }
}

// ---- checkpoints (upload_model): every MoE path of the fixtures (prefill chunks, 1–4-row steps, the MTP layer) ----

class GpuExpertCacheFixture : public ::testing::TestWithParam<std::filesystem::path> {
 protected:
  void SetUp() override { ASSERT_GT(cuda::device_count(), 0) << "the GPU tests need a CUDA device"; }
};

// Prompt logits in chunks of 7, 3 and 1 rows, the MTP head's logits, and greedy tokens with 0–3 drafts.
Outputs run_fixture(const Model& model, const test::ReferenceFixture& fixture,
                    std::shared_ptr<const cuda::DeviceModel> weights) {
  Outputs out;
  const SequenceFactory factory = cuda::sequence_factory(weights);
  const size_t vocab = size_t(model.config.vocab_size), n = fixture.prompt.size();
  for (size_t chunk : {size_t(7), size_t(3), size_t(1)}) {
    auto sequence = factory();
    std::vector<float> logits(n * vocab);
    for (size_t begin = 0; begin < n; begin += chunk) {
      const size_t count = std::min(chunk, n - begin);
      sequence->forward(std::span<const int32_t>(fixture.prompt).subspan(begin, count),
                        {true, logits.data() + begin * vocab, nullptr, false});
    }
    out.logits.insert(out.logits.end(), logits.begin(), logits.end());
  }
  if (model.mtp) {
    auto sequence = factory();
    const size_t sh = size_t(model.config.hc_hidden());
    std::vector<float> stacks(n * sh), head((n - 1) * sh), logits((n - 1) * vocab);
    sequence->forward(fixture.prompt, {false, nullptr, stacks.data(), false});
    sequence->mtp_forward(stacks.data(), std::span<const int32_t>(fixture.prompt).subspan(1), head.data(),
                          MtpRows::All);
    sequence->mtp_logits(head.data(), int64_t(n - 1), logits.data());
    out.logits.insert(out.logits.end(), logits.begin(), logits.end());
  }
  GenerateOptions options;
  options.max_tokens = 16;
  options.ignore_eos = true;
  for (int drafts = 0; drafts <= (model.mtp ? 3 : 0); ++drafts) {
    SpeculativeOptions speculative;
    speculative.drafts = drafts;
    GenerateStats stats;
    SpeculativeStats spec_stats;
    const std::vector<int32_t> tokens =
        generate_speculative(model, fixture.prompt, options, speculative, stats, spec_stats, {}, factory);
    out.ids.insert(out.ids.end(), tokens.begin(), tokens.end());
  }
  return out;
}

TEST_P(GpuExpertCacheFixture, BitIdenticalToResidentExpertsAtEveryBudget) {
  test::ReferenceFixture fixture(GetParam());
  auto model = load_model(fixture.dir.string());
  const Outputs resident = run_fixture(*model, fixture, cuda::upload_model(*model));
  const int64_t expert_bytes = cuda::upload_model(*model, 0)->expert_cache->stats().slot_bytes;
  const int64_t experts = int64_t(model->config.num_experts) * (model->config.num_layers + (model->mtp ? 1 : 0));
  for (const auto& [name, bytes] : budgets(expert_bytes, experts)) {
    std::shared_ptr<const cuda::DeviceModel> weights = cuda::upload_model(*model, bytes);
    expect_identical(run_fixture(*model, fixture, weights), resident, name);
    expect_cache_worked(*weights->expert_cache, name);
  }
}

TEST_P(GpuExpertCacheFixture, BudgetBelowOneExpertIsAnErrorNamingTheOption) {
  test::ReferenceFixture fixture(GetParam());
  auto model = load_model(fixture.dir.string());
  try {
    cuda::upload_model(*model, 100);
    FAIL() << "a 100-byte cache was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("--expert-cache-mb"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("holds no routed expert"), std::string::npos) << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GpuExpertCacheFixture, ::testing::ValuesIn(test::fixture_dirs(test::mtp_fixtures())),
                         [](const auto& info) { return info.param.filename().string(); });

// ---- synthetic Q4 at Flash-Next geometry (2 layers + MTP): the fused 1-row experts, the 2–4-row GEMV experts and
// prefill on the codes, with real expert sizes (2.6 MB) ----

// A 40-token prefill (last row's logits), then four rounds of: a 1-row step with logits, a 4-row recorded step with
// every row's greedy id and stacks, rollback to 2 rows, the head over the last kept row and its greedy draft.
Outputs run_synthetic(const ModelConfig& c, std::shared_ptr<const cuda::DeviceModel> weights) {
  Outputs out;
  auto sequence = cuda::sequence_factory(weights)();
  std::mt19937 rng(3);
  const auto ids = [&](int n) {
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (int32_t& id : v) id = int32_t(rng() % uint32_t(c.vocab_size));
    return v;
  };
  const size_t vocab = size_t(c.vocab_size), sh = size_t(c.hc_hidden());
  std::vector<float> logits(vocab), stacks(4 * sh), head(sh);
  sequence->forward(ids(40), {false, logits.data(), nullptr, false});
  out.logits.insert(out.logits.end(), logits.begin(), logits.end());
  for (int step = 0; step < 4; ++step) {
    sequence->forward(ids(1), {false, logits.data(), nullptr, false});
    out.logits.insert(out.logits.end(), logits.begin(), logits.end());
    const int64_t first = sequence->position();
    int32_t greedy[4];
    sequence->forward(ids(4), {true, nullptr, stacks.data(), true, greedy});
    out.ids.insert(out.ids.end(), greedy, greedy + 4);
    sequence->keep_rows(first, 2);
    const std::vector<int32_t> next = {greedy[1]};
    sequence->mtp_forward(stacks.data() + sh, next, head.data(), MtpRows::Last);
    out.ids.push_back(sequence->draft_greedy(head.data()));
  }
  return out;
}

TEST(GpuExpertCacheSynthetic, FlashNextQ4BitIdenticalToResidentExpertsAtEveryBudget) {
  ASSERT_GT(cuda::device_count(), 0) << "the GPU tests need a CUDA device";
  const ModelConfig c = test::flash_next_layers(2);
  cuda::SyntheticOptions options;
  const Outputs resident = run_synthetic(c, cuda::synthetic_model(c, options));
  // Q4: codes (n / 2 bytes) and a bf16 scale and bias per 64 values (n / 16) for each of gate, up and down.
  const int64_t expert_bytes = 3 * int64_t(c.hidden_size) * c.moe_intermediate_size * 9 / 16;
  for (const auto& [name, bytes] : budgets(expert_bytes, int64_t(c.num_experts) * 3)) {
    options.expert_cache_bytes = bytes;
    std::shared_ptr<const cuda::DeviceModel> weights = cuda::synthetic_model(c, options);
    EXPECT_EQ(weights->expert_cache->stats().slot_bytes, expert_bytes) << "one blob per expert, no padding";
    expect_identical(run_synthetic(c, weights), resident, name);
    expect_cache_worked(*weights->expert_cache, name);
  }
}

}  // namespace
}  // namespace vavilov
