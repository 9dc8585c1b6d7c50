// GPU decode GEMV against the memory-bandwidth limit, at Qwen3.8-Flash-Next shapes with synthetic Q4/BF16 weights.
//
// Measures the device's copy bandwidth (device-to-device, bytes read + written), checks the kernels against a
// double-precision host reference, then times grouped launches of real-geometry matrices (weights far larger than
// L2) for 1–4 activation rows. Prints a table and writes JSON (argument 1, default gemv.json).
// Build: nvcc -O3 -std=c++17 -arch=sm_90 -Isrc bench/cuda/gemv_bench.cu src/cuda/gemv.cu -o gemv_bench
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "cuda/gemv.cuh"

using vavilov::cuda::GemvMatrix;

#define CHECK(call)                                                                                   \
  do {                                                                                                \
    cudaError_t error_ = (call);                                                                      \
    if (error_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(error_)); \
      std::exit(1);                                                                                   \
    }                                                                                                 \
  } while (0)

namespace {

__device__ uint32_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  return uint32_t(x ^ (x >> 33));
}

__global__ void fill_words(uint32_t* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = mix(seed * 0x9e3779b97f4a7c15ull + i);
}

// bf16 values in [-scale, scale) from the same hash.
__global__ void fill_bf16(__nv_bfloat16* p, size_t n, uint64_t seed, float scale) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16(scale * (float(mix(seed * 0x9e3779b97f4a7c15ull + i) >> 8) / 8388608.0f - 1.0f));
}

__global__ void fill_floats(float* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = float(mix(seed * 0x9e3779b97f4a7c15ull + i) >> 8) / 8388608.0f - 1.0f;
}

template <typename T>
T* device_alloc(size_t n) {
  T* p = nullptr;
  CHECK(cudaMalloc(&p, n * sizeof(T)));
  return p;
}

float host_bf16(__nv_bfloat16 v) { return __bfloat162float(v); }

struct Shape {
  std::string name;
  int rows, cols, count;  // `count` distinct matrices in one launch
};

struct Buffers {
  std::vector<GemvMatrix> host;
  GemvMatrix* device = nullptr;
  size_t weight_bytes = 0;
  int max_rows = 0, max_cols = 0;
};

// `count` matrices per shape, each with its own weights, all sharing one activation buffer and one output buffer.
Buffers make_matrices(const std::vector<Shape>& shapes, bool q4, float* x, float* y, uint64_t seed) {
  Buffers b;
  for (const Shape& s : shapes)
    for (int i = 0; i < s.count; ++i) {
      GemvMatrix m;
      m.rows = s.rows;
      m.cols = s.cols;
      m.x = x;
      m.y = y;
      size_t n = size_t(s.rows) * s.cols;
      if (q4) {
        size_t groups = n / vavilov::cuda::kQuantGroup;
        auto* codes = device_alloc<uint32_t>(n / 8);
        auto* scales = device_alloc<__nv_bfloat16>(groups);
        auto* biases = device_alloc<__nv_bfloat16>(groups);
        fill_words<<<1024, 256>>>(codes, n / 8, ++seed);
        fill_bf16<<<256, 256>>>(scales, groups, ++seed, 0.01f);
        fill_bf16<<<256, 256>>>(biases, groups, ++seed, 0.05f);
        m.codes = codes;
        m.scales = scales;
        m.biases = biases;
        b.weight_bytes += n / 2 + 4 * groups;
      } else {
        auto* dense = device_alloc<__nv_bfloat16>(n);
        fill_bf16<<<1024, 256>>>(dense, n, ++seed, 0.05f);
        m.dense = dense;
        b.weight_bytes += 2 * n;
      }
      b.max_rows = std::max(b.max_rows, s.rows);
      b.max_cols = std::max(b.max_cols, s.cols);
      b.host.push_back(m);
    }
  CHECK(cudaGetLastError());
  b.device = device_alloc<GemvMatrix>(b.host.size());
  CHECK(cudaMemcpy(b.device, b.host.data(), b.host.size() * sizeof(GemvMatrix), cudaMemcpyHostToDevice));
  return b;
}

