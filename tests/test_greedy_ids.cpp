// The Decoder's greedy-id path (the backend returns each row's argmax instead of its logits) against the logits path
// it replaces, through a device-style backend on the CPU engine: greedy decoding with and without drafts gives the
// same tokens as plain greedy decoding and as the same Decoder answered from logits with std::max_element
// (test::LogitsOnlySequence), and asks for no logits; logit adjustments (penalties, bias) keep the logits path.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "engine/backend.h"
#include "engine/generate.h"
#include "engine/speculative.h"
#include "fixture_paths.h"
#include "logits_only_sequence.h"
#include "model/weights.h"

namespace vavilov {
namespace {

constexpr int64_t kTokens = 20;

struct Decoded {
  std::vector<int32_t> tokens;
  int64_t logits_requests = 0, greedy_requests = 0;
};

Decoded decode(const Model& model, const std::vector<int32_t>& prompt, const GenerateOptions& options, int drafts) {
  SpeculativeOptions speculative;
  speculative.drafts = drafts;
  SequenceFactory device = [&]() -> std::unique_ptr<SequenceBackend> {
    return std::make_unique<test::LogitsOnlySequence>(cpu_sequence(model), model.config.vocab_size);
  };
  GenerateStats stats;
  SpeculativeStats spec_stats;
  Decoded run;
  Decoder decoder(model, options, speculative, device);
  run.tokens.push_back(decoder.start(prompt));
  while (int64_t(run.tokens.size()) < options.max_tokens)
    for (int32_t token : decoder.step())
      if (int64_t(run.tokens.size()) < options.max_tokens) run.tokens.push_back(token);
  const auto& sequence = static_cast<const test::LogitsOnlySequence&>(decoder.backend());
  run.logits_requests = sequence.logits_requests;
  run.greedy_requests = sequence.greedy_requests;
  return run;
}

class GreedyIds : public ::testing::TestWithParam<std::filesystem::path> {
 protected:
  void SetUp() override {
    model = load_model(GetParam().string());
    std::ifstream in(GetParam() / "reference.json");
    prompt = nlohmann::json::parse(in)["prompt_ids"].get<std::vector<int32_t>>();
    options.max_tokens = kTokens;
    options.ignore_eos = true;
  }
  std::unique_ptr<Model> model;
  std::vector<int32_t> prompt;
  GenerateOptions options;
};

// The Decoder asks only for greedy ids; LogitsOnlySequence answers them from logits with std::max_element (the old
// path), and the tokens equal plain greedy decoding (logits and choose()).
TEST_P(GreedyIds, GreedyDecodingAsksForIdsAndEqualsTheLogitsPath) {
  GenerateStats stats;
  const std::vector<int32_t> plain = generate_greedy(*model, prompt, options, stats);
  for (int drafts = 0; drafts <= (model->mtp ? 3 : 0); ++drafts) {
    const Decoded run = decode(*model, prompt, options, drafts);
    EXPECT_EQ(run.tokens, plain) << "drafts " << drafts;
    EXPECT_EQ(run.logits_requests, 0) << "drafts " << drafts;
    EXPECT_GT(run.greedy_requests, 0) << "drafts " << drafts;
  }
}

// Greedy with a repetition penalty and a logit bias: the argmax of adjusted logits needs the logits on the host.
TEST_P(GreedyIds, LogitAdjustmentsKeepTheLogitsPath) {
  options.sampling.repetition_penalty = 1.5f;
  options.sampling.logit_bias = {{prompt.front(), 0.25f}};
  GenerateStats stats;
  const std::vector<int32_t> plain = generate_plain(*model, prompt, options, stats);
  for (int drafts = 0; drafts <= (model->mtp ? 2 : 0); ++drafts) {
    const Decoded run = decode(*model, prompt, options, drafts);
    EXPECT_EQ(run.tokens, plain) << "drafts " << drafts;
    EXPECT_EQ(run.greedy_requests, 0) << "drafts " << drafts;
    EXPECT_GT(run.logits_requests, 0) << "drafts " << drafts;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GreedyIds, ::testing::ValuesIn(test::model_fixture_dirs()),
                         [](const auto& info) { return info.param.filename().string(); });

}  // namespace
}  // namespace vavilov
