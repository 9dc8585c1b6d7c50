// cuda::linear for every path it takes (the gemv.cuh kernels for 1–4 rows with each way they split a shape, the
// row-parallel kernel otherwise), and gemv.cuh's grouped entry point, against a double-precision product of the same
// weights on the host.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <vector>

#include "core/dtype.h"
#include "cuda/gemv.cuh"
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

// A random matrix on the device, and the weights it holds (after quantization or rounding) on the host.
struct TestMatrix {
  cuda::DeviceMatrix device;
  std::vector<float> exact;
  std::vector<void*> allocations;

  TestMatrix(const Case& c, std::mt19937& rng) : exact(size_t(c.rows) * size_t(c.cols)) {
    std::normal_distribution<float> normal;
    std::vector<float> w(exact.size());
    for (float& v : w) v = normal(rng);
    device.format = c.format;
    device.rows = c.rows;
    device.cols = c.cols;
    if (c.format == cuda::WeightFormat::Q4) {
      QuantizedRows q = quantize_rows(w.data(), c.rows, c.cols, 4);
      Matrix host{"w", DType::BF16,     c.rows,         c.cols, reinterpret_cast<const std::byte*>(q.codes.data()),
                  4,   q.scales.data(), q.biases.data()};
      for (int r = 0; r < c.rows; ++r) dequantize_row(host, r, exact.data() + size_t(r) * c.cols);
      device.data = device_copy(q.codes);
      device.scales = device_copy(q.scales);
      device.biases = device_copy(q.biases);
      allocations = {const_cast<void*>(device.data), const_cast<uint16_t*>(device.scales),
                     const_cast<uint16_t*>(device.biases)};
    } else if (c.format == cuda::WeightFormat::BF16) {
      std::vector<uint16_t> bits(w.size());
      for (size_t i = 0; i < w.size(); ++i) exact[i] = bf16_to_f32(bits[i] = f32_to_bf16(w[i]));
      device.data = device_copy(bits);
      allocations = {const_cast<void*>(device.data)};
    } else {
      exact = w;
      device.data = device_copy(w);
      allocations = {const_cast<void*>(device.data)};
    }
  }
  ~TestMatrix() {
    for (void* p : allocations) cudaFree(p);
  }
};

// Rounding-order differences only: the bound is 1e-5 of the sum of |w·x| terms (fp32 sums; the tensor-core Q4 kernel
// keeps ~22 bits of the activations). A wrong index, a lost slice or a slice counted twice gives errors of order one.
void expect_product(const std::vector<float>& exact, int rows, int cols, const std::vector<float>& x, int x_rows,
                    const std::vector<float>& y, const char* what) {
  for (int b = 0; b < x_rows; ++b)
    for (int r = 0; r < rows; ++r) {
      double want = 0, magnitude = 0;
      for (int k = 0; k < cols; ++k) {
        const double term = double(exact[size_t(r) * cols + k]) * x[size_t(b) * cols + k];
        want += term;
        magnitude += std::abs(term);
      }
      ASSERT_NEAR(y[size_t(b) * rows + r], want, 1e-5 * magnitude)
          << what << " " << rows << "x" << cols << " x_rows " << x_rows << " at (" << b << ", " << r << ")";
    }
}

