// Sampling on the device (cuda/sampling.cuh, cuda/device_sampler.h) against the host's sampler (engine/sampling.h) and
// the Decoder's verification (engine/speculative.cpp): the filtered distributions at Flash-Next's vocabulary for every
// filter, bias and penalty; draws, and verify steps, with the same uniforms; and whole sampled decodings on the MTP
// fixtures, the device's against the same GPU's logits sampled on the host, token for token.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "composed_sequence.h"
#include "cuda/backend.h"
#include "cuda/device_model.h"
#include "cuda/device_sampler.h"
#include "decoded.h"
#include "engine/sampling.h"
#include "fixture_paths.h"
#include "graph_modes.h"
#include "model/weights.h"
#include "sampling_rows.h"

namespace vavilov {
namespace {

using test::with_graphs;

using cuda::device_alloc;
using cuda::DeviceAllocation;

class DeviceSampling : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_GT(cuda::device_count(), 0) << "the GPU tests need a CUDA device"; }
};

template <typename T>
DeviceAllocation upload(const std::vector<T>& host, const char* what) {
  DeviceAllocation device = device_alloc(std::max<size_t>(host.size(), 1) * sizeof(T), what);
  cuda::cuda_check(cudaMemcpy(device.get(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), what);
  return device;
}

template <typename T>
std::vector<T> download(const void* device, size_t count) {
  std::vector<T> host(count);
  cuda::cuda_check(cudaMemcpy(host.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost), "download");
  return host;
}

struct Filters {
  float temperature, top_p, min_p;
  int top_k;
};

const Filters kFilters[] = {{1, 1, 0, 0},    {0.7f, 1, 0, 20},     {0.7f, 0.8f, 0, 20}, {0.7f, 0.95f, 0, 0},
                            {2, 0.5f, 0, 0}, {0.3f, 0.999f, 0, 0}, {1, 1, 0.05f, 0},    {1, 0.9f, 0.01f, 5000},
                            {1, 1, 0, 1},    {1, 0.1f, 0, 0}};

// The device's distribution of one row with `options` and `history`, as engine::distribution computes it.
std::vector<double> device_distribution(const std::vector<float>& logits, const SamplingOptions& options,
                                        const TokenHistory& history, std::vector<int32_t>& status) {
  const int64_t vocab = int64_t(logits.size());
  std::vector<cuda::LogitAdjustment> adjustments;
  std::vector<float> biases;
  cuda::append_row_adjustments(options, history, {}, adjustments, biases);
  const std::vector<int32_t> row_begin{0, int32_t(adjustments.size())};
  DeviceAllocation d_logits = upload(logits, "logits"), d_adjust = upload(adjustments, "adjustments");
  DeviceAllocation d_begin = upload(row_begin, "rows"), d_biases = upload(biases, "biases");
  DeviceAllocation adjusted = device_alloc(size_t(vocab) * 4, "adjusted"), probs = device_alloc(size_t(vocab) * 8, "p");
  DeviceAllocation d_status = upload(std::vector<int32_t>{cuda::kSampleOk}, "status");  // written only when bad
  cuda::DistributionRows rows;
  rows.logits = static_cast<const float*>(d_logits.get());
  rows.logits_stride = vocab;
  rows.adjustments = static_cast<const cuda::LogitAdjustment*>(d_adjust.get());
  rows.row_begin = static_cast<const int32_t*>(d_begin.get());
  rows.biases = static_cast<const float*>(d_biases.get());
  rows.adjusted = static_cast<float*>(adjusted.get());
  rows.probs = static_cast<double*>(probs.get());
  rows.status = static_cast<int32_t*>(d_status.get());
  cuda::DeviceSamplingOptions o;
  o.temperature = options.temperature, o.top_p = options.top_p, o.min_p = options.min_p, o.top_k = options.top_k;
  o.repetition = options.repetition_penalty, o.presence = options.presence_penalty;
  o.frequency = options.frequency_penalty;
  cuda::cuda_check(cuda::sample_distributions(rows, 1, vocab, o, nullptr), "distribution");
  cuda::cuda_check(cudaDeviceSynchronize(), "distribution");
  status = download<int32_t>(d_status.get(), 1);
  return download<double>(probs.get(), size_t(vocab));
}

// Zero where the host's is zero; elsewhere equal but for the normalising sums. The host adds the n weights one after
// another in id order, which bounds its sum's relative error by (n − 1)·2^-53 (Higham's γ(n−1)); the device adds runs
// of ~n/1024 and then a tree (a far smaller bound). On the tied rows below the host's sum is off by 1.3e-12 and
// 2.9e-12 (against a long double sum), more than the 1e-12 a first version of this test allowed; each probability may
// differ by 2n·2^-53 relative (5.5e-11 at 248320 tokens), not more.
size_t mismatches(const std::vector<double>& got, const std::vector<double>& want) {
  const double tolerance = 2.0 * double(want.size()) * 0x1p-53;
  size_t wrong = 0;
  for (size_t i = 0; i < want.size(); ++i)
    wrong += want[i] == 0 ? got[i] != 0 : std::abs(got[i] - want[i]) > tolerance * want[i];
  return wrong;
}

void expect_distributions_match_the_host(int64_t vocab) {
  const std::vector<std::vector<float>> rows = test::sampling_rows(vocab, 11);
  TokenHistory history;
  std::vector<int32_t> prompt;
  for (int32_t i = 0; i < 300; ++i) prompt.push_back(i * 811 % int32_t(vocab));
  history.add_prompt(prompt);
  for (int32_t i = 0; i < 200; ++i) history.push(i * 131 % 1400);  // repeats: frequency counts above 1
  for (size_t c = 0; c < rows.size(); ++c)
    for (const Filters& f : kFilters)
      for (bool adjusted : {false, true}) {
        SamplingOptions o;
        o.temperature = f.temperature, o.top_k = f.top_k, o.top_p = f.top_p, o.min_p = f.min_p;
        if (adjusted) {
          o.logit_bias = {{7, 3.0f}, {7, -0.5f}, {123, -INFINITY}, {0, 5.0f}};
          o.repetition_penalty = 1.3f, o.presence_penalty = 0.4f, o.frequency_penalty = 0.2f;
        }
        const std::string what = "case " + std::to_string(c) + ", T " + std::to_string(f.temperature) + ", top_k " +
                                 std::to_string(f.top_k) + ", top_p " + std::to_string(f.top_p) + ", min_p " +
                                 std::to_string(f.min_p) + (adjusted ? ", bias and penalties" : "");
        std::vector<int32_t> status;
        const std::vector<double> got = device_distribution(rows[c], o, history, status);
        ASSERT_EQ(status[0], cuda::kSampleOk) << what;
        EXPECT_EQ(mismatches(got, distribution(rows[c].data(), vocab, o, history)), 0u) << what;
      }
}

TEST_F(DeviceSampling, DistributionsMatchTheHostAtFlashNextsVocabulary) { expect_distributions_match_the_host(248320); }

TEST_F(DeviceSampling, DistributionsMatchTheHostOnShortRows) { expect_distributions_match_the_host(1500); }

// Few launches for racecheck: one short row with exact ties through top-k, top-p and min-p with a bias and a penalty,
// then a draft from it and a two-row verify step through DeviceSampler (every kernel and shared-memory path).
TEST_F(DeviceSampling, EveryKernelOnAShortRow) {
  constexpr int64_t kVocab = 1500;
  const std::vector<float> logits = test::sampling_rows(kVocab, 5)[1];
  SamplingOptions o;
  o.temperature = 0.8f, o.top_k = 400, o.top_p = 0.9f, o.min_p = 0.01f, o.presence_penalty = 0.5f;
  o.logit_bias = {{3, 2.0f}};
  TokenHistory history;
  history.push(11);
  std::vector<int32_t> status;
  const std::vector<double> want = distribution(logits.data(), kVocab, o, history);
  EXPECT_EQ(mismatches(device_distribution(logits, o, history, status), want), 0u);
  cuda::StepRunner runner(1 << 20, 1 << 20, false);
  cuda::DeviceSampler sampler(kVocab);
  DeviceAllocation d_logits = upload(std::vector<float>(logits.begin(), logits.end()), "logits");
  std::vector<float> two(logits);
  two.insert(two.end(), logits.begin(), logits.end());
  DeviceAllocation d_two = upload(two, "logits");
  Rng host(3);
  const int32_t draft =
      sampler.draft(static_cast<const float*>(d_logits.get()), 0, {&o, &history, host.state(), {}}, runner);
  EXPECT_EQ(draft, draw(want, host));
  const std::vector<int32_t> rows{1, draft};
  const SampledVerify verified =
      sampler.verify(static_cast<const float*>(d_two.get()), rows, {&o, &history, host.state(), {}}, runner);
  EXPECT_EQ(verified.emitted.front(), draft);  // the trunk's distribution is the draft's: always accepted
  EXPECT_EQ(verified.emitted.size(), 2u);
}

TEST_F(DeviceSampling, BadRowsReportTheHostsErrors) {
  SamplingOptions o;
  o.temperature = 1;
  std::vector<int32_t> status;
  device_distribution({1, 2, NAN, 0, NAN}, o, {}, status);
  EXPECT_EQ(status[0], 2);  // the first NaN's id
  device_distribution({-INFINITY, -INFINITY}, o, {}, status);
  EXPECT_EQ(status[0], cuda::kSampleAllBanned);
  device_distribution({1, INFINITY, 0}, o, {}, status);
  EXPECT_EQ(status[0], cuda::kSampleNoMass);
}

// draw() on the host and the device's draw over the same probabilities, with the same uniforms; the device's generator
// advanced by the one uniform drawn.
TEST_F(DeviceSampling, DrawsMatchTheHostWithTheSameUniforms) {
  for (int64_t vocab : {int64_t(3), int64_t(1000), int64_t(248320)}) {
    const std::vector<float> logits = test::sampling_rows(vocab, 3)[1];
    SamplingOptions o;
    o.temperature = 1.5f;
    const std::vector<double> probs = distribution(logits.data(), vocab, o, {});
    DeviceAllocation d_probs = upload(probs, "p"), token = device_alloc(4, "token");
    DeviceAllocation generator = device_alloc(sizeof(cuda::SamplerState), "generator");
    Rng host(99);
    for (int i = 0; i < (vocab > 1000 ? 40 : 300); ++i) {
      const cuda::SamplerState start{host.state(), 0};
      cuda::cuda_check(cudaMemcpy(generator.get(), &start, sizeof start, cudaMemcpyHostToDevice), "generator");
      const int32_t want = draw(probs, host);
      cuda::cuda_check(cuda::sampled_draw(static_cast<const double*>(d_probs.get()), vocab,
                                          static_cast<cuda::SamplerState*>(generator.get()),
                                          static_cast<int32_t*>(token.get()), nullptr),
                       "draw");
      EXPECT_EQ(download<int32_t>(token.get(), 1)[0], want) << "vocabulary " << vocab << ", draw " << i;
      const cuda::SamplerState end = download<cuda::SamplerState>(generator.get(), 1)[0];
      EXPECT_EQ(end.state, host.state());
      EXPECT_EQ(end.uniforms, 1);
    }
  }
}

// Decoder::verify_row's rule on the host: the emitted tokens and the uniforms drawn.
SampledVerify host_verify(const std::vector<std::vector<double>>& p, std::vector<std::vector<double>> q,
                          const std::vector<int32_t>& rows, const std::vector<int64_t>& stops, Rng& rng) {
  SampledVerify v;
  const uint64_t start = rng.state();
  for (size_t r = 0; r < rows.size(); ++r) {
    int32_t token;
    if (r + 1 < rows.size()) {
      const int32_t x = rows[r + 1];
      if (rng.uniform() < std::min(1.0, p[r][size_t(x)] / q[r][size_t(x)])) {
        token = x;
      } else {
        double residual = 0;
        for (size_t i = 0; i < q[r].size(); ++i) residual += q[r][i] = std::max(0.0, p[r][i] - q[r][i]);
        token = draw(residual > 0 ? q[r] : p[r], rng);
      }
    } else {
      token = draw(p[r], rng);
    }
    v.emitted.push_back(token);
    if (r + 1 == rows.size() || token != rows[r + 1] || std::count(stops.begin(), stops.end(), token)) break;
  }
  Rng counter(start);
  while (counter.state() != rng.state()) counter.uniform(), ++v.uniforms;
  return v;
}

// DeviceSampler::verify on the device's logits (rows penalised by the drafts before them) and its drafts' q, against
// the host's rule on the host's distributions of the same logits: 200 steps of 1–4 rows, drafts drawn from q (mostly
// accepted) or not (mostly rejected), a stop token among them.
TEST_F(DeviceSampling, VerifyStepsMatchTheDecodersRule) {
  constexpr int64_t kVocab = 997;
  cuda::StepRunner runner(1 << 20, 1 << 20, false);
  cuda::DeviceSampler sampler(kVocab);
  SamplingOptions o;
  o.temperature = 0.9f, o.top_k = 300, o.top_p = 0.97f, o.presence_penalty = 0.7f, o.logit_bias = {{5, 3.0f}};
  TokenHistory history;
  history.add_prompt(std::vector<int32_t>{1, 2, 3, 5});
  const std::vector<int64_t> stops{17, 5};  // 5 is biased up: steps that end at a stop
  std::mt19937 generator(4);
  std::normal_distribution<float> normal(0.0f, 1.5f);
  DeviceAllocation d_logits = device_alloc(size_t(4 * kVocab) * 4, "logits");
  int accepted = 0, rejected = 0, stopped = 0;
  for (int step = 0; step < 200; ++step) {
    const int drafts = step % 4;
    std::vector<float> draft_logits(static_cast<size_t>(kVocab)), logits(static_cast<size_t>((drafts + 1) * kVocab));
    // Row r's trunk logits: draft r's logits and some noise, so that drafts from q are mostly accepted.
    for (float& x : logits) x = normal(generator);
    Rng host(1000 + uint64_t(step));
    std::vector<int32_t> rows{int32_t(generator() % kVocab)};
    std::vector<std::vector<double>> q;
    TokenHistory drafted = history;
    for (int j = 0; j < drafts; ++j) {  // drafts from q on the device, as draft_sampled draws them
      for (int64_t i = 0; i < kVocab; ++i)
        draft_logits[size_t(i)] = logits[size_t(j * kVocab + i)] + 0.3f * normal(generator);
      cuda::cuda_check(cudaMemcpy(d_logits.get(), draft_logits.data(), draft_logits.size() * 4, cudaMemcpyHostToDevice),
                       "logits");
      const uint64_t state = host.state();
      int32_t draft = sampler.draft(static_cast<const float*>(d_logits.get()), j, {&o, &drafted, state, stops}, runner);
      q.push_back(distribution(draft_logits.data(), kVocab, o, drafted));
      ASSERT_EQ(draft, draw(q.back(), host)) << "step " << step << ", draft " << j;
      if (step % 3 == 1) {  // a draft not from q: rejected more often than not, and replaced on the device too
        draft = int32_t((draft + 1) % kVocab);
        sampler.replace(j, draft, runner);
        q.back().assign(size_t(kVocab), 0.0);
        q.back()[size_t(draft)] = 1.0;
      }
      rows.push_back(draft);
      drafted.push(draft);
    }
    std::vector<std::vector<double>> p;
    TokenHistory row_history = history;
    for (int r = 0; r <= drafts; ++r) {
      p.push_back(distribution(logits.data() + r * kVocab, kVocab, o, row_history));
      if (r < drafts) row_history.push(rows[size_t(r) + 1]);
    }
    cuda::cuda_check(cudaMemcpy(d_logits.get(), logits.data(), logits.size() * 4, cudaMemcpyHostToDevice), "logits");
    const SampledVerify got =
        sampler.verify(static_cast<const float*>(d_logits.get()), rows, {&o, &history, host.state(), stops}, runner);
    const SampledVerify want = host_verify(p, q, rows, stops, host);
    ASSERT_EQ(got.emitted, want.emitted) << "step " << step;
    ASSERT_EQ(got.uniforms, want.uniforms) << "step " << step;
    accepted += int(want.emitted.size()) - 1;
    rejected += want.emitted.size() < rows.size();
    stopped += std::count(stops.begin(), stops.end(), want.emitted.back()) > 0;
  }
  EXPECT_GT(accepted, 50);  // both branches of the rule ran many times, and steps ended at a stop
  EXPECT_GT(rejected, 50);
  EXPECT_GT(stopped, 3);
}

// Whole decodings through the Decoder: the device's sampling against the same GPU's logits sampled on the host
// (ComposedSequence does not sample on the device), at 0–3 drafts, fixed and adaptive, with every filter, a bias, with
// penalties (the device's calls) and without (the whole step as one graph where the fixture's head allows:
// sampled_step), with CUDA graphs and eagerly, and with drafts replaced by an override.
class GpuSampledDecoding : public ::testing::TestWithParam<std::filesystem::path> {
 protected:
  void SetUp() override { ASSERT_GT(cuda::device_count(), 0) << "the GPU tests need a CUDA device"; }
};

TEST_P(GpuSampledDecoding, DeviceSamplingEqualsHostSamplingOfTheSameLogits) {
  auto model = load_model(GetParam().string());
  const SequenceFactory gpu = cuda::sequence_factory(*model);
  const SequenceFactory host_sampled = [gpu]() -> std::unique_ptr<SequenceBackend> {
    return std::make_unique<test::ComposedSequence>(gpu());
  };
  const std::vector<int32_t> prompt{1, 5, 9, 14, 3, 8, 2};
  GenerateOptions options;
  options.max_tokens = 40;
  options.sampling.temperature = 0.8f;
  options.sampling.top_k = 40, options.sampling.top_p = 0.9f, options.sampling.min_p = 0.02f;
  options.sampling.logit_bias = {{4, 2.0f}};
  for (bool penalties : {true, false})
    for (bool graphs : {true, false})
      for (uint64_t seed : {uint64_t(1), uint64_t(2)})
        for (int drafts = 0; drafts <= (model->mtp ? 3 : 0); ++drafts)
          for (bool adaptive : {false, true})
            for (bool override_drafts : {false, true}) {
              if ((adaptive || override_drafts) && drafts == 0) continue;
              options.sampling.seed = seed;
              options.sampling.presence_penalty = penalties ? 0.5f : 0.0f;
              options.sampling.repetition_penalty = penalties ? 1.1f : 1.0f;
              SpeculativeOptions speculative;
              speculative.drafts = drafts;
              speculative.adaptive = adaptive;
              if (override_drafts)
                speculative.draft_override = [](int64_t position, int32_t draft) {
                  return position % 3 ? draft : int32_t(position % 7);
                };
              const std::string what = std::string(penalties ? "penalties" : "no penalties") +
                                       (graphs ? ", graphs" : ", eager") + ", seed " + std::to_string(seed) +
                                       ", drafts " + std::to_string(drafts) + (adaptive ? " adaptive" : " fixed") +
                                       (override_drafts ? ", overridden" : "");
              const test::Decoded device = test::decode(*model, prompt, options, speculative, with_graphs(gpu, graphs));
              const test::Decoded host = test::decode(*model, prompt, options, speculative, host_sampled);
              test::expect_same_decoding(device, host, what);
            }
}

// The whole sampled step as one graph (no penalties) on a few steps, short enough for memcheck.
TEST_P(GpuSampledDecoding, FusedSampledStepsEqualHostSamplingShort) {
  auto model = load_model(GetParam().string());
  if (!model->mtp) GTEST_SKIP() << "no MTP head in this fixture";
  const SequenceFactory gpu = cuda::sequence_factory(*model);
  const SequenceFactory host_sampled = [gpu]() -> std::unique_ptr<SequenceBackend> {
    return std::make_unique<test::ComposedSequence>(gpu());
  };
  GenerateOptions options;
  options.max_tokens = 12;
  options.sampling.temperature = 0.8f, options.sampling.top_k = 40, options.sampling.top_p = 0.9f;
  SpeculativeOptions speculative;
  speculative.drafts = 3;
  speculative.adaptive = true;
  const std::vector<int32_t> prompt{1, 5, 9, 14};
  test::expect_same_decoding(test::decode(*model, prompt, options, speculative, gpu),
                             test::decode(*model, prompt, options, speculative, host_sampled), "adaptive, 3 drafts");
  // The decodings above took the fused step: a sequence runs it (one verify uniform at least, one a draft).
  auto seq = gpu();
  const int64_t sh = model->config.hc_hidden();
  std::vector<float> stacks(prompt.size() * size_t(sh)), head(static_cast<size_t>(sh));
  int32_t first = 0;
  seq->forward(prompt, {false, nullptr, stacks.data(), false, &first});
  std::vector<int32_t> next(prompt.begin() + 1, prompt.end());
  next.push_back(first);
  seq->mtp_forward(stacks.data(), next, head.data(), MtpRows::Last);
  const std::vector<int32_t> rows{first, 2, 3};
  GreedyStep step;
  step.rows = rows;
  step.stack_size = sh;
  step.head = true;
  step.drafts = step.drafts_after_rejection = 2;
  TokenHistory history;
  SampledStepResult fused;
  ASSERT_TRUE(seq->sampled_step(step, {&options.sampling, &history, 7, {}}, fused));
  EXPECT_GE(fused.step.emitted.size(), 1u);
  EXPECT_EQ(fused.step.drafts.size(), 2u);
  EXPECT_GE(fused.uniforms, 3);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GpuSampledDecoding, ::testing::ValuesIn(test::fixture_dirs(test::mtp_fixtures())),
                         [](const auto& info) { return info.param.filename().string(); });

}  // namespace
}  // namespace vavilov
