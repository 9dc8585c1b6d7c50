// Decode-product speed of every GPU weight format through cuda::linear (the path the model takes) at the shapes of
// Flash-Next's matrices: microseconds per product and weight bytes per second, for 1–4 activation rows. Enough
// copies of each matrix are cycled that every product streams from HBM, not from the 50 MB L2.
// Usage (on the GPU machine): vavilov_formats_bench [OUT.json] [LABEL]
#include <cuda_runtime.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cuda/device_matrix.h"
#include "cuda/linear.cuh"

namespace {

using vavilov::cuda::DeviceMatrix;
using vavilov::cuda::WeightFormat;

void check(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return;
  std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(status));
  std::exit(1);
}

void* device_bytes(size_t bytes, int fill) {
  void* p = nullptr;
  check(cudaMalloc(&p, bytes), "cudaMalloc");
  check(cudaMemset(p, fill, bytes), "cudaMemset");
  return p;
}

struct Format {
  const char* name;
  WeightFormat format;
  int bits;
};

// One matrix of `format` whose bytes are a fixed pattern (speed does not depend on the values): codes 0x37, affine
// scales and biases 0x3c3c (bf16 0.0115), e4m3 block scales 0x38 (1.0).
DeviceMatrix make(const Format& f, int rows, int cols, std::vector<void*>& allocations) {
  DeviceMatrix m;
  m.format = f.format;
  m.rows = rows;
  m.cols = cols;
  m.bits = f.bits;
  const size_t n = size_t(rows) * size_t(cols);
  auto alloc = [&](size_t bytes, int fill) {
    allocations.push_back(device_bytes(bytes, fill));
    return allocations.back();
  };
  switch (f.format) {
    case WeightFormat::BF16:
      m.data = alloc(n * 2, 0x3c);
      break;
    case WeightFormat::F8:
      m.data = alloc(n, 0x37);
      m.tensor_scale = 0.01f;
      break;
    case WeightFormat::NVFP4:
      m.data = alloc(n / 2, 0x37);
      m.block_scales = static_cast<const uint8_t*>(alloc(n / 16, 0x38));
      m.tensor_scale = 0.01f;
      break;
    default:  // affine
      m.data = alloc(n * size_t(f.bits) / 8, 0x37);
      m.scales = static_cast<const uint16_t*>(alloc(n / 64 * 2, 0x3c));
      m.biases = static_cast<const uint16_t*>(alloc(n / 64 * 2, 0x3c));
      break;
  }
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<Format> formats = {
      {"bf16", WeightFormat::BF16, 16}, {"q4", WeightFormat::Q4, 4},          {"q3", WeightFormat::Q3, 3},
      {"q2", WeightFormat::Q2, 2},      {"affine8", WeightFormat::Affine, 8}, {"nvfp4", WeightFormat::NVFP4, 4},
      {"fp8", WeightFormat::F8, 8},
  };
  struct Shape {
    const char* what;
    int rows, cols;
  };
  const std::vector<Shape> shapes = {{"expert gate/up", 640, 2560},
                                     {"expert down", 2560, 640},
                                     {"GDN in_qkv", 10240, 2560},
                                     {"GDN out", 2560, 6144},
                                     {"lm_head", 248320, 2560}};
  constexpr size_t kStreamBytes = size_t(256) << 20;  // cycled per shape: 5x the L2
  constexpr int kReps = 60;
  float *x = nullptr, *y = nullptr;
  check(cudaMalloc(&x, 4 * 10240 * sizeof(float)), "x");
  check(cudaMemset(x, 0, 4 * 10240 * sizeof(float)), "x");
  check(cudaMalloc(&y, 4 * size_t(248320) * sizeof(float)), "y");
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "event");
  check(cudaEventCreate(&stop), "event");
  nlohmann::json results = nlohmann::json::array();
  for (const Shape& shape : shapes)
    for (const Format& format : formats) {
      std::vector<void*> allocations;
      std::vector<DeviceMatrix> copies = {make(format, shape.rows, shape.cols, allocations)};
      const double bytes = vavilov::cuda::matrix_bytes(copies.front());
      while (double(copies.size()) * bytes < double(kStreamBytes))
        copies.push_back(make(format, shape.rows, shape.cols, allocations));
      nlohmann::json per_rows;
      for (int rows = 1; rows <= 4; ++rows) {
        for (const DeviceMatrix& m : copies) vavilov::cuda::linear(m, x, rows, y, nullptr);  // warm-up
        check(cudaEventRecord(start), "record");
        for (int i = 0; i < kReps; ++i) vavilov::cuda::linear(copies[size_t(i) % copies.size()], x, rows, y, nullptr);
        check(cudaEventRecord(stop), "record");
        check(cudaEventSynchronize(stop), "product");
        float ms = 0;
        check(cudaEventElapsedTime(&ms, start, stop), "elapsed");
        const double us = 1e3 * double(ms) / kReps;
        per_rows[std::to_string(rows)] = {{"us", us}, {"weight_gbs", bytes / us * 1e-3}};
      }
      results.push_back({{"shape", shape.what},
                         {"rows", shape.rows},
                         {"cols", shape.cols},
                         {"format", format.name},
                         {"weight_bytes", bytes},
                         {"per_activation_rows", per_rows}});
      for (void* p : allocations) cudaFree(p);
      std::fprintf(stderr, "%-15s %-8s 1 row: %8.2f us %7.0f GB/s\n", shape.what, format.name,
                   per_rows["1"]["us"].get<double>(), per_rows["1"]["weight_gbs"].get<double>());
    }
  cudaDeviceProp properties{};
  check(cudaGetDeviceProperties(&properties, 0), "properties");
  const nlohmann::json out = {{"gpu", properties.name},
                              {"label", argc > 2 ? argv[2] : "unknown"},
                              {"what",
                               "cuda::linear per weight format, back-to-back launches on one stream (launch "
                               "gaps included), matrices cycled through 256 MB so weights come from HBM"},
                              {"results", results}};
  if (argc > 1) {
    std::ofstream(argv[1]) << out.dump(2) << "\n";
  } else {
    std::printf("%s\n", out.dump(2).c_str());
  }
  return 0;
}
