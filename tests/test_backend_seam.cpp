// The Decoder through the SequenceBackend seam as a device backend sees it (no CPU state: each decoder steps on its
// own), checked on the CPU engine: the calls keep the contract the CUDA backend relies on (at most 4 recorded rows,
// rollback right after the recorded pass, the head never truncated past its own position), greedy decoding asks for
// greedy ids and never for logits, and the tokens equal plain greedy decoding for every draft count.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "composed_sequence.h"
#include "decoded.h"
#include "engine/backend.h"
#include "engine/generate.h"
#include "engine/speculative.h"
#include "error_of.h"
#include "fixture_paths.h"
#include "model/weights.h"

namespace vavilov {
namespace {

constexpr int64_t kTokens = 24;
constexpr size_t kDeviceRecordedRows = 4;  // src/cuda/sequence.cpp: kRecordedRows

class ContractCheckingSequence final : public SequenceBackend {
 public:
  explicit ContractCheckingSequence(const Model& model) : inner_(cpu_sequence(model)) {}

  int64_t position() const override { return inner_->position(); }
  void forward(std::span<const int32_t> ids, const TrunkOutputs& outputs) override {
    if (outputs.record_rows) {
      EXPECT_LE(ids.size(), kDeviceRecordedRows);
    }
    recorded_first_ = outputs.record_rows ? position() : -1;
    recorded_rows_ = outputs.record_rows ? int64_t(ids.size()) : 0;
    logits_requests_ += outputs.logits != nullptr;
    inner_->forward(ids, outputs);
    ++calls_;
  }
  void keep_rows(int64_t first_position, int64_t kept) override {
    EXPECT_EQ(first_position, recorded_first_) << "keep_rows without the recorded pass just before";
    EXPECT_EQ(first_position + recorded_rows_, position());
    EXPECT_GE(kept, 1);
    EXPECT_LE(kept, recorded_rows_);
    inner_->keep_rows(first_position, kept);
    recorded_rows_ = 0;
  }
  void mtp_forward(const float* stacks, std::span<const int32_t> next_ids, float* head_stacks,
                   MtpRows output) override {
    inner_->mtp_forward(stacks, next_ids, head_stacks, output);
    head_ += int64_t(next_ids.size());
  }
  void mtp_logits(const float* head_stacks, int64_t rows, float* logits) override {
    ++logits_requests_;
    inner_->mtp_logits(head_stacks, rows, logits);
  }
  void mtp_greedy(const float* head_stacks, int64_t rows, int32_t* ids) override {
    inner_->mtp_greedy(head_stacks, rows, ids);
  }
  void truncate_head(int64_t position) override {
    EXPECT_GE(position, 0);
    EXPECT_LE(position, head_) << "the head truncated past its own position";
    inner_->truncate_head(position);
    head_ = position;
  }
  void export_state(SequenceState& state) override { inner_->export_state(state); }
  void import_state(const SequenceState& state) override {
    inner_->import_state(state);
    head_ = state.mtp_position;
    recorded_rows_ = 0;
  }
  int64_t calls() const { return calls_; }
  int64_t logits_requests() const { return logits_requests_; }

