// cuda::linear for every path it takes (split-K for short wide matrices, the gemv.cuh kernels for 1–4 rows, the
// row-parallel kernel otherwise) against a double-precision product of the same weights on the host.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "cuda/linear.cuh"
#include "model/quantize.h"

namespace vavilov {
namespace {

template <typename T>
T* device_copy(const std::vector<T>& host) {
  T* device = nullptr;
  EXPECT_EQ(cudaMalloc(&device, host.size() * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  return device;
}

struct Case {
  cuda::WeightFormat format;
  int rows, cols;
};

// Rounding-order differences only: the bound is 1e-5 of the sum of |w·x| terms (fp32 sums; the tensor-core Q4 kernel
// keeps ~22 bits of the activations). A wrong index or a lost split gives errors of order one.
TEST(CudaLinear, EveryPathMatchesDoublePrecision) {
  const std::vector<Case> cases = {
      {cuda::WeightFormat::Q4, 4, 4096},    {cuda::WeightFormat::Q4, 48, 2560},   {cuda::WeightFormat::Q4, 1, 2560},
      {cuda::WeightFormat::Q4, 64, 1024},   {cuda::WeightFormat::Q4, 320, 2560},  {cuda::WeightFormat::Q4, 16, 256},
      {cuda::WeightFormat::Q4, 320, 10240}, {cuda::WeightFormat::BF16, 200, 4096},
      {cuda::WeightFormat::BF16, 4, 4096},  {cuda::WeightFormat::BF16, 40, 520},  {cuda::WeightFormat::BF16, 130, 512},
      {cuda::WeightFormat::F32, 3, 2048},   {cuda::WeightFormat::F32, 100, 768},
  };
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  for (const Case& c : cases)
    for (int x_rows = 1; x_rows <= 5; ++x_rows) {
      std::vector<float> w(size_t(c.rows) * size_t(c.cols)), x(size_t(x_rows) * size_t(c.cols));
      for (float& v : w) v = normal(rng);
      for (float& v : x) v = normal(rng);
      cuda::DeviceMatrix dm;
      dm.format = c.format;
      dm.rows = c.rows;
      dm.cols = c.cols;
      std::vector<float> exact(w.size());  // the weights the GPU sees
      std::vector<void*> allocations;
      if (c.format == cuda::WeightFormat::Q4) {
        QuantizedRows q = quantize_rows(w.data(), c.rows, c.cols, 4);
        Matrix host{"w", DType::BF16, c.rows, c.cols, reinterpret_cast<const std::byte*>(q.codes.data()), 4,
                    q.scales.data(), q.biases.data()};
        for (int r = 0; r < c.rows; ++r) dequantize_row(host, r, exact.data() + size_t(r) * c.cols);
        dm.data = device_copy(q.codes);
        dm.scales = device_copy(q.scales);
        dm.biases = device_copy(q.biases);
        allocations = {const_cast<void*>(dm.data), const_cast<uint16_t*>(dm.scales), const_cast<uint16_t*>(dm.biases)};
      } else if (c.format == cuda::WeightFormat::BF16) {
        std::vector<uint16_t> bits(w.size());
        for (size_t i = 0; i < w.size(); ++i) exact[i] = bf16_to_f32(bits[i] = f32_to_bf16(w[i]));
        dm.data = device_copy(bits);
        allocations = {const_cast<void*>(dm.data)};
      } else {
        exact = w;
        dm.data = device_copy(w);
        allocations = {const_cast<void*>(dm.data)};
      }
      float* dx = device_copy(x);
      float* dy = nullptr;
      ASSERT_EQ(cudaMalloc(&dy, size_t(x_rows) * size_t(c.rows) * sizeof(float)), cudaSuccess);
      cuda::linear(dm, dx, x_rows, dy, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      std::vector<float> y(size_t(x_rows) * size_t(c.rows));
      ASSERT_EQ(cudaMemcpy(y.data(), dy, y.size() * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
      for (int b = 0; b < x_rows; ++b)
        for (int r = 0; r < c.rows; ++r) {
          double want = 0, magnitude = 0;
          for (int k = 0; k < c.cols; ++k) {
            const double term = double(exact[size_t(r) * c.cols + k]) * x[size_t(b) * c.cols + k];
            want += term;
            magnitude += std::abs(term);
          }
          ASSERT_NEAR(y[size_t(b) * c.rows + r], want, 1e-5 * magnitude)
              << "format " << int(c.format) << " " << c.rows << "x" << c.cols << " x_rows " << x_rows << " at (" << b
              << ", " << r << ")";
        }
      for (void* p : allocations) cudaFree(p);
      cudaFree(dx);
      cudaFree(dy);
    }
}

}  // namespace
}  // namespace vavilov
