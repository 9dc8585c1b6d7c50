// The sampler's filters against hand-computed distributions, their order of application, the generator, and
// sampled generation (plain and speculative) on the MTP fixtures: stop tokens, determinism, batching.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>

#include "core/error.h"
#include "engine/generate.h"
#include "engine/sampling.h"
#include "engine/speculative.h"
#include "fixture_paths.h"
#include "model/weights.h"
#include "sampling_rows.h"

namespace vavilov {
namespace {

std::vector<double> probs_of(std::vector<float> logits, const SamplingOptions& options,
                             const TokenHistory& history = {}) {
  return distribution(logits.data(), int64_t(logits.size()), options, history);
}

void expect_probs(const std::vector<double>& got, const std::vector<double>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-6) << "token " << i;
}

// Logits whose softmax at temperature 1 is `probs`.
std::vector<float> logits_for(const std::vector<double>& probs) {
  std::vector<float> logits;
  for (double p : probs) logits.push_back(float(std::log(p)));
  return logits;
}

SamplingOptions sampled(float temperature = 1) {
  SamplingOptions options;
  options.temperature = temperature;
  return options;
}

TEST(Sampling, TemperatureOneIsSoftmax) {
  expect_probs(probs_of(logits_for({0.5, 0.3, 0.15, 0.05}), sampled()), {0.5, 0.3, 0.15, 0.05});
}

TEST(Sampling, TemperatureDividesLogits) {
  // weights 1 and exp(ln 2 / 0.5) = 4
  expect_probs(probs_of({0, float(std::log(2.0))}, sampled(0.5f)), {0.2, 0.8});
}

TEST(Sampling, LogitBiasIsAdded) {
  SamplingOptions options = sampled();
  options.logit_bias = {{2, float(std::log(3.0))}, {0, -INFINITY}};
  expect_probs(probs_of({0, 0, 0, 0}, options), {0, 0.2, 0.6, 0.2});
}

TEST(Sampling, RepetitionPenaltyCoversPromptAndOutput) {
  SamplingOptions options;
  options.repetition_penalty = 2;
  TokenHistory history;
  history.add_prompt(std::vector<int32_t>{0});
  history.push(1);
  std::vector<float> logits{2, -2, 1, 0.5};
  EXPECT_EQ(adjusted_logits(logits.data(), 4, options, history), (std::vector<float>{1, -4, 1, 0.5}));
}

TEST(Sampling, PresenceAndFrequencyPenaltiesCoverOutputOnly) {
  SamplingOptions options;
  options.presence_penalty = 1;
  options.frequency_penalty = 0.5;
  TokenHistory history;
  history.add_prompt(std::vector<int32_t>{3});
  for (int32_t token : {1, 1, 2}) history.push(token);
  std::vector<float> logits{0, 0, 0, 0};
  EXPECT_EQ(adjusted_logits(logits.data(), 4, options, history), (std::vector<float>{0, -2, -1.5, 0}));
}

TEST(Sampling, HistoryPopUndoesPush) {
  SamplingOptions options;
  options.presence_penalty = 1;
  TokenHistory history;
  history.push(1);
  history.push(2);
  history.pop(2);
  std::vector<float> logits{0, 0, 0};
  EXPECT_EQ(adjusted_logits(logits.data(), 3, options, history), (std::vector<float>{0, -1, 0}));
  EXPECT_THROW(history.pop(2), Error);
}

TEST(Sampling, TopKKeepsLargestWithLowerIdOnTies) {
  SamplingOptions options = sampled();
  options.top_k = 2;
  expect_probs(probs_of({1, 3, 2, 3}, options), {0, 0.5, 0, 0.5});
  options.top_k = 1;
  expect_probs(probs_of({1, 2, 2, 0}, options), {0, 1, 0, 0});
}

TEST(Sampling, TopPKeepsSmallestPrefixReachingP) {
  SamplingOptions options = sampled();
  options.top_p = 0.75;
  expect_probs(probs_of(logits_for({0.15, 0.5, 0.05, 0.3}), options), {0, 0.625, 0, 0.375});
  options.top_p = 0.85;
  expect_probs(probs_of(logits_for({0.15, 0.5, 0.05, 0.3}), options), {0.15 / 0.95, 0.5 / 0.95, 0, 0.3 / 0.95});
  options.top_p = 0.1;  // the most likely token always stays
  expect_probs(probs_of(logits_for({0.15, 0.5, 0.05, 0.3}), options), {0, 1, 0, 0});
}

TEST(Sampling, MinPIsRelativeToTheTopProbability) {
  SamplingOptions options = sampled();
  options.min_p = 0.25;  // threshold 0.125
  expect_probs(probs_of(logits_for({0.5, 0.3, 0.15, 0.05}), options), {0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0});
  options.min_p = 0.5;  // threshold 0.25
  expect_probs(probs_of(logits_for({0.5, 0.3, 0.15, 0.05}), options), {0.625, 0.375, 0, 0});
}

TEST(Sampling, OrderBiasBeforeRepetitionPenalty) {
  SamplingOptions options;
  options.logit_bias = {{0, 1}};
  options.repetition_penalty = 2;
  TokenHistory history;
  history.push(0);
  std::vector<float> logits{1};
  // (1 + 1) / 2 = 1; the penalty first would give 1 / 2 + 1 = 1.5.
  EXPECT_EQ(adjusted_logits(logits.data(), 1, options, history), (std::vector<float>{1}));
}

TEST(Sampling, OrderTopKBeforeTopP) {
  SamplingOptions options = sampled();
  options.top_k = 2;
  options.top_p = 0.5;
  // After top-k, token 0 has 0.4 / 0.7 ≥ 0.5 alone; top-p first (0.4 < 0.5) would keep token 1 too.
  expect_probs(probs_of(logits_for({0.4, 0.3, 0.2, 0.1}), options), {1, 0, 0, 0});
}

TEST(Sampling, OrderTemperatureBeforeMinP) {
  SamplingOptions options = sampled(2);
  options.min_p = 0.5;
  // At T = 2 the weights are √p: 0.707, 0.548, 0.387, 0.224; threshold 0.354 keeps three tokens (at T = 1 only two).
  std::vector<double> root{std::sqrt(0.5), std::sqrt(0.3), std::sqrt(0.15)};
  double total = root[0] + root[1] + root[2];
  expect_probs(probs_of(logits_for({0.5, 0.3, 0.15, 0.05}), options),
               {root[0] / total, root[1] / total, root[2] / total, 0});
}

TEST(Sampling, OrderTopPBeforeMinP) {
  SamplingOptions options = sampled();
  options.top_p = 0.85;  // keeps 0.5, 0.3, 0.15
  options.min_p = 0.25;  // then drops nothing more: 0.15 ≥ 0.125
  expect_probs(probs_of(logits_for({0.5, 0.3, 0.15, 0.05}), options), {0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0});
}

TEST(Sampling, GreedyIsArgmaxOfAdjustedLogits) {
  SamplingOptions options;
  Rng rng(1);
  std::vector<float> logits{1, 3, 2};
  EXPECT_EQ(choose(logits.data(), 3, options, {}, rng), 1);
  options.logit_bias = {{2, 1.5f}};
  EXPECT_EQ(choose(logits.data(), 3, options, {}, rng), 2);
  options.top_k = 1;  // filters after temperature cannot change the argmax
  options.top_p = 0.1f;
  EXPECT_EQ(choose(logits.data(), 3, options, {}, rng), 2);
}

TEST(Sampling, RngIsSeededAndUniform) {
  Rng a(42), b(42), c(43);
  double sum = 0;
  for (int i = 0; i < 10000; ++i) {
    double u = a.uniform();
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    EXPECT_EQ(u, b.uniform());
    sum += u;
  }
  EXPECT_NE(Rng(42).uniform(), c.uniform());
  EXPECT_NEAR(sum / 10000, 0.5, 0.01);
}

// A device that draws uniforms itself starts from state() and the host skips them (cuda/sampling.cuh).
TEST(Sampling, RngAdvanceSkipsUniforms) {
  Rng drawn(5), skipped(5);
  for (int i = 0; i < 7; ++i) drawn.uniform();
  skipped.advance(7);
  EXPECT_EQ(skipped.state(), drawn.state());
  EXPECT_EQ(skipped.uniform(), drawn.uniform());
  Rng copy(drawn.state());
  EXPECT_EQ(copy.uniform(), drawn.uniform());
}

TEST(Sampling, DrawFollowsWeightsAndSkipsZeros) {
  Rng rng(7);
  std::vector<double> weights{0, 0.5, 0, 1.5};
  std::vector<int> counts(4);
  for (int i = 0; i < 20000; ++i) ++counts[size_t(draw(weights, rng))];
  EXPECT_EQ(counts[0] + counts[2], 0);
  EXPECT_NEAR(counts[3] / 20000.0, 0.75, 0.015);  // > 4.8 standard deviations
}

// docs/SAMPLING.md's filters written the plain way: every token sorted by (falling logit, rising id), top-k and top-p
// as prefixes of that order, min-p against the top weight. distribution() sorts only the bucket a cut falls in.
std::vector<double> full_sort_distribution(const std::vector<float>& logits, const SamplingOptions& o) {
  const size_t vocab = logits.size();
  std::vector<int32_t> order(vocab);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return logits[size_t(a)] > logits[size_t(b)] || (logits[size_t(a)] == logits[size_t(b)] && a < b);
  });
  if (o.top_k > 0 && size_t(o.top_k) < vocab) order.resize(size_t(o.top_k));
  const double top = logits[size_t(order[0])];
  std::vector<double> weight(vocab, 0.0);
  for (int32_t id : order) weight[size_t(id)] = std::exp((logits[size_t(id)] - top) / o.temperature);
  if (o.top_p < 1) {
    double total = 0, kept = 0;
    for (int32_t id : order) total += weight[size_t(id)];
    size_t n = 0;
    while (n < order.size() && kept < o.top_p * total) kept += weight[size_t(order[n++])];
    for (size_t i = n; i < order.size(); ++i) weight[size_t(order[i])] = 0;
  }
  for (double& w : weight)
    if (w < o.min_p) w = 0;  // the top token's weight is 1
  const double total = std::accumulate(weight.begin(), weight.end(), 0.0);
  for (double& w : weight) w /= total;
  return weight;
}

