// Affine quantization: codes packed LSB-first into uint32 words (MLX's layout), w ≈ scale·q + bias per group of 64.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "core/error.h"
#include "cpu/forward.h"
#include "cpu/linear.h"
#include "engine/generate.h"
#include "model/quantize.h"
#include "tokenizer/prompt.h"

namespace vavilov {
namespace {

std::vector<float> random_rows(int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> w(size_t(rows * cols));
  for (auto& v : w) v = normal(rng);
  return w;
}

Matrix as_matrix(const QuantizedRows& q, int64_t rows, int64_t cols, int bits) {
  return Matrix{"q",  DType::BF16,     rows,           cols, reinterpret_cast<const std::byte*>(q.codes.data()),
                bits, q.scales.data(), q.biases.data()};
}

TEST(Quantize, RoundTripErrorIsWithinHalfAStep) {
  for (int bits : {4, 3, 2}) {
    const int64_t rows = 5, cols = 256;
    const float levels = float((1 << bits) - 1);
    auto w = random_rows(rows, cols, 7 + bits);
    QuantizedRows q = quantize_rows(w.data(), rows, cols, bits);
    Matrix m = as_matrix(q, rows, cols, bits);
    std::vector<float> back(static_cast<size_t>(cols));
    for (int64_t r = 0; r < rows; ++r) {
      dequantize_row(m, r, back.data());
      for (int64_t c = 0; c < cols; ++c) {
        size_t g = size_t(r * (cols / kQuantGroup) + c / kQuantGroup);
        float scale = bf16_to_f32(q.scales[g]), bias = bf16_to_f32(q.biases[g]);
        // MLX makes the edge of larger magnitude an exact grid point; rounding q0 can leave the far end of the group
        // just outside the grid, where values clamp to its last point. Within the grid: half a step, plus the bf16
        // rounding (2^-9 relative) of the stored scale (times the code) and bias, since codes are chosen against the
        // unrounded fp32 values, as MLX does.
        float first = std::min(bias, bias + levels * scale), last = std::max(bias, bias + levels * scale);
        float target = std::clamp(w[size_t(r * cols + c)], first, last);
        EXPECT_LE(std::fabs(back[size_t(c)] - target),
                  0.5f * std::fabs(scale) + std::ldexp(levels * std::fabs(scale) + std::fabs(bias), -9) * 1.01f)
            << bits << " bits, row " << r << " col " << c;
        // And overall: |edge| ≥ (max − min)/2 makes |q0| ≥ levels/2, so the far end falls short of the group by
        // less than the unrounded step (max − min)/levels ≤ 4/3 of the stored one (2 bits; less for more bits);
        // 1.6 leaves room for the bf16 rounding of the scale.
        EXPECT_LE(std::fabs(back[size_t(c)] - w[size_t(r * cols + c)]), 1.6f * std::fabs(scale) + 0.02f)
            << bits << " bits, row " << r << " col " << c;
      }
    }
  }
}

TEST(Quantize, CodesArePackedLeastSignificantFirst) {
  // A group whose values are exactly 0, 1, ..., 15 (repeated): MLX keeps the edge of larger magnitude (15) exactly,
  // so the grid runs downwards from it: scale −1, bias 15, code 15 − w.
  std::vector<float> w(kQuantGroup);
  for (int64_t i = 0; i < kQuantGroup; ++i) w[size_t(i)] = float(i % 16);
  QuantizedRows q = quantize_rows(w.data(), 1, kQuantGroup, 4);
  EXPECT_EQ(bf16_to_f32(q.scales[0]), -1.0f);
  EXPECT_EQ(bf16_to_f32(q.biases[0]), 15.0f);
  EXPECT_EQ(q.codes[0], 0x89abcdefu);
  EXPECT_EQ(q.codes[1], 0x01234567u);
}

TEST(Quantize, QuantizedMatmulEqualsDenseMatmulOfDequantizedWeights) {
  const int64_t rows = 33, cols = 192, batch = 3;
  auto w = random_rows(rows, cols, 3);
  auto x = random_rows(batch, cols, 4);
  QuantizedRows q = quantize_rows(w.data(), rows, cols, 4);
  Matrix quantized = as_matrix(q, rows, cols, 4);
  std::vector<float> dense(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r) dequantize_row(quantized, r, dense.data() + r * cols);
  std::vector<float> got(size_t(batch * rows));
  cpu::matmul(quantized, x.data(), batch, got.data());
  // Against the double-precision product of the dequantized weights: the kernel's fp32 sums may differ only by
  // their rounding, a few ε times the sum of |w·x| terms.
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t r = 0; r < rows; ++r) {
      double want = 0, magnitude = 0;
      for (int64_t k = 0; k < cols; ++k) {
        const double term = double(dense[size_t(r * cols + k)]) * x[size_t(b * cols + k)];
        want += term;
        magnitude += std::abs(term);
      }
      EXPECT_NEAR(got[size_t(b * rows + r)], want, 4 * 1.2e-7 * magnitude * std::log2(double(cols) + 1));
    }
}

TEST(Quantize, RejectsUnsupportedShapes) {
  std::vector<float> w(100);
  EXPECT_THROW(quantize_rows(w.data(), 1, 100, 4), Error);
  EXPECT_THROW(quantize_rows(w.data(), 1, 64, 7), Error);  // MLX has no 7-bit affine mode
}

}  // namespace
}  // namespace vavilov

