// Host sampling at Flash-Next's vocabulary: distribution() (logit processors, filters, normalisation) and draw() of one
// row, for the settings a chat client sends. Run: build/vavilov_sampling_bench [--benchmark_filter=...].
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "engine/sampling.h"

namespace {

constexpr int64_t kVocab = 248320;

const std::vector<float>& row_logits() {
  static const std::vector<float> logits = [] {
    std::vector<float> v(static_cast<size_t>(kVocab));
    std::mt19937 generator(1);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    for (float& x : v) x = normal(generator);
    return v;
  }();
  return logits;
}

void sample_row(benchmark::State& state, float temperature, int top_k, float top_p, float min_p, float penalty) {
  vavilov::SamplingOptions o;
  o.temperature = temperature, o.top_k = top_k, o.top_p = top_p, o.min_p = min_p, o.presence_penalty = penalty;
  vavilov::TokenHistory history;
  for (int32_t t = 0; t < 2000; ++t) history.push(t * 97);  // a long conversation's generated tokens
  vavilov::Rng rng(7);
  std::vector<double> probs;
  for (auto _ : state) {
    vavilov::distribution(row_logits().data(), kVocab, o, history, probs);
    benchmark::DoNotOptimize(vavilov::draw(probs, rng));
  }
}

}  // namespace

BENCHMARK_CAPTURE(sample_row, temperature, 0.7f, 0, 1.0f, 0.0f, 0.0f)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(sample_row, top_p_0_95, 0.7f, 0, 0.95f, 0.0f, 0.0f)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(sample_row, top_k_20_top_p_0_8, 0.7f, 20, 0.8f, 0.0f, 0.0f)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(sample_row, min_p_0_05, 1.0f, 0, 1.0f, 0.05f, 0.0f)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(sample_row, presence_penalty_top_p, 0.7f, 0, 0.95f, 0.0f, 1.5f)->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
