// The causal conv of longer passes (gdn_conv, in place over [rows, channels]) against a double-precision host conv:
// row counts across the kernel's 16-row groups and 256-row stretches (the window carried between stretches), fewer
// rows than the history, channels that leave a partial block, the release's kernel width and others, the state after
// the pass and after every row.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "cuda/gated_deltanet.cuh"
#include "device_matrices.h"

namespace vavilov {
namespace {

struct Conv {
  std::vector<float> taps, state, x;  // [channels, kernel], [kernel−1, channels], [rows, channels]
};

double silu(double v) { return v / (1.0 + std::exp(-v)); }

// Outputs [rows, channels], then the state after every row ([rows, kernel−1, channels]).
void host_conv(const Conv& c, int channels, int kernel, int rows, std::vector<double>& out,
               std::vector<double>& row_states) {
  const int history = kernel - 1;
  auto input = [&](int row, int ch) {
    return row >= 0 ? double(c.x[size_t(row) * channels + ch]) : double(c.state[size_t(history + row) * channels + ch]);
  };
  out.assign(size_t(rows) * channels, 0.0);
  row_states.assign(size_t(rows) * history * channels, 0.0);
  for (int t = 0; t < rows; ++t)
    for (int ch = 0; ch < channels; ++ch) {
      double sum = 0;
      for (int k = 0; k < kernel; ++k) sum += double(c.taps[size_t(ch) * kernel + k]) * input(t - history + k, ch);
      out[size_t(t) * channels + ch] = silu(sum);
      for (int k = 0; k < history; ++k)
        row_states[(size_t(t) * history + k) * channels + ch] = input(t - history + 1 + k, ch);
    }
}

// fp32 sums of kernel ≤ 8 terms and one silu: a few ulps of the largest term; 1e-5 relative to max(1, |value|) fails
// on any wrong row, tap or carried input.
constexpr double kBound = 1e-5;

TEST(CudaGdnConv, LongPassesInPlaceMatchDoublePrecision) {
  struct Case {
    int channels, kernel, rows;
    bool record;
  };
  const std::vector<Case> cases = {{40, 4, 1, true},       {40, 4, 2, true},    {40, 4, 3, false},
                                   {40, 4, 17, true},      {40, 4, 256, false}, {40, 4, 257, true},
                                   {70, 4, 300, false},    {33, 2, 600, false}, {64, 8, 260, true},
                                   {10240, 4, 512, false}, {96, 5, 5, true}};
  std::mt19937 rng(31);
  std::normal_distribution<float> normal;
  for (const Case& k : cases) {
    Conv c;
    const int history = k.kernel - 1;
    for (auto [v, n] :
         {std::pair{&c.taps, size_t(k.channels) * k.kernel}, std::pair{&c.state, size_t(history) * k.channels},
          std::pair{&c.x, size_t(k.rows) * k.channels}}) {
      v->resize(n);
      for (float& f : *v) f = normal(rng);
    }
    std::vector<double> want, want_states;
    host_conv(c, k.channels, k.kernel, k.rows, want, want_states);
    test::DeviceMemory memory;
    float *taps = memory.copy(c.taps), *state = memory.copy(c.state), *x = memory.copy(c.x);
    float* row_states = k.record ? memory.copy(std::vector<float>(want_states.size(), NAN)) : nullptr;
    cuda::gdn_conv(taps, k.channels, k.kernel, state, x, k.rows, row_states, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<float> got = test::download(x, want.size()), got_state = test::download(state, c.state.size());
    double worst = 0;
    for (size_t i = 0; i < want.size(); ++i)
      worst = std::max(worst, std::abs(got[i] - want[i]) / std::max(1.0, std::abs(want[i])));
    EXPECT_LE(worst, kBound) << k.channels << " channels, kernel " << k.kernel << ", " << k.rows << " rows";
    // The state after the pass: the last kernel−1 raw inputs, exactly.
    const std::vector<double> last(want_states.end() - long(c.state.size()), want_states.end());
    for (size_t i = 0; i < last.size(); ++i)
      ASSERT_EQ(double(got_state[i]), last[i]) << "state " << i << ", " << k.rows << " rows";
    if (k.record) {
      const std::vector<float> states = test::download(row_states, want_states.size());
      for (size_t i = 0; i < states.size(); ++i) ASSERT_EQ(double(states[i]), want_states[i]) << "row state " << i;
    }
  }
}

}  // namespace
}  // namespace vavilov
