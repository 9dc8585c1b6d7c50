// GPU decode GEMV against the memory-bandwidth limit, at Qwen3.8-Flash-Next shapes with synthetic Q4/Q3/Q2/BF16
// weights.
//
// Measures the device's copy bandwidth (device-to-device, bytes read + written), checks every kernel against a
// double-precision host reference, then times grouped launches of real-geometry matrices (weights far larger than
// L2) for 1–4 activation rows, and single-layer launches back to back over rotating copies (so L2 holds none of
// them). Then cuda::linear() itself at every decode shape of Flash-Next: a CUDA graph of calls over rotating copies
// (at least 200 MB of them where 2048 copies reach it), so the time per call is the kernel's plus the graph's gap
// between kernels (~1 µs), as in a captured decode step, alone and each call after a norm-like kernel that writes its
// input (the GEMV kernels are dependent launches that stream their weights while such a kernel runs: launch.cuh).
// With --sweep, also every split of the Q4 GEMV at a few shapes. With --step, only the products of a decode step as the
// step runs them (a layer's grouped input products, out / o, lm_head), each after a dependent norm-like kernel that
// writes its input. Prints a table and writes JSON.
// Usage: gemv_bench OUT.json [LABEL] [--linear-only | --sweep | --step]   (LABEL: the commit / kernel variant)
// VAVILOV_PDL=0 launches the GEMV kernels as ordinary ones (the comparison without dependent launches).
// Build: the CMake target vavilov_gemv_bench (with bench/cuda/bench_product_group.cpp and the engine's library).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "bench_product_group.h"
#include "check.cuh"
#include "cuda/gemv.cuh"
#include "cuda/launch.cuh"
#include "cuda/linear.cuh"
#include "event_times.cuh"

using vavilov::cuda::GemvMatrix;

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

// Like fill_floats, times 2^e with e drawn per group of 64 in [-16, 24] (beyond fp16's range on both sides) plus per
// element in [-6, 6]: the quantized kernels scale each group into fp16's range, and must stay exact doing so.
__global__ void fill_wide_floats(float* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const int exponent = int(mix(seed + i / 64) % 41) - 16 + int(mix(~seed - i) % 13) - 6;
    p[i] = ldexpf(float(mix(seed * 0x9e3779b97f4a7c15ull + i) >> 8) / 8388608.0f - 1.0f, exponent);
  }
}

template <typename T>
T* device_alloc(size_t n) {
  T* p = nullptr;
  CHECK(cudaMalloc(&p, n * sizeof(T)));
  return p;
}

float host_bf16(__nv_bfloat16 v) { return __bfloat162float(v); }

enum class Format { q4, q3, q2, bf16 };