// At Flash-Next's vocabulary, on tests/sampling_rows.h's rows: every filter and their combinations.
TEST(Sampling, LargeVocabularyFiltersMatchAFullSort) {
  constexpr int64_t kVocab = 248320;
  const std::vector<std::vector<float>> cases = test::sampling_rows(kVocab, 11);
  struct Filters {
    float temperature, top_p, min_p;
    int top_k;
  };
  const Filters filters[] = {{1, 1, 0, 0},    {0.7f, 1, 0, 20},     {0.7f, 0.8f, 0, 20},  {0.7f, 0.95f, 0, 0},
                             {2, 0.5f, 0, 0}, {0.3f, 0.999f, 0, 0}, {1, 1, 0.05f, 0},     {1, 0.9f, 0.01f, 5000},
                             {1, 1, 0, 1},    {1, 0.1f, 0, 0},      {1, 1, 0, kVocab - 1}};
  std::vector<double> got;
  for (size_t c = 0; c < cases.size(); ++c) {
    for (const Filters& f : filters) {
      SamplingOptions o = sampled(f.temperature);
      o.top_k = f.top_k, o.top_p = f.top_p, o.min_p = f.min_p;
      distribution(cases[c].data(), kVocab, o, {}, got);
      const std::vector<double> want = full_sort_distribution(cases[c], o);
      size_t kept = 0, wrong = 0;
      for (size_t i = 0; i < want.size(); ++i) {
        kept += want[i] > 0;
        // Zero where the reference is zero; elsewhere equal but for the order of the normalising sums.
        wrong += want[i] == 0 ? got[i] != 0 : std::abs(got[i] - want[i]) > 1e-12 * want[i];
      }
      EXPECT_EQ(wrong, 0u) << "case " << c << ", T " << f.temperature << ", top_k " << f.top_k << ", top_p " << f.top_p
                           << ", min_p " << f.min_p << " (" << kept << " tokens kept)";
    }
  }
}

