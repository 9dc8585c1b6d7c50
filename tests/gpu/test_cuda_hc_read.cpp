// The fused hyper-connection read (src/cuda/hc_fused_read.cu) against a double-precision evaluation of the spec's
// formulas (qwen4_exp.md §4) on the host, with the exact (dequantised) Q4 weights the GPU reads: every weight, norm
// weight, stack, pending output and inject value random; 1–4 rows; with and without the previous write folded in; at
// Flash-Next's geometry and at small ones (other stream counts, a partial inject tile, no inject, fewer column groups
// than hc_down's warps); after a producer that lets the read start before it writes the stack, the same bits as after
// a finished one.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "cuda/hyper_connection.cuh"
#include "device_matrices.h"
#include "late_producer.h"

namespace vavilov {
namespace {

using cuda::WeightFormat;
using test::DeviceMemory;
using test::make_matrix;
using test::normal_values;
using test::TestMatrix;

constexpr int kRows = 4;
constexpr float kEps = 1e-6f;

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

struct Geometry {
  int streams, hidden, rank;
  bool inject;
};

struct Reference {
  std::vector<double> stack, input, inject;  // after the write; the block input; the raw inject projections
  std::vector<double> input_bound, inject_bound;
};

struct Read {
  Geometry shape;
  TestMatrix down, up, inject;
  std::vector<float> norm;

  int sh() const { return shape.streams * shape.hidden; }
  int inject_rows() const { return shape.inject ? shape.streams : 0; }

  // The spec's read of `rows` rows of stack, after stack += 2σ(old_inject / S)·y when pending. The bounds allow
  // 1e-4 of the magnitudes the GPU's fp32 sums go through (Σ|terms| of each product, carried through silu and σ,
  // whose slopes are at most 1.1 and 1/4); a wrong index, row or stream gives errors of order one of them.
  Reference evaluate(const std::vector<float>& stack, const std::vector<float>& y, const std::vector<float>& old_inject,
                     bool pending, int rows) const {
    const int s = shape.streams, h = shape.hidden, r = shape.rank, n = sh();
    Reference ref;
    ref.stack.assign(stack.begin(), stack.begin() + size_t(rows) * n);
    for (int b = 0; b < rows && pending; ++b)
      for (int c = 0; c < s; ++c) {
        const double gate = 2.0 * sigmoid(double(old_inject[size_t(b * s + c)]) / s);
        for (int d = 0; d < h; ++d) ref.stack[size_t(b) * n + size_t(c * h + d)] += gate * y[size_t(b) * h + size_t(d)];
      }
    for (int b = 0; b < rows; ++b) {
      const double* row = ref.stack.data() + size_t(b) * n;
      std::vector<double> normed(size_t(n), 0.0);
      for (int c = 0; c < s; ++c) {
        double squares = 0;
        for (int d = 0; d < h; ++d) squares += row[c * h + d] * row[c * h + d];
        const double scale = 1.0 / std::sqrt(squares / h + double(kEps));
        for (int d = 0; d < h; ++d)
          normed[size_t(c * h + d)] = row[c * h + d] * scale * (1.0 + norm[size_t(c * h + d)]);
      }
      std::vector<double> u(static_cast<size_t>(r)), u_magnitude(static_cast<size_t>(r));
      for (int k = 0; k < r; ++k) {
        double low = 0, magnitude = 0;
        for (int j = 0; j < n; ++j)
          low += down.at(k, j) * normed[size_t(j)], magnitude += std::fabs(down.at(k, j) * normed[size_t(j)]);
        const double x = low / s;
        u[size_t(k)] = x * sigmoid(x);
        u_magnitude[size_t(k)] = std::fabs(u[size_t(k)]) + 1.1 * magnitude / s;
      }
      for (int d = 0; d < h; ++d) {
        double sum = 0, bound = 0;
        for (int c = 0; c < s; ++c) {
          double mix = 0, magnitude = 0;
          for (int k = 0; k < r; ++k)
            mix += up.at(c * h + d, k) * u[size_t(k)],
                magnitude += std::fabs(up.at(c * h + d, k)) * u_magnitude[size_t(k)];
          const double x = normed[size_t(c * h + d)];
          sum += sigmoid(mix) * x;
          bound += std::fabs(x) * (1.0 + 0.25 * magnitude);
        }
        ref.input.push_back(sum / s);
        ref.input_bound.push_back(1e-4 * bound / s);
      }
      for (int c = 0; c < inject_rows(); ++c) {
        double sum = 0, magnitude = 0;
        for (int j = 0; j < n; ++j)
          sum += inject.at(c, j) * normed[size_t(j)], magnitude += std::fabs(inject.at(c, j) * normed[size_t(j)]);
        ref.inject.push_back(sum);
        ref.inject_bound.push_back(1e-4 * magnitude);
      }
    }
    return ref;
  }
};

Read make_read(DeviceMemory& memory, std::mt19937& rng, Geometry shape, WeightFormat format = WeightFormat::Q4) {
  Read read;
  read.shape = shape;
  const int n = shape.streams * shape.hidden;
  read.down = make_matrix(memory, format, normal_values(rng, size_t(shape.rank) * n, 1.0f / std::sqrt(float(n))),
                          shape.rank, n);
  read.up = make_matrix(memory, format, normal_values(rng, size_t(n) * shape.rank, 2.0f / std::sqrt(float(shape.rank))),
                        n, shape.rank);
  if (shape.inject)
    read.inject = make_matrix(memory, format, normal_values(rng, size_t(shape.streams) * n, 1.0f / std::sqrt(float(n))),
                              shape.streams, n);
  read.norm = normal_values(rng, size_t(n), 0.5f);
  return read;
}

class CudaHcRead : public ::testing::Test {
 protected:
  void SetUp() override {
    int devices = 0;
    ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess);
    ASSERT_GT(devices, 0) << "the GPU tests need a CUDA device";
  }

