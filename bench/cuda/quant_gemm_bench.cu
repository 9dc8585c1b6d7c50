// The prefill's dense quantized products (src/cuda/quant_gemm.cu) alone, at Flash-Next's shapes and a chunk of 512 rows
// (or the row count given), cut both ways: warp tiles (a warp decodes its 16 rows once per 16 activation rows) and
// block tiles (a block of 64 activation rows decodes each of its matrix rows once: the form and shape the build's knobs
// choose, quant_gemm.cu). For each shape: µs a product (the fastest of kRepeats runs of kLaunches back-to-back
// launches), the tensor-core rate it reaches (2 mma products a multiply: hi and lo halves), and whether the two cuts
// gave the same bits (they must); first the rate of mma.sync itself with no memory traffic (the ceiling of both cuts).
// Then the routed experts' grouped products (gate and down of 512 experts, the chunk's rows routed at random, 10 picks
// a token): µs of the rows' split and of the products, and their bits against the dense warp tiles (they must match).
// Usage: quant_gemm_bench OUT.json [ROWS]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "check.cuh"
#include "cuda/quant_gemm.cuh"
#include "cuda/quant_mma.cuh"
#include "event_times.cuh"

namespace {

using vavilov::cuda::DeviceMatrix;
using vavilov::cuda::QuantGemmTiles;
using vavilov::cuda::WeightFormat;

constexpr int kLaunches = 20;
constexpr int kRepeats = 5;

struct Shape {
  const char* name;
  int rows, cols;
};

// Flash-Next's dense products of a prefill chunk (hidden 2560; GDN 16 key heads × 128, 48 value heads × 128;
// attention 24 heads × 256 with its output gate, 2 key/value heads; hyper-connection mix 320 ↔ 4 × 2560; shared
// expert 640).
const Shape kShapes[] = {
    {"gdn_in_qkv", 10240, 2560}, {"gdn_in_z", 6144, 2560},     {"gdn_out", 2560, 6144},    {"mix_down", 320, 10240},
    {"mix_up", 10240, 320},      {"attention_q", 12288, 2560}, {"attention_k", 512, 2560}, {"attention_v", 512, 2560},
    {"attention_o", 2560, 6144}, {"shared_gate", 640, 2560},   {"shared_down", 2560, 640},
};

template <typename T>
T* upload(const std::vector<T>& host) {
  T* device = nullptr;
  CHECK(cudaMalloc(&device, host.size() * sizeof(T)));
  CHECK(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return device;
}

// A Q4 matrix of random codes, scales and biases (bf16 of magnitude ~0.01).
DeviceMatrix random_q4(std::mt19937& rng, int rows, int cols) {
  const size_t n = size_t(rows) * size_t(cols);
  std::vector<uint32_t> codes(n / 8);
  for (uint32_t& c : codes) c = rng();
  std::vector<uint16_t> scales(n / 64), biases(n / 64);
  for (uint16_t& s : scales) s = uint16_t(0x3c00u + rng() % 0x100u);
  for (uint16_t& b : biases) b = uint16_t(0xbc00u + rng() % 0x100u);
  DeviceMatrix m;
  m.format = WeightFormat::Q4, m.rows = rows, m.cols = cols, m.bits = 4;
  m.data = upload(codes), m.scales = upload(scales), m.biases = upload(biases);
  return m;
}

// The tensor cores' ceiling for the products' instruction: every warp runs 16 independent chains of
// mma.sync m16n8k16 (fp16 in, fp32 sums), as the block tiles' warps do, with no memory traffic.
__global__ void mma_ceiling_kernel(int steps, float* out) {
  const uint32_t one = 0x3c003c00u + (threadIdx.x & 1u);  // fp16 pairs near 1: finite sums
  float c[16][4] = {};
  for (int s = 0; s < steps; ++s)
#pragma unroll
    for (int i = 0; i < 16; ++i) vavilov::cuda::qmma::mma_f16(c[i], one, one, one, one, one, one);
  float sum = 0;
#pragma unroll
  for (int i = 0; i < 16; ++i) sum += c[i][0] + c[i][1] + c[i][2] + c[i][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = sum;
}

double mma_ceiling_tflops(cudaStream_t stream) {
  int device = 0, multiprocessors = 0;
  CHECK(cudaGetDevice(&device));
  CHECK(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device));
  const int blocks = 2 * multiprocessors, threads = 256, steps = 4096;
  float* out = nullptr;
  CHECK(cudaMalloc(&out, size_t(blocks) * threads * sizeof(float)));
  mma_ceiling_kernel<<<blocks, threads, 0, stream>>>(steps, out);
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  CHECK(cudaEventRecord(start, stream));
  mma_ceiling_kernel<<<blocks, threads, 0, stream>>>(steps, out);
  CHECK(cudaEventRecord(stop, stream));
  CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, start, stop));
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(stop));
  CHECK(cudaFree(out));
  const double mmas = double(blocks) * (threads / 32) * steps * 16;
  return mmas * 2.0 * 16 * 8 * 16 / (ms * 1e-3) * 1e-12;
}

