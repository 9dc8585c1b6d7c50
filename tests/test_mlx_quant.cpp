// Our affine quantizer, dequantizer and quantized matrix products against mlx itself
// (tests/fixtures/mlx_quant/cases.safetensors, made by tools/make_mlx_quant_fixtures.py with mlx on the CPU).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>

#include "core/error.h"
#include "cpu/linear.h"
#include "fixture_paths.h"
#include "io/safetensors.h"
#include "model/quantize.h"

namespace vavilov {
namespace {

class MlxCases {
 public:
  MlxCases() : file_((test::source_dir() / "tests/fixtures/mlx_quant/cases.safetensors").string()) {
    for (const auto& entry : file_.entries()) views_.emplace(entry.name, file_.view(entry));
  }
  const TensorView& get(const std::string& name) const {
    auto it = views_.find(name);
    if (it == views_.end()) throw std::runtime_error("fixture tensor missing: " + name);
    return it->second;
  }
  std::vector<float> floats(const std::string& name) const {
    const TensorView& v = get(name);
    std::vector<float> out(size_t(v.numel()));
    to_f32(v.dtype, v.data, out.data(), out.size());
    return out;
  }
  // Scales or biases as bf16 bits: bf16 fixtures as stored, f32 fixtures rounded the way we store them.
  std::vector<uint16_t> bf16s(const std::string& name) const {
    std::vector<uint16_t> out;
    for (float v : floats(name)) out.push_back(f32_to_bf16(v));
    return out;
  }
  template <typename T>
  std::vector<T> raw(const std::string& name) const {
    const TensorView& v = get(name);
    std::vector<T> out(v.bytes / sizeof(T));
    std::memcpy(out.data(), v.data, v.bytes);
    return out;
  }

 private:
  SafetensorsFile file_;
  std::map<std::string, TensorView> views_;
};

const MlxCases& cases() {
  static MlxCases instance;
  return instance;
}

struct Case {
  std::string name;
  int bits;
  int64_t group;
};

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (const char* dtype : {"bf16", "f32"})
    for (int bits : {4, 3, 2})
      for (int64_t group : {32, 64, 128})
        out.push_back({std::string(dtype) + "_b" + std::to_string(bits) + "_g" + std::to_string(group), bits, group});
  for (const char* dtype : {"bf16", "f32"})
    for (int bits : {8, 6, 5}) out.push_back({std::string(dtype) + "_b" + std::to_string(bits) + "_g64", bits, 64});
  return out;
}

Matrix as_matrix(const QuantizedRows& q, int64_t rows, int64_t cols, int bits, int64_t group) {
  return Matrix{"q",
                DType::BF16,
                rows,
                cols,
                reinterpret_cast<const std::byte*>(q.codes.data()),
                bits,
                q.scales.data(),
                q.biases.data(),
                group};
}

// Codes, scales and biases equal mlx.core.quantize's bit for bit: bf16 inputs (the released checkpoints' dtype) and
// f32 inputs (scales compared after the bf16 rounding we store them with), 4/3/2 bits at groups 32/64/128 and
// 8/6/5 bits at group 64, with
// constant, all-zero, one-signed, outlier, tiny and tie-heavy groups among random ones.
TEST(MlxQuant, QuantizeMatchesMlxBitForBit) {
  for (const Case& c : all_cases()) {
    const TensorView& w = cases().get(c.name + ".w");
    const int64_t rows = w.dim(0), cols = w.dim(1);
    QuantizedRows q = quantize_rows(cases().floats(c.name + ".w").data(), rows, cols, c.bits, c.group);
    EXPECT_EQ(q.codes, cases().raw<uint32_t>(c.name + ".q")) << c.name;
    EXPECT_EQ(q.scales, cases().bf16s(c.name + ".scales")) << c.name;
    EXPECT_EQ(q.biases, cases().bf16s(c.name + ".biases")) << c.name;
  }
}

// Dequantized values equal mlx.core.dequantize's exactly (mlx given the bf16 scales and biases widened to f32).
TEST(MlxQuant, DequantizeMatchesMlxExactly) {
  for (const Case& c : all_cases()) {
    if (c.name.rfind("bf16", 0) != 0) continue;  // mlx dequantized with its f32 scales there, we keep bf16
    const TensorView& w = cases().get(c.name + ".w");
    const int64_t rows = w.dim(0), cols = w.dim(1);
    auto codes = cases().raw<uint32_t>(c.name + ".q");
    auto scales = cases().raw<uint16_t>(c.name + ".scales"), biases = cases().raw<uint16_t>(c.name + ".biases");
    Matrix m{"mlx",  DType::BF16,   rows,          cols,   reinterpret_cast<const std::byte*>(codes.data()),
             c.bits, scales.data(), biases.data(), c.group};
    auto want = cases().floats(c.name + ".deq");
    std::vector<float> got(static_cast<size_t>(cols));
    for (int64_t r = 0; r < rows; ++r) {
      dequantize_row(m, r, got.data());
      for (int64_t i = 0; i < cols; ++i)
        ASSERT_EQ(got[size_t(i)], want[size_t(r * cols + i)]) << c.name << " row " << r << " col " << i;
    }
  }
}

// Matrix products with 4/3/2-bit weights (and the slow path's 8/6/5, group 64) against numpy's float64 x·Wᵀ of mlx's
// dequantized weights, for 1, 2, 3 and 4 input rows (each row count takes its own register path). fp32 accumulation of
// 256 products of O(1) values in a different order: allowed error 1e-5 of the output's scale (Σ|x·w|), ~100× fp32
// rounding.
TEST(MlxQuant, QuantizedMatmulMatchesNumpy) {
  for (const Case& c : all_cases()) {
    if (c.group != 64 || c.name.rfind("bf16", 0) != 0) continue;
    const TensorView& w = cases().get(c.name + ".w");
    const int64_t rows = w.dim(0), cols = w.dim(1);
    auto codes = cases().raw<uint32_t>(c.name + ".q");
    auto scales = cases().raw<uint16_t>(c.name + ".scales"), biases = cases().raw<uint16_t>(c.name + ".biases");
    Matrix m{"mlx",  DType::BF16,   rows,          cols,   reinterpret_cast<const std::byte*>(codes.data()),
             c.bits, scales.data(), biases.data(), c.group};
    auto x = cases().floats(c.name + ".x"), y = cases().floats(c.name + ".y"), deq = cases().floats(c.name + ".deq");
    for (int64_t batch = 1; batch <= 4; ++batch) {
      std::vector<float> got(size_t(batch * rows));
      cpu::matmul(m, x.data(), batch, got.data());
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t o = 0; o < rows; ++o) {
          double magnitude = 0;
          for (int64_t i = 0; i < cols; ++i)
            magnitude += std::fabs(x[size_t(b * cols + i)] * deq[size_t(o * cols + i)]);
          EXPECT_NEAR(got[size_t(b * rows + o)], y[size_t(b * rows + o)], 1e-5 * magnitude)
              << c.name << " batch " << batch << " row " << b << " out " << o;
        }
    }
  }
}

