// The prefill products (gemm.cuh: dense GEMMs of more than four rows, grouped expert GEMMs) and the expert grouping
// (expert_prefill.cuh) against double-precision products of the same weights and a host counting sort.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "cuda/expert_prefill.cuh"
#include "cuda/gemm.cuh"
#include "model/quantize.h"

namespace vavilov {
namespace {

using cuda::GemmPrecision;
using cuda::WeightFormat;

template <typename T>
T* device_copy(const std::vector<T>& host) {
  T* device = nullptr;
  EXPECT_EQ(cudaMalloc(&device, std::max<size_t>(host.size(), 1) * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  return device;
}

template <typename T>
std::vector<T> host_copy(const T* device, size_t count) {
  std::vector<T> host(count);
  EXPECT_EQ(cudaMemcpy(host.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

template <typename T>
T* device_buffer(size_t count) {
  T* device = nullptr;
  EXPECT_EQ(cudaMalloc(&device, std::max<size_t>(count, 1) * sizeof(T)), cudaSuccess);
  return device;
}

const char* name_of(WeightFormat f) { return f == WeightFormat::Q4 ? "Q4" : f == WeightFormat::BF16 ? "BF16" : "F32"; }

// A matrix on the device and, on the host, the fp32 weights the GPU sees (after bf16 rounding or Q4 quantization).
struct TestMatrix {
  cuda::DeviceMatrix device;
  std::vector<float> exact;
  std::vector<void*> allocations;
  TestMatrix() = default;
  TestMatrix(TestMatrix&&) = default;
  TestMatrix& operator=(TestMatrix&&) = default;
  ~TestMatrix() {
    for (void* p : allocations) cudaFree(p);
  }
};

TestMatrix make_matrix(WeightFormat format, int rows, int cols, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  std::vector<float> w(size_t(rows) * size_t(cols));
  for (float& v : w) v = normal(rng);
  TestMatrix m;
  m.device.format = format;
  m.device.rows = rows;
  m.device.cols = cols;
  m.exact.resize(w.size());
  if (format == WeightFormat::Q4) {
    QuantizedRows q = quantize_rows(w.data(), rows, cols, 4);
    Matrix host{"w", DType::BF16,     rows,           cols, reinterpret_cast<const std::byte*>(q.codes.data()),
                4,   q.scales.data(), q.biases.data()};
    for (int r = 0; r < rows; ++r) dequantize_row(host, r, m.exact.data() + size_t(r) * size_t(cols));
    m.device.data = device_copy(q.codes);
    m.device.scales = device_copy(q.scales);
    m.device.biases = device_copy(q.biases);
    m.allocations = {const_cast<void*>(m.device.data), const_cast<uint16_t*>(m.device.scales),
                     const_cast<uint16_t*>(m.device.biases)};
  } else if (format == WeightFormat::BF16) {
    std::vector<uint16_t> bits(w.size());
    for (size_t i = 0; i < w.size(); ++i) m.exact[i] = bf16_to_f32(bits[i] = f32_to_bf16(w[i]));
    m.device.data = device_copy(bits);
    m.allocations = {const_cast<void*>(m.device.data)};
  } else {
    m.exact = w;
    m.device.data = device_copy(w);
    m.allocations = {const_cast<void*>(m.device.data)};
  }
  return m;
}

std::vector<float> random_rows(int rows, int cols, std::mt19937& rng) {
  std::normal_distribution<float> normal;
  std::vector<float> x(size_t(rows) * size_t(cols));
  for (float& v : x) v = normal(rng);
  return x;
}

// |got − W·x| / Σ_k |W[r, k]·x[k]| for one output: the error in units of the sum of the terms' magnitudes, the scale
// every rounding bound below is stated in.
double scaled_error(const std::vector<float>& w, int row, int cols, const float* x, float got) {
  double want = 0, magnitude = 0;
  for (int k = 0; k < cols; ++k) {
    const double term = double(w[size_t(row) * size_t(cols) + size_t(k)]) * double(x[k]);
    want += term;
    magnitude += std::abs(term);
  }
  return std::abs(double(got) - want) / std::max(magnitude, 1e-30);
}

// The largest scaled error of y [x_rows, rows] = x [x_rows, cols] · Wᵀ.
double worst_error(const TestMatrix& m, const std::vector<float>& x, int x_rows, const std::vector<float>& y) {
  const int rows = m.device.rows, cols = m.device.cols;
  double worst = 0;
  for (int b = 0; b < x_rows; ++b)
    for (int r = 0; r < rows; ++r)
      worst = std::max(worst, scaled_error(m.exact, r, cols, x.data() + size_t(b) * size_t(cols),
                                           y[size_t(b) * size_t(rows) + size_t(r)]));
  return worst;
}

// y = x · Wᵀ through cuda::gemm_linear (asserting that cuBLAS took it) and its worst scaled error.
double gemm_error(const TestMatrix& m, int x_rows, std::mt19937& rng) {
  const std::vector<float> x = random_rows(x_rows, m.device.cols, rng);
  float* dx = device_copy(x);
  float* dy = device_buffer<float>(size_t(x_rows) * size_t(m.device.rows));
  EXPECT_TRUE(cuda::gemm_linear(m.device, dx, x_rows, dy, nullptr));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> y = host_copy(dy, size_t(x_rows) * size_t(m.device.rows));
  cudaFree(dx);
  cudaFree(dy);
  return worst_error(m, x, x_rows, y);
}

// fp32 products: only the order of fp32 roundings differs from the double sum. Worst case cols·2⁻²⁴ of Σ|terms|;
// rounding errors of tiled sums stay near √cols·2⁻²⁴, and 1e-5 (the bound of test_cuda_linear) leaves room for
// that at every width here while any wrong index, stride or lost block gives errors of order one.
constexpr double kFp32Bound = 1e-5;
// Rounding both inputs of every product: 2⁻¹⁰ each for TF32 (10-bit mantissa, even if truncated), 2⁻⁸ each for bf16
// (7 bits), plus the sums.
constexpr double kTf32Bound = 2 * 0x1p-10 + kFp32Bound;
constexpr double kBf16Bound = 2 * 0x1p-8 + kFp32Bound;

struct Shape {
  WeightFormat format;
  int rows, cols;
};

const std::vector<Shape> kShapes = {
    {WeightFormat::Q4, 320, 2560},  {WeightFormat::Q4, 77, 1024},  {WeightFormat::Q4, 1, 2560},
    {WeightFormat::BF16, 130, 512}, {WeightFormat::BF16, 40, 520}, {WeightFormat::F32, 100, 768},
    {WeightFormat::F32, 33, 250},
};

TEST(CudaGemm, DenseProductsMatchDoublePrecisionAtEveryRowCount) {
  cuda::set_gemm_precision(GemmPrecision::Fp32);
  std::mt19937 rng(5);
  for (const Shape& s : kShapes) {
    const TestMatrix m = make_matrix(s.format, s.rows, s.cols, rng);
    for (int x_rows : {5, 17, 64, 131, 512})
      EXPECT_LE(gemm_error(m, x_rows, rng), kFp32Bound)
          << name_of(s.format) << " " << s.rows << "x" << s.cols << ", " << x_rows << " rows";
  }
}

TEST(CudaGemm, RowBlocksThroughASmallScratch) {
  cuda::set_gemm_precision(GemmPrecision::Fp32);
  cuda::set_weight_scratch_limit(64 << 10);  // 16-row blocks: 20 of them for 320 rows, 4 and a partial one for 77
  std::mt19937 rng(6);
  for (const Shape& s :
       {Shape{WeightFormat::Q4, 320, 2560}, Shape{WeightFormat::Q4, 77, 1024}, Shape{WeightFormat::BF16, 130, 512}}) {
    const TestMatrix m = make_matrix(s.format, s.rows, s.cols, rng);
    for (int x_rows : {5, 33})
      EXPECT_LE(gemm_error(m, x_rows, rng), kFp32Bound)
          << name_of(s.format) << " " << s.rows << "x" << s.cols << ", " << x_rows << " rows";
  }
  cuda::set_weight_scratch_limit(cuda::kWeightScratchBytes);
}

// The faster precisions meet their stated bounds; the measured errors are printed for the record.
TEST(CudaGemm, Tf32AndBf16WithinTheirBounds) {
  std::mt19937 rng(7);
  for (const Shape& s : kShapes) {
    const TestMatrix m = make_matrix(s.format, s.rows, s.cols, rng);
    for (auto [precision, bound, name] :
         {std::tuple{GemmPrecision::Fp32, kFp32Bound, "fp32"}, std::tuple{GemmPrecision::Tf32, kTf32Bound, "tf32"},
          std::tuple{GemmPrecision::Bf16, kBf16Bound, "bf16"}}) {
      cuda::set_gemm_precision(precision);
      const double error = gemm_error(m, 37, rng);
      std::printf("gemm error %s %s %dx%d: %.3g of sum |w*x|\n", name, name_of(s.format), s.rows, s.cols, error);
      EXPECT_LE(error, bound) << name << " " << name_of(s.format) << " " << s.rows << "x" << s.cols;
    }
  }
  cuda::set_gemm_precision(GemmPrecision::Fp32);
}

struct Grouping {
  std::vector<int> counts, offsets, order, position;
};

Grouping group_on_device(const std::vector<int>& ids, int experts) {
  const int slots = int(ids.size());
  int* d_ids = device_copy(ids);
  int *counts = device_buffer<int>(size_t(experts)), *offsets = device_buffer<int>(size_t(experts));
  int *order = device_buffer<int>(size_t(slots)), *position = device_buffer<int>(size_t(slots));
  cuda::group_by_expert(d_ids, slots, experts, counts, offsets, order, position, nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  Grouping g{host_copy(counts, size_t(experts)), host_copy(offsets, size_t(experts)), host_copy(order, size_t(slots)),
             host_copy(position, size_t(slots))};
  for (void* p : {static_cast<void*>(d_ids), static_cast<void*>(counts), static_cast<void*>(offsets),
                  static_cast<void*>(order), static_cast<void*>(position)})
    cudaFree(p);
  return g;
}

// A host counting sort: slots ordered by expert, then by slot.
Grouping group_on_host(const std::vector<int>& ids, int experts) {
  Grouping g;
  g.counts.assign(size_t(experts), 0);
  for (int id : ids) ++g.counts[size_t(id)];
  g.offsets.assign(size_t(experts), 0);
  std::exclusive_scan(g.counts.begin(), g.counts.end(), g.offsets.begin(), 0);
  g.order.resize(ids.size());
  std::iota(g.order.begin(), g.order.end(), 0);
  std::stable_sort(g.order.begin(), g.order.end(), [&](int a, int b) { return ids[size_t(a)] < ids[size_t(b)]; });
  g.position.resize(ids.size());
  for (size_t p = 0; p < g.order.size(); ++p) g.position[size_t(g.order[p])] = int(p);
  return g;
}

TEST(CudaExpertGrouping, RepeatedAbsentAndAllSameExperts) {
  std::mt19937 rng(9);
  struct Case {
    const char* what;
    int experts;
    std::vector<int> ids;
  };
  std::vector<Case> cases;
  auto random_ids = [&](int slots, int experts, std::vector<int> allowed) {
    std::vector<int> ids(static_cast<size_t>(slots));
    for (int& id : ids) id = allowed.empty() ? int(rng() % unsigned(experts)) : allowed[rng() % allowed.size()];
    return ids;
  };
  cases.push_back({"repeated, 16 experts", 16, random_ids(77, 16, {})});
  cases.push_back({"all the same", 8, std::vector<int>(50, 5)});
  cases.push_back({"most absent", 32, random_ids(41, 32, {0, 7, 31})});
  cases.push_back({"one slot", 4, {3}});
  cases.push_back({"Flash-Next chunk: 512 rows × 10 of 512 experts", 512, random_ids(5120, 512, {})});
  cases.push_back({"2048 experts, 3 tiles", 2048, random_ids(2500, 2048, {})});
  for (const Case& c : cases) {
    const Grouping got = group_on_device(c.ids, c.experts), want = group_on_host(c.ids, c.experts);
    EXPECT_EQ(got.counts, want.counts) << c.what;
    EXPECT_EQ(got.offsets, want.offsets) << c.what;
    EXPECT_EQ(got.order, want.order) << c.what;
    EXPECT_EQ(got.position, want.position) << c.what;

    int* d_counts = device_copy(want.counts);
    std::vector<cuda::ExpertGroup> groups;
    ASSERT_EQ(cuda::active_experts(d_counts, c.experts, groups, nullptr), cudaSuccess);
    cudaFree(d_counts);
    std::vector<cuda::ExpertGroup> expected;
    for (int e = 0; e < c.experts; ++e)
      if (want.counts[size_t(e)]) expected.push_back({e, want.offsets[size_t(e)], want.counts[size_t(e)]});
    ASSERT_EQ(groups.size(), expected.size()) << c.what;
    for (size_t i = 0; i < groups.size(); ++i) {
      EXPECT_EQ(groups[i].expert, expected[i].expert) << c.what;
      EXPECT_EQ(groups[i].offset, expected[i].offset) << c.what;
      EXPECT_EQ(groups[i].count, expected[i].count) << c.what;
    }
  }
}

// The whole prefill expert path: group, gather, one GEMM per active expert (in batches when the scratch is small),
// scatter back to slot order; every slot's output against its own expert's double-precision product.
TEST(CudaExpertGrouping, GroupedExpertProductsMatchDoublePrecision) {
  cuda::set_gemm_precision(GemmPrecision::Fp32);
  constexpr int kExperts = 8, kRowsOut = 96, kCols = 128, kTokens = 13, kTopK = 3;
  std::mt19937 rng(10);
  for (WeightFormat format : {WeightFormat::F32, WeightFormat::BF16, WeightFormat::Q4})
    for (size_t scratch :
         {cuda::kWeightScratchBytes, size_t(2) * kRowsOut * kCols * 4}) {  // one batch, or 2 experts a batch
      cuda::set_weight_scratch_limit(scratch);
      std::vector<TestMatrix> experts;
      std::vector<cuda::DeviceMatrix> descriptors;
      for (int e = 0; e < kExperts; ++e) {
        experts.push_back(make_matrix(format, kRowsOut, kCols, rng));
        descriptors.push_back(experts.back().device);
      }
      cuda::DeviceMatrix* d_descriptors = device_copy(descriptors);
      std::vector<int> ids(size_t(kTokens) * kTopK);
      for (int& id : ids) id = int(rng() % 7);  // expert 7 absent, the others repeated
      const std::vector<float> x = random_rows(kTokens, kCols, rng);
      const int slots = int(ids.size());
      int* d_ids = device_copy(ids);
      float* d_x = device_copy(x);
      int *counts = device_buffer<int>(kExperts), *offsets = device_buffer<int>(kExperts);
      int *order = device_buffer<int>(size_t(slots)), *position = device_buffer<int>(size_t(slots));
      float* grouped = device_buffer<float>(size_t(slots) * kCols);
      float* grouped_out = device_buffer<float>(size_t(slots) * kRowsOut);
      float* out = device_buffer<float>(size_t(slots) * kRowsOut);
      cuda::group_by_expert(d_ids, slots, kExperts, counts, offsets, order, position, nullptr);
      std::vector<cuda::ExpertGroup> groups;
      ASSERT_EQ(cuda::active_experts(counts, kExperts, groups, nullptr), cudaSuccess);
      cuda::gather_grouped_rows(d_x, order, slots, kTopK, kCols, grouped, nullptr);
      ASSERT_TRUE(
          cuda::grouped_expert_gemm(d_descriptors, format, kRowsOut, kCols, groups, grouped, grouped_out, nullptr));
      cuda::scatter_grouped_rows(grouped_out, position, slots, kRowsOut, out, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<float> y = host_copy(out, size_t(slots) * kRowsOut);
      double worst = 0;
      for (int s = 0; s < slots; ++s)
        for (int r = 0; r < kRowsOut; ++r)
          worst =
              std::max(worst, scaled_error(experts[size_t(ids[size_t(s)])].exact, r, kCols,
                                           x.data() + size_t(s / kTopK) * kCols, y[size_t(s) * kRowsOut + size_t(r)]));
      EXPECT_LE(worst, kFp32Bound) << name_of(format) << ", scratch " << scratch << " bytes";
      for (void* p : {static_cast<void*>(d_descriptors), static_cast<void*>(d_ids), static_cast<void*>(d_x),
                      static_cast<void*>(counts), static_cast<void*>(offsets), static_cast<void*>(order),
                      static_cast<void*>(position), static_cast<void*>(grouped), static_cast<void*>(grouped_out),
                      static_cast<void*>(out)})
        cudaFree(p);
    }
  cuda::set_weight_scratch_limit(cuda::kWeightScratchBytes);
}

}  // namespace
}  // namespace vavilov
