// The CPU kernels against plain double-precision arithmetic: the blocked matmul for every row count and shape tail
// (in place for F32/BF16, through widened rows for F16), and each row's result independent of its batch;
// the int8 draft product within its rounding bound, and the vectorised gates against std::exp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "cpu/int8_linear.h"
#include "cpu/linear.h"
#include "cpu/ops.h"

namespace vavilov {
namespace {

Matrix dense_matrix(std::vector<std::byte>& storage, DType dtype, int64_t rows, int64_t cols, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  storage.resize(size_t(rows * cols) * dtype_size(dtype));
  for (int64_t i = 0; i < rows * cols; ++i) {
    float v = normal(rng);
    if (dtype == DType::BF16) {
      uint16_t bits = f32_to_bf16(v);
      std::memcpy(storage.data() + i * 2, &bits, 2);
    } else if (dtype == DType::F16) {  // sign, exponent 2^-3 … 2^2, random mantissa: finite normal values
      const auto bits = uint16_t((rng() & 0x83FFu) | ((12u + rng() % 6u) << 10));
      std::memcpy(storage.data() + i * 2, &bits, 2);
    } else {
      std::memcpy(storage.data() + i * 4, &v, 4);
    }
  }
  Matrix m;
  m.name = "test";
  m.dtype = dtype;
  m.rows = rows;
  m.cols = cols;
  m.data = storage.data();
  return m;
}

// Every output of the blocked product equals the double-precision sum over the same (widened) weights within a
// bound that is a few fp32 roundings of the sum of |w·x| terms: blocking only reorders fp32 additions.
TEST(CpuKernels, MatmulMatchesDoublePrecisionForEveryBlockShape) {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (DType dtype : {DType::F32, DType::BF16, DType::F16})
    for (int64_t out_dim : {1, 3, 7, 8, 13, 33})
      for (int64_t in_dim : {5, 8, 32, 45, 320})
        for (int64_t rows : {1, 2, 3, 4, 5, 9}) {
          std::vector<std::byte> storage;
          Matrix w = dense_matrix(storage, dtype, out_dim, in_dim, rng);
          std::vector<float> x(size_t(rows * in_dim)), y(size_t(rows * out_dim)), row(static_cast<size_t>(in_dim));
          for (float& v : x) v = normal(rng);
          cpu::matmul(w, x.data(), rows, y.data());
          for (int64_t o = 0; o < out_dim; ++o) {
            cpu::matrix_row(w, o, row.data());
            for (int64_t r = 0; r < rows; ++r) {
              double want = 0, magnitude = 0;
              for (int64_t k = 0; k < in_dim; ++k) {
                want += double(row[size_t(k)]) * x[size_t(r * in_dim + k)];
                magnitude += std::abs(double(row[size_t(k)]) * x[size_t(r * in_dim + k)]);
              }
              const double bound = 4 * 1.2e-7 * magnitude * std::log2(double(in_dim) + 1) + 1e-30;
              ASSERT_NEAR(y[size_t(r * out_dim + o)], want, bound)
                  << "dtype " << dtype_name(dtype) << " out " << out_dim << " in " << in_dim << " rows " << rows
                  << " at (" << r << ", " << o << ")";
            }
          }
        }
}

// A row's outputs do not depend on the other rows of the product (the blocking over input and weight rows only
// changes which pairs share registers), so a speculative verify row computes exactly what a one-row decode step
// would: compared bit for bit, for every row count and shape tail.
TEST(CpuKernels, MatmulRowIsBitIdenticalWhateverTheBatch) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  for (DType dtype : {DType::F32, DType::BF16, DType::F16})
    for (int64_t out_dim : {1, 5, 8, 13, 27, 33})
      for (int64_t in_dim : {5, 8, 45, 320})
        for (int64_t rows : {2, 3, 4, 5, 9}) {
          std::vector<std::byte> storage;
          Matrix w = dense_matrix(storage, dtype, out_dim, in_dim, rng);
          std::vector<float> x(size_t(rows * in_dim)), y(size_t(rows * out_dim)), alone(static_cast<size_t>(out_dim));
          for (float& v : x) v = normal(rng);
          cpu::matmul(w, x.data(), rows, y.data());
          for (int64_t r = 0; r < rows; ++r) {
            cpu::matmul(w, x.data() + r * in_dim, 1, alone.data());
            ASSERT_EQ(std::memcmp(alone.data(), y.data() + r * out_dim, size_t(out_dim) * sizeof(float)), 0)
                << "dtype " << dtype_name(dtype) << " out " << out_dim << " in " << in_dim << " row " << r << " of "
                << rows;
          }
        }
}

// The int8 product (draft logits) against the double-precision product of the original weights: within the error
// that rounding weights to max|w|/63 and inputs to max|x|/127 steps allows, scale_w/2·Σ|x| + scale_x/2·Σ(|w| +
// scale_w/2), plus fp32 slack. A subset of rows comes out in the order asked for.
TEST(CpuKernels, Int8MatvecWithinItsRoundingBound) {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  for (DType dtype : {DType::F32, DType::BF16})
    for (int64_t out_dim : {1, 5, 37})
      for (int64_t in_dim : {5, 32, 45, 320}) {
        std::vector<std::byte> storage;
        Matrix w = dense_matrix(storage, dtype, out_dim, in_dim, rng);
        std::vector<float> x(static_cast<size_t>(in_dim)), row(static_cast<size_t>(in_dim));
        for (float& v : x) v = 3.0f * normal(rng);
        std::vector<int32_t> rows;
        for (int64_t o = out_dim - 1; o >= 0; o -= 2) rows.push_back(int32_t(o));
        for (bool subset : {false, true}) {
          const cpu::Int8Matrix q =
              cpu::quantize_int8(w, subset ? std::span<const int32_t>(rows) : std::span<const int32_t>());
          const int64_t count = subset ? int64_t(rows.size()) : out_dim;
          ASSERT_EQ(q.rows, count);
          std::vector<float> y(static_cast<size_t>(count));
          cpu::int8_matvec(q, x.data(), y.data());
          double x_abs = 0, x_max = 0;
          for (float v : x) {
            x_abs += std::abs(v);
            x_max = std::max(x_max, double(std::abs(v)));
          }
          for (int64_t i = 0; i < count; ++i) {
            cpu::matrix_row(w, subset ? rows[size_t(i)] : i, row.data());
            double want = 0, w_max = 0, magnitude = 0;
            for (int64_t k = 0; k < in_dim; ++k) {
              want += double(row[size_t(k)]) * x[size_t(k)];
              w_max = std::max(w_max, double(std::abs(row[size_t(k)])));
              magnitude += std::abs(double(row[size_t(k)]) * x[size_t(k)]);
            }
            const double w_step = w_max / 63, x_step = x_max / 127;
            double w_abs = 0;
            for (float v : row) w_abs += std::abs(v) + w_step / 2;
            const double bound = w_step / 2 * x_abs + x_step / 2 * w_abs + 1e-6 * (magnitude + 1);
            ASSERT_NEAR(y[size_t(i)], want, bound) << dtype_name(dtype) << " out " << out_dim << " in " << in_dim
                                                   << (subset ? " subset" : "") << " row " << i;
          }
        }
      }
}

// 2 ulp of the correctly rounded result, which is what simd::exp8 promises, plus the rounding of the divide; where
// e^|x| leaves the fp32 range (|x| > 88.37) the gates may differ from 0 by a subnormal (1e-36 absolute).
TEST(CpuKernels, VectorGatesMatchStdExp) {
  std::vector<float> inputs;
  for (float v = -100.0f; v <= 100.0f; v += 0.0371f) inputs.push_back(v);
  inputs.insert(inputs.end(), {0.0f, -0.0f, 1e-8f, -1e-8f, 87.0f, -87.0f, 88.5f});
  std::vector<float> sig = inputs, scaled = inputs, silu = inputs, gate = inputs;
  std::vector<float> up(inputs.size(), 1.5f);
  cpu::sigmoid_inplace(sig.data(), int64_t(sig.size()));
  cpu::sigmoid_inplace(scaled.data(), int64_t(scaled.size()), 0.25f, 2.0f);
  cpu::silu_inplace(silu.data(), int64_t(silu.size()), 0.5f);
  cpu::swiglu_inplace(gate.data(), up.data(), int64_t(gate.size()));
  for (size_t i = 0; i < inputs.size(); ++i) {
    const double x = inputs[i], s = 1.0 / (1.0 + std::exp(-x)), s4 = 1.0 / (1.0 + std::exp(-0.25 * x));
    const double s2 = 1.0 / (1.0 + std::exp(-0.5 * x));
    auto ulps = [](double value) { return 4 * 1.2e-7 * std::abs(value) + 1e-36; };
    EXPECT_NEAR(sig[i], s, ulps(s)) << "sigmoid(" << x << ")";
    EXPECT_NEAR(scaled[i], 2 * s4, ulps(2 * s4)) << "2·sigmoid(" << x << "/4)";
    EXPECT_NEAR(silu[i], 0.5 * x * s2, ulps(0.5 * x * s2)) << "silu(" << x << "/2)";
    EXPECT_NEAR(gate[i], x * s * 1.5, ulps(x * s * 1.5)) << "swiglu(" << x << ")";
  }
}

}  // namespace
}  // namespace vavilov
