// The decode GEMV kernels are dependent launches (src/cuda/launch.cuh): they may start while the kernel before them
// still runs and read their weights then, but their activations, and descriptors written in the pass, only after the
// wait. Here a producer kernel lets them start at once and writes their input only ~100 µs later; every product must
// equal, bit for bit, the same call made on the finished input — eagerly and replayed from a captured graph. A kernel
// that read its input before the wait would see the poison (NaN) left there. after_late_producer (late_producer.h)
// lets other tests do the same (test_cuda_moe.cpp: the 2–4-row MoE block; test_cuda_expert_decode.cpp: the 1-row chain).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "cuda/gemv.cuh"
#include "cuda/linear.cuh"
#include "late_producer.h"

namespace vavilov {
namespace test {
namespace {

// Lets the next kernel launch at once, waits kLateDelayNs, then copies `bytes` from source to target.
__global__ void late_copy_kernel(const uint8_t* source, uint8_t* target, size_t bytes) {
  cudaTriggerProgrammaticLaunchCompletion();
  if (threadIdx.x == 0) {
    uint64_t start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
      __nanosleep(1000);
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < uint64_t(kLateDelayNs));
  }
  __syncthreads();
  for (size_t i = threadIdx.x; i < bytes; i += blockDim.x) target[i] = source[i];
}

}  // namespace

void launch_late_copy(const void* source, void* target, size_t bytes, cudaStream_t stream) {
  late_copy_kernel<<<1, 256, 0, stream>>>(static_cast<const uint8_t*>(source), static_cast<uint8_t*>(target), bytes);
}

}  // namespace test