  // Every output for 1–4 rows, with and without a pending write, against Read::evaluate.
  void expect_reads(const Geometry& shape) {
    const Read read = make_read(memory_, rng_, shape);
    const int s = shape.streams, h = shape.hidden, n = read.sh();
    // Streams of different sizes, so that a wrong stream's RMS scale shows.
    std::vector<float> stack = normal_values(rng_, size_t(kRows) * n, 1.0f);
    for (size_t i = 0; i < stack.size(); ++i) stack[i] *= float(1 + (i / size_t(h)) % size_t(s));
    const std::vector<float> y = normal_values(rng_, size_t(kRows) * h, 1.0f);
    const std::vector<float> old_inject = normal_values(rng_, size_t(kRows) * s, 2.0f);
    const float* norm = memory_.copy(read.norm);
    ASSERT_TRUE(cuda::hc_fused_read_fits(read.down.device, read.up.device, shape.inject ? &read.inject.device : nullptr,
                                         norm, s, h, kRows));
    float* y_device = memory_.copy(y);
    float* scratch = memory_.zeros<float>(cuda::hc_fused_read_scratch_floats(read.shape.rank + read.inject_rows()));
    float* input = memory_.zeros<float>(size_t(kRows) * h);
    const cuda::HcFusedRead weights{
        read.down.device, read.up.device, shape.inject ? read.inject.device : cuda::DeviceMatrix{}, norm, s, h, kEps};
    for (bool pending : {false, true})
      for (int rows = 1; rows <= kRows; ++rows) {
        SCOPED_TRACE(testing::Message() << "streams " << s << ", hidden " << h << ", rank " << shape.rank
                                        << (pending ? ", pending write" : "") << ", rows " << rows);
        float* stack_device = memory_.copy(stack);
        float* inject_device = memory_.copy(old_inject);
        ASSERT_EQ(
            cuda::hc_fused_read(weights, rows, stack_device, pending, y_device, inject_device, scratch, input, nullptr),
            cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const Reference ref = read.evaluate(stack, y, old_inject, pending, rows);
        std::vector<float> got_stack(stack.size()), got_input(size_t(rows) * h), got_inject(old_inject.size());
        ASSERT_EQ(cudaMemcpy(got_stack.data(), stack_device, got_stack.size() * 4, cudaMemcpyDeviceToHost),
                  cudaSuccess);
        ASSERT_EQ(cudaMemcpy(got_input.data(), input, got_input.size() * 4, cudaMemcpyDeviceToHost), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(got_inject.data(), inject_device, got_inject.size() * 4, cudaMemcpyDeviceToHost),
                  cudaSuccess);
        // The write is one fused multiply-add per value: within an fp32 rounding of the exact sum. Rows past `rows`
        // stay as they were.
        for (size_t i = 0; i < stack.size(); ++i) {
          const double want = i < ref.stack.size() ? ref.stack[i] : stack[i];
          ASSERT_NEAR(got_stack[i], want, 1e-6 * (std::fabs(want) + 1.0)) << "stack value " << i;
        }
        for (size_t i = 0; i < ref.input.size(); ++i)
          ASSERT_NEAR(got_input[i], ref.input[i], ref.input_bound[i]) << "input " << i;
        for (size_t i = 0; i < got_inject.size(); ++i) {
          if (i < ref.inject.size())
            ASSERT_NEAR(got_inject[i], ref.inject[i], ref.inject_bound[i]) << "inject " << i;
          else
            ASSERT_EQ(got_inject[i], old_inject[i]) << "inject " << i << " is not the read's to write";
        }
      }
  }

  DeviceMemory memory_;
  std::mt19937 rng_{20261130};
};

TEST_F(CudaHcRead, FlashNextGeometryMatchesTheSpec) { expect_reads({4, 2560, 320, true}); }

TEST_F(CudaHcRead, SmallGeometriesMatchTheSpec) {
  expect_reads({3, 192, 64, true});   // three streams: 3 groups a stream (5 of 8 warps idle), inject of 3 rows
  expect_reads({2, 64, 128, false});  // a final mixer: no inject, one group a stream
  expect_reads({4, 448, 192, true});  // 7 groups a stream: runs of 0 or 1 group a warp
  expect_reads({1, 128, 64, true});   // one stream: hc_up's blocks are a single warp
}

// Flash-Next's read with random inputs on the device, for the bit-identity tests: the stack (on the host; each run
// copies it), the pending output y and the old inject logits.
struct BitsCase {
  static constexpr Geometry kShape{4, 2560, 320, true};
  Read read;
  std::vector<float> stack, old_inject;
  cuda::HcFusedRead weights;
  float *y = nullptr, *scratch = nullptr;