namespace vavilov {
namespace {

// --quantize q4 on the bundled model: every weight matrix whose width allows it is quantized, and the model still
// makes the same top-1 choice at ≥ 90 % of the positions of a code prompt (95 % on the first held-out prompt of
// bench/prompts). Q4 group-64 rounding moves logits by up to ~18 % of the largest one, so equality is not expected.
TEST(Quantize, BundledModelKeepsItsChoicesAtQ4) {
  const std::string dir = std::string(VAVILOV_SOURCE_DIR) + "/models/flash-next-mini";
  auto dense = load_model(dir);
  auto quantized = load_model(dir);
  int count = quantize_model(*quantized, 4);
  int quantizable = 0;
  for_each_matrix(*quantized, [&](Matrix& m) {
    if (m.cols % kQuantGroup == 0) {
      ++quantizable;
      EXPECT_EQ(m.bits, 4) << m.name;
    }
  });
  EXPECT_EQ(count, quantizable);
  EXPECT_GT(count, 100);
  const char* code =
      "import os\n\n\ndef find_files(root, suffix):\n    \"\"\"Yield every path below root whose name ends with "
      "suffix.\"\"\"\n    for directory, _, names in os.walk(root):\n        for name in names:\n            if "
      "name.endswith(suffix):\n                yield os.path.join(directory, name)\n";
  std::vector<int32_t> prompt;
  for (uint32_t id : tokenizer::PromptTokenizer(dir).encode_prompt(code, true)) prompt.push_back(int32_t(id));
  const size_t vocab = size_t(dense->config.vocab_size);
  std::vector<float> want(prompt.size() * vocab), got(want.size());
  SequenceState a = new_sequence_state(*dense), b = new_sequence_state(*quantized);
  cpu::forward(*dense, a, prompt, {true, want.data(), nullptr});
  cpu::forward(*quantized, b, prompt, {true, got.data(), nullptr});
  auto argmax = [&](const std::vector<float>& logits, size_t r) {
    return std::max_element(logits.begin() + long(r * vocab), logits.begin() + long((r + 1) * vocab)) - logits.begin();
  };
  int same = 0;
  for (size_t r = 0; r < prompt.size(); ++r) same += argmax(want, r) == argmax(got, r);
  EXPECT_GE(double(same) / double(prompt.size()), 0.9);
}

}  // namespace
}  // namespace vavilov