void free_matrices(Buffers& b) {
  for (auto& m : b.host) {
    cudaFree(const_cast<uint32_t*>(m.codes));
    cudaFree(const_cast<__nv_bfloat16*>(m.scales));
    cudaFree(const_cast<__nv_bfloat16*>(m.biases));
    cudaFree(const_cast<__nv_bfloat16*>(m.dense));
  }
  cudaFree(b.device);
}

cudaError_t launch(const Buffers& b, bool q4, int batch) {
  return q4 ? vavilov::cuda::gemv_q4(b.device, int(b.host.size()), b.max_rows, b.max_cols, batch, nullptr)
            : vavilov::cuda::gemv_bf16(b.device, int(b.host.size()), b.max_rows, batch, nullptr);
}

// Median time of `reps` launches, in ms.
float time_ms(const std::function<void()>& body, int reps) {
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) body();
  std::vector<float> times;
  for (int i = 0; i < reps; ++i) {
    CHECK(cudaEventRecord(start));
    body();
    CHECK(cudaEventRecord(stop));
    CHECK(cudaEventSynchronize(stop));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

double copy_bandwidth_gbs() {
  const size_t bytes = size_t(4) << 30;
  char* a = device_alloc<char>(bytes);
  char* b = device_alloc<char>(bytes);
  CHECK(cudaMemset(a, 1, bytes));
  float ms = time_ms([&] { CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); }, 10);
  cudaFree(a);
  cudaFree(b);
  return 2.0 * double(bytes) / (ms * 1e-3) / 1e9;
}