  BitsCase(DeviceMemory& memory, std::mt19937& rng) : read(make_read(memory, rng, kShape)) {
    const int s = kShape.streams, h = kShape.hidden;
    stack = normal_values(rng, size_t(kRows) * read.sh(), 1.0f);
    y = memory.copy(normal_values(rng, size_t(kRows) * h, 1.0f));
    old_inject = normal_values(rng, size_t(kRows) * s, 2.0f);
    weights = {read.down.device, read.up.device, read.inject.device, memory.copy(read.norm), s, h, kEps};
    scratch = memory.zeros<float>(cuda::hc_fused_read_scratch_floats(kShape.rank + read.inject_rows()));
  }
  size_t input_floats() const { return size_t(kRows) * kShape.hidden; }
  size_t output_floats() const { return stack.size() + input_floats() + old_inject.size(); }
  // What a read wrote: the stack, the block input and the inject logits, one after the other.
  std::vector<float> download(const float* stack_device, const float* input, const float* inject_device) const {
    std::vector<float> got(output_floats());
    float* at = got.data();
    for (const auto& [from, count] : {std::pair{stack_device, stack.size()}, std::pair{input, input_floats()},
                                      std::pair{inject_device, old_inject.size()}}) {
      EXPECT_EQ(cudaMemcpy(at, from, count * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
      at += count;
    }
    return got;
  }
};

// Every sum runs in a fixed order: the same read repeated gives the same bits (stack, input, inject).
TEST_F(CudaHcRead, RepeatedReadsAreBitIdentical) {
  const BitsCase c(memory_, rng_);
  std::vector<std::vector<float>> outputs;
  for (int run = 0; run < 3; ++run) {
    float* stack_device = memory_.copy(c.stack);
    float* inject_device = memory_.copy(c.old_inject);
    float* input = memory_.zeros<float>(c.input_floats());
    ASSERT_EQ(cuda::hc_fused_read(c.weights, kRows, stack_device, true, c.y, inject_device, c.scratch, input, nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    outputs.push_back(c.download(stack_device, input, inject_device));
  }
  for (int run = 1; run < 3; ++run)
    ASSERT_EQ(std::memcmp(outputs[0].data(), outputs[size_t(run)].data(), outputs[0].size() * sizeof(float)), 0)
        << "run " << run << " differs from the first";
}

// A pending 1-row output in fixed point (expert_decode.cuh's, fixed_sum.cuh): the read must equal, bit for bit, the
// read of the floats those sums stand for (each the integer rounded once to a float, times 2^-32), leave the sums all
// zero for the next pass, and refuse them for more than one row or without a pending write. The output spans
// magnitudes from 2^-20 to 2^10, so that the conversion's rounding matters.
TEST_F(CudaHcRead, FixedPointPendingOutputReadsAsItsFloatsAndIsCleared) {
  const BitsCase c(memory_, rng_);
  const int h = BitsCase::kShape.hidden;
  std::vector<unsigned long long> sums(static_cast<size_t>(h));
  std::vector<float> y(static_cast<size_t>(h));
  std::uniform_real_distribution<double> exponent(-20.0, 10.0);
  std::normal_distribution<double> value(0.0, 1.0);
  for (size_t i = 0; i < sums.size(); ++i) {
    const long long fixed = std::llround(value(rng_) * std::exp2(exponent(rng_)) * 4294967296.0);
    sums[i] = static_cast<unsigned long long>(fixed);
    y[i] = static_cast<float>(fixed) * 0x1p-32f;  // nearest float, then an exact power of two
  }
  unsigned long long* sums_device = memory_.copy(sums);
  const float* y_device = memory_.copy(y);
  const auto read = [&](bool fixed) {
    float* stack_device = memory_.copy(c.stack);
    float* inject_device = memory_.copy(c.old_inject);
    float* input = memory_.zeros<float>(c.input_floats());
    EXPECT_EQ(cuda::hc_fused_read(c.weights, 1, stack_device, true, y_device, inject_device, c.scratch, input, nullptr,
                                  fixed ? sums_device : nullptr),
              cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return c.download(stack_device, input, inject_device);
  };
  const std::vector<float> from_floats = read(false), from_sums = read(true);
  EXPECT_EQ(std::memcmp(from_sums.data(), from_floats.data(), c.output_floats() * sizeof(float)), 0);
  EXPECT_EQ(test::download(sums_device, sums.size()), std::vector<unsigned long long>(sums.size(), 0ull));
  float* scratch_input = memory_.zeros<float>(c.input_floats());
  float* stack_device = memory_.copy(c.stack);
  float* inject_device = memory_.copy(c.old_inject);
  EXPECT_EQ(cuda::hc_fused_read(c.weights, 2, stack_device, true, y_device, inject_device, c.scratch, scratch_input,
                                nullptr, sums_device),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::hc_fused_read(c.weights, 1, stack_device, false, y_device, inject_device, c.scratch, scratch_input,
                                nullptr, sums_device),
            cudaErrorInvalidValue);
}

// The read (1–4 rows: hc_down_kernel or the sliced kernel, then hc_up_kernel) after a producer that lets it start at
// once and writes its stack ~100 µs later (tests/gpu/late_producer.h), eagerly and from a graph: the same bits as after
// a finished producer. A kernel that read the stack (or anything else the kernels before write) before its wait would
// differ.
TEST_F(CudaHcRead, AfterLateProducerMatchesFinishedProducer) {
  const BitsCase c(memory_, rng_);
  const float* stack_source = memory_.copy(c.stack);
  const size_t stack_bytes = c.stack.size() * sizeof(float);
  for (int rows = 1; rows <= kRows; ++rows) {
    // The read after the stack is copied in (`late`: by the late producer): stack, input and inject.
    const auto run = [&](bool late, bool graph) {
      float* stack_device = memory_.zeros<float>(c.stack.size());
      float* inject_device = memory_.copy(c.old_inject);
      float* input = memory_.zeros<float>(c.input_floats());
      const auto read_after = [&](cudaStream_t stream) {
        EXPECT_EQ(
            cuda::hc_fused_read(c.weights, rows, stack_device, true, c.y, inject_device, c.scratch, input, stream),
            cudaSuccess);
      };
      if (late) {
        test::after_late_producer(stack_source, stack_device, stack_bytes, graph, read_after);
      } else {
        EXPECT_EQ(cudaMemcpy(stack_device, stack_source, stack_bytes, cudaMemcpyDeviceToDevice), cudaSuccess);
        read_after(nullptr);
        EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      }
      return c.download(stack_device, input, inject_device);
    };
    const std::vector<float> finished = run(false, false);
    for (bool graph : {false, true})
      EXPECT_EQ(std::memcmp(run(true, graph).data(), finished.data(), c.output_floats() * sizeof(float)), 0)
          << rows << " rows, graph " << graph;
  }
}

TEST_F(CudaHcRead, FitsOnlyQ4MixersOfWholeGroups) {
  const Read q4 = make_read(memory_, rng_, {4, 64, 64, true});
  const float* norm = memory_.copy(q4.norm);
  EXPECT_TRUE(cuda::hc_fused_read_fits(q4.down.device, q4.up.device, &q4.inject.device, norm, 4, 64, 1));
  EXPECT_FALSE(cuda::hc_fused_read_fits(q4.down.device, q4.up.device, &q4.inject.device, norm, 4, 64, 5)) << "5 rows";
  EXPECT_FALSE(cuda::hc_fused_read_fits(q4.down.device, q4.up.device, &q4.inject.device, norm, 3, 64, 1))
      << "streams that disagree with the matrices";
  EXPECT_FALSE(cuda::hc_fused_read_fits(q4.down.device, q4.up.device, &q4.inject.device, norm + 1, 4, 64, 1))
      << "a norm that float4 loads cannot read";
  const Read bf16 = make_read(memory_, rng_, {4, 64, 64, true}, WeightFormat::BF16);
  EXPECT_FALSE(cuda::hc_fused_read_fits(bf16.down.device, bf16.up.device, &bf16.inject.device, norm, 4, 64, 1));
  const Read narrow = make_read(memory_, rng_, {4, 64, 16, false}, WeightFormat::F32);
  EXPECT_FALSE(cuda::hc_fused_read_fits(narrow.down.device, narrow.up.device, nullptr, norm, 4, 64, 1));
}

}  // namespace
}  // namespace vavilov
