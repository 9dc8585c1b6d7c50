// Speculative sampling is lossless: the joint distribution of the first kTokens tokens with 1, 2 or 3 MTP drafts
// equals the distribution without speculation, and the same statistic detects a biased acceptance rule.
//
// The fixtures' MTP heads are random, so the draft distribution q is far from the trunk's p: the hard case, where
// most of the output comes through rejections and residual draws. A large logit bias on kSupport tokens plus top-k
// of the same size makes p and q share a small support (|support|^kTokens cells) on which they still differ, and a
// presence penalty makes each row's distribution depend on the tokens before it (accepted drafts included).
//
// Statistic: Pearson's chi-square of the observed joint counts against the exact joint distribution of plain
// sampling (computed with the trunk alone, one forward per prefix), cells with expected count < 5 pooled, rejected
// at α = 1e-3. Seeds are fixed, so the test is deterministic. It runs on the cheapest MTP fixture (fp32, per-expert
// head) to stay near 20 s on one core; the other fixtures passed it too at 12,000 and 40,000 runs.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "cpu/forward.h"
#include "engine/sampling.h"
#include "engine/speculative.h"
#include "fixture_paths.h"
#include "model/weights.h"

namespace vavilov {
namespace {

constexpr int kTokens = 4;
constexpr int kRuns = 6000;  // per setting; about 0.5 ms each on one core
constexpr double kAlpha = 1e-3;
constexpr double kZ = 3.090232;  // the standard normal's upper 1e-3 quantile
const std::vector<int32_t> kSupport{3, 7, 11};

using Joint = std::map<std::vector<int32_t>, double>;

// The chi-square distribution's upper α quantile (Wilson–Hilferty; within 0.5% for df ≥ 10).
double chi_square_critical(int df) {
  const double k = 2.0 / (9.0 * df);
  return df * std::pow(1 - k + kZ * std::sqrt(k), 3);
}

struct Statistic {
  double value;
  int df;
  bool rejects() const { return value > chi_square_critical(df); }
};

Statistic chi_square(const Joint& expected_probs, const std::map<std::vector<int32_t>, int>& observed, int runs) {
  double value = 0, pooled_expected = 0, pooled_observed = runs;
  int cells = 0;
  for (const auto& [tokens, prob] : expected_probs) {
    const double expected = prob * runs;
    auto it = observed.find(tokens);
    const double count = it == observed.end() ? 0 : it->second;
    if (expected < 5) {
      pooled_expected += expected;
      continue;
    }
    pooled_observed -= count;
    value += (count - expected) * (count - expected) / expected;
    ++cells;
  }
  // The pool also holds every outcome outside the expected support (probability 0 under the null).
  if (pooled_expected > 0) {
    value += (pooled_observed - pooled_expected) * (pooled_observed - pooled_expected) / pooled_expected;
    ++cells;
  } else if (pooled_observed > 0) {
    value = INFINITY;
  }
  return {value, cells - 1};
}

class LosslessSampling : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::filesystem::path dir = test::mtp_fixtures() / "mtp_f32_hc4";
    if (!std::filesystem::exists(dir / "reference.json")) GTEST_SKIP() << "no fixture " << dir;
    model_ = load_model(dir.string());
    std::ifstream in(dir / "reference.json");
    prompt_ = nlohmann::json::parse(in)["prompt_ids"].get<std::vector<int32_t>>();
    options_.max_tokens = kTokens;
    options_.ignore_eos = true;
    options_.prefill_chunk = int64_t(prompt_.size()) - 1;
    SamplingOptions& s = options_.sampling;
    s.temperature = 1.0f;
    s.top_k = int(kSupport.size());
    s.presence_penalty = 0.6f;
    for (int32_t id : kSupport) s.logit_bias.emplace_back(id, 30.0f);
    // The state after all but the last prompt token, trunk and head: every run starts from it.
    SpeculativeOptions spec;
    spec.drafts = 1;
    Decoder decoder(*model_, options_, spec);
    decoder.start(prompt_, nullptr, [&](const SequenceState& state) { prefix_ = state; });
  }