std::vector<float> download(const float* y, size_t count) {
  std::vector<float> host(count);
  CHECK(cudaMemcpy(host.data(), y, count * sizeof(float), cudaMemcpyDeviceToHost));
  return host;
}

// µs of one call of `launch` (the fastest of kRepeats runs of kLaunches back-to-back calls).
template <typename Launch>
double time_calls_us(const Launch& launch, cudaStream_t stream) {
  for (int i = 0; i < 3; ++i) CHECK(launch());
  const float best = fastest(event_times_ms(stream, kRepeats, [&](int) {
    for (int i = 0; i < kLaunches; ++i) CHECK(launch());
  }));
  return 1000.0 * best / kLaunches;
}

double time_us(const DeviceMatrix& w, const float* x, int x_rows, float* y, QuantGemmTiles tiles, cudaStream_t stream) {
  return time_calls_us([&] { return vavilov::cuda::quant_gemm(w, x, x_rows, y, stream, tiles); }, stream);
}

// Flash-Next's routed experts (512 experts of 640 × 2560 gate/up and 2560 × 640 down, 10 picks a token) for a chunk of
// `tokens` rows routed at random, as moe_prefill runs them: the rows split once (quant_split_rows), then one grouped
// product over all experts — gate reading the chunk's rows in place (x_rows map), down writing slot order (y_rows
// map). Prints and returns a JSON entry: µs of the split and of the products, and whether the first experts' rows
// give the bits of the dense warp tiles of the same rows.
std::string expert_products(const char* name, int rows_out, int cols, bool gate, int tokens, std::mt19937& rng,
                            cudaStream_t stream, bool& all_same) {
  constexpr int kExperts = 512, kPicks = 10;
  const int slots = tokens * kPicks;
  std::vector<DeviceMatrix> experts;
  for (int e = 0; e < kExperts; ++e) experts.push_back(random_q4(rng, rows_out, cols));
  std::vector<int> ids(static_cast<size_t>(slots));
  for (int& id : ids) id = int(rng() % kExperts);
  std::vector<int> counts(kExperts, 0), offsets(kExperts, 0), order;  // order: grouped row → slot
  for (int e = 0; e < kExperts; ++e) {
    offsets[size_t(e)] = int(order.size());
    for (int s = 0; s < slots; ++s)
      if (ids[size_t(s)] == e) ++counts[size_t(e)], order.push_back(s);
  }
  const int x_rows = gate ? tokens : slots;
  std::normal_distribution<float> normal;
  std::vector<float> host_x(size_t(x_rows) * size_t(cols));
  for (float& v : host_x) v = normal(rng);
  float* x = upload(host_x);
  float* y = nullptr;
  CHECK(cudaMalloc(&y, size_t(slots) * size_t(rows_out) * sizeof(float)));
  void* split = nullptr;
  CHECK(cudaMalloc(&split, vavilov::cuda::quant_split_bytes(x_rows, cols)));
  const DeviceMatrix* device_experts = upload(experts);
  const int *device_counts = upload(counts), *device_offsets = upload(offsets), *device_order = upload(order);
  vavilov::cuda::GroupedRowMap map;
  if (gate)
    map.x_rows = device_order, map.x_divisor = kPicks;
  else
    map.y_rows = device_order;
  const double split_us = time_calls_us(
      [&] { return vavilov::cuda::quant_split_rows(WeightFormat::Q4, x, x_rows, cols, split, stream); }, stream);
  const double products_us = time_calls_us(
      [&] {
        return vavilov::cuda::quant_expert_gemm(device_experts, WeightFormat::Q4, kExperts, rows_out, cols,
                                                device_counts, device_offsets, split, y, stream, map);
      },
      stream);
  CHECK(cudaStreamSynchronize(stream));
  const std::vector<float> grouped = download(y, size_t(slots) * size_t(rows_out));
  bool same = true;
  for (int e = 0; e < 4; ++e) {  // the first experts' rows, gathered, through the dense warp tiles
    const int count = counts[size_t(e)], first = offsets[size_t(e)];
    if (!count) continue;
    std::vector<float> rows(size_t(count) * size_t(cols));
    for (int i = 0; i < count; ++i) {
      const int p = first + i, source = gate ? order[size_t(p)] / kPicks : p;
      std::copy_n(&host_x[size_t(source) * size_t(cols)], cols, &rows[size_t(i) * size_t(cols)]);
    }
    float* dense_x = upload(rows);
    float* dense_y = nullptr;
    CHECK(cudaMalloc(&dense_y, size_t(count) * size_t(rows_out) * sizeof(float)));
    CHECK(vavilov::cuda::quant_gemm(experts[size_t(e)], dense_x, count, dense_y, stream, QuantGemmTiles::warp));
    const std::vector<float> want = download(dense_y, size_t(count) * size_t(rows_out));
    for (int i = 0; i < count; ++i) {
      const int p = first + i, target = gate ? p : order[size_t(p)];
      same = same && std::memcmp(&grouped[size_t(target) * size_t(rows_out)], &want[size_t(i) * size_t(rows_out)],
                                 size_t(rows_out) * sizeof(float)) == 0;
    }
    CHECK(cudaFree(dense_x));
    CHECK(cudaFree(dense_y));
  }
  all_same = all_same && same;
  const double bytes = double(kExperts) * rows_out * cols * 0.5625;
  std::printf("%-12s %d experts %5d x %5d, %d rows: split %6.1f us  products %7.1f us (%5.0f GB/s of codes)  %s\n",
              name, kExperts, rows_out, cols, slots, split_us, products_us, bytes / products_us * 1e-3,
              same ? "same bits as the dense warp tiles" : "BITS DIFFER");
  char entry[400];
  std::snprintf(entry, sizeof entry,
                "{\"name\": \"%s\", \"experts\": %d, \"rows_out\": %d, \"cols\": %d, \"rows\": %d, "
                "\"split_us\": %.2f, \"products_us\": %.2f, \"same_bits\": %s}",
                name, kExperts, rows_out, cols, slots, split_us, products_us, same ? "true" : "false");
  for (const DeviceMatrix& m : experts) {
    CHECK(cudaFree(const_cast<void*>(m.data)));
    CHECK(cudaFree(const_cast<uint16_t*>(m.scales)));
    CHECK(cudaFree(const_cast<uint16_t*>(m.biases)));
  }
  for (const void* p : {static_cast<const void*>(x), static_cast<const void*>(y), static_cast<const void*>(split),
                        static_cast<const void*>(device_experts), static_cast<const void*>(device_counts),
                        static_cast<const void*>(device_offsets), static_cast<const void*>(device_order)})
    CHECK(cudaFree(const_cast<void*>(p)));
  return entry;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3) {
    std::fprintf(stderr, "usage: quant_gemm_bench OUT.json [ROWS]\n");
    return 2;
  }
  const int x_rows = argc == 3 ? std::atoi(argv[2]) : 512;
  if (x_rows <= 0) {
    std::fprintf(stderr, "quant_gemm_bench: ROWS must be a positive count, got '%s'\n", argv[2]);
    return 2;
  }
  std::mt19937 rng(7);
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  const double ceiling = mma_ceiling_tflops(stream);
  std::printf("mma.sync m16n8k16 f16 -> f32 ceiling: %.1f TFLOP/s\n", ceiling);
  std::string json = "{\"rows\": " + std::to_string(x_rows) + ", \"mma_ceiling_tflops\": " + std::to_string(ceiling) +
                     ", \"products\": [";
  bool all_same = true;
  for (size_t s = 0; s < std::size(kShapes); ++s) {
    const Shape& shape = kShapes[s];
    const DeviceMatrix w = random_q4(rng, shape.rows, shape.cols);
    std::normal_distribution<float> normal;
    std::vector<float> host_x(size_t(x_rows) * size_t(shape.cols));
    for (float& v : host_x) v = normal(rng);
    float* x = upload(host_x);
    const size_t outputs = size_t(x_rows) * size_t(shape.rows);
    float* y = nullptr;
    CHECK(cudaMalloc(&y, outputs * sizeof(float)));
    const double warp_us = time_us(w, x, x_rows, y, QuantGemmTiles::warp, stream);
    const std::vector<float> warp_y = download(y, outputs);
    const double block_us = time_us(w, x, x_rows, y, QuantGemmTiles::block, stream);
    const std::vector<float> block_y = download(y, outputs);
    const double automatic_us = time_us(w, x, x_rows, y, QuantGemmTiles::automatic, stream);
    const bool same = std::memcmp(warp_y.data(), block_y.data(), outputs * sizeof(float)) == 0;
    all_same = all_same && same;
    const double mma_flop = 2.0 * 2.0 * double(shape.rows) * double(shape.cols) * double(x_rows);  // hi and lo
    std::printf("%-12s %5d x %5d  warp %8.1f us  block %8.1f us (%5.1f TFLOP/s)  automatic %8.1f us  %s\n", shape.name,
                shape.rows, shape.cols, warp_us, block_us, mma_flop / block_us * 1e-6, automatic_us,
                same ? "same bits" : "BITS DIFFER");
    char entry[512];
    std::snprintf(entry, sizeof entry,
                  "%s\n  {\"name\": \"%s\", \"rows_out\": %d, \"cols\": %d, \"warp_tiles_us\": %.2f, "
                  "\"block_tiles_us\": %.2f, \"automatic_us\": %.2f, \"same_bits\": %s}",
                  s ? "," : "", shape.name, shape.rows, shape.cols, warp_us, block_us, automatic_us,
                  same ? "true" : "false");
    json += entry;
    CHECK(cudaFree(x));
    CHECK(cudaFree(y));
    CHECK(cudaFree(const_cast<void*>(w.data)));
    CHECK(cudaFree(const_cast<uint16_t*>(w.scales)));
    CHECK(cudaFree(const_cast<uint16_t*>(w.biases)));
  }
  json += "\n], \"experts\": [\n  " + expert_products("expert_gate", 640, 2560, true, x_rows, rng, stream, all_same);
  json += ",\n  " + expert_products("expert_down", 2560, 640, false, x_rows, rng, stream, all_same) + "\n]}\n";
  FILE* out = std::fopen(argv[1], "w");
  if (!out || std::fputs(json.c_str(), out) < 0 || std::fclose(out) != 0) {
    std::fprintf(stderr, "quant_gemm_bench: cannot write %s\n", argv[1]);
    return 1;
  }
  return all_same ? 0 : 1;
}
