// The prefill's grouped expert products on the codes (quant_gemm.cuh) against double-precision products of the exact
// weights the GPU sees.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cuda/moe.cuh"
#include "cuda/quant_gemm.cuh"
#include "device_matrices.h"

namespace vavilov {
namespace {

using cuda::WeightFormat;
using test::DeviceMemory;
using test::TestMatrix;

const char* name_of(WeightFormat f) { return f == WeightFormat::Q4 ? "Q4" : f == WeightFormat::Q3 ? "Q3" : "Q2"; }

// Rounding-order differences only, as for the decode GEMV (test_cuda_linear): 1e-5 of the sum of |w·x| terms. The
// activations enter the tensor cores as two fp16 halves (22 significant bits) and the codes exactly, so a wrong index,
// stride, pass or chunk gives errors of order one.
constexpr double kBound = 1e-5;

struct Result {
  std::vector<float> y;
  std::vector<TestMatrix> experts;
};

// y for rows grouped by expert: expert e owns rows [offsets[e], offsets[e] + counts[e]) of x (all of x's rows split
// first, as moe_prefill does).
std::vector<float> run(DeviceMemory& memory, const std::vector<TestMatrix>& experts, WeightFormat format,
                       const std::vector<int>& counts, const std::vector<float>& x, int rows_out, int cols,
                       const cuda::GroupedRowMap& map = {}) {
  std::vector<int> offsets(counts.size());
  int total = 0;
  for (size_t e = 0; e < counts.size(); ++e) offsets[e] = total, total += counts[e];
  std::vector<cuda::DeviceMatrix> descriptors;
  for (const TestMatrix& m : experts) descriptors.push_back(m.device);
  const size_t outputs = size_t(total) * size_t(rows_out);
  float* y = memory.copy(std::vector<float>(outputs, std::numeric_limits<float>::quiet_NaN()));
  const int x_rows = int(x.size() / size_t(cols));
  // The split rows start as NaN bits, so that a record the split never wrote fails the checks.
  uint8_t* split = memory.copy(std::vector<uint8_t>(cuda::quant_split_bytes(x_rows, cols), 0xff));
  EXPECT_EQ(cuda::quant_split_rows(format, memory.copy(x), x_rows, cols, split, nullptr), cudaSuccess);
  EXPECT_EQ(cuda::quant_expert_gemm(memory.copy(descriptors), format, int(experts.size()), rows_out, cols,
                                    memory.copy(counts), memory.copy(offsets), split, y, nullptr, map),
            cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return test::download(y, outputs);
}

double scaled_error(const TestMatrix& w, int row, const float* x, float got) {
  double want = 0, magnitude = 0;
  for (int k = 0; k < w.cols; ++k) {
    const double term = w.at(row, k) * double(x[k]);
    want += term;
    magnitude += std::abs(term);
  }
  return std::isfinite(got) ? std::abs(double(got) - want) / std::max(magnitude, 1e-30) : INFINITY;
}

// Shapes with partial row blocks and tiles (96, 200 rows), a partial column chunk (640 = 8 + 2 groups), and experts
// with no rows, one, a partial pass, a whole one (16) and several (17, 40).
TEST(CudaQuantGemm, GroupedProductsOnTheCodesMatchDoublePrecision) {
  struct Shape {
    int rows_out, cols;
  };
  const std::vector<int> counts = {3, 0, 1, 16, 17, 0, 40, 5};
  std::mt19937 rng(21);
  for (WeightFormat format : {WeightFormat::Q4, WeightFormat::Q3, WeightFormat::Q2})
    for (Shape s : {Shape{96, 640}, Shape{200, 2560}, Shape{640, 256}}) {
      DeviceMemory memory;
      std::vector<TestMatrix> experts;
      for (size_t e = 0; e < counts.size(); ++e)
        experts.push_back(test::make_matrix(
            memory, format, test::normal_values(rng, size_t(s.rows_out) * size_t(s.cols), 0.05f), s.rows_out, s.cols));
      int total = 0;
      for (int c : counts) total += c;
      // Rows of very different magnitudes, so that the per-group scaling of the activations is exercised.
      std::vector<float> x = test::normal_values(rng, size_t(total) * size_t(s.cols), 1.0f);
      for (int r = 0; r < total; ++r)
        for (int k = 0; k < s.cols; ++k) x[size_t(r) * size_t(s.cols) + size_t(k)] *= std::ldexp(1.0f, r % 7 - 3);
      const std::vector<float> y = run(memory, experts, format, counts, x, s.rows_out, s.cols);
      double worst = 0;
      int row = 0;
      for (size_t e = 0; e < counts.size(); ++e)
        for (int i = 0; i < counts[e]; ++i, ++row)
          for (int r = 0; r < s.rows_out; ++r)
            worst = std::max(worst, scaled_error(experts[e], r, x.data() + size_t(row) * size_t(s.cols),
                                                 y[size_t(row) * size_t(s.rows_out) + size_t(r)]));
      EXPECT_LE(worst, kBound) << name_of(format) << " " << s.rows_out << "×" << s.cols;
    }
}

// An activation row's products do not depend on which other rows share its expert: the same row alone and as row 20
// of 33 gives the same bits.
TEST(CudaQuantGemm, RowResultsDoNotDependOnTheExpertsOtherRows) {
  constexpr int kRowsOut = 130, kCols = 768;
  std::mt19937 rng(22);
  DeviceMemory memory;
  std::vector<TestMatrix> experts = {test::make_matrix(
      memory, WeightFormat::Q4, test::normal_values(rng, size_t(kRowsOut) * kCols, 0.05f), kRowsOut, kCols)};
  const std::vector<float> many = test::normal_values(rng, size_t(33) * kCols, 1.0f);
  const std::vector<float> alone(many.begin() + 20 * kCols, many.begin() + 21 * kCols);
  const std::vector<float> y_many = run(memory, experts, WeightFormat::Q4, {33}, many, kRowsOut, kCols);
  const std::vector<float> y_alone = run(memory, experts, WeightFormat::Q4, {1}, alone, kRowsOut, kCols);
  EXPECT_EQ(std::memcmp(y_alone.data(), y_many.data() + 20 * kRowsOut, kRowsOut * sizeof(float)), 0);
}

// y = W · x by the dense form (cut as `tiles` says), copied to the host. Outputs start as NaN, so that one never
// written fails the checks.
std::vector<float> dense(DeviceMemory& memory, const TestMatrix& w, const std::vector<float>& x, int x_rows,
                         cuda::QuantGemmTiles tiles = cuda::QuantGemmTiles::automatic) {
  const size_t outputs = size_t(x_rows) * size_t(w.rows);
  float* y = memory.copy(std::vector<float>(outputs, std::numeric_limits<float>::quiet_NaN()));
  EXPECT_EQ(cuda::quant_gemm(w.device, memory.copy(x), x_rows, y, nullptr, tiles), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return test::download(y, outputs);
}

// Activations of very different magnitudes from row to row and group to group, so that the per-group scaling of the
// activations is exercised.
std::vector<float> mixed_magnitudes(std::mt19937& rng, int rows, int cols) {
  std::vector<float> x = test::normal_values(rng, size_t(rows) * size_t(cols), 1.0f);
  for (int r = 0; r < rows; ++r)
    for (int k = 0; k < cols; ++k) x[size_t(r) * size_t(cols) + size_t(k)] *= std::ldexp(1.0f, (r + k / 64) % 9 - 4);
  return x;
}

// moe_prefill's map folded into the products — rows read where they are (x_rows: grouped row → slot, divided by the
// picks a token) and written in slot order (y_rows) — gives the bits of the products of gathered rows, scattered
// afterwards. 17 tokens × 3 picks over 5 experts, one of them without rows, every format, short rows (640 columns)
// and long (2560: the two cuts of quant_gemm.cu).
TEST(CudaQuantGemm, MappedRowsGiveTheGatheredRowsBits) {
  constexpr int kRowsOut = 200, kTokens = 17, kPicks = 3, kSlots = kTokens * kPicks, kExperts = 5;
  std::mt19937 rng(26);
  std::vector<int> ids(kSlots);
  for (int& id : ids) id = std::array{0, 1, 3, 4}[rng() % 4];  // expert 2 gets no rows
  std::vector<int> counts(kExperts, 0), order;                 // order: grouped row → slot, stable per expert
  for (int e = 0; e < kExperts; ++e)
    for (int s = 0; s < kSlots; ++s)
      if (ids[size_t(s)] == e) ++counts[size_t(e)], order.push_back(s);
  for (const int cols : {640, 2560})
    for (WeightFormat format : {WeightFormat::Q4, WeightFormat::Q3, WeightFormat::Q2}) {
      DeviceMemory memory;
      std::vector<TestMatrix> experts;
      for (int e = 0; e < kExperts; ++e)
        experts.push_back(test::make_matrix(memory, format, test::normal_values(rng, size_t(kRowsOut) * cols, 0.05f),
                                            kRowsOut, cols));
      const std::vector<float> x = mixed_magnitudes(rng, kTokens, cols);
      std::vector<float> gathered(size_t(kSlots) * cols);
      for (int p = 0; p < kSlots; ++p)
        std::memcpy(&gathered[size_t(p) * cols], &x[size_t(order[size_t(p)] / kPicks) * cols], cols * sizeof(float));
      const std::vector<float> grouped = run(memory, experts, format, counts, gathered, kRowsOut, cols);
      std::vector<float> scattered(grouped.size());
      for (int p = 0; p < kSlots; ++p)
        std::memcpy(&scattered[size_t(order[size_t(p)]) * kRowsOut], &grouped[size_t(p) * kRowsOut],
                    kRowsOut * sizeof(float));
      const int* device_order = memory.copy(order);
      const std::vector<float> read_in_place =
          run(memory, experts, format, counts, x, kRowsOut, cols, {.x_rows = device_order, .x_divisor = kPicks});
      const std::vector<float> written_in_slot_order =
          run(memory, experts, format, counts, gathered, kRowsOut, cols, {.y_rows = device_order});
      const std::vector<float> both = run(memory, experts, format, counts, x, kRowsOut, cols,
                                          {.x_rows = device_order, .x_divisor = kPicks, .y_rows = device_order});
      EXPECT_EQ(std::memcmp(read_in_place.data(), grouped.data(), grouped.size() * sizeof(float)), 0)
          << name_of(format) << " " << cols;
      EXPECT_EQ(std::memcmp(written_in_slot_order.data(), scattered.data(), grouped.size() * sizeof(float)), 0)
          << name_of(format) << " " << cols;
      EXPECT_EQ(std::memcmp(both.data(), scattered.data(), grouped.size() * sizeof(float)), 0)
          << name_of(format) << " " << cols;
    }
}

double worst_dense_error(const TestMatrix& w, const std::vector<float>& x, int x_rows, const std::vector<float>& y) {
  double worst = 0;
  for (int b = 0; b < x_rows; ++b)
    for (int r = 0; r < w.rows; ++r)
      worst = std::max(
          worst, scaled_error(w, r, x.data() + size_t(b) * size_t(w.cols), y[size_t(b) * size_t(w.rows) + size_t(r)]));
  return worst;
}

// The block tiles (256 matrix rows × 64 activation rows a block, 64 rows a warp): partial row blocks (200 and 136
// rows: a warp with half an m-tile, warps with no rows), one whole (256), partial activation-row blocks (1, 100, 130
// rows), one whole (64) and the pipeline's edges (2 groups: one step ahead only once; 1 group: none), every format.
TEST(CudaQuantGemm, BlockTilesMatchDoublePrecision) {
  struct Shape {
    int rows_out, cols;
  };
  std::mt19937 rng(26);
  for (WeightFormat format : {WeightFormat::Q4, WeightFormat::Q3, WeightFormat::Q2})
    for (Shape s : {Shape{200, 640}, Shape{256, 128}, Shape{136, 64}})
      for (int x_rows : {1, 64, 100, 130}) {
        DeviceMemory memory;
        const TestMatrix w = test::make_matrix(
            memory, format, test::normal_values(rng, size_t(s.rows_out) * size_t(s.cols), 0.05f), s.rows_out, s.cols);
        const std::vector<float> x = mixed_magnitudes(rng, x_rows, s.cols);
        const std::vector<float> y = dense(memory, w, x, x_rows, cuda::QuantGemmTiles::block);
        EXPECT_LE(worst_dense_error(w, x, x_rows, y), kBound)
            << name_of(format) << " " << s.rows_out << "×" << s.cols << ", " << x_rows << " rows";
      }
}

// Both cuts of the dense form compute every output as the same sum in the same order: the same bits, so that a row's
// result does not depend on the chunk's size (which picks the cut).
TEST(CudaQuantGemm, BlockTilesGiveTheWarpTilesBits) {
  std::mt19937 rng(27);
  for (WeightFormat format : {WeightFormat::Q4, WeightFormat::Q3, WeightFormat::Q2}) {
    constexpr int kRowsOut = 328, kCols = 1280, kRows = 150;
    DeviceMemory memory;
    const TestMatrix w =
        test::make_matrix(memory, format, test::normal_values(rng, size_t(kRowsOut) * kCols, 0.05f), kRowsOut, kCols);
    const std::vector<float> x = mixed_magnitudes(rng, kRows, kCols);
    const std::vector<float> block = dense(memory, w, x, kRows, cuda::QuantGemmTiles::block);
    const std::vector<float> warp = dense(memory, w, x, kRows, cuda::QuantGemmTiles::warp);
    EXPECT_EQ(std::memcmp(block.data(), warp.data(), block.size() * sizeof(float)), 0) << name_of(format);
  }
}

// A chunk large enough for the automatic choice to take block tiles on the H200 (10240 rows: 40 row blocks × 5
// activation-row blocks ≥ 132 / 2 multiprocessors) matches double precision.
TEST(CudaQuantGemm, AutomaticChoiceOfManyRowsMatchesDoublePrecision) {
  constexpr int kRowsOut = 10240, kCols = 128, kRows = 300;
  std::mt19937 rng(28);
  DeviceMemory memory;
  const TestMatrix w = test::make_matrix(memory, WeightFormat::Q4,
                                         test::normal_values(rng, size_t(kRowsOut) * kCols, 0.05f), kRowsOut, kCols);
  const std::vector<float> x = mixed_magnitudes(rng, kRows, kCols);
  EXPECT_LE(worst_dense_error(w, x, kRows, dense(memory, w, x, kRows)), kBound);
}

// The dense form: rows in slices side by side (5, 16, 17 and 100 rows: partial and several slices). A matrix of few
// row blocks (200 rows) takes slices of 4 rows, so that the multiprocessors fill; one of many (5120 rows: 40 row
// blocks) slices of 16 at 100 rows.
TEST(CudaQuantGemm, DenseProductsOnTheCodesMatchDoublePrecision) {
  struct Shape {
    int rows_out, cols;
  };
  std::mt19937 rng(23);
  for (WeightFormat format : {WeightFormat::Q4, WeightFormat::Q3, WeightFormat::Q2})
    for (Shape s : {Shape{200, 640}, Shape{5120, 128}})
      for (int x_rows : {5, 16, 17, 100}) {
        DeviceMemory memory;
        const TestMatrix w = test::make_matrix(
            memory, format, test::normal_values(rng, size_t(s.rows_out) * size_t(s.cols), 0.05f), s.rows_out, s.cols);
        const std::vector<float> x = test::normal_values(rng, size_t(x_rows) * size_t(s.cols), 1.0f);
        const std::vector<float> y = dense(memory, w, x, x_rows);
        double worst = 0;
        for (int b = 0; b < x_rows; ++b)
          for (int r = 0; r < s.rows_out; ++r)
            worst = std::max(worst, scaled_error(w, r, x.data() + size_t(b) * size_t(s.cols),
                                                 y[size_t(b) * size_t(s.rows_out) + size_t(r)]));
        EXPECT_LE(worst, kBound) << name_of(format) << " " << s.rows_out << "×" << s.cols << ", " << x_rows << " rows";
      }
}

// A row's products do not depend on the slice it falls in: the first 5 of 100 rows (16-row slices of a 5120-row
// matrix on the H200) and the same 5 rows alone (slices of 4) give the same bits.
TEST(CudaQuantGemm, DenseRowResultsDoNotDependOnTheSlicing) {
  constexpr int kRowsOut = 5120, kCols = 128;
  std::mt19937 rng(25);
  DeviceMemory memory;
  const TestMatrix w = test::make_matrix(memory, WeightFormat::Q4,
                                         test::normal_values(rng, size_t(kRowsOut) * kCols, 0.05f), kRowsOut, kCols);
  const std::vector<float> many = test::normal_values(rng, size_t(100) * kCols, 1.0f);
  const std::vector<float> few(many.begin(), many.begin() + 5 * kCols);
  const std::vector<float> y_many = dense(memory, w, many, 100);
  const std::vector<float> y_few = dense(memory, w, few, 5);
  EXPECT_EQ(std::memcmp(y_few.data(), y_many.data(), y_few.size() * sizeof(float)), 0);
}

// The grouped products (rows split once by quant_split_rows, copied by each block) give the bits of the dense warp
// tiles (rows split by each block as it stages them): one expert of 37 rows (passes of 16, 16 and 5) and the same 37
// rows as a dense product, every format, a partial row block and a partial chunk (200 × 640: 8 + 2 groups) and a
// long row (2560 columns: 5 chunks).
TEST(CudaQuantGemm, GroupedProductsGiveTheDenseProductsBits) {
  constexpr int kRows = 37;
  struct Shape {
    int rows_out, cols;
  };
  std::mt19937 rng(27);
  for (WeightFormat format : {WeightFormat::Q4, WeightFormat::Q3, WeightFormat::Q2})
    for (Shape s : {Shape{200, 640}, Shape{96, 2560}}) {
      DeviceMemory memory;
      const std::vector<TestMatrix> experts = {test::make_matrix(
          memory, format, test::normal_values(rng, size_t(s.rows_out) * size_t(s.cols), 0.05f), s.rows_out, s.cols)};
      const std::vector<float> x = mixed_magnitudes(rng, kRows, s.cols);
      const std::vector<float> grouped = run(memory, experts, format, {kRows}, x, s.rows_out, s.cols);
      const std::vector<float> warp_tiles = dense(memory, experts[0], x, kRows, cuda::QuantGemmTiles::warp);
      EXPECT_EQ(std::memcmp(grouped.data(), warp_tiles.data(), grouped.size() * sizeof(float)), 0)
          << name_of(format) << " " << s.rows_out << "×" << s.cols;
    }
}

// The swiglu folded into the split (down's input) gives the bytes of the split of moe.cuh's swiglu rows: the same
// activations reach the products. Gates of every sign and size (silu's tails: e^-x overflowing and vanishing), every
// format.
TEST(CudaQuantGemm, SwigluSplitGivesTheSplitOfTheSwigluRows) {
  constexpr int kRows = 21, kCols = 640;
  std::mt19937 rng(28);
  std::vector<float> gate = mixed_magnitudes(rng, kRows, kCols);
  for (size_t i = 0; i < gate.size(); i += 97) gate[i] = i % 2 ? 120.0f : -120.0f;
  const std::vector<float> up = mixed_magnitudes(rng, kRows, kCols);
  const size_t bytes = cuda::quant_split_bytes(kRows, kCols);
  for (WeightFormat format : {WeightFormat::Q4, WeightFormat::Q3, WeightFormat::Q2}) {
    DeviceMemory memory;
    float* device_gate = memory.copy(gate);
    const float* device_up = memory.copy(up);
    uint8_t* folded = memory.copy(std::vector<uint8_t>(bytes, 0xff));
    uint8_t* separate = memory.copy(std::vector<uint8_t>(bytes, 0xff));
    EXPECT_EQ(cuda::quant_split_swiglu_rows(format, device_gate, device_up, kRows, kCols, folded, nullptr),
              cudaSuccess);
    cuda::swiglu(device_gate, device_up, int64_t(gate.size()), nullptr);
    EXPECT_EQ(cuda::quant_split_rows(format, device_gate, kRows, kCols, separate, nullptr), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(test::download(folded, bytes), test::download(separate, bytes)) << name_of(format);
  }
}

TEST(CudaQuantGemm, ExpertSetsOfOneFormatAndShapeOnly) {
  std::mt19937 rng(24);
  DeviceMemory memory;
  auto descriptors = [&](std::vector<std::pair<WeightFormat, int>> kinds) {
    std::vector<cuda::DeviceMatrix> host;
    for (auto [format, rows] : kinds)
      host.push_back(
          test::make_matrix(memory, format, test::normal_values(rng, size_t(rows) * 128, 0.05f), rows, 128).device);
    return memory.copy(host);
  };
  EXPECT_TRUE(cuda::quant_gemm_reads_all(descriptors({{WeightFormat::Q4, 64}, {WeightFormat::Q4, 64}}), 2,
                                         WeightFormat::Q4, 64, 128));
  EXPECT_FALSE(cuda::quant_gemm_reads_all(descriptors({{WeightFormat::Q4, 64}, {WeightFormat::Q3, 64}}), 2,
                                          WeightFormat::Q4, 64, 128));
  EXPECT_FALSE(cuda::quant_gemm_reads_all(descriptors({{WeightFormat::Q4, 64}, {WeightFormat::Q4, 80}}), 2,
                                          WeightFormat::Q4, 64, 128));
  EXPECT_FALSE(cuda::quant_gemm_reads_all(descriptors({{WeightFormat::BF16, 64}}), 1, WeightFormat::BF16, 64, 128));
}

TEST(CudaQuantGemm, RefusesWhatItDoesNotTake) {
  EXPECT_FALSE(cuda::quant_gemm_takes(WeightFormat::BF16));
  EXPECT_FALSE(cuda::quant_gemm_takes(WeightFormat::NVFP4));
  EXPECT_EQ(
      cuda::quant_expert_gemm(nullptr, WeightFormat::BF16, 4, 64, 64, nullptr, nullptr, nullptr, nullptr, nullptr),
      cudaErrorInvalidValue);
  EXPECT_EQ(cuda::quant_expert_gemm(nullptr, WeightFormat::Q4, 4, 64, 100, nullptr, nullptr, nullptr, nullptr, nullptr),
            cudaErrorInvalidValue);
  const int order[1] = {0};
  EXPECT_EQ(cuda::quant_expert_gemm(nullptr, WeightFormat::Q4, 4, 64, 128, nullptr, nullptr, nullptr, nullptr, nullptr,
                                    {.x_rows = order, .x_divisor = 0}),
            cudaErrorInvalidValue);
  // Splits: formats the products take, whole groups of 64 columns, 16-byte aligned rows and records.
  const auto* aligned = reinterpret_cast<const float*>(uintptr_t{0x1000});
  void* aligned_split = reinterpret_cast<void*>(uintptr_t{0x2000});
  EXPECT_EQ(cuda::quant_split_rows(WeightFormat::BF16, aligned, 4, 64, aligned_split, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cuda::quant_split_rows(WeightFormat::Q4, aligned, 4, 100, aligned_split, nullptr), cudaErrorInvalidValue);
  EXPECT_EQ(cuda::quant_split_rows(WeightFormat::Q4, aligned + 1, 4, 64, aligned_split, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::quant_split_rows(WeightFormat::Q4, aligned, 4, 64, static_cast<char*>(aligned_split) + 8, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::quant_split_rows(WeightFormat::Q4, aligned, 0, 64, aligned_split, nullptr), cudaSuccess);
  EXPECT_EQ(cuda::quant_split_swiglu_rows(WeightFormat::Q4, aligned, nullptr, 4, 64, aligned_split, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::quant_split_swiglu_rows(WeightFormat::Q4, aligned, aligned + 2, 4, 64, aligned_split, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::quant_split_bytes(3, 128), size_t(3 * 2 * 17 * 16));
  // Q4 codes need 8-byte alignment (their loads are 8 bytes), Q3/Q2 4; whole groups of 64 columns.
  cuda::DeviceMatrix q4;
  q4.format = WeightFormat::Q4, q4.rows = 64, q4.cols = 128;
  q4.data = reinterpret_cast<const void*>(uintptr_t{0x1008});
  EXPECT_TRUE(cuda::quant_gemm_reads(q4));
  q4.data = reinterpret_cast<const void*>(uintptr_t{0x1004});
  EXPECT_FALSE(cuda::quant_gemm_reads(q4));
  EXPECT_EQ(cuda::quant_gemm(q4, nullptr, 8, nullptr, nullptr), cudaErrorInvalidValue);
  q4.format = WeightFormat::Q3;
  EXPECT_TRUE(cuda::quant_gemm_reads(q4));
  q4.cols = 100;
  EXPECT_FALSE(cuda::quant_gemm_reads(q4));
  cuda::DeviceMatrix bf16;
  bf16.format = WeightFormat::BF16, bf16.rows = 64, bf16.cols = 64;
  EXPECT_EQ(cuda::quant_gemm(bf16, nullptr, 8, nullptr, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace vavilov