// The 3- and 2-bit products also hold at a width with many groups and for more than four rows (the prefill path).
TEST(MlxQuant, LowBitMatmulEqualsDequantizedProductOnManyRows) {
  for (int bits : {4, 3, 2}) {
    const int64_t rows = 37, cols = 640, batch = 9;
    std::vector<float> w(size_t(rows * cols)), x(size_t(batch * cols));
    for (size_t i = 0; i < w.size(); ++i) w[i] = std::sin(0.37f * float(i)) + 0.01f * float(i % 17);
    for (size_t i = 0; i < x.size(); ++i) x[i] = std::cos(0.11f * float(i));
    QuantizedRows q = quantize_rows(w.data(), rows, cols, bits);
    Matrix m = as_matrix(q, rows, cols, bits, kQuantGroup);
    std::vector<float> dense(size_t(rows * cols));
    for (int64_t r = 0; r < rows; ++r) dequantize_row(m, r, dense.data() + r * cols);
    for (int64_t n : {int64_t(1), int64_t(4), batch}) {
      std::vector<float> got(size_t(n * rows));
      cpu::matmul(m, x.data(), n, got.data());
      for (int64_t b = 0; b < n; ++b)
        for (int64_t o = 0; o < rows; ++o) {
          double want = 0, magnitude = 0;
          for (int64_t i = 0; i < cols; ++i) {
            want += double(x[size_t(b * cols + i)]) * dense[size_t(o * cols + i)];
            magnitude += std::fabs(double(x[size_t(b * cols + i)]) * dense[size_t(o * cols + i)]);
          }
          EXPECT_NEAR(got[size_t(b * rows + o)], want, 1e-5 * magnitude) << bits << " bits, rows " << n;
        }
    }
  }
}

TEST(MlxQuant, RejectsUnsupportedGroupsAndBits) {
  std::vector<float> w(256);
  EXPECT_THROW(quantize_rows(w.data(), 1, 256, 4, 16), Error);
  EXPECT_THROW(quantize_rows(w.data(), 1, 256, 7, 64), Error);
  EXPECT_THROW(quantize_rows(w.data(), 1, 96, 4, 64), Error);
}

}  // namespace
}  // namespace vavilov
