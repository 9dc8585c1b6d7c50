// The Decoder through the SequenceBackend seam as a device backend sees it (no CPU state: each decoder steps on its
// own), checked on the CPU engine: the calls keep the contract the CUDA backend relies on (at most 4 recorded rows,
// rollback right after the recorded pass, the head never truncated past its own position), greedy decoding asks for
// greedy ids and never for logits, and the tokens equal plain greedy decoding for every draft count.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "engine/backend.h"
#include "engine/generate.h"
#include "engine/speculative.h"
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
  int64_t calls() const { return calls_; }
  int64_t logits_requests() const { return logits_requests_; }

 private:
  std::unique_ptr<SequenceBackend> inner_;
  int64_t recorded_first_ = -1, recorded_rows_ = 0, head_ = 0, calls_ = 0, logits_requests_ = 0;
};

class BackendSeam : public ::testing::TestWithParam<std::filesystem::path> {};

TEST_P(BackendSeam, DeviceStyleDecoderKeepsTheContractAndEqualsPlainGreedy) {
  auto model = load_model(GetParam().string());
  ASSERT_TRUE(model->mtp.has_value());
  std::ifstream in(GetParam() / "reference.json");
  const auto prompt = nlohmann::json::parse(in)["prompt_ids"].get<std::vector<int32_t>>();
  GenerateOptions options;
  options.max_tokens = kTokens;
  options.ignore_eos = true;
  options.prefill_chunk = 5;
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

INSTANTIATE_TEST_SUITE_P(MtpFixtures, BackendSeam, ::testing::ValuesIn(test::fixture_dirs(test::mtp_fixtures())),
                         [](const auto& info) { return info.param.filename().string(); });

}  // namespace
}  // namespace vavilov