int bits_of(Format f) { return f == Format::q4 ? 4 : f == Format::q3 ? 3 : f == Format::q2 ? 2 : 16; }
const char* name_of(Format f) {
  return f == Format::q4 ? "q4" : f == Format::q3 ? "q3" : f == Format::q2 ? "q2" : "bf16";
}

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
Buffers make_matrices(const std::vector<Shape>& shapes, Format format, float* x, float* y, uint64_t seed) {
  Buffers b;
  const int bits = bits_of(format);
  for (const Shape& s : shapes)
    for (int i = 0; i < s.count; ++i) {
      GemvMatrix m;
      m.rows = s.rows;
      m.cols = s.cols;
      m.x = x;
      m.y = y;
      size_t n = size_t(s.rows) * s.cols;
      if (format != Format::bf16) {
        size_t groups = n / vavilov::cuda::kQuantGroup, words = n * bits / 32;
        auto* codes = device_alloc<uint32_t>(words);
        auto* scales = device_alloc<__nv_bfloat16>(groups);
        auto* biases = device_alloc<__nv_bfloat16>(groups);
        fill_words<<<1024, 256>>>(codes, words, ++seed);
        fill_bf16<<<256, 256>>>(scales, groups, ++seed, 0.01f);
        fill_bf16<<<256, 256>>>(biases, groups, ++seed, 0.05f);
        m.codes = codes;
        m.scales = scales;
        m.biases = biases;
        b.weight_bytes += 4 * words + 4 * groups;
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

cudaError_t launch(const Buffers& b, Format format, int batch) {
  const int count = int(b.host.size());
  switch (format) {
    case Format::q4:
      return vavilov::cuda::gemv_q4(b.device, count, b.max_rows, b.max_cols, batch, nullptr);
    case Format::q3:
      return vavilov::cuda::gemv_q3(b.device, count, b.max_rows, b.max_cols, batch, nullptr);
    case Format::q2:
      return vavilov::cuda::gemv_q2(b.device, count, b.max_rows, b.max_cols, batch, nullptr);
    case Format::bf16:
      return vavilov::cuda::gemv_bf16(b.device, count, b.max_rows, b.max_cols, batch, nullptr);
  }
  return cudaErrorInvalidValue;
}

// Median time of `reps` runs of body(rep), in ms.
float time_ms(const std::function<void(int)>& body, int reps) {
  for (int i = 0; i < 3; ++i) body(i);
  return median(event_times_ms(nullptr, reps, body));
}

double copy_bandwidth_gbs() {
  const size_t bytes = size_t(4) << 30;
  char* a = device_alloc<char>(bytes);
  char* b = device_alloc<char>(bytes);
  CHECK(cudaMemset(a, 1, bytes));
  float ms = time_ms([&](int) { CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); }, 10);
  cudaFree(a);
  cudaFree(b);
  return 2.0 * double(bytes) / (ms * 1e-3) / 1e9;
}

// Code i of a row packed densely least-significant bit first (as src/model/quantize.cpp writes it).
uint32_t host_code(const uint32_t* row, size_t i, int bits) {
  const size_t bit = i * bits;
  uint64_t window = row[bit / 32];
  if (bit % 32 + bits > 32) window |= uint64_t(row[bit / 32 + 1]) << 32;
  return uint32_t(window >> (bit % 32)) & ((1u << bits) - 1);
}

// Every output of a few random matrices against a double-precision host computation, with activations spread over
// 2^-22..2^30. Returns the worst relative error (max |Δ| / max |ref| per matrix).
double check(Format format, int batch) {
  // Rows not a multiple of 16 and an odd number of groups (320 columns) exercise the edges of the tiling.
  const std::vector<Shape> shapes = {{"a", 136, 512, 2}, {"b", 40, 1280, 1}, {"c", 21, 320, 1}};
  const int max_cols = 1280, max_rows = 136, bits = bits_of(format);
  float* x = device_alloc<float>(size_t(batch) * max_cols);
  fill_wide_floats<<<64, 256>>>(x, size_t(batch) * max_cols, 77 + batch);
  std::vector<float*> outputs;
  Buffers b = make_matrices(shapes, format, x, nullptr, 1000 + 10 * batch + bits);
  for (auto& m : b.host) {
    m.y = device_alloc<float>(size_t(batch) * max_rows);
    CHECK(cudaMemset(m.y, 0xff, size_t(batch) * max_rows * sizeof(float)));  // poison: every output must be written
    outputs.push_back(m.y);
  }
  CHECK(cudaMemcpy(b.device, b.host.data(), b.host.size() * sizeof(GemvMatrix), cudaMemcpyHostToDevice));
  CHECK(launch(b, format, batch));
  CHECK(cudaDeviceSynchronize());
  std::vector<float> hx(size_t(batch) * max_cols);
  CHECK(cudaMemcpy(hx.data(), x, hx.size() * 4, cudaMemcpyDeviceToHost));
  double worst = 0;
  for (const GemvMatrix& m : b.host) {
    const size_t n = size_t(m.rows) * m.cols, groups = n / 64, row_words = size_t(m.cols) * bits / 32;
    const bool quantized = format != Format::bf16;
    std::vector<uint32_t> codes(quantized ? m.rows * row_words : 0);
    std::vector<__nv_bfloat16> scales(quantized ? groups : 0), biases(quantized ? groups : 0), dense(quantized ? 0 : n);
    if (quantized) {
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
          double w = quantized ? double(host_bf16(scales[i / 64])) * host_code(&codes[r * row_words], c, bits) +
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

// One decode shape of cuda::linear.
struct LinearShape {
  std::string name;
  vavilov::cuda::WeightFormat format;
  int rows, cols;
};

size_t round_up(size_t n) { return (n + 255) / 256 * 256; }

// What a decode step launches before most products: a norm of the activations (one block a row, as
// cuda::rms_norm), which lets the next kernel start early (launch.cuh) and writes the product's input.
__device__ void norm_like_body(const float* source, int cols, float* x) {
  __shared__ float partial[32];
  const float* row = source + size_t(blockIdx.x) * cols;
  float sum = 0.0f;
  for (int i = threadIdx.x; i < cols; i += blockDim.x) sum += row[i] * row[i];
  for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = sum;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < int(blockDim.x / 32); ++w) total += partial[w];
  const float scale = rsqrtf(total / float(cols) + 1e-6f);
  for (int i = threadIdx.x; i < cols; i += blockDim.x) x[size_t(blockIdx.x) * cols + i] = row[i] * scale;
}

__global__ void norm_like_kernel(const float* source, int cols, float* x) {
  cudaTriggerProgrammaticLaunchCompletion();
  norm_like_body(source, cols, x);
}

// The same as a dependent launch: it waits before it writes x, which the product before it may still read.
__global__ void dependent_norm_like_kernel(const float* source, int cols, float* x) {
  vavilov::cuda::wait_for_producers();
  vavilov::cuda::allow_dependents();
  norm_like_body(source, cols, x);
}

void norm_like(const float* source, int batch, int cols, float* x, cudaStream_t stream, bool dependent = false) {
  const int threads = std::clamp((cols / 4 + 31) / 32 * 32, 128, 1024);
  if (dependent)
    CHECK(vavilov::cuda::launch_dependent(dependent_norm_like_kernel, dim3(batch), dim3(threads), 0, stream, source,
                                          cols, x));
  else
    norm_like_kernel<<<batch, threads, 0, stream>>>(source, cols, x);
}

// `copies` rotating copies of one shape's weights (at least 200 MB of them where 2048 copies reach it, so that L2
// holds none of them when a graph walks through them).
struct LinearPool {
  std::vector<vavilov::cuda::DeviceMatrix> matrices;
  size_t weight_bytes = 0;
  char* memory = nullptr;
};

LinearPool make_pool(const LinearShape& shape) {
  using vavilov::cuda::WeightFormat;
  const size_t n = size_t(shape.rows) * shape.cols;
  const size_t data_bytes = shape.format == WeightFormat::Q4     ? n / 2
                            : shape.format == WeightFormat::BF16 ? 2 * n
                                                                 : 4 * n;
  const size_t affine_bytes = shape.format == WeightFormat::Q4 ? n / 64 * 2 : 0;
  LinearPool pool;
  pool.weight_bytes = data_bytes + 2 * affine_bytes;
  const int copies = int(std::clamp<size_t>((size_t(200) << 20) / pool.weight_bytes + 1, 1, 2048));
  const size_t stride = round_up(data_bytes) + 2 * round_up(affine_bytes);
  pool.memory = device_alloc<char>(stride * copies);
  fill_words<<<1024, 256>>>(reinterpret_cast<uint32_t*>(pool.memory), stride * copies / 4, 7);  // codes, overwritten
  pool.matrices.resize(static_cast<size_t>(copies));
  for (int i = 0; i < copies; ++i) {
    auto& m = pool.matrices[size_t(i)];
    char* base = pool.memory + stride * i;
    m.format = shape.format;
    m.rows = shape.rows;
    m.cols = shape.cols;
    m.data = base;
    if (shape.format == WeightFormat::Q4) {
      auto* scales = reinterpret_cast<__nv_bfloat16*>(base + round_up(data_bytes));
      auto* biases = reinterpret_cast<__nv_bfloat16*>(base + round_up(data_bytes) + round_up(affine_bytes));
      fill_bf16<<<64, 256>>>(scales, n / 64, 100 + i, 0.01f);
      fill_bf16<<<64, 256>>>(biases, n / 64, 200 + i, 0.05f);
      m.scales = reinterpret_cast<const uint16_t*>(scales);
      m.biases = reinterpret_cast<const uint16_t*>(biases);
    } else if (shape.format == WeightFormat::BF16) {
      fill_bf16<<<256, 256>>>(reinterpret_cast<__nv_bfloat16*>(base), n, 300 + i, 0.05f);
    } else {
      fill_floats<<<256, 256>>>(reinterpret_cast<float*>(base), n, 400 + i);
    }
  }
  CHECK(cudaGetLastError());
  return pool;
}

// A CUDA graph of `calls` launches of body(stream, i), i < calls; returns µs per call (median of 10 replays).
float time_graph(int calls, const std::function<void(cudaStream_t, int)>& body) {
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  body(stream, 0);  // first use outside the capture
  CHECK(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
  for (int i = 0; i < calls; ++i) body(stream, i);
  CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec;
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const auto replay = [&](int) { CHECK(cudaGraphLaunch(exec, stream)); };
  for (int rep = 0; rep < 3; ++rep) replay(rep);  // untimed
  const float replay_ms = median(event_times_ms(stream, 10, replay));
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  CHECK(cudaStreamDestroy(stream));
  return replay_ms * 1e3f / float(calls);
}

// Every cuda::linear shape of a Flash-Next decode step (src/cuda/synthetic.cpp), Q4 as the model stores them, and the
// hyper-connection matrices also dense (checkpoints may keep them unquantized). Each is timed twice: calls back to
// back ("us"), each call after a norm-like kernel that writes its input, as in a decode step ("after_norm_us"; a graph
// of the norms alone: "norm_us"), and after the same norm launched as a dependent launch too
// ("after_dependent_norm_us": what converting the step's other kernels would add).
void bench_linear(FILE* json, double copy) {
  using vavilov::cuda::WeightFormat;
  const std::vector<LinearShape> shapes = {
      {"gdn in_qkv, ple key", WeightFormat::Q4, 10240, 2560},
      {"gdn in_z", WeightFormat::Q4, 6144, 2560},
      {"gdn in_b / in_a", WeightFormat::Q4, 48, 2560},
      {"gdn out, attn o", WeightFormat::Q4, 2560, 6144},
      {"attn q", WeightFormat::Q4, 12288, 2560},
      {"attn k / v, router", WeightFormat::Q4, 512, 2560},
      {"indexer qk, shared gate/up", WeightFormat::Q4, 640, 2560},
      {"shared down", WeightFormat::Q4, 2560, 640},
      {"shared gate", WeightFormat::Q4, 1, 2560},
      {"hc mix_down", WeightFormat::Q4, 320, 10240},
      {"hc mix_up", WeightFormat::Q4, 10240, 320},
      {"hc inject", WeightFormat::Q4, 4, 10240},
      {"lm_head", WeightFormat::Q4, 248320, 2560},
      {"mtp fc, ple value", WeightFormat::Q4, 2560, 2560},
      {"mtp fc hidden (wide)", WeightFormat::Q4, 2560, 10240},
      {"hc mix_down bf16", WeightFormat::BF16, 320, 10240},
      {"hc inject bf16", WeightFormat::BF16, 4, 10240},
      {"hc mix_down f32", WeightFormat::F32, 320, 10240},
      {"hc inject f32", WeightFormat::F32, 4, 10240},
  };
  const char* format_names[] = {"f32", "bf16", "q4"};
  float* x = device_alloc<float>(size_t(4) * 10240);
  float* source = device_alloc<float>(size_t(4) * 10240);
  float* y = device_alloc<float>(size_t(4) * 248320);
  fill_floats<<<64, 256>>>(source, size_t(4) * 10240, 9);
  fill_floats<<<64, 256>>>(x, size_t(4) * 10240, 9);
  std::printf(
      "\ncuda::linear, graph of calls over rotating copies (alone / each after a norm, minus the norm)\n"
      "%-28s %-4s %6s %6s %5s %5s %8s %8s %8s %8s %7s %8s\n",
      "shape", "fmt", "rows", "cols", "batch", "copies", "MB", "us", "+norm", "norm", "GB/s", "of copy");
  std::fprintf(json, "  \"linear\": [\n");
  bool first = true;
  for (const LinearShape& shape : shapes) {
    LinearPool pool = make_pool(shape);
    const int copies = int(pool.matrices.size());
    for (int batch : {1, 3, 4}) {
      if (batch == 3 && shape.rows != 2560) continue;  // 3 rows: the products that run at 13-35 % (gdn out, ...)
      const float us = time_graph(copies, [&](cudaStream_t stream, int i) {
        vavilov::cuda::linear(pool.matrices[size_t(i)], x, batch, y, stream);
      });
      const float pair_us = time_graph(copies, [&](cudaStream_t stream, int i) {
        norm_like(source, batch, shape.cols, x, stream);
        vavilov::cuda::linear(pool.matrices[size_t(i)], x, batch, y, stream);
      });
      const float norm_us =
          time_graph(copies, [&](cudaStream_t stream, int) { norm_like(source, batch, shape.cols, x, stream); });
      // What converting the other kernels to dependent launches would add: the norm's launch overlaps the product.
      const float dependent_pair_us = time_graph(copies, [&](cudaStream_t stream, int i) {
        norm_like(source, batch, shape.cols, x, stream, true);
        vavilov::cuda::linear(pool.matrices[size_t(i)], x, batch, y, stream);
      });
      const size_t bytes = pool.weight_bytes;
      const double gbs = double(bytes) / (us * 1e-6) / 1e9;
      const char* format = format_names[int(shape.format)];
      std::printf("%-28s %-4s %6d %6d %5d %5d %8.2f %8.2f %8.2f %8.2f %8.2f %7.0f %7.1f%%\n", shape.name.c_str(),
                  format, shape.rows, shape.cols, batch, copies, bytes / 1e6, us, pair_us, norm_us, dependent_pair_us,
                  gbs, 100.0 * gbs / copy);
      std::fprintf(json,
                   "%s    {\"shape\": \"%s\", \"format\": \"%s\", \"rows\": %d, \"cols\": %d, \"batch\": %d, "
                   "\"copies\": %d, \"weight_bytes\": %zu, \"us\": %.3f, \"gbs\": %.1f, \"fraction_of_copy\": %.4f, "
                   "\"after_norm_us\": %.3f, \"norm_us\": %.3f, \"after_dependent_norm_us\": %.3f}",
                   first ? "" : ",\n", shape.name.c_str(), format, shape.rows, shape.cols, batch, copies, bytes, us,
                   gbs, gbs / copy, pair_us, norm_us, dependent_pair_us);
      first = false;
    }
    cudaFree(pool.memory);
  }
  std::fprintf(json, "\n  ]");
  cudaFree(x);
  cudaFree(source);
  cudaFree(y);
}

// The quantized GEMV of one Q4 matrix after a norm, for every split of up to 16 warps a block, against the split
// gemv_quant_split chooses (for tuning it).
void sweep_splits(FILE* json) {
  using vavilov::cuda::GemvSplit;
  const std::vector<LinearShape> shapes = {
      {"gdn out, attn o", vavilov::cuda::WeightFormat::Q4, 2560, 6144},
      {"mtp fc, ple value", vavilov::cuda::WeightFormat::Q4, 2560, 2560},
      {"gdn in_z", vavilov::cuda::WeightFormat::Q4, 6144, 2560},
      {"gdn in_qkv, ple key", vavilov::cuda::WeightFormat::Q4, 10240, 2560},
      {"hc mix_down", vavilov::cuda::WeightFormat::Q4, 320, 10240},
      {"shared down", vavilov::cuda::WeightFormat::Q4, 2560, 640},
      {"attn k / v, router", vavilov::cuda::WeightFormat::Q4, 512, 2560},
  };
  float* x = device_alloc<float>(size_t(4) * 10240);
  float* source = device_alloc<float>(size_t(4) * 10240);
  float* y = device_alloc<float>(size_t(4) * 12288);
  fill_floats<<<64, 256>>>(source, size_t(4) * 10240, 11);
  std::printf("\nsplit sweep (Q4, each call after a norm): shape batch chosen -> best\n");
  std::fprintf(json, ",\n  \"split_sweep\": [\n");
  bool first = true;
  for (const LinearShape& shape : shapes) {
    LinearPool pool = make_pool(shape);
    std::vector<GemvMatrix> matrices;
    for (const auto& d : pool.matrices) {
      GemvMatrix m;
      m.codes = static_cast<const uint32_t*>(d.data);
      m.scales = reinterpret_cast<const __nv_bfloat16*>(d.scales);
      m.biases = reinterpret_cast<const __nv_bfloat16*>(d.biases);
      m.rows = d.rows;
      m.cols = d.cols;
      m.x = x;
      m.y = y;
      matrices.push_back(m);
    }
    for (int batch : {1, 2, 3, 4}) {
      const GemvSplit chosen = vavilov::cuda::gemv_quant_split(shape.rows, shape.cols, 1, batch);
      float chosen_us = 0, best_us = 1e30f;
      GemvSplit best;
      std::vector<GemvSplit> candidates = {chosen};
      for (int tiles : {1, 2, 4, 8})
        for (int splits : {1, 2, 3, 4, 6, 8, 12, 16})
          if (tiles * splits <= 16 && (shape.rows + 15) / 16 >= tiles &&
              (tiles != chosen.tiles || splits != chosen.splits))
            candidates.push_back({tiles, splits});
      for (const GemvSplit& split : candidates) {
        const int tiles = split.tiles, splits = split.splits;
        const float us = time_graph(int(matrices.size()), [&](cudaStream_t stream, int i) {
          norm_like(source, batch, shape.cols, x, stream);
          CHECK(vavilov::cuda::gemv_q4(matrices[size_t(i)], batch, split, stream));
        });
        const bool is_chosen = tiles == chosen.tiles && splits == chosen.splits;
        if (is_chosen) chosen_us = us;
        if (us < best_us) best_us = us, best = split;
        std::fprintf(json,
                     "%s    {\"shape\": \"%s\", \"rows\": %d, \"cols\": %d, \"batch\": %d, \"tiles\": %d, "
                     "\"splits\": %d, \"after_norm_us\": %.3f, \"chosen\": %s}",
                     first ? "" : ",\n", shape.name.c_str(), shape.rows, shape.cols, batch, tiles, splits, us,
                     is_chosen ? "true" : "false");
        first = false;
      }
      std::printf("%-24s %d  chosen (%d, %d) %.2f us -> best (%d, %d) %.2f us\n", shape.name.c_str(), batch,
                  chosen.tiles, chosen.splits, chosen_us, best.tiles, best.splits, best_us);
    }
    cudaFree(pool.memory);
  }
  std::fprintf(json, "\n  ]");
  cudaFree(x);
  cudaFree(source);
  cudaFree(y);
}

// The products of a decode step as the step launches them (sequence.cpp: a layer's input products as one product group,
// out / o and lm_head through cuda::linear), each call after a dependent norm-like kernel that writes its input, in a
// graph over rotating copies (at least 200 MB of each shape's weights). µs per product, the norm's graph subtracted.
void bench_step(FILE* json, double copy) {
  using vavilov::cuda::WeightFormat;
  struct StepCase {
    std::string name;
    std::vector<LinearShape> shapes;  // one product group (one shape: a cuda::linear call)
  };
  const std::vector<StepCase> cases = {
      {"gdn inputs (qkv, z, b, a)",
       {{"qkv", WeightFormat::Q4, 10240, 2560},
        {"z", WeightFormat::Q4, 6144, 2560},
        {"b", WeightFormat::Q4, 48, 2560},
        {"a", WeightFormat::Q4, 48, 2560}}},
      {"attention inputs (q, k, v, index)",
       {{"q", WeightFormat::Q4, 12288, 2560},
        {"k", WeightFormat::Q4, 512, 2560},
        {"v", WeightFormat::Q4, 512, 2560},
        {"index_qk", WeightFormat::Q4, 640, 2560}}},
      {"router + shared gate", {{"router", WeightFormat::Q4, 512, 2560}, {"shared gate", WeightFormat::Q4, 1, 2560}}},
      {"gdn out, attn o", {{"out", WeightFormat::Q4, 2560, 6144}}},
      {"lm_head", {{"lm_head", WeightFormat::Q4, 248320, 2560}}},
  };
  float* x = device_alloc<float>(size_t(4) * 6144);
  float* source = device_alloc<float>(size_t(4) * 6144);
  float* y = device_alloc<float>(size_t(4) * 248320 + 4 * 2 * 12288);
  fill_floats<<<64, 256>>>(source, size_t(4) * 6144, 13);
  std::printf(
      "\ndecode-step products after a dependent norm (graph over rotating copies, norm subtracted)\n"
      "%-36s %5s %8s %8s %7s %8s\n",
      "case", "batch", "MB", "us", "GB/s", "of copy");
  std::fprintf(json, ",\n  \"step_products\": [\n");
  bool first = true;
  for (const StepCase& c : cases) {
    std::vector<LinearPool> pools;
    size_t bytes = 0;
    for (const LinearShape& shape : c.shapes) {
      pools.push_back(make_pool(shape));
      bytes += pools.back().weight_bytes;
    }
    const int cols = c.shapes[0].cols;
    std::vector<vavilov::bench::BenchProductGroup> groups;
    for (size_t i = 0; i < pools[0].matrices.size() && c.shapes.size() > 1; ++i) {
      std::vector<std::pair<vavilov::cuda::DeviceMatrix, float*>> products;
      float* out = y;
      for (const LinearPool& pool : pools) {
        products.emplace_back(pool.matrices[i % pool.matrices.size()], out);
        out += size_t(4) * pool.matrices[0].rows;
      }
      groups.emplace_back(x, std::move(products));
    }
    // Calls a graph: a group per copy of the first (largest) shape; at least 4 (lm_head alone exceeds L2 by far).
    const int copies = std::max<int>(4, groups.empty() ? int(pools[0].matrices.size()) : int(groups.size()));
    for (int batch : {1, 2, 4}) {
      const auto product = [&](cudaStream_t stream, int i) {
        if (groups.empty())
          vavilov::cuda::linear(pools[0].matrices[size_t(i) % pools[0].matrices.size()], x, batch, y, stream);
        else
          groups[size_t(i) % groups.size()].run(batch, stream);
      };
      const float pair_us = time_graph(copies, [&](cudaStream_t stream, int i) {
        norm_like(source, batch, cols, x, stream, true);
        product(stream, i);
      });
      const float norm_us =
          time_graph(copies, [&](cudaStream_t stream, int) { norm_like(source, batch, cols, x, stream, true); });
      const float us = pair_us - norm_us;
      const double gbs = double(bytes) / (us * 1e-6) / 1e9;
      std::printf("%-36s %5d %8.2f %8.2f %7.0f %7.1f%%\n", c.name.c_str(), batch, bytes / 1e6, us, gbs,
                  100.0 * gbs / copy);
      std::fprintf(json,
                   "%s    {\"case\": \"%s\", \"batch\": %d, \"weight_bytes\": %zu, \"copies\": %d, "
                   "\"us\": %.3f, \"after_norm_us\": %.3f, \"norm_us\": %.3f, \"fraction_of_copy\": %.4f}",
                   first ? "" : ",\n", c.name.c_str(), batch, bytes, copies, us, pair_us, norm_us, gbs / copy);
      first = false;
    }
    groups.clear();
    for (LinearPool& pool : pools) cudaFree(pool.memory);
  }
  std::fprintf(json, "\n  ]");
  cudaFree(x);
  cudaFree(source);
  cudaFree(y);
}

struct Case {
  std::string name;
  Format format;
  std::vector<Shape> shapes;
  int copies = 1;  // > 1: this many copies of the weights, launched in turn back to back (one layer's launches)
};

}  // namespace

int main(int argc, char** argv) {
  const char* out_path = argc > 1 ? argv[1] : "gemv.json";
  const char* label = argc > 2 ? argv[2] : "";
  const std::string mode = argc > 3 ? argv[3] : "";
  const bool step = mode == "--step";                                             // the step's products alone
  const bool linear_only = mode == "--linear-only" || mode == "--sweep" || step;  // cuda::linear's shapes alone
  const bool sweep = mode == "--sweep";                                           // and the split sweep
  cudaDeviceProp props;
  CHECK(cudaGetDeviceProperties(&props, 0));
  const double copy = copy_bandwidth_gbs();
  std::printf("device %s, %d SMs, L2 %d MB; copy bandwidth %.0f GB/s (read + write); %s\n", props.name,
              props.multiProcessorCount, props.l2CacheSize >> 20, copy, label);

  bool correct = true;
  for (Format format : {Format::q4, Format::q3, Format::q2, Format::bf16})
    for (int batch = 1; batch <= 4 && !linear_only; ++batch) {
      double error = check(format, batch);
      // fp32 accumulation of ≤ 1280 products against double; the quantized kernels' activations carry 22 bits.
      bool ok = error <= 1e-5;
      correct &= ok;
      std::printf("check %-4s batch %d: rel err %.2e %s\n", name_of(format), batch, error, ok ? "ok" : "FAIL");
    }

  // Real Flash-Next shapes (hidden 2560, 48 layers of which 36 GDN, 4 hyper-connection streams of rank 320).
  const std::vector<Shape> experts = {{"gate", 640, 2560, 480}, {"up", 640, 2560, 480}, {"down", 2560, 640, 480}};
  const std::vector<Shape> layer_experts = {{"gate", 640, 2560, 10}, {"up", 640, 2560, 10}, {"down", 2560, 640, 10}};
  const std::vector<Case> cases = {
      {"gdn in_proj_qkv x36", Format::q4, {{"qkv", 10240, 2560, 36}}},
      {"gdn out_proj x36", Format::q4, {{"out", 2560, 6144, 36}}},
      {"routed experts 10/layer x48", Format::q4, experts},
      {"lm_head", Format::q4, {{"lm_head", 248320, 2560, 1}}},
      {"hc mixer down x97", Format::q4, {{"down", 320, 10240, 97}}},
      {"hc mixer up x97", Format::q4, {{"up", 10240, 320, 97}}},
      {"one layer: gdn in_proj_qkv", Format::q4, {{"qkv", 10240, 2560, 1}}, 16},
      {"one layer: routed experts", Format::q4, layer_experts, 8},
      {"gdn in_proj_qkv x36", Format::q3, {{"qkv", 10240, 2560, 36}}},
      {"routed experts 10/layer x48", Format::q3, experts},
      {"gdn in_proj_qkv x36", Format::q2, {{"qkv", 10240, 2560, 36}}},
      {"routed experts 10/layer x48", Format::q2, experts},
      {"gdn in_proj_qkv x36", Format::bf16, {{"qkv", 10240, 2560, 36}}},
  };
  float* x = device_alloc<float>(size_t(4) * 10240);
  float* y = device_alloc<float>(size_t(4) * 248320);
  fill_floats<<<64, 256>>>(x, size_t(4) * 10240, 5);
  FILE* json = std::fopen(out_path, "w");
  if (!json) {
    std::fprintf(stderr, "cannot write %s\n", out_path);
    return 1;
  }
  std::fprintf(json,
               "{\n  \"gpu\": \"%s\",\n  \"label\": \"%s\",\n  \"copy_bandwidth_gbs\": %.1f,\n  \"correct\": %s,\n",
               props.name, label, copy, correct ? "true" : "false");
  if (!linear_only)
    std::printf("\n%-30s %-4s %4s %9s %9s %7s %8s\n", "case", "fmt", "rows", "MB", "us", "GB/s", "of copy");
  if (!linear_only) std::fprintf(json, "  \"cases\": [\n");
  bool first = true;
  for (const Case& c : linear_only ? std::vector<Case>{} : cases) {
    std::vector<Buffers> copies;
    for (int i = 0; i < c.copies; ++i) copies.push_back(make_matrices(c.shapes, c.format, x, y, 42 + 1000 * i));
    for (int batch = 1; batch <= 4; ++batch) {
      // Each timed run launches every copy once; a single-copy case is one grouped launch.
      const float ms = time_ms(
                           [&](int) {
                             for (const Buffers& b : copies) CHECK(launch(b, c.format, batch));
                           },
                           20) /
                       c.copies;
      const size_t bytes = copies[0].weight_bytes;
      const double gbs = double(bytes) / (ms * 1e-3) / 1e9;
      std::printf("%-30s %-4s %4d %9.1f %9.2f %7.0f %7.1f%%\n", c.name.c_str(), name_of(c.format), batch, bytes / 1e6,
                  ms * 1e3, gbs, 100.0 * gbs / copy);
      std::fprintf(json,
                   "%s    {\"case\": \"%s\", \"format\": \"%s\", \"rows\": %d, \"weight_bytes\": %zu, "
                   "\"us\": %.2f, \"gbs\": %.1f, \"fraction_of_copy\": %.4f}",
                   first ? "" : ",\n", c.name.c_str(), name_of(c.format), batch, bytes, ms * 1e3, gbs, gbs / copy);
      first = false;
    }
    for (Buffers& b : copies) free_matrices(b);
  }
  if (!linear_only) std::fprintf(json, "\n  ],\n");
  if (step)
    std::fprintf(json, "  \"linear\": []");
  else
    bench_linear(json, copy);
  if (sweep) sweep_splits(json);
  if (step) bench_step(json, copy);
  std::fprintf(json, "\n}\n");
  std::fclose(json);
  return correct ? 0 : 1;
}
