#pragma once
// Weight matrices on the device for the GPU kernel tests, with the exact fp32 values the GPU sees, so that host
// references in double precision can use them.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "cuda/device_matrix.h"
#include "model/quantize.h"

namespace vavilov::test {

// Device allocations of one test, freed at its end.
class DeviceMemory {
 public:
  ~DeviceMemory() {
    for (void* p : blocks_) cudaFree(p);
  }
  template <typename T>
  T* zeros(size_t count) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemset(p, 0, std::max<size_t>(count, 1) * sizeof(T)), cudaSuccess);
    blocks_.push_back(p);
    return static_cast<T*>(p);
  }
  template <typename T>
  T* copy(const std::vector<T>& host) {
    T* p = zeros<T>(host.size());
    EXPECT_EQ(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    return p;
  }

 private:
  std::vector<void*> blocks_;
};

// `count` values from the device.
template <typename T>
std::vector<T> download(const T* device, size_t count) {
  std::vector<T> host(count);
  EXPECT_EQ(cudaMemcpy(host.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

// A weight matrix on the device and the exact fp32 values the GPU sees (after quantization or bf16 rounding).
struct TestMatrix {
  cuda::DeviceMatrix device;
  std::vector<float> exact;  // [rows, cols]
  int rows = 0, cols = 0;
  double at(int r, int c) const { return exact[size_t(r) * size_t(cols) + size_t(c)]; }
};

inline TestMatrix make_matrix(DeviceMemory& memory, cuda::WeightFormat format, const std::vector<float>& w, int rows,
                              int cols) {
  TestMatrix m;
  m.rows = rows;
  m.cols = cols;
  m.exact.resize(w.size());
  m.device.format = format;
  m.device.rows = rows;
  m.device.cols = cols;
  if (format == cuda::WeightFormat::Q4 || format == cuda::WeightFormat::Q3 || format == cuda::WeightFormat::Q2) {
    const int bits = format == cuda::WeightFormat::Q4 ? 4 : format == cuda::WeightFormat::Q3 ? 3 : 2;
    QuantizedRows q = quantize_rows(w.data(), rows, cols, bits);
    Matrix host{"w",  DType::BF16,     rows,           cols, reinterpret_cast<const std::byte*>(q.codes.data()),
                bits, q.scales.data(), q.biases.data()};
    for (int r = 0; r < rows; ++r) dequantize_row(host, r, m.exact.data() + size_t(r) * size_t(cols));
    m.device.bits = bits;
    m.device.data = memory.copy(q.codes);
    m.device.scales = memory.copy(q.scales);
    m.device.biases = memory.copy(q.biases);
  } else if (format == cuda::WeightFormat::BF16) {
    std::vector<uint16_t> bits(w.size());
    for (size_t i = 0; i < w.size(); ++i) m.exact[i] = bf16_to_f32(bits[i] = f32_to_bf16(w[i]));
    m.device.data = memory.copy(bits);
  } else {
    m.exact = w;
    m.device.data = memory.copy(w);
  }
  return m;
}

inline std::vector<float> normal_values(std::mt19937& rng, size_t n, float scale) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

}  // namespace vavilov::test
