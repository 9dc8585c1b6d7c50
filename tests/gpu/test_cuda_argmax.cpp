// The GPU's greedy ids: the argmax kernel (cuda/argmax.cuh) against std::max_element on random, tie-heavy and
// NaN/inf rows at Flash-Next's vocabulary and small ones (both load paths), and the Decoder on the GPU — which now
// takes greedy ids from the device — against the same Decoder answered from downloaded logits (the old path) and
// plain CPU greedy decoding, with 0-3 drafts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>

#include "cuda/argmax.cuh"
#include "cuda/backend.h"
#include "device_matrices.h"
#include "engine/generate.h"
#include "engine/speculative.h"
#include "fixture_paths.h"
#include "logits_only_sequence.h"
#include "model/weights.h"

namespace vavilov {
namespace {

constexpr int64_t kFlashNextVocab = 248320;
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// Runs the kernel over `rows` rows of `vocab` values starting `offset` floats into a device buffer (offset 1: rows
// not 16-byte aligned, the scalar path) and checks every id against std::max_element.
void expect_matches_host(const std::vector<float>& logits, int rows, int64_t vocab, size_t offset, const char* what) {
  test::DeviceMemory memory;
  std::vector<float> padded(offset, 0.0f);
  padded.insert(padded.end(), logits.begin(), logits.end());
  const float* device = memory.copy(padded) + offset;
  auto* scratch = memory.zeros<cuda::ArgmaxPartial>(cuda::argmax_scratch_count(rows));
  int32_t* ids = memory.zeros<int32_t>(size_t(rows));
  ASSERT_EQ(cuda::argmax_rows(device, rows, vocab, scratch, ids, nullptr), cudaSuccess);
  std::vector<int32_t> got(static_cast<size_t>(rows));
  ASSERT_EQ(cudaMemcpy(got.data(), ids, got.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  for (int r = 0; r < rows; ++r) {
    const auto row = logits.begin() + int64_t(r) * vocab;
    EXPECT_EQ(got[size_t(r)], int32_t(std::max_element(row, row + vocab) - row))
        << what << ": row " << r << " of " << rows << ", vocab " << vocab << ", offset " << offset;
  }
}

const std::vector<int64_t> kVocabs{kFlashNextVocab, kFlashNextVocab + 3, 4096, 4097, 1000, 7, 1};

TEST(CudaArgmax, RandomRowsMatchHost) {
  ASSERT_GT(cuda::device_count(), 0);
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  for (int64_t vocab : kVocabs)
    for (int rows : {1, 4, 64}) {
      if (rows == 64 && vocab == kFlashNextVocab + 3) continue;  // 64 rows of the large vocabulary once is enough
      std::vector<float> logits(size_t(rows * vocab));
      for (float& x : logits) x = normal(rng);
      for (size_t offset : {size_t(0), size_t(1)}) expect_matches_host(logits, rows, vocab, offset, "random");
    }
}

// A few levels, so the maximum repeats all over the row (and across chunks); the maximum alone at the last or first
// index; all equal.
TEST(CudaArgmax, TieHeavyRowsPickTheLowestIndex) {
  ASSERT_GT(cuda::device_count(), 0);
  std::mt19937 rng(12);
  for (int64_t vocab : kVocabs)
    for (int levels : {1, 2, 3, 1000}) {
      constexpr int kRows = 4;
      std::uniform_int_distribution<int> level(0, levels - 1);
      std::vector<float> logits(size_t(kRows * vocab));
      for (float& x : logits) x = float(level(rng));
      if (vocab > 1) {
        std::fill(logits.begin(), logits.begin() + vocab, -1.0f);  // row 0: its maximum only at the end
        logits[size_t(vocab - 1)] = 0.5f;
        logits[size_t(vocab)] = float(levels);  // row 1: at the start
      }
      for (size_t offset : {size_t(0), size_t(1)}) expect_matches_host(logits, kRows, vocab, offset, "ties");
    }
}

// NaN first (chosen, as by std::max_element), NaN elsewhere (never chosen), all NaN, all −inf, +inf twice, ±0, and
// specials sprinkled over random rows.
TEST(CudaArgmax, NaNAndInfinitiesFollowMaxElement) {
  ASSERT_GT(cuda::device_count(), 0);
  for (int64_t vocab : kVocabs) {
    constexpr int kRows = 7;
    std::vector<float> logits(size_t(kRows * vocab), 1.0f);
    auto row = [&](int r) { return logits.begin() + int64_t(r) * vocab; };
    row(0)[0] = kNaN;
    row(0)[vocab - 1] = 5.0f;
    for (int64_t i = 0; i < vocab; i += 3) row(1)[i] = kNaN;
    row(1)[vocab / 2] = 2.0f;
    std::fill(row(2), row(2) + vocab, kNaN);
    std::fill(row(3), row(3) + vocab, -kInf);
    row(4)[vocab / 3] = kInf;
    row(4)[vocab - 1] = kInf;
    std::fill(row(5), row(5) + vocab, -0.0f);
    row(5)[vocab - 1] = 0.0f;
    std::fill(row(6), row(6) + vocab, kNaN);
    row(6)[0] = -kInf;
    for (size_t offset : {size_t(0), size_t(1)}) expect_matches_host(logits, kRows, vocab, offset, "special");
  }
  std::mt19937 rng(13);
  std::uniform_int_distribution<int> kind(0, 9), small(-2, 2);
  const float specials[] = {kNaN, kInf, -kInf, -0.0f, 0.0f};
  for (int64_t vocab : {kFlashNextVocab, int64_t(333)}) {
    constexpr int kRows = 8;
    std::vector<float> logits(size_t(kRows * vocab));
    for (float& x : logits) x = kind(rng) < 2 ? specials[size_t(kind(rng)) % 5] : float(small(rng));
    expect_matches_host(logits, kRows, vocab, 0, "sprinkled");
  }
}

struct Decoded {
  std::vector<int32_t> tokens;
  int64_t logits_requests = 0;
};

Decoded decode(const Model& model, const std::vector<int32_t>& prompt, const GenerateOptions& options, int drafts,
               const SequenceFactory& device) {
  SpeculativeOptions speculative;
  speculative.drafts = drafts;
  Decoder decoder(model, options, speculative, device);
  Decoded run;
  run.tokens.push_back(decoder.start(prompt));
  while (int64_t(run.tokens.size()) < options.max_tokens)
    for (int32_t token : decoder.step())
      if (int64_t(run.tokens.size()) < options.max_tokens) run.tokens.push_back(token);
  if (auto* logits_only = dynamic_cast<test::LogitsOnlySequence*>(&decoder.backend()))
    run.logits_requests = logits_only->logits_requests;
  return run;
}

class GpuGreedyIds : public ::testing::TestWithParam<std::filesystem::path> {
 protected:
  void SetUp() override { ASSERT_GT(cuda::device_count(), 0) << "the GPU tests need a CUDA device"; }
};

// Greedy ids on the device give the tokens of the old path (logits downloaded, std::max_element) and of plain CPU
// greedy decoding, with and without drafts.
TEST_P(GpuGreedyIds, DeviceGreedyIdsEqualTheLogitsPath) {
  auto model = load_model(GetParam().string());
  std::ifstream in(GetParam() / "reference.json");
  const auto prompt = nlohmann::json::parse(in)["prompt_ids"].get<std::vector<int32_t>>();
  GenerateOptions options;
  options.max_tokens = 16;
  options.ignore_eos = true;
  GenerateStats stats;
  const std::vector<int32_t> plain = generate_greedy(*model, prompt, options, stats);
  const SequenceFactory gpu = cuda::sequence_factory(*model);
  const SequenceFactory logits_only = [&]() -> std::unique_ptr<SequenceBackend> {
    return std::make_unique<test::LogitsOnlySequence>(gpu(), model->config.vocab_size);
  };
  for (int drafts = 0; drafts <= (model->mtp ? 3 : 0); ++drafts) {
    const Decoded device = decode(*model, prompt, options, drafts, gpu);
    const Decoded host = decode(*model, prompt, options, drafts, logits_only);
    EXPECT_EQ(device.tokens, host.tokens) << "drafts " << drafts;
    EXPECT_EQ(device.tokens, plain) << "drafts " << drafts;
    EXPECT_EQ(host.logits_requests, 0) << "drafts " << drafts;
  }
}

// Logits and greedy ids asked for together (a prompt of over 64 rows, whose logits come in 64-row products; decode
// and verify passes of 1-4 rows in captured graphs; the head's rows in two products): each id is std::max_element of
// the logits that came with it.
TEST_P(GpuGreedyIds, IdsAreTheArgmaxOfTheSamePassLogits) {
  auto model = load_model(GetParam().string());
  std::ifstream in(GetParam() / "reference.json");
  const auto ids_of_fixture = nlohmann::json::parse(in)["prompt_ids"].get<std::vector<int32_t>>();
  std::vector<int32_t> prompt;  // over 64 rows: the logits of every row come in 64-row products after the pass
  while (prompt.size() < 70) prompt.insert(prompt.end(), ids_of_fixture.begin(), ids_of_fixture.end());
  const int64_t vocab = model->config.vocab_size, sh = model->config.hc_hidden(), n = int64_t(prompt.size());
  auto sequence = cuda::sequence_factory(*model)();
  auto expect_argmax = [&](const std::vector<float>& logits, const std::vector<int32_t>& ids, const char* what) {
    for (size_t r = 0; r < ids.size(); ++r) {
      const auto row = logits.begin() + int64_t(r) * vocab;
      EXPECT_EQ(ids[r], int32_t(std::max_element(row, row + vocab) - row)) << what << " row " << r;
    }
  };
  std::vector<float> logits(size_t(n * vocab)), stacks(size_t(n * sh));
  std::vector<int32_t> ids(static_cast<size_t>(n));
  sequence->forward(prompt, {true, logits.data(), stacks.data(), false, ids.data()});
  expect_argmax(logits, ids, "prompt");
  for (int rows = 1; rows <= 4; ++rows) {
    const std::vector<int32_t> step(prompt.begin(), prompt.begin() + rows);
    for (bool all_rows : {true, false}) {
      std::vector<float> step_logits(size_t((all_rows ? rows : 1) * vocab));
      std::vector<int32_t> step_ids(all_rows ? size_t(rows) : 1);
      const int64_t first = sequence->position();
      sequence->forward(step, {all_rows, step_logits.data(), nullptr, true, step_ids.data()});
      expect_argmax(step_logits, step_ids, all_rows ? "verify" : "last");
      sequence->keep_rows(first, 1);
    }
  }
  if (!model->mtp) return;
  std::vector<float> head(size_t((n - 1) * sh)), head_logits(size_t((n - 1) * vocab));
  std::vector<int32_t> head_ids(size_t(n - 1));
  sequence->mtp_forward(stacks.data(), std::span<const int32_t>(prompt).subspan(1), head.data(), MtpRows::All);
  sequence->mtp_logits(head.data(), n - 1, head_logits.data());
  sequence->mtp_greedy(head.data(), n - 1, head_ids.data());
  expect_argmax(head_logits, head_ids, "head");
  EXPECT_EQ(sequence->draft_greedy(head.data()), head_ids.front());
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GpuGreedyIds, ::testing::ValuesIn(test::model_fixture_dirs()),
                         [](const auto& info) { return info.param.filename().string(); });

}  // namespace
}  // namespace vavilov