 private:
  std::unique_ptr<SequenceBackend> inner_;
  int64_t recorded_first_ = -1, recorded_rows_ = 0, head_ = 0, calls_ = 0, logits_requests_ = 0;
};

class BackendSeam : public ::testing::TestWithParam<std::filesystem::path> {};

std::vector<int32_t> reference_prompt(const std::filesystem::path& fixture) {
  std::ifstream in(fixture / "reference.json");
  return nlohmann::json::parse(in)["prompt_ids"].get<std::vector<int32_t>>();
}

// kTokens greedy tokens past EOS, the prompt prefilled `prefill_chunk` rows at a time.
GenerateOptions seam_options(int64_t prefill_chunk) {
  GenerateOptions options;
  options.max_tokens = kTokens;
  options.ignore_eos = true;
  options.prefill_chunk = prefill_chunk;
  return options;
}

TEST_P(BackendSeam, DeviceStyleDecoderKeepsTheContractAndEqualsPlainGreedy) {
  auto model = load_model(GetParam().string());
  ASSERT_TRUE(model->mtp.has_value());
  const auto prompt = reference_prompt(GetParam());
  const GenerateOptions options = seam_options(5);
  GenerateStats stats;
  const std::vector<int32_t> plain = generate_greedy(*model, prompt, options, stats);
  for (int drafts = 0; drafts <= 3; ++drafts)
    for (bool adaptive : {false, true}) {
      SpeculativeOptions speculative;
      speculative.drafts = drafts;
      speculative.adaptive = adaptive;
      SequenceFactory device = [&]() -> std::unique_ptr<SequenceBackend> {
        return std::make_unique<ContractCheckingSequence>(*model);
      };
      Decoder decoder(*model, options, speculative, device);
      EXPECT_EQ(decoder.backend().cpu_state(), nullptr);
      std::vector<int32_t> generated{decoder.start(prompt)};
      while (int64_t(generated.size()) < kTokens) {
        Decoder* self = &decoder;
        const std::vector<std::vector<int32_t>> emitted = step_batch(*model, std::span<Decoder* const>(&self, 1));
        for (int32_t token : emitted.front())
          if (int64_t(generated.size()) < kTokens) generated.push_back(token);
      }
      EXPECT_EQ(generated, plain) << "drafts " << drafts << (adaptive ? " adaptive" : " fixed");
      const auto& sequence = static_cast<ContractCheckingSequence&>(decoder.backend());
      EXPECT_GT(sequence.calls(), 0);
      EXPECT_EQ(sequence.logits_requests(), 0) << "greedy decoding downloaded logits";
    }
}

using test::decode;
using test::Decoded;

// The Decoder's greedy step through the seam's default greedy_step (a device-style backend) against the CPU
// decoder's own path (the trunk's logits, accept and fold_head: the rules as they always were): the same tokens and
// the same statistics at 0–3 drafts, fixed and adaptive, past EOS and with stop tokens the continuation reaches
// (inside a step's drafts or at its end), and with oracle drafts replaced on the host.
TEST_P(BackendSeam, DefaultGreedyStepEqualsTheLogitsPathTokensAndStats) {
  auto model = load_model(GetParam().string());
  const auto prompt = reference_prompt(GetParam());
  GenerateOptions past_eos = seam_options(0);
  GenerateStats stats;
  const std::vector<int32_t> plain = generate_greedy(*model, prompt, past_eos, stats);
  GenerateOptions with_stops = past_eos;
  with_stops.ignore_eos = false;
  with_stops.stop_ids = {plain[7], plain[11]};
  const SequenceFactory composed = [&]() -> std::unique_ptr<SequenceBackend> {
    return std::make_unique<test::ComposedSequence>(cpu_sequence(*model));
  };
  for (const GenerateOptions* options : {&past_eos, &with_stops})
    for (int drafts = 0; drafts <= 3; ++drafts)
      for (int variant = 0; variant < 3; ++variant) {
        SpeculativeOptions speculative;
        speculative.drafts = drafts;
        speculative.adaptive = variant == 1;
        if (variant == 2)  // oracle drafts: plain greedy's token at the position, wrong at every fifth
          speculative.draft_override = [&](int64_t position, int32_t head) {
            const int64_t at = position - int64_t(prompt.size());
            return at % 5 == 4 || at >= int64_t(plain.size()) ? head : plain[size_t(at)];
          };
        const std::string what = "drafts " + std::to_string(drafts) + " variant " + std::to_string(variant) +
                                 (options == &with_stops ? " with stops" : " past EOS");
        const Decoded reference = decode(*model, prompt, *options, speculative, {});
        const Decoded stepped = decode(*model, prompt, *options, speculative, composed);
        test::expect_same_decoding(stepped, reference, what);
        if (options == &past_eos) {
          EXPECT_EQ(stepped.tokens, plain) << what;
        }
      }
}

// accept_all (benchmarks' forced full acceptance): every draft kept, the emitted tokens the drafts and the last row's
// greedy id, the trunk and head advanced by every row.
TEST_P(BackendSeam, AcceptAllKeepsEveryDraft) {
  auto model = load_model(GetParam().string());
  const ModelConfig& c = model->config;
  auto sequence = cpu_sequence(*model);
  const std::vector<int32_t> prompt{3, 1, 4, 1, 5, 9};
  std::vector<float> stacks(prompt.size() * size_t(c.hc_hidden())), head(size_t(c.hc_hidden()));
  int32_t first = 0;
  sequence->forward(prompt, {false, nullptr, stacks.data(), false, &first});
  std::vector<int32_t> next(prompt.begin() + 1, prompt.end());
  next.push_back(first);
  sequence->mtp_forward(stacks.data(), next, head.data(), MtpRows::Last);
  const std::vector<int32_t> rows{first, 7, 2, 8};
  GreedyStep step;
  step.rows = rows;
  step.stack_size = c.hc_hidden();
  step.head = true;
  step.drafts = step.drafts_after_rejection = 3;
  step.accept_all = true;
  const GreedyStepResult result = sequence->greedy_step(step);
  ASSERT_EQ(result.emitted.size(), 4u);
  EXPECT_EQ(std::vector<int32_t>(result.emitted.begin(), result.emitted.begin() + 3),
            std::vector<int32_t>(rows.begin() + 1, rows.end()));
  EXPECT_EQ(result.drafts.size(), 3u);
  EXPECT_EQ(sequence->position(), int64_t(prompt.size()) + 4);
  EXPECT_EQ(sequence->cpu_state()->mtp_position, sequence->position());
}

// Prefix caching through the seam alone: a device-style decoder (no CPU state) hands out its chunk-boundary states
// by export_state, equal to the CPU decoder's own, and device-style decoders started from them (import_state) emit
// the uninterrupted decoder's tokens.
TEST_P(BackendSeam, DeviceStyleDecoderExportsChunkStatesAndResumesFromThem) {
  auto model = load_model(GetParam().string());
  const auto prompt = reference_prompt(GetParam());
  const GenerateOptions options = seam_options(8);
  SpeculativeOptions speculative;
  speculative.drafts = 2;
  const SequenceFactory device = [&]() -> std::unique_ptr<SequenceBackend> {
    return std::make_unique<ContractCheckingSequence>(*model);
  };
  auto run = [&](const SequenceFactory& factory, const SequenceState* prefix, std::vector<SequenceState>* saved) {
    Decoder decoder(*model, options, speculative, factory);
    std::vector<int32_t> tokens{decoder.start(prompt, prefix, [&](const SequenceState& state) {
      if (saved) saved->push_back(state);
    })};
    while (int64_t(tokens.size()) < kTokens) {
      const std::vector<int32_t> more = decoder.step();
      tokens.insert(tokens.end(), more.begin(), more.end());
    }
    tokens.resize(size_t(kTokens));
    return tokens;
  };
  std::vector<SequenceState> on_cpu, exported;
  const std::vector<int32_t> want = run({}, nullptr, &on_cpu);
  EXPECT_EQ(run(device, nullptr, &exported), want);
  ASSERT_EQ(on_cpu.size(), (prompt.size() - 1) / 8);
  // The device exports after 1, 2, 4, ... chunks and before the last chunk only, each the CPU's state there.
  std::vector<int64_t> boundaries;
  for (int64_t end = 8; end < int64_t(prompt.size()); end += 8)
    if ((end / 8 & (end / 8 - 1)) == 0 || end + 8 >= int64_t(prompt.size())) boundaries.push_back(end);
  ASSERT_LT(boundaries.size(), on_cpu.size())
      << "the fixture's prompt is too short to tell the policy from every chunk";
  ASSERT_EQ(exported.size(), boundaries.size());
  for (size_t i = 0; i < exported.size(); ++i) {
    const SequenceState& cpu = on_cpu[size_t(boundaries[i] / 8 - 1)];
    ASSERT_EQ(exported[i].position, boundaries[i]);
    EXPECT_EQ(exported[i].position, cpu.position);
    EXPECT_EQ(exported[i].mtp_position, cpu.mtp_position);
    EXPECT_EQ(exported[i].layers.size(), cpu.layers.size());
    for (size_t l = 0; l < exported[i].layers.size(); ++l) {
      EXPECT_EQ(exported[i].layers[l].gdn.recurrent, cpu.layers[l].gdn.recurrent) << "layer " << l;
      EXPECT_EQ(exported[i].layers[l].attn.keys, cpu.layers[l].attn.keys) << "layer " << l;
      EXPECT_EQ(exported[i].layers[l].ple.conv_rows, cpu.layers[l].ple.conv_rows) << "layer " << l;
    }
    EXPECT_EQ(exported[i].mtp.attn.values, cpu.mtp.attn.values);
  }
  for (const SequenceState& prefix : {exported.front(), exported.back()})
    EXPECT_EQ(run(device, &prefix, nullptr), want) << "prefix of " << prefix.position << " tokens";
}

TEST(SnapshotBoundary, AfterPowersOfTwoChunksAndBeforeTheLast) {
  std::vector<int64_t> ends;
  for (int64_t end = 64; end < 1000; end += 64)
    if (snapshot_boundary(end, 1000, 64)) ends.push_back(end);
  EXPECT_EQ(ends, (std::vector<int64_t>{64, 128, 256, 512, 960}));
  EXPECT_TRUE(snapshot_boundary(64, 100, 64));    // the only boundary is also the one before the last chunk
  EXPECT_FALSE(snapshot_boundary(64, 1000, 0));   // no chunking: the whole prompt is one chunk
  EXPECT_TRUE(snapshot_boundary(192, 256, 64));   // the next chunk (192..256) is the last
  EXPECT_FALSE(snapshot_boundary(192, 257, 64));  // two chunks left
}

// States that do not fit the model are refused with the field named (and the layer), and the sequence keeps its own.
TEST_P(BackendSeam, ImportRefusesStatesOfAnotherShape) {
  auto model = load_model(GetParam().string());
  const ModelConfig& c = model->config;
  auto sequence = cpu_sequence(*model);
  const std::vector<int32_t> ids{3, 1, 4, 1, 5, 9, 2};
  std::vector<float> stacks(ids.size() * size_t(c.hc_hidden())), head(size_t(c.hc_hidden()));
  sequence->forward(std::span(ids).first(6), {false, nullptr, stacks.data(), false});
  sequence->mtp_forward(stacks.data(), std::span(ids).subspan(1), head.data(), MtpRows::Last);
  SequenceState own;
  sequence->export_state(own);
  size_t gdn = 0, attention = 0, ple = 0;
  for (int i = 0; i < c.num_layers; ++i) {
    if (c.layer_kinds[size_t(i)] == LayerKind::GatedDeltaNet) gdn = size_t(i);
    if (c.layer_kinds[size_t(i)] == LayerKind::SparseAttention) attention = size_t(i);
    if (c.is_ple_layer(i)) ple = size_t(i);
  }
  const auto refused = [&](const std::function<void(SequenceState&)>& edit, const std::string& expected) {
    SequenceState state = own;
    edit(state);
    const std::string error = test::error_of([&] { sequence->import_state(state); });
    EXPECT_NE(error.find(expected), std::string::npos) << "expected '" << expected << "' in: " << error;
  };
  refused([](SequenceState& s) { s.layers.pop_back(); }, "sequence state: " + std::to_string(c.num_layers - 1) +
                                                             " layers, this model has " + std::to_string(c.num_layers));
  refused([&](SequenceState& s) { s.layers[gdn].gdn.recurrent.pop_back(); },
          "layer " + std::to_string(gdn) + " GDN recurrent state has");
  refused([&](SequenceState& s) { s.layers[gdn].gdn.conv.push_back(0); },
          "layer " + std::to_string(gdn) + " GDN conv state has");
  refused([&](SequenceState& s) { s.layers[attention].attn.values.resize(0); },
          "layer " + std::to_string(attention) + " attention values has 0 values");
  refused([&](SequenceState& s) { ++s.position; }, "attention keys");  // caches shorter than the position
  refused([&](SequenceState& s) { s.mtp.attn.index_keys.pop_back(); }, "MTP layer indexer keys");
  refused([&](SequenceState& s) { s.mtp_position = s.position + 1; }, "MTP position");
  if (c.is_ple_layer(int(ple))) {
    refused([&](SequenceState& s) { s.layers[ple].ple.conv_rows.pop_back(); },
            "layer " + std::to_string(ple) + " PLE conv window");
    refused([&](SequenceState& s) { s.layers[ple].ple.previous_ids.back() = c.vocab_size; }, "PLE previous id");
  }
  EXPECT_EQ(sequence->position(), 6);
  SequenceState after;
  sequence->export_state(after);
  EXPECT_EQ(after.layers[gdn].gdn.recurrent, own.layers[gdn].gdn.recurrent);
}

INSTANTIATE_TEST_SUITE_P(MtpFixtures, BackendSeam, ::testing::ValuesIn(test::fixture_dirs(test::mtp_fixtures())),
                         [](const auto& info) { return info.param.filename().string(); });

}  // namespace
}  // namespace vavilov