TEST(Sampling, NanLogitIsAnError) {
  std::vector<float> logits{1, 2, NAN, 0};
  EXPECT_THROW(probs_of(logits, sampled()), Error);
}

TEST(Sampling, ValidateRejectsBadSettings) {
  SamplingOptions options;
  options.logit_bias = {{5, 1}};
  EXPECT_THROW(validate(options, 5), Error);
  options.logit_bias.clear();
  options.top_p = 0;
  EXPECT_THROW(validate(options, 5), Error);
  options.top_p = 1;
  options.temperature = -1;
  EXPECT_THROW(validate(options, 5), Error);
  options.temperature = 1;
  options.repetition_penalty = 0;
  EXPECT_THROW(validate(options, 5), Error);
  options.repetition_penalty = 1;
  EXPECT_NO_THROW(validate(options, 5));
}

// Sampled generation on the MTP fixtures.
class SampledGeneration : public ::testing::TestWithParam<std::filesystem::path> {
 protected:
  void SetUp() override {
    model_ = load_model(GetParam().string());
    std::ifstream in(GetParam() / "reference.json");
    prompt_ = nlohmann::json::parse(in)["prompt_ids"].get<std::vector<int32_t>>();
    options_.max_tokens = 24;
    options_.ignore_eos = true;
    options_.sampling = sampled(1.0f);
    options_.sampling.top_k = 40;
    options_.sampling.presence_penalty = 0.5f;
    options_.sampling.repetition_penalty = 1.1f;
  }

  std::vector<int32_t> speculative(const GenerateOptions& options, int drafts) {
    SpeculativeOptions spec;
    spec.drafts = drafts;
    GenerateStats stats;
    SpeculativeStats spec_stats;
    return generate_speculative(*model_, prompt_, options, spec, stats, spec_stats);
  }