  // Plain sampling's exact joint distribution of the first kTokens tokens: a trunk forward for every prefix.
  Joint exact_joint() const {
    const int64_t vocab = model_->config.vocab_size;
    std::vector<float> logits(size_t(vocab), 0.0f);
    SequenceState state = prefix_;
    cpu::forward(*model_, state, std::span<const int32_t>(&prompt_.back(), 1), {false, logits.data(), nullptr});
    TokenHistory history;
    history.add_prompt(prompt_);
    Joint joint;
    extend(state, logits, history, {}, 1.0, joint);
    return joint;
  }

  void extend(const SequenceState& state, const std::vector<float>& logits, TokenHistory& history,
              std::vector<int32_t> tokens, double prob, Joint& joint) const {
    if (int(tokens.size()) == kTokens) {
      joint[tokens] = prob;
      return;
    }
    const std::vector<double> p = distribution(logits.data(), int64_t(logits.size()), options_.sampling, history);
    for (size_t id = 0; id < p.size(); ++id) {
      if (p[id] == 0) continue;
      const int32_t token = int32_t(id);
      SequenceState next = state;
      std::vector<float> next_logits(logits.size());
      cpu::forward(*model_, next, std::span<const int32_t>(&token, 1), {false, next_logits.data(), nullptr});
      history.push(token);
      tokens.push_back(token);
      extend(next, next_logits, history, tokens, prob * p[id], joint);
      tokens.pop_back();
      history.pop(token);
    }
  }

  // The first kTokens tokens of `runs` decodes, one seed each, as counts per token tuple.
  std::map<std::vector<int32_t>, int> sample(const SpeculativeOptions& spec, uint64_t first_seed) const {
    std::map<std::vector<int32_t>, int> counts;
    GenerateOptions options = options_;
    for (int run = 0; run < kRuns; ++run) {
      options.sampling.seed = first_seed + uint64_t(run);
      Decoder decoder(*model_, options, spec);
      std::vector<int32_t> tokens{decoder.start(prompt_, &prefix_)};
      while (int(tokens.size()) < kTokens) {
        auto more = decoder.step();
        tokens.insert(tokens.end(), more.begin(), more.end());
      }
      tokens.resize(kTokens);
      ++counts[tokens];
    }
    return counts;
  }

  Statistic statistic(const SpeculativeOptions& spec, uint64_t first_seed) const {
    Statistic s = chi_square(exact_joint(), sample(spec, first_seed), kRuns);
    std::printf("[ stat     ] drafts %d: chi-square %.1f, df %d, critical %.1f (alpha %g)\n", spec.drafts, s.value,
                s.df, chi_square_critical(s.df), kAlpha);
    return s;
  }

  std::unique_ptr<Model> model_;
  std::vector<int32_t> prompt_;
  GenerateOptions options_;
  SequenceState prefix_;
};

TEST_F(LosslessSampling, JointDistributionEqualsPlainSampling) {
  for (int drafts = 0; drafts <= 3; ++drafts) {
    SpeculativeOptions spec;
    spec.drafts = drafts;
    EXPECT_FALSE(statistic(spec, 1'000'000 * uint64_t(drafts)).rejects()) << "drafts " << drafts;
  }
}

TEST_F(LosslessSampling, DetectsBiasedAcceptanceRules) {
  SpeculativeOptions spec;
  spec.drafts = 3;
  spec.acceptance_override = [](double p, double q) { return std::sqrt(std::min(1.0, p / q)); };
  EXPECT_TRUE(statistic(spec, 5'000'000).rejects()) << "min(1, p/q)^0.5";
  spec.acceptance_override = [](double, double) { return 1.0; };
  EXPECT_TRUE(statistic(spec, 6'000'000).rejects()) << "always accept";
}

}  // namespace
}  // namespace vavilov