// Every output of a few random matrices against a double-precision host computation. Returns the worst relative
// error (max |Δ| / max |ref|).
double check(bool q4, int batch) {
  const std::vector<Shape> shapes = {{"a", 136, 512, 2}, {"b", 40, 1280, 1}};
  const int max_cols = 1280, max_rows = 136;
  float* x = device_alloc<float>(size_t(batch) * max_cols);
  fill_floats<<<64, 256>>>(x, size_t(batch) * max_cols, 77);
  std::vector<float*> outputs;
  Buffers b = make_matrices(shapes, q4, x, nullptr, 1000 + batch);
  for (auto& m : b.host) {
    m.y = device_alloc<float>(size_t(batch) * max_rows);
    CHECK(cudaMemset(m.y, 0xff, size_t(batch) * max_rows * sizeof(float)));  // poison: every output must be written
    outputs.push_back(m.y);
  }
  CHECK(cudaMemcpy(b.device, b.host.data(), b.host.size() * sizeof(GemvMatrix), cudaMemcpyHostToDevice));
  CHECK(launch(b, q4, batch));
  CHECK(cudaDeviceSynchronize());
  std::vector<float> hx(size_t(batch) * max_cols);
  CHECK(cudaMemcpy(hx.data(), x, hx.size() * 4, cudaMemcpyDeviceToHost));
  double worst = 0;
  for (const GemvMatrix& m : b.host) {
    size_t n = size_t(m.rows) * m.cols, groups = n / 64;
    std::vector<uint32_t> codes(q4 ? n / 8 : 0);
    std::vector<__nv_bfloat16> scales(q4 ? groups : 0), biases(q4 ? groups : 0), dense(q4 ? 0 : n);
    if (q4) {
      CHECK(cudaMemcpy(codes.data(), m.codes, codes.size() * 4, cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(scales.data(), m.scales, groups * 2, cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(biases.data(), m.biases, groups * 2, cudaMemcpyDeviceToHost));
    } else {
      CHECK(cudaMemcpy(dense.data(), m.dense, n * 2, cudaMemcpyDeviceToHost));
    }
    std::vector<float> got(size_t(batch) * m.rows);
    CHECK(cudaMemcpy(got.data(), m.y, got.size() * 4, cudaMemcpyDeviceToHost));
    double max_diff = 0, max_ref = 0;
    for (int bi = 0; bi < batch; ++bi)
      for (int r = 0; r < m.rows; ++r) {
        double ref = 0;
        for (int c = 0; c < m.cols; ++c) {
          size_t i = size_t(r) * m.cols + c;
          double w = q4 ? double(host_bf16(scales[i / 64])) * double((codes[i / 8] >> (4 * (i % 8))) & 0xf) +
                              double(host_bf16(biases[i / 64]))
                        : double(host_bf16(dense[i]));
          ref += w * double(hx[size_t(bi) * m.cols + c]);
        }
        double value = got[size_t(bi) * m.rows + r];
        max_diff = std::isnan(value) ? INFINITY : std::max(max_diff, std::fabs(value - ref));
        max_ref = std::max(max_ref, std::fabs(ref));
      }
    worst = std::max(worst, max_diff / max_ref);
  }
  for (float* p : outputs) cudaFree(p);
  free_matrices(b);
  cudaFree(x);
  return worst;
}

}  // namespace

int main(int argc, char** argv) {
  const char* out_path = argc > 1 ? argv[1] : "gemv.json";
  cudaDeviceProp props;
  CHECK(cudaGetDeviceProperties(&props, 0));
  const double copy = copy_bandwidth_gbs();
  std::printf("device %s, %d SMs, L2 %d MB; copy bandwidth %.0f GB/s (read + write)\n", props.name,
              props.multiProcessorCount, props.l2CacheSize >> 20, copy);

  bool correct = true;
  for (bool q4 : {true, false})
    for (int batch = 1; batch <= 4; ++batch) {
      double error = check(q4, batch);
      bool ok = error <= 1e-5;  // fp32 accumulation of ≤1280 products against double
      correct &= ok;
      std::printf("check %-4s batch %d: rel err %.2e %s\n", q4 ? "q4" : "bf16", batch, error, ok ? "ok" : "FAIL");
    }

  // Real Flash-Next shapes (hidden 2560): matrices of all layers in one launch, far more bytes than L2.
  struct Case {
    std::string name;
    bool q4;
    std::vector<Shape> shapes;
  };
  const std::vector<Case> cases = {
      {"gdn in_proj_qkv x36 (q4)", true, {{"qkv", 10240, 2560, 36}}},
      {"gdn out_proj x36 (q4)", true, {{"out", 2560, 6144, 36}}},
      {"routed experts 10/layer x48 (q4)", true, {{"gate", 640, 2560, 480}, {"up", 640, 2560, 480}, {"down", 2560, 640, 480}}},
      {"lm_head (q4)", true, {{"lm_head", 248320, 2560, 1}}},
      {"gdn in_proj_qkv x36 (bf16)", false, {{"qkv", 10240, 2560, 36}}},
  };
  float* x = device_alloc<float>(size_t(4) * 8192);
  float* y = device_alloc<float>(size_t(4) * 248320);
  fill_floats<<<64, 256>>>(x, size_t(4) * 8192, 5);
  FILE* json = std::fopen(out_path, "w");
  std::fprintf(json, "{\n  \"gpu\": \"%s\",\n  \"copy_bandwidth_gbs\": %.1f,\n  \"correct\": %s,\n  \"cases\": [\n",
               props.name, copy, correct ? "true" : "false");
  std::printf("\n%-36s %6s %10s %10s %9s %8s\n", "case", "rows", "MB", "us", "GB/s", "of copy");
  bool first = true;
  for (const Case& c : cases) {
    Buffers b = make_matrices(c.shapes, c.q4, x, y, 42);
    for (int batch = 1; batch <= 4; ++batch) {
      float ms = time_ms([&] { CHECK(launch(b, c.q4, batch)); }, 20);
      double gbs = double(b.weight_bytes) / (ms * 1e-3) / 1e9;
      std::printf("%-36s %6d %10.1f %10.1f %9.0f %7.1f%%\n", c.name.c_str(), batch, b.weight_bytes / 1e6, ms * 1e3,
                  gbs, 100.0 * gbs / copy);
      std::fprintf(json, "%s    {\"case\": \"%s\", \"rows\": %d, \"weight_bytes\": %zu, \"us\": %.2f, \"gbs\": %.1f, "
                   "\"fraction_of_copy\": %.4f}", first ? "" : ",\n", c.name.c_str(), batch, b.weight_bytes,
                   ms * 1e3, gbs, gbs / copy);
      first = false;
    }
    free_matrices(b);
  }
  std::fprintf(json, "\n  ]\n}\n");
  std::fclose(json);
  return correct ? 0 : 1;
}
