// The CUDA backend against HF transformers' fixtures and the CPU engine (ctest label `gpu`; run on the device
// machine by tests/gpu/run_gpu_tests.sh).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cpu/forward.h"
#include "cpu/mtp.h"
#include "cuda/backend.h"
#include "engine/generate.h"
#include "engine/speculative.h"
#include "fixture_paths.h"
#include "model/quantize.h"
#include "model/weights.h"
#include "reference_logits.h"

namespace vavilov {
namespace {

// fp32 arithmetic on the same weights as the reference (F32 checkpoints, or bf16 ones that HF also ran in fp32):
// only the order of fp32 roundings differs (the bound).
constexpr double kFp32Tolerance = 1e-3;
// Q4 weights: GPU and CPU dequantize the same codes, scales and biases with the same formula, so the bound is the
// fp32 one; against unquantized references Q4 makes no promise beyond what the CPU path shows.
constexpr double kQ4Tolerance = 1e-3;
constexpr int64_t kTokens = 16;

std::vector<float> logits_of(const Model& model, SequenceBackend& sequence, const std::vector<int32_t>& prompt,
                             size_t chunk) {
  const size_t vocab = size_t(model.config.vocab_size);
  std::vector<float> logits(prompt.size() * vocab);
  for (size_t begin = 0; begin < prompt.size(); begin += chunk) {
    size_t count = std::min(chunk, prompt.size() - begin);
    sequence.forward(std::span<const int32_t>(prompt).subspan(begin, count),
                     {true, logits.data() + begin * vocab, nullptr, false});
  }
  return logits;
}

std::vector<float> cpu_logits(const Model& model, const std::vector<int32_t>& prompt) {
  auto sequence = cpu_sequence(model);
  return logits_of(model, *sequence, prompt, prompt.size());
}

class GpuModel : public ::testing::TestWithParam<std::filesystem::path> {
 protected:
  void SetUp() override { ASSERT_GT(cuda::device_count(), 0) << "the GPU tests need a CUDA device"; }
};

TEST_P(GpuModel, LogitsMatchHfAndCpuOneShotChunkedAndTokenByToken) {
  test::ReferenceFixture fixture(GetParam());
  auto model = load_model(fixture.dir.string());
  auto gpu = cuda::sequence_factory(*model);
  const std::vector<float> cpu = cpu_logits(*model, fixture.prompt);
  for (size_t chunk : {fixture.prompt.size(), size_t(5), size_t(1)}) {
    auto sequence = gpu();
    const std::vector<float> logits = logits_of(*model, *sequence, fixture.prompt, chunk);
    EXPECT_LE(test::relative_error(logits, fixture.logits), kFp32Tolerance) << "vs HF, chunk " << chunk;
    EXPECT_LE(test::relative_error(logits, cpu), kFp32Tolerance) << "vs CPU, chunk " << chunk;
  }
}

TEST_P(GpuModel, Q4LogitsMatchCpuQ4) {
  test::ReferenceFixture fixture(GetParam());
  auto model = load_model(fixture.dir.string());
  if (quantize_model(*model, 4) == 0) GTEST_SKIP() << "no matrix of this fixture has a multiple of 64 columns";
  const std::vector<float> cpu = cpu_logits(*model, fixture.prompt);
  auto gpu = cuda::sequence_factory(*model);
  // Chunks of 7 rows take the prefill products (cuBLAS); 3 and 1 the decode GEMVs, grouped where products share
  // their input (src/cuda/product_groups.*).
  for (size_t chunk : {size_t(7), size_t(3), size_t(1)}) {
    auto sequence = gpu();
    EXPECT_LE(test::relative_error(logits_of(*model, *sequence, fixture.prompt, chunk), cpu), kQ4Tolerance)
        << "chunk " << chunk;
  }
}

TEST_P(GpuModel, GreedyMatchesHfAndCpu) {
  test::ReferenceFixture fixture(GetParam());
  auto model = load_model(fixture.dir.string());
  GenerateOptions options;
  options.max_tokens = int64_t(fixture.greedy.size());
  options.ignore_eos = true;
  GenerateStats stats;
  SpeculativeStats spec_stats;
  SpeculativeOptions plain;
  plain.drafts = 0;
  const auto gpu = generate_speculative(*model, fixture.prompt, options, plain, stats, spec_stats, {},
                                        cuda::sequence_factory(*model));
  EXPECT_EQ(gpu, fixture.greedy);
  EXPECT_EQ(gpu, generate_greedy(*model, fixture.prompt, options, stats));
}

TEST_P(GpuModel, MtpLogitsMatchReferenceAndCpu) {
  test::ReferenceFixture fixture(GetParam());
  if (!fixture.reference.contains("mtp_logits_file")) GTEST_SKIP() << "no MTP head in this fixture";
  auto model = load_model(fixture.dir.string());
  const size_t n = fixture.prompt.size(), sh = size_t(model->config.hc_hidden());
  const size_t vocab = size_t(model->config.vocab_size);
  auto run = [&](SequenceBackend& sequence) {
    std::vector<float> stacks(n * sh), head((n - 1) * sh), logits((n - 1) * vocab);
    sequence.forward(fixture.prompt, {false, nullptr, stacks.data(), false});
    sequence.mtp_forward(stacks.data(), std::span<const int32_t>(fixture.prompt).subspan(1), head.data(), MtpRows::All);
    sequence.mtp_logits(head.data(), int64_t(n - 1), logits.data());
    return logits;
  };
  auto gpu = cuda::sequence_factory(*model)();
  auto cpu = cpu_sequence(*model);
  const std::vector<float> logits = run(*gpu);
  EXPECT_LE(test::relative_error(
                logits, test::read_floats(fixture.dir / fixture.reference["mtp_logits_file"].get<std::string>())),
            kFp32Tolerance);
  EXPECT_LE(test::relative_error(logits, run(*cpu)), kFp32Tolerance);
}

// Speculative decoding on the GPU (drafts, verification, rollback on the device) gives exactly plain greedy, for every
// draft count, with the head's own drafts and with oracle drafts (every fifth one wrong) that force long accepted runs
// and rollbacks at chosen rows.
TEST_P(GpuModel, SpeculativeEqualsPlainGreedy) {
  test::ReferenceFixture fixture(GetParam());
  auto model = load_model(fixture.dir.string());
  if (!model->mtp) GTEST_SKIP() << "no MTP head in this fixture";
  GenerateOptions options;
  options.max_tokens = kTokens;
  options.ignore_eos = true;
  GenerateStats stats;
  const std::vector<int32_t> plain = generate_greedy(*model, fixture.prompt, options, stats);
  std::vector<int32_t> tokens = fixture.prompt;
  tokens.insert(tokens.end(), plain.begin(), plain.end());
  auto gpu = cuda::sequence_factory(*model);
  for (int drafts = 0; drafts <= 3; ++drafts)
    for (bool adaptive : {false, true})
      for (bool oracle : {false, true}) {
        SpeculativeOptions speculative;
        speculative.drafts = drafts;
        speculative.adaptive = adaptive;
        if (oracle)
          speculative.draft_override = [&](int64_t position, int32_t head_draft) {
            if (position >= int64_t(tokens.size())) return head_draft;
            const int32_t truth = tokens[size_t(position)];
            return position % 5 == 0 ? (truth + 1) % int32_t(model->config.vocab_size) : truth;
          };
        SpeculativeStats spec_stats;
        EXPECT_EQ(generate_speculative(*model, fixture.prompt, options, speculative, stats, spec_stats, {}, gpu), plain)
            << "drafts " << drafts << (adaptive ? " adaptive" : " fixed") << (oracle ? " oracle" : "");
        if (oracle && drafts > 0) {
          EXPECT_GT(spec_stats.mean_accepted(), 0.5) << "drafts " << drafts;
        }
      }
}

// Every backend call of a run of decode steps that crosses the attention caches' first growth (1024 positions), with
// CUDA graphs (captured per step shape, re-captured after the growth) and without (VAVILOV_CUDA_GRAPH=0): trunk
// passes of 1–4 recorded rows with logits and stacks, rollback, the head over the kept rows, its logits and a chained
// draft. The same kernels run either way, so every output must be bit-identical.
std::vector<float> decode_run_outputs(const Model& model, const SequenceFactory& factory, bool graphs) {
  if (graphs)
    unsetenv("VAVILOV_CUDA_GRAPH");
  else
    setenv("VAVILOV_CUDA_GRAPH", "0", 1);
  auto sequence = factory();
  unsetenv("VAVILOV_CUDA_GRAPH");
  const ModelConfig& c = model.config;
  const size_t vocab = size_t(c.vocab_size), sh = size_t(c.hc_hidden());
  uint64_t state = 7;
  auto random_ids = [&](size_t n) {
    std::vector<int32_t> ids(n);
    for (int32_t& id : ids) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      id = int32_t((state >> 33) % vocab);
    }
    return ids;
  };
  std::vector<float> outputs;
  auto keep = [&](const std::vector<float>& values) { outputs.insert(outputs.end(), values.begin(), values.end()); };
  constexpr size_t kPrompt = 1010, kEnd = 1040;
  const std::vector<int32_t> prompt = random_ids(kPrompt);
  std::vector<float> logits(vocab), stacks(kPrompt * sh);
  sequence->forward(prompt, {false, logits.data(), stacks.data(), false});
  keep(logits);
  if (model.mtp) {
    std::vector<float> head(sh);
    std::vector<int32_t> next(prompt.begin() + 1, prompt.end());
    next.push_back(prompt.front());
    sequence->mtp_forward(stacks.data(), next, head.data(), MtpRows::Last);
    keep(head);
  }
  for (int step = 0; sequence->position() < int64_t(kEnd); ++step) {
    const int64_t rows = 1 + step % 4, kept = 1 + (step / 4) % rows, first = sequence->position();
    const std::vector<int32_t> ids = random_ids(size_t(rows));
    std::vector<float> step_logits(size_t(rows) * vocab), step_stacks(size_t(rows) * sh);
    sequence->forward(ids, {true, step_logits.data(), step_stacks.data(), true});
    keep(step_logits);
    keep(step_stacks);
    sequence->keep_rows(first, kept);
    if (!model.mtp) continue;
    sequence->truncate_head(first);
    const std::vector<int32_t> next = random_ids(size_t(kept));
    std::vector<float> head(size_t(kept) * sh), head_logits(size_t(kept) * vocab), chained(sh);
    sequence->mtp_forward(step_stacks.data(), next, head.data(), MtpRows::All);
    sequence->mtp_logits(head.data(), kept, head_logits.data());
    sequence->mtp_forward(head.data() + (kept - 1) * int64_t(sh), std::span<const int32_t>(&next.back(), 1),
                          chained.data(), MtpRows::Last);
    sequence->mtp_logits(chained.data(), 1, logits.data());
    sequence->truncate_head(first + kept);
    for (const auto* values : {&head, &head_logits, &chained, &logits}) keep(*values);
  }
  return outputs;
}

TEST_P(GpuModel, GraphReplayEqualsEagerAcrossCacheGrowth) {
  test::ReferenceFixture fixture(GetParam());
  auto model = load_model(fixture.dir.string());
  const auto& kinds = model->config.layer_kinds;
  if (std::find(kinds.begin(), kinds.end(), LayerKind::SparseAttention) == kinds.end())
    GTEST_SKIP() << "no attention layer in this fixture";
  auto factory = cuda::sequence_factory(*model);
  const std::vector<float> graphs = decode_run_outputs(*model, factory, true);
  const std::vector<float> eager = decode_run_outputs(*model, factory, false);
  ASSERT_EQ(graphs.size(), eager.size());
  size_t differing = 0;
  for (size_t i = 0; i < graphs.size(); ++i) differing += std::memcmp(&graphs[i], &eager[i], sizeof(float)) != 0;
  EXPECT_EQ(differing, 0u) << "of " << graphs.size() << " output values";
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GpuModel, ::testing::ValuesIn(test::model_fixture_dirs()),
                         [](const auto& info) { return info.param.filename().string(); });

}  // namespace
}  // namespace vavilov