namespace {

using test::after_late_producer;

template <typename T>
T* device_copy(const std::vector<T>& host) {
  T* device = nullptr;
  EXPECT_EQ(cudaMalloc(&device, host.size() * sizeof(T)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  return device;
}

template <typename T>
std::vector<T> download(const T* device, size_t n) {
  std::vector<T> host(n);
  EXPECT_EQ(cudaMemcpy(host.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

uint16_t bf16_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return uint16_t(bits >> 16);
}

// Random weights of one format (finite values only), owned by the fixture's list of allocations.
struct Weights {
  cuda::DeviceMatrix matrix;
  std::vector<void*> allocations;

  Weights(cuda::WeightFormat format, int rows, int cols, std::mt19937& rng) {
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    std::uniform_int_distribution<uint32_t> word;
    const size_t n = size_t(rows) * cols;
    matrix.format = format;
    matrix.rows = rows;
    matrix.cols = cols;
    if (format == cuda::WeightFormat::Q4 || format == cuda::WeightFormat::NVFP4) {
      std::vector<uint32_t> codes(n / 8);
      for (uint32_t& c : codes) c = word(rng);
      matrix.data = keep(device_copy(codes));
    }
    if (format == cuda::WeightFormat::Q4) {
      std::vector<uint16_t> scales(n / 64), biases(n / 64);
      for (uint16_t& s : scales) s = bf16_bits(0.01f * uniform(rng));
      for (uint16_t& b : biases) b = bf16_bits(0.05f * uniform(rng));
      matrix.scales = keep(device_copy(scales));
      matrix.biases = keep(device_copy(biases));
      matrix.bits = 4;
    } else if (format == cuda::WeightFormat::NVFP4) {
      std::vector<uint8_t> block_scales(n / 16);
      for (uint8_t& s : block_scales) s = uint8_t(0x30 + word(rng) % 16);  // e4m3 0.5 … 1.9: finite
      matrix.block_scales = keep(device_copy(block_scales));
      matrix.tensor_scale = 0.03f;
    } else if (format == cuda::WeightFormat::BF16) {
      std::vector<uint16_t> values(n);
      for (uint16_t& v : values) v = bf16_bits(0.05f * uniform(rng));
      matrix.data = keep(device_copy(values));
    } else {
      std::vector<float> values(n);
      for (float& v : values) v = 0.05f * uniform(rng);
      matrix.data = keep(device_copy(values));
    }
  }
  ~Weights() {
    for (void* p : allocations) cudaFree(p);
  }
  template <typename T>
  T* keep(T* p) {
    allocations.push_back(p);
    return p;
  }
};

TEST(CudaDependentLaunch, ProductsWaitForTheirInput) {
  using F = cuda::WeightFormat;
  struct Case {
    F format;
    int rows, cols;
  };
  // Q4 one slice a warp and many (320 × 10240), BF16, F32 and NVFP4.
  const std::vector<Case> cases = {
      {F::Q4, 2560, 2560}, {F::Q4, 320, 10240}, {F::BF16, 640, 2048}, {F::F32, 300, 1024}, {F::NVFP4, 520, 2560}};
  std::mt19937 rng(21);
  std::normal_distribution<float> normal;
  for (const Case& c : cases)
    for (int rows = 1; rows <= 4; rows += 3) {
      const Weights w(c.format, c.rows, c.cols, rng);
      std::vector<float> x(size_t(rows) * c.cols);
      for (float& v : x) v = normal(rng);
      float* final_x = device_copy(x);
      float *input = nullptr, *y = nullptr;
      const size_t x_bytes = x.size() * sizeof(float), outputs = size_t(rows) * c.rows;
      ASSERT_EQ(cudaMalloc(&input, x_bytes), cudaSuccess);
      ASSERT_EQ(cudaMalloc(&y, outputs * sizeof(float)), cudaSuccess);
      cuda::linear(w.matrix, final_x, rows, y, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<float> expected = download(y, outputs);
      for (bool graph : {false, true}) {
        ASSERT_EQ(cudaMemset(input, 0xff, x_bytes), cudaSuccess);  // NaN until the producer writes it
        ASSERT_EQ(cudaMemset(y, 0xff, outputs * sizeof(float)), cudaSuccess);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        after_late_producer(final_x, input, x_bytes, graph,
                            [&](cudaStream_t stream) { cuda::linear(w.matrix, input, rows, y, stream); });
        EXPECT_EQ(std::memcmp(download(y, outputs).data(), expected.data(), outputs * sizeof(float)), 0)
            << int(c.format) << " " << c.rows << "x" << c.cols << ", " << rows << " rows, graph " << graph;
      }
      cudaFree(final_x);
      cudaFree(input);
      cudaFree(y);
    }
}

// A grouped launch whose descriptors the previous kernel writes (the MoE block's routing does) reads them only after
// the wait; with fixed descriptors (written before the pass) only the activations arrive late.
TEST(CudaDependentLaunch, GroupedProductsWaitForDescriptorsWrittenInThePass) {
  std::mt19937 rng(22);
  std::normal_distribution<float> normal;
  const Weights a(cuda::WeightFormat::Q4, 640, 2560, rng), b(cuda::WeightFormat::Q4, 2560, 2560, rng);
  const int rows = 2, cols = 2560;
  std::vector<float> x(size_t(rows) * cols);
  for (float& v : x) v = normal(rng);
  float* input = device_copy(x);
  float* final_x = device_copy(x);
  float* y = nullptr;
  const size_t outputs = size_t(rows) * (640 + 2560);
  ASSERT_EQ(cudaMalloc(&y, 2 * outputs * sizeof(float)), cudaSuccess);
  std::vector<cuda::GemvMatrix> host;
  for (const Weights* w : {&a, &b}) {
    cuda::GemvMatrix m;
    m.codes = static_cast<const uint32_t*>(w->matrix.data);
    m.scales = reinterpret_cast<const __nv_bfloat16*>(w->matrix.scales);
    m.biases = reinterpret_cast<const __nv_bfloat16*>(w->matrix.biases);
    m.rows = w->matrix.rows;
    m.cols = cols;
    m.x = input;
    m.y = y + (host.empty() ? 0 : size_t(rows) * 640);
    host.push_back(m);
  }
  cuda::GemvMatrix* final_descriptors = device_copy(host);
  cuda::GemvMatrix* descriptors = device_copy(host);
  ASSERT_EQ(cuda::gemv_q4(final_descriptors, 2, 2560, cols, rows, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> expected = download(y, outputs);
  for (bool graph : {false, true}) {
    ASSERT_EQ(cudaMemset(descriptors, 0, host.size() * sizeof(cuda::GemvMatrix)), cudaSuccess);  // rows 0: no work
    ASSERT_EQ(cudaMemset(y, 0xff, outputs * sizeof(float)), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    after_late_producer(
        final_descriptors, descriptors, host.size() * sizeof(cuda::GemvMatrix), graph,
        [&](cudaStream_t stream) { ASSERT_EQ(cuda::gemv_q4(descriptors, 2, 2560, cols, rows, stream), cudaSuccess); });
    EXPECT_EQ(std::memcmp(download(y, outputs).data(), expected.data(), outputs * sizeof(float)), 0)
        << "descriptors written in the pass, graph " << graph;

    ASSERT_EQ(cudaMemset(input, 0xff, x.size() * sizeof(float)), cudaSuccess);
    ASSERT_EQ(cudaMemset(y, 0xff, outputs * sizeof(float)), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    after_late_producer(final_x, input, x.size() * sizeof(float), graph, [&](cudaStream_t stream) {
      ASSERT_EQ(cuda::gemv_q4(final_descriptors, 2, 2560, cols, rows, stream, cuda::GemvDescriptors::fixed),
                cudaSuccess);
    });
    EXPECT_EQ(std::memcmp(download(y, outputs).data(), expected.data(), outputs * sizeof(float)), 0)
        << "fixed descriptors, graph " << graph;
  }
  cudaFree(input);
  cudaFree(final_x);
  cudaFree(y);
  cudaFree(descriptors);
  cudaFree(final_descriptors);
}

}  // namespace
}  // namespace vavilov
