// The fused greedy step (CudaSequence::greedy_step: trunk, accept, rollback, head and chained drafts as one graph,
// one synchronisation) against SequenceBackend's default composition of the same backend's calls
// (tests/composed_sequence.h): the same tokens and the same statistics through the Decoder at 1–3 drafts, fixed and
// adaptive, past EOS and with stop tokens that the continuation reaches, with CUDA graphs and eagerly
// (VAVILOV_CUDA_GRAPH=0), also across the attention caches' first growth (1024 positions); both equal plain CPU greedy
// decoding. On a synthetic Flash-Next model (2 layers + MTP, Q4) the steps are driven through the seam directly, with
// drafts taken from the step before or from plain greedy decoding (every draft accepted) in turn.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "composed_sequence.h"
#include "cuda/backend.h"
#include "cuda/synthetic.h"
#include "decoded.h"
#include "engine/generate.h"
#include "engine/speculative.h"
#include "fixture_paths.h"
#include "flash_next_config.h"
#include "graph_modes.h"
#include "model/config.h"
#include "model/weights.h"

namespace vavilov {
namespace {

using test::with_graphs;

SequenceFactory composed(const SequenceFactory& gpu) {
  return [gpu]() -> std::unique_ptr<SequenceBackend> { return std::make_unique<test::ComposedSequence>(gpu()); };
}

using test::decode;
using test::Decoded;

class GpuGreedyStep : public ::testing::TestWithParam<std::filesystem::path> {
 protected:
  void SetUp() override { ASSERT_GT(cuda::device_count(), 0) << "the GPU tests need a CUDA device"; }
};

std::vector<int32_t> reference_prompt(const std::filesystem::path& fixture) {
  std::ifstream in(fixture / "reference.json");
  return nlohmann::json::parse(in)["prompt_ids"].get<std::vector<int32_t>>();
}

// Fused and composed decoders at each draft count and adaptive mode, past EOS and with stops, with graphs or eagerly.
void expect_fused_equals_composed(const Model& model, const std::vector<int32_t>& prompt, int64_t tokens,
                                  const std::vector<int>& draft_counts, const std::vector<bool>& adaptive_modes,
                                  const std::vector<bool>& graph_modes) {
  GenerateOptions past_eos;
  past_eos.max_tokens = tokens;
  past_eos.ignore_eos = true;
  GenerateStats stats;
  const std::vector<int32_t> plain = generate_greedy(model, prompt, past_eos, stats);
  GenerateOptions with_stops = past_eos;
  with_stops.ignore_eos = false;
  with_stops.stop_ids = {plain[size_t(tokens / 3)], plain[size_t(tokens / 2)]};
  const SequenceFactory gpu = cuda::sequence_factory(model);
  for (bool graphs : graph_modes)
    for (const GenerateOptions* options : {&past_eos, &with_stops})
      for (int drafts : draft_counts)
        for (bool adaptive : adaptive_modes) {
          SpeculativeOptions speculative;
          speculative.drafts = drafts;
          speculative.adaptive = adaptive;
          const std::string what = "drafts " + std::to_string(drafts) + (adaptive ? " adaptive" : " fixed") +
                                   (options == &with_stops ? ", stops" : ", past EOS") +
                                   (graphs ? ", graphs" : ", eager");
          const Decoded fused = decode(model, prompt, *options, speculative, with_graphs(gpu, graphs));
          const Decoded reference = decode(model, prompt, *options, speculative, composed(with_graphs(gpu, graphs)));
          test::expect_same_decoding(fused, reference, what);
          if (options == &past_eos) {
            EXPECT_EQ(fused.tokens, plain) << what;
          }
          if (options == &with_stops) {
            EXPECT_LT(fused.tokens.size(), plain.size()) << what << ": no stop reached";
          }
        }
}

// The fused step runs for an attention head with every weight resident (CudaSequence::fused_step_applies).
bool fuses(const Model& model) { return model.mtp && model.mtp->layer.kind == LayerKind::SparseAttention; }

TEST_P(GpuGreedyStep, FusedEqualsComposedThroughTheDecoder) {
  auto model = load_model(GetParam().string());
  if (!fuses(*model)) GTEST_SKIP() << "no MTP attention head";
  expect_fused_equals_composed(*model, reference_prompt(GetParam()), 24, {1, 2, 3}, {false, true}, {true});
}

TEST_P(GpuGreedyStep, FusedEqualsComposedEagerly) {
  auto model = load_model(GetParam().string());
  if (!fuses(*model)) GTEST_SKIP() << "no MTP attention head";
  expect_fused_equals_composed(*model, reference_prompt(GetParam()), 24, {1, 2, 3}, {false, true}, {false});
}

// A prompt of 1010 tokens, then decoding past 1024 positions: the caches grow between steps (graphs captured again).
TEST_P(GpuGreedyStep, FusedEqualsComposedAcrossCacheGrowth) {
  auto model = load_model(GetParam().string());
  if (!fuses(*model)) GTEST_SKIP() << "no MTP attention head";
  const auto& kinds = model->config.layer_kinds;
  if (std::find(kinds.begin(), kinds.end(), LayerKind::SparseAttention) == kinds.end())
    GTEST_SKIP() << "no attention layer in this fixture";
  std::mt19937 rng(5);
  std::vector<int32_t> prompt(1010);
  for (int32_t& id : prompt) id = int32_t(rng() % uint32_t(model->config.vocab_size));
  expect_fused_equals_composed(*model, prompt, 40, {3}, {false, true}, {true, false});
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GpuGreedyStep, ::testing::ValuesIn(test::fixture_dirs(test::mtp_fixtures())),
                         [](const auto& info) { return info.param.filename().string(); });

// ---- synthetic Q4 at Flash-Next geometry (2 layers + MTP), driven through the seam ----

struct Steps {
  std::vector<int32_t> emitted;  // every step's emitted tokens, one after the other
  std::vector<std::vector<int32_t>> drafts;
  std::vector<int64_t> positions;
};

// A 40-token prompt, then `count` greedy steps: the drafts of every third step from `oracle` (the plain greedy
// continuation, so every draft is accepted up to the stops), the others the step before's.
Steps run_steps(SequenceBackend& seq, const ModelConfig& c, const std::vector<int32_t>& prompt,
                const std::vector<int32_t>& oracle, std::span<const int64_t> stops, int drafts, int count) {
  const size_t sh = size_t(c.hc_hidden());
  std::vector<float> stacks(prompt.size() * sh), head(sh);
  int32_t first = 0;
  seq.forward(prompt, {false, nullptr, stacks.data(), false, &first});
  std::vector<int32_t> next(prompt.begin() + 1, prompt.end());
  next.push_back(first);
  seq.mtp_forward(stacks.data(), next, head.data(), MtpRows::Last);
  std::vector<int32_t> rows{first};
  for (int j = 0; j < drafts; ++j) rows.push_back(oracle[size_t(j) + 1]);
  GreedyStep step;
  step.stops = stops;
  step.stack_size = c.hc_hidden();
  step.head = true;
  step.drafts = drafts;
  step.drafts_after_rejection = 1;
  Steps out;
  for (int i = 0; i < count; ++i) {
    const int64_t at = seq.position() - int64_t(prompt.size());  // rows[0]'s index in the continuation
    if (i % 3 == 2 && at + int64_t(rows.size()) < int64_t(oracle.size()))
      for (size_t r = 1; r < rows.size(); ++r) rows[r] = oracle[size_t(at) + r];
    step.rows = rows;
    const GreedyStepResult result = seq.greedy_step(step);
    out.emitted.insert(out.emitted.end(), result.emitted.begin(), result.emitted.end());
    out.drafts.push_back(result.drafts);
    out.positions.push_back(seq.position());
    rows = {result.emitted.back()};
    rows.insert(rows.end(), result.drafts.begin(), result.drafts.end());
  }
  return out;
}

TEST(GpuGreedyStepSynthetic, FlashNextQ4FusedEqualsComposedAndPlainGreedy) {
  ASSERT_GT(cuda::device_count(), 0) << "the GPU tests need a CUDA device";
  const ModelConfig c = test::flash_next_layers(2);
  ASSERT_GT(c.mtp_num_layers, 0);
  std::shared_ptr<const cuda::DeviceModel> weights = cuda::synthetic_model(c, {});
  const SequenceFactory gpu = cuda::sequence_factory(weights);
  std::mt19937 rng(9);
  std::vector<int32_t> prompt(40);
  for (int32_t& id : prompt) id = int32_t(rng() % uint32_t(c.vocab_size));
  // Plain greedy decoding on the GPU, one row a step.
  constexpr int kSteps = 12, kPlain = kSteps * 4 + 8;
  std::vector<int32_t> plain;
  {
    auto seq = gpu();
    int32_t id = 0;
    seq->forward(prompt, {false, nullptr, nullptr, false, &id});
    plain.push_back(id);
    while (plain.size() < size_t(kPlain)) {
      seq->forward(std::span<const int32_t>(&plain.back(), 1), {false, nullptr, nullptr, false, &id});
      plain.push_back(id);
    }
  }
  const std::vector<int64_t> no_stops, stops{plain[9], plain[20]};
  for (int drafts = 1; drafts <= 3; ++drafts)
    for (const std::vector<int64_t>* stop_ids : {&no_stops, &stops}) {
      const std::string what = "drafts " + std::to_string(drafts) + (stop_ids == &stops ? ", stops" : "");
      auto fused_seq = gpu();
      auto composed_seq = composed(gpu)();
      const Steps fused = run_steps(*fused_seq, c, prompt, plain, *stop_ids, drafts, kSteps);
      const Steps reference = run_steps(*composed_seq, c, prompt, plain, *stop_ids, drafts, kSteps);
      EXPECT_EQ(fused.emitted, reference.emitted) << what;
      EXPECT_EQ(fused.drafts, reference.drafts) << what;
      EXPECT_EQ(fused.positions, reference.positions) << what;
      // The steps emit the continuation after its first token (the prompt's).
      ASSERT_LT(fused.emitted.size(), plain.size()) << what;
      EXPECT_EQ(fused.emitted, std::vector<int32_t>(plain.begin() + 1, plain.begin() + 1 + fused.emitted.size()))
          << what;
      EXPECT_GT(fused.emitted.size(), size_t(kSteps)) << what << ": no draft was ever accepted";
    }
}

}  // namespace
}  // namespace vavilov
