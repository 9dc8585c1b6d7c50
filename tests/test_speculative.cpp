// MTP speculative greedy decoding must be token-identical to plain greedy decoding, and after every verify step
// the committed state (trunk and head) must equal what plain decoding has at the same position.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cpu/forward.h"
#include "cpu/mtp.h"
#include "engine/generate.h"
#include "engine/speculative.h"
#include "fixture_paths.h"
#include "model/weights.h"

namespace vavilov {
namespace {

namespace fs = std::filesystem;
constexpr int64_t kTokens = 64;

std::vector<fs::path> mtp_fixture_dirs() { return test::fixture_dirs(test::mtp_fixtures()); }

std::vector<int32_t> prompt_of(const fs::path& dir) {
  std::ifstream in(dir / "reference.json");
  return nlohmann::json::parse(in)["prompt_ids"].get<std::vector<int32_t>>();
}

void expect_near(const std::vector<float>& got, const std::vector<float>& want, const char* what, int64_t position) {
  ASSERT_EQ(got.size(), want.size()) << what << " at position " << position;
  for (size_t i = 0; i < want.size(); ++i)
    ASSERT_NEAR(got[i], want[i], 1e-5f * (1.0f + std::fabs(want[i]))) << what << "[" << i << "] at " << position;
}

void expect_same_trunk_state(const SequenceState& got, const SequenceState& want) {
  ASSERT_EQ(got.position, want.position);
  for (size_t i = 0; i < want.layers.size(); ++i) {
    const LayerState &g = got.layers[i], &w = want.layers[i];
    expect_near(g.gdn.recurrent, w.gdn.recurrent, "gdn.recurrent", want.position);
    expect_near(g.gdn.conv, w.gdn.conv, "gdn.conv", want.position);
    expect_near(g.attn.keys, w.attn.keys, "attn.keys", want.position);
    expect_near(g.attn.values, w.attn.values, "attn.values", want.position);
    expect_near(g.attn.index_keys, w.attn.index_keys, "attn.index_keys", want.position);
    expect_near(g.attn.block_keys, w.attn.block_keys, "attn.block_keys", want.position);
    EXPECT_EQ(g.ple.previous_ids, w.ple.previous_ids);
    expect_near(g.ple.conv_rows, w.ple.conv_rows, "ple.conv_rows", want.position);
  }
}

// Plain greedy decoding, keeping the whole state at every position and the token sequence.
struct PlainRun {
  std::vector<int32_t> tokens;  // prompt + generated
  std::vector<int32_t> generated;
  std::map<int64_t, SequenceState> states;
  std::vector<float> head_keys;  // the head's keys from one pass over the whole sequence