  std::unique_ptr<Model> model_;
  std::vector<int32_t> prompt_;
  GenerateOptions options_;
};

TEST_P(SampledGeneration, NeverEmitsPastAStopToken) {
  const int32_t stop = 5;
  GenerateOptions options = options_;
  options.ignore_eos = false;
  options.stop_ids = {stop};
  options.sampling.logit_bias = {{stop, 3.0f}};  // likely enough to stop within a few tokens
  int stopped = 0;
  for (uint64_t seed = 0; seed < 12; ++seed) {
    options.sampling.seed = seed;
    GenerateStats stats;
    for (int drafts : {0, 1, 3}) {
      std::vector<int32_t> out =
          drafts ? speculative(options, drafts) : generate_plain(*model_, prompt_, options, stats);
      auto first_stop = std::find(out.begin(), out.end(), stop);
      if (first_stop == out.end()) continue;
      EXPECT_EQ(first_stop + 1, out.end()) << "seed " << seed << ", drafts " << drafts;
      ++stopped;
    }
  }
  EXPECT_GT(stopped, 18);
}

TEST_P(SampledGeneration, SameSeedSameOutputDifferentSeedDifferentOutput) {
  GenerateStats stats;
  for (int drafts : {0, 2}) {
    auto run = [&](uint64_t seed) {
      GenerateOptions options = options_;
      options.sampling.seed = seed;
      return drafts ? speculative(options, drafts) : generate_plain(*model_, prompt_, options, stats);
    };
    EXPECT_EQ(run(11), run(11)) << "drafts " << drafts;
    EXPECT_NE(run(11), run(12)) << "drafts " << drafts;
  }
}

TEST_P(SampledGeneration, TemperatureZeroWithDefaultsIsGreedy) {
  GenerateOptions options = options_;
  options.sampling = {};
  options.sampling.seed = 99;  // ignored when greedy
  GenerateStats stats;
  std::vector<int32_t> greedy = generate_greedy(*model_, prompt_, options, stats);
  EXPECT_EQ(generate_plain(*model_, prompt_, options, stats), greedy);
  EXPECT_EQ(speculative(options, 3), greedy);
}

TEST_P(SampledGeneration, GreedyWithPenaltiesMatchesPlain) {
  GenerateOptions options = options_;
  options.sampling.temperature = 0;
  options.sampling.logit_bias = {{7, 0.5f}};
  GenerateStats stats;
  std::vector<int32_t> plain = generate_plain(*model_, prompt_, options, stats);
  for (int drafts = 1; drafts <= 3; ++drafts) EXPECT_EQ(speculative(options, drafts), plain) << drafts;
}

// Decoders stepped together give each the output it gives alone: every sequence owns its generator.
TEST_P(SampledGeneration, BatchedDecodersMatchAlone) {
  const std::vector<int> drafts{3, 0, 2, 1};
  std::vector<std::unique_ptr<Decoder>> decoders;
  std::vector<std::vector<int32_t>> outputs(drafts.size());
  std::vector<GenerateOptions> options(drafts.size(), options_);
  for (size_t i = 0; i < drafts.size(); ++i) {
    options[i].sampling.seed = 100 + i;
    SpeculativeOptions spec;
    spec.drafts = drafts[i];
    spec.adaptive = i == 2;
    decoders.push_back(std::make_unique<Decoder>(*model_, options[i], spec));
    outputs[i].push_back(decoders[i]->start(prompt_));
  }
  for (int step = 0; step < 10; ++step) {
    std::vector<Decoder*> all;
    for (auto& decoder : decoders) all.push_back(decoder.get());
    auto emitted = step_batch(*model_, all);
    for (size_t i = 0; i < drafts.size(); ++i)
      outputs[i].insert(outputs[i].end(), emitted[i].begin(), emitted[i].end());
  }
  for (size_t i = 0; i < drafts.size(); ++i) {
    SpeculativeOptions spec;
    spec.drafts = drafts[i];
    spec.adaptive = i == 2;
    Decoder alone(*model_, options[i], spec);
    std::vector<int32_t> want{alone.start(prompt_)};
    for (int step = 0; step < 10; ++step) {
      auto more = alone.step();
      want.insert(want.end(), more.begin(), more.end());
    }
    EXPECT_EQ(outputs[i], want) << "decoder " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, SampledGeneration, ::testing::ValuesIn(test::fixture_dirs(test::mtp_fixtures())),
                         [](const auto& info) { return info.param.filename().string(); });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(SampledGeneration);

}  // namespace
}  // namespace vavilov