std::vector<float> download(const float* device, size_t n) {
  std::vector<float> host(n);
  EXPECT_EQ(cudaMemcpy(host.data(), device, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

// The decode shapes of Flash-Next (src/cuda/synthetic.cpp), or smaller ones that gemv_quant_split / gemv_dense_split
// cut the same way (CasesCoverEverySplit), odd numbers of groups, and rows that are no multiple of 16.
TEST(CudaLinear, EveryPathMatchesDoublePrecision) {
  using F = cuda::WeightFormat;
  const std::vector<Case> cases = {
      {F::Q4, 4, 10240},     {F::Q4, 48, 2560},   {F::Q4, 1, 2560},    {F::Q4, 64, 1024},   {F::Q4, 320, 2560},
      {F::Q4, 16, 256},      {F::Q4, 320, 10240}, {F::Q4, 2560, 640},  {F::Q4, 8448, 320},  {F::Q4, 2560, 6144},
      {F::Q4, 67584, 64},    {F::Q4, 200, 2560},  {F::Q4, 2560, 2560}, {F::Q4, 1232, 2560}, {F::BF16, 200, 4096},
      {F::BF16, 4, 4096},    {F::BF16, 4, 10240}, {F::BF16, 40, 520},  {F::BF16, 130, 512}, {F::BF16, 3000, 256},
      {F::BF16, 1232, 2560}, {F::F32, 3, 2048},   {F::F32, 100, 768},  {F::F32, 4, 10240},  {F::F32, 21, 36},
  };
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  for (const Case& c : cases) {
    const TestMatrix w(c, rng);
    for (int x_rows = 1; x_rows <= 5; ++x_rows) {
      std::vector<float> x(size_t(x_rows) * size_t(c.cols));
      for (float& v : x) v = normal(rng);
      float* dx = device_copy(x);
      const size_t outputs = size_t(x_rows) * size_t(c.rows);
      float *dy = nullptr, *again = nullptr;
      ASSERT_EQ(cudaMalloc(&dy, 2 * outputs * sizeof(float)), cudaSuccess);
      ASSERT_EQ(cudaMemset(dy, 0xff, 2 * outputs * sizeof(float)), cudaSuccess);  // NaN: every output must be written
      again = dy + outputs;
      cuda::linear(w.device, dx, x_rows, dy, nullptr);
      cuda::linear(w.device, dx, x_rows, again, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<float> y = download(dy, outputs), y_again = download(again, outputs);
      expect_product(w.exact, c.rows, c.cols, x, x_rows, y,
                     c.format == F::Q4     ? "Q4"
                     : c.format == F::BF16 ? "BF16"
                                           : "F32");
      // Partial sums are added in a fixed order: the same call gives the same bits.
      EXPECT_EQ(std::memcmp(y.data(), y_again.data(), outputs * sizeof(float)), 0) << c.rows << "x" << c.cols;
      cudaFree(dx);
      cudaFree(dy);
    }
  }
}

// The cases above reach every way of splitting a shape: several tiles a block with one slice each (lm_head), with
// several (GDN in_qkv, mix_up), and one tile with many slices (in_b, router, mix_down, inject).
TEST(CudaLinear, CasesCoverEverySplit) {
  using Kind = std::pair<bool, bool>;  // (slices, several tiles a block)
  const std::set<Kind> every = {{false, true}, {true, true}, {true, false}};
  std::set<Kind> quant, dense;
  for (const auto& [rows, cols] :
       std::vector<std::pair<int, int>>{{4, 10240}, {48, 2560}, {320, 10240}, {8448, 320}, {67584, 64}, {2560, 6144}}) {
    const cuda::GemvSplit s = cuda::gemv_quant_split(rows, cols, 1, 1);
    quant.insert({s.splits > 1, s.tiles > 1});
  }
  for (const auto& [rows, cols] : std::vector<std::pair<int, int>>{{4, 10240}, {1232, 2560}, {3000, 256}}) {
    const cuda::GemvSplit s = cuda::gemv_dense_split(rows, cols, 1);
    dense.insert({s.splits > 1, s.tiles > 1});
  }
  EXPECT_EQ(quant, every);
  EXPECT_EQ(dense, every);
}

// gemv_q4 over a device array of descriptors (the grouped entry point the MoE path uses), and gemv_q4_fixed (the
// product groups' one): matrices of different shapes in one launch, each against its own activations.
TEST(CudaLinear, GroupedQ4MatchesDoublePrecision) {
  const std::vector<Case> cases = {
      {cuda::WeightFormat::Q4, 640, 2560}, {cuda::WeightFormat::Q4, 2560, 640}, {cuda::WeightFormat::Q4, 37, 1280}};
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  for (int batch = 1; batch <= 4; ++batch) {
    std::vector<std::unique_ptr<TestMatrix>> matrices;
    std::vector<std::vector<float>> xs;
    std::vector<cuda::GemvMatrix> descriptors;
    std::vector<void*> buffers;
    for (const Case& c : cases) {
      matrices.push_back(std::make_unique<TestMatrix>(c, rng));
      std::vector<float>& x = xs.emplace_back(size_t(batch) * size_t(c.cols));
      for (float& v : x) v = normal(rng);
      cuda::GemvMatrix m;
      m.codes = static_cast<const uint32_t*>(matrices.back()->device.data);
      m.scales = reinterpret_cast<const __nv_bfloat16*>(matrices.back()->device.scales);
      m.biases = reinterpret_cast<const __nv_bfloat16*>(matrices.back()->device.biases);
      m.rows = c.rows;
      m.cols = c.cols;
      m.x = device_copy(x);
      float* y = nullptr;
      ASSERT_EQ(cudaMalloc(&y, size_t(batch) * c.rows * sizeof(float)), cudaSuccess);
      m.y = y;
      buffers.push_back(const_cast<float*>(m.x));
      buffers.push_back(y);
      descriptors.push_back(m);
    }
    cuda::GemvMatrix* device = device_copy(descriptors);
    ASSERT_EQ(cuda::gemv_q4(device, int(cases.size()), 2560, 2560, batch, nullptr), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (size_t i = 0; i < cases.size(); ++i)
      expect_product(matrices[i]->exact, cases[i].rows, cases[i].cols, xs[i], batch,
                     download(descriptors[i].y, size_t(batch) * cases[i].rows), "grouped Q4");
    // The same matrices in the grid of their own row blocks (gemv_q4_fixed), outputs poisoned first.
    std::vector<int> heights;
    for (const Case& c : cases) heights.push_back(c.rows);
    for (size_t i = 0; i < cases.size(); ++i)
      ASSERT_EQ(cudaMemset(descriptors[i].y, 0xff, size_t(batch) * cases[i].rows * sizeof(float)), cudaSuccess);
    ASSERT_EQ(cuda::gemv_q4_fixed(device, heights.data(), int(cases.size()), 2560, 2560, batch, nullptr), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (size_t i = 0; i < cases.size(); ++i)
      expect_product(matrices[i]->exact, cases[i].rows, cases[i].cols, xs[i], batch,
                     download(descriptors[i].y, size_t(batch) * cases[i].rows), "grouped Q4, own row blocks");
    heights[0] = 2561;  // taller than max_rows: refused
    EXPECT_EQ(cuda::gemv_q4_fixed(device, heights.data(), int(cases.size()), 2560, 2560, batch, nullptr),
              cudaErrorInvalidValue);
    cudaFree(device);
    for (void* p : buffers) cudaFree(p);
  }
}

// gemv_q4_experts (the MoE experts' launches): past one wave of tiles its blocks sum several runs of tiles each
// (gemv_expert_rounds > 1), else gemv_q4's kernel; in both, matrices with x_up take silu(x)·x_up as activations. The
// launch holds a matrix whose height is no multiple of a run (2500 rows), one with an odd number of groups and an
// empty descriptor (rows 0, no outputs) as the MoE routing writes for unused slots.
TEST(CudaLinear, ExpertLaunchesMatchDoublePrecision) {
  constexpr int kMatrices = 16, kMaxRows = 2560, kMaxCols = 192;
  std::mt19937 rng(8);
  std::normal_distribution<float> normal;
  std::vector<std::unique_ptr<TestMatrix>> matrices;
  std::vector<Case> cases;
  for (int i = 0; i + 1 < kMatrices; ++i) {
    cases.push_back({cuda::WeightFormat::Q4, i == 3 ? 2500 : kMaxRows, i == 5 ? kMaxCols : 128});
    matrices.push_back(std::make_unique<TestMatrix>(cases.back(), rng));
  }
  for (int batch = 1; batch <= 4; ++batch) {
    std::vector<std::vector<float>> activations;  // what each product multiplies: x, or silu(x)·up
    std::vector<cuda::GemvMatrix> descriptors;
    std::vector<void*> buffers;
    for (size_t i = 0; i < cases.size(); ++i) {
      const Case& c = cases[i];
      std::vector<float> x(size_t(batch) * size_t(c.cols)), up(x.size());
      for (float& v : x) v = normal(rng);
      for (float& v : up) v = normal(rng);
      cuda::GemvMatrix m;
      m.codes = static_cast<const uint32_t*>(matrices[i]->device.data);
      m.scales = reinterpret_cast<const __nv_bfloat16*>(matrices[i]->device.scales);
      m.biases = reinterpret_cast<const __nv_bfloat16*>(matrices[i]->device.biases);
      m.rows = c.rows;
      m.cols = c.cols;
      m.x = device_copy(x);
      buffers.push_back(const_cast<float*>(m.x));
      std::vector<float>& a = activations.emplace_back(x);
      if (i % 2 == 1) {
        m.x_up = device_copy(up);
        buffers.push_back(const_cast<float*>(m.x_up));
        for (size_t k = 0; k < a.size(); ++k)
          a[k] = float(double(x[k]) / (1.0 + std::exp(-double(x[k]))) * double(up[k]));
      }
      float* y = nullptr;
      ASSERT_EQ(cudaMalloc(&y, size_t(batch) * c.rows * sizeof(float)), cudaSuccess);
      m.y = y;
      buffers.push_back(y);
      descriptors.push_back(m);
    }
    descriptors.push_back(cuda::GemvMatrix{});  // an empty slot
    cuda::GemvMatrix* device = device_copy(descriptors);
    ASSERT_GT(cuda::gemv_expert_rounds(kMatrices, kMaxRows, kMaxCols, batch), 1) << "the premise: several runs";
    ASSERT_EQ(cuda::gemv_q4_experts(device, kMatrices, kMaxRows, kMaxCols, batch, nullptr), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (size_t i = 0; i < cases.size(); ++i)
      expect_product(matrices[i]->exact, cases[i].rows, cases[i].cols, activations[i], batch,
                     download(descriptors[i].y, size_t(batch) * cases[i].rows), "expert launch, runs");
    // The first four alone fit one wave: gemv_q4's kernel, outputs poisoned first.
    ASSERT_EQ(cuda::gemv_expert_rounds(4, kMaxRows, kMaxCols, batch), 1);
    for (size_t i = 0; i < 4; ++i)
      ASSERT_EQ(cudaMemset(descriptors[i].y, 0xff, size_t(batch) * cases[i].rows * sizeof(float)), cudaSuccess);
    ASSERT_EQ(cuda::gemv_q4_experts(device, 4, kMaxRows, kMaxCols, batch, nullptr), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (size_t i = 0; i < 4; ++i)
      expect_product(matrices[i]->exact, cases[i].rows, cases[i].cols, activations[i], batch,
                     download(descriptors[i].y, size_t(batch) * cases[i].rows), "expert launch, one wave");
    cudaFree(device);
    for (void* p : buffers) cudaFree(p);
  }
}

}  // namespace
}  // namespace vavilov
