// Grouped products of one input (src/cuda/product_groups.*) against a double-precision evaluation of the same
// (dequantised or bf16-rounded) weights on the host: which products a group launches together, and their results for
// 1–4 rows (grouped GEMV) and 5 rows (one cuda::linear each).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "cuda/product_groups.h"
#include "device_matrices.h"

namespace vavilov {
namespace {

using cuda::WeightFormat;
using test::DeviceMemory;
using test::make_matrix;
using test::normal_values;
using test::TestMatrix;

constexpr int kCols = 512;
constexpr int kMaxRows = 5;

struct Case {
  std::vector<TestMatrix> matrices;
  std::vector<float*> outputs;
  cuda::ProductGroup group;
};

// Matrices of the given formats and row counts (tall, short, fewer rows than a 16-row tile, not a multiple of 16),
// each with its own output buffer, grouped on the input x.
Case make_case(DeviceMemory& memory, std::mt19937& rng, const std::vector<std::pair<WeightFormat, int>>& shapes,
               const float* x) {
  Case c;
  std::vector<std::pair<cuda::DeviceMatrix, float*>> products;
  for (const auto& [format, rows] : shapes) {
    c.matrices.push_back(make_matrix(memory, format, normal_values(rng, size_t(rows) * kCols, 0.1f), rows, kCols));
    c.outputs.push_back(memory.zeros<float>(size_t(kMaxRows) * size_t(rows)));
    products.emplace_back(c.matrices.back().device, c.outputs.back());
  }
  c.group = cuda::make_product_group(x, std::move(products));
  return c;
}

// Every output of every product for `rows` activation rows against the double-precision products. The GPU sums in
// fp32 (the Q4 kernel splits each activation into two fp16 halves, exact to 2^-22): a few 1e-7 of Σ|w·x| here, at
// most 512·2^-24 ≈ 3e-5. The bound, 1e-4 of Σ|w·x|, is far below what a wrong matrix, row or batch row gives (order 1).
void expect_products(const Case& c, const std::vector<float>& x, int rows) {
  cuda::run_products(c.group, rows, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (size_t i = 0; i < c.matrices.size(); ++i) {
    const TestMatrix& w = c.matrices[i];
    std::vector<float> y(size_t(rows) * size_t(w.rows));
    ASSERT_EQ(cudaMemcpy(y.data(), c.outputs[i], y.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    for (int b = 0; b < rows; ++b)
      for (int r = 0; r < w.rows; ++r) {
        double sum = 0, magnitude = 0;
        for (int k = 0; k < kCols; ++k) {
          const double term = w.at(r, k) * double(x[size_t(b) * kCols + size_t(k)]);
          sum += term;
          magnitude += std::fabs(term);
        }
        ASSERT_NEAR(y[size_t(b) * size_t(w.rows) + size_t(r)], sum, 1e-4 * magnitude)
            << "product " << i << ", batch row " << b << " of " << rows << ", output row " << r;
      }
  }
}

class CudaProductGroups : public ::testing::Test {
 protected:
  void SetUp() override {
    int devices = 0;
    ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
    ASSERT_GT(devices, 0) << "the GPU tests need a CUDA device";
    x_ = normal_values(rng_, size_t(kMaxRows) * kCols, 1.0f);
    x_device_ = memory_.copy(x_);
  }
  void expect_all_row_counts(const Case& c) {
    for (int rows = 1; rows <= kMaxRows; ++rows) expect_products(c, x_, rows);
  }

  DeviceMemory memory_;
  std::mt19937 rng_{20261130};
  std::vector<float> x_;
  float* x_device_ = nullptr;
};

// GDN's input projections in miniature: one grouped Q4 launch.
TEST_F(CudaProductGroups, Q4ProductsRunAsOneGroup) {
  const Case c = make_case(memory_, rng_,
                           {{WeightFormat::Q4, 640},
                            {WeightFormat::Q4, 384},
                            {WeightFormat::Q4, 3},
                            {WeightFormat::Q4, 48},
                            {WeightFormat::Q4, 17}},
                           x_device_);
  EXPECT_EQ(c.group.q4_count, 5);
  EXPECT_EQ(c.group.q4_max_rows, 640);
  EXPECT_EQ(c.group.bf16_count, 0);
  EXPECT_TRUE(c.group.others.empty());
  expect_all_row_counts(c);
}

// More Q4 products than the launch's grid of their own row blocks holds (8): the grid of the tallest instead.
TEST_F(CudaProductGroups, ManyQ4ProductsRunAsOneGroup) {
  const Case c = make_case(memory_, rng_,
                           {{WeightFormat::Q4, 40},
                            {WeightFormat::Q4, 16},
                            {WeightFormat::Q4, 1},
                            {WeightFormat::Q4, 33},
                            {WeightFormat::Q4, 8},
                            {WeightFormat::Q4, 64},
                            {WeightFormat::Q4, 2},
                            {WeightFormat::Q4, 31},
                            {WeightFormat::Q4, 17}},
                           x_device_);
  EXPECT_EQ(c.group.q4_count, 9);
  EXPECT_EQ(c.group.q4_max_rows, 64);
  expect_all_row_counts(c);
}

TEST_F(CudaProductGroups, Bf16ProductsRunAsOneGroup) {
  const Case c = make_case(memory_, rng_, {{WeightFormat::BF16, 320}, {WeightFormat::BF16, 4}}, x_device_);
  EXPECT_EQ(c.group.bf16_count, 2);
  EXPECT_EQ(c.group.bf16_max_rows, 320);
  EXPECT_EQ(c.group.q4_count, 0);
  EXPECT_TRUE(c.group.others.empty());
  expect_all_row_counts(c);
}

// Q4 and BF16 products each in their format's launch; a format's single product and F32 through cuda::linear.
TEST_F(CudaProductGroups, MixedFormatsSplitByFormat) {
  const Case c = make_case(memory_, rng_,
                           {{WeightFormat::F32, 40},
                            {WeightFormat::Q4, 100},
                            {WeightFormat::BF16, 24},
                            {WeightFormat::Q4, 7},
                            {WeightFormat::BF16, 130},
                            {WeightFormat::Q4, 1}},
                           x_device_);
  EXPECT_EQ(c.group.q4_count, 3);
  EXPECT_EQ(c.group.q4_max_rows, 100);
  EXPECT_EQ(c.group.bf16_count, 2);
  EXPECT_EQ(c.group.bf16_max_rows, 130);
  EXPECT_EQ(c.group.others.size(), 1u);
  expect_all_row_counts(c);
}

TEST_F(CudaProductGroups, SingleProductsAndMisalignedInputsTakeLinear) {
  const Case single = make_case(memory_, rng_, {{WeightFormat::Q4, 64}, {WeightFormat::BF16, 32}}, x_device_);
  EXPECT_EQ(single.group.q4_count + single.group.bf16_count, 0);
  EXPECT_EQ(single.group.others.size(), 2u);
  expect_all_row_counts(single);
  // 4 bytes past a 16-byte boundary: the GEMV kernels' 16-byte activation loads cannot read it.
  const Case misaligned = make_case(memory_, rng_, {{WeightFormat::Q4, 64}, {WeightFormat::Q4, 32}}, x_device_ + 1);
  EXPECT_EQ(misaligned.group.q4_count, 0);
  EXPECT_EQ(misaligned.group.others.size(), 2u);
}

}  // namespace
}  // namespace vavilov