  PlainRun(const Model& model, const std::vector<int32_t>& prompt) : tokens(prompt) {
    const int64_t vocab = model.config.vocab_size;
    SequenceState state = new_sequence_state(model);
    std::vector<float> logits(static_cast<size_t>(vocab));
    cpu::forward(model, state, prompt, {false, logits.data(), nullptr});
    for (int64_t i = 0; i < kTokens; ++i) {
      states[state.position] = state;
      const int32_t next = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
      generated.push_back(next);
      tokens.push_back(next);
      cpu::forward(model, state, std::span<const int32_t>(&next, 1), {false, logits.data(), nullptr});
    }
    // Head rows pair the stack at i with token i + 1, for every position that has a next token.
    const size_t rows = tokens.size() - 1, sh = size_t(model.config.hc_hidden());
    SequenceState full = new_sequence_state(model);
    std::vector<float> stacks(rows * sh), head(rows * sh);
    cpu::forward(model, full, std::span<const int32_t>(tokens).first(rows), {false, nullptr, stacks.data()});
    cpu::mtp_forward(model, full, stacks.data(), std::span<const int32_t>(tokens).subspan(1), head.data());
    head_keys = full.mtp.attn.keys;
  }
};

struct Setting {
  int drafts;
  bool adaptive;
  bool oracle;  // drafts replaced by the true continuation, with every fifth position corrupted
};

class Speculative : public ::testing::TestWithParam<fs::path> {};

TEST(SpeculativeFixtures, ArePresent) { EXPECT_GE(mtp_fixture_dirs().size(), 3u); }

TEST_P(Speculative, IdenticalToPlainGreedyWithStateInStep) {
  auto model = load_model(GetParam().string());
  ASSERT_TRUE(model->mtp.has_value());
  std::vector<int32_t> prompt = prompt_of(GetParam());
  PlainRun plain(*model, prompt);
  const size_t kv = size_t(model->config.num_key_value_heads) * size_t(model->config.head_dim);

  std::vector<Setting> settings;
  for (int drafts = 0; drafts <= 3; ++drafts)
    for (bool adaptive : {false, true})
      for (bool oracle : {false, true}) settings.push_back({drafts, adaptive, oracle});
  for (const Setting& setting : settings) {
    SCOPED_TRACE(::testing::Message() << "drafts " << setting.drafts << (setting.adaptive ? " adaptive" : " fixed")
                                      << (setting.oracle ? " oracle" : ""));
    GenerateOptions options;
    options.max_tokens = kTokens;
    options.ignore_eos = true;
    SpeculativeOptions speculative;
    speculative.drafts = setting.drafts;
    speculative.adaptive = setting.adaptive;
    if (setting.oracle)
      speculative.draft_override = [&](int64_t position, int32_t head_draft) {
        if (position >= int64_t(plain.tokens.size())) return head_draft;  // beyond what the plain run knows
        int32_t truth = plain.tokens[size_t(position)];
        return position % 5 == 0 ? (truth + 1) % int32_t(model->config.vocab_size) : truth;
      };
    int64_t steps_checked = 0;
    speculative.on_step = [&](const SequenceState& state, std::span<const int32_t>) {
      auto it = plain.states.find(state.position);
      if (it == plain.states.end()) return;  // past the plain run's last recorded position
      expect_same_trunk_state(state, it->second);
      if (setting.drafts > 0) {
        ASSERT_EQ(state.mtp_position, state.position);
        std::vector<float> want(plain.head_keys.begin(), plain.head_keys.begin() + state.position * int64_t(kv));
        expect_near(state.mtp.attn.keys, want, "mtp.attn.keys", state.position);
      }
      ++steps_checked;
    };
    GenerateStats stats;
    SpeculativeStats spec_stats;
    EXPECT_EQ(generate_speculative(*model, prompt, options, speculative, stats, spec_stats), plain.generated);
    EXPECT_GT(steps_checked, 0);
    if (setting.oracle && setting.drafts > 0) {
      // The oracle's drafts are right except at every fifth position, so whole steps are accepted.
      EXPECT_GT(spec_stats.accepted[0], 0);
      EXPECT_GT(spec_stats.tokens_per_step(), 1.5);
    }
  }
}

// Decoders stepped together through batched trunk passes emit what each emits alone.
TEST_P(Speculative, BatchedDecodersMatchPlainGreedy) {
  auto model = load_model(GetParam().string());
  std::vector<int32_t> prompt = prompt_of(GetParam());
  std::vector<std::vector<int32_t>> prompts{prompt, std::vector<int32_t>(prompt.begin(), prompt.begin() + 7),
                                            std::vector<int32_t>(prompt.begin() + 3, prompt.end())};
  GenerateOptions options;
  options.max_tokens = 40;
  options.ignore_eos = true;
  std::vector<SpeculativeOptions> settings(3);
  settings[0].drafts = 3;
  settings[1].drafts = 0;
  settings[2].drafts = 2;
  settings[2].adaptive = true;
  std::vector<std::unique_ptr<Decoder>> decoders;
  std::vector<std::vector<int32_t>> outputs(3);
  for (size_t i = 0; i < 3; ++i) {
    decoders.push_back(std::make_unique<Decoder>(*model, options, settings[i]));
    outputs[i].push_back(decoders[i]->start(prompts[i]));
  }
  std::vector<Decoder*> active;
  for (auto& d : decoders) active.push_back(d.get());
  while (!active.empty()) {
    auto emitted = step_batch(*model, active);
    std::vector<Decoder*> still;
    for (size_t i = 0; i < active.size(); ++i) {
      size_t index =
          size_t(std::find_if(decoders.begin(), decoders.end(), [&](auto& d) { return d.get() == active[i]; }) -
                 decoders.begin());
      outputs[index].insert(outputs[index].end(), emitted[i].begin(), emitted[i].end());
      if (int64_t(outputs[index].size()) < options.max_tokens) still.push_back(active[i]);
    }
    active = still;
  }
  for (size_t i = 0; i < 3; ++i) {
    GenerateStats stats;
    std::vector<int32_t> want = generate_greedy(*model, prompts[i], options, stats);
    outputs[i].resize(want.size());
    EXPECT_EQ(outputs[i], want) << "decoder " << i;
  }
}

// A decoder started from a state saved at a prompt-chunk boundary (prefix caching) continues exactly as one that
// prefilled the whole prompt.
TEST_P(Speculative, StartFromSavedPrefixStateIsExact) {
  auto model = load_model(GetParam().string());
  std::vector<int32_t> prompt = prompt_of(GetParam());
  GenerateOptions options;
  options.max_tokens = 24;
  options.ignore_eos = true;
  options.prefill_chunk = 8;
  SpeculativeOptions speculative;
  speculative.drafts = 2;
  std::vector<SequenceState> saved;
  Decoder full(*model, options, speculative);
  std::vector<int32_t> want{full.start(prompt, nullptr, [&](const SequenceState& s) { saved.push_back(s); })};
  while (int64_t(want.size()) < options.max_tokens) {
    auto more = full.step();
    want.insert(want.end(), more.begin(), more.end());
  }
  ASSERT_EQ(saved.size(), (prompt.size() - 1) / 8);
  for (const SequenceState& prefix : {saved.front(), saved.back()}) {
    Decoder resumed(*model, options, speculative);
    std::vector<int32_t> got{resumed.start(prompt, &prefix)};
    while (int64_t(got.size()) < options.max_tokens) {
      auto more = resumed.step();
      got.insert(got.end(), more.begin(), more.end());
    }
    got.resize(size_t(options.max_tokens));
    std::vector<int32_t> expected(want.begin(), want.begin() + options.max_tokens);
    EXPECT_EQ(got, expected) << "prefix of " << prefix.position << " tokens";
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Speculative, ::testing::ValuesIn(mtp_fixture_dirs()),
                         [](const auto& info) { return info.param.filename().string(); });
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(Speculative);

}  // namespace
}  // namespace vavilov
