// The GPU's weight formats beyond F32/BF16/Q4 (ctest label `gpu`): MLX affine at 3/2 bits and other widths and groups,
// NVIDIA NVFP4 and FP8, and experts whose formats differ inside one layer. Kernel products against double precision
// of the dequantized weights; whole models against the CPU engine on the same weights (the CPU is tested against
// mlx / ModelOpt's arithmetic) and against the fixtures' reference logits.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <random>
#include <vector>

#include "cli/common.h"
#include "core/dtype.h"
#include "cuda/backend.h"
#include "cuda/device_model.h"
#include "cuda/linear.cuh"
#include "engine/generate.h"
#include "engine/speculative.h"
#include "fixture_paths.h"
#include "model/pack.h"
#include "model/packed_model.h"
#include "model/quantize.h"
#include "reference_logits.h"

namespace vavilov {
namespace {

namespace fs = std::filesystem;
using cuda::WeightFormat;

// GPU and CPU compute in fp32 on the same stored weights, decoded with the same formulas: only the order of
// roundings differs (the bound the other GPU tests use). The fixtures' references were themselves matched by the CPU
// within 1e-4.
constexpr double kTolerance = 1e-3;

const fs::path kMlx = test::source_dir() / "tests/fixtures/models_mlx/tiny_mlx_q4";
const fs::path kNvfp4 = test::source_dir() / "tests/fixtures/models_nvfp4/tiny_nvfp4";

// ---- kernels ----

// Device copies that free themselves.
class DeviceBuffers {
 public:
  template <typename T>
  T* copy(const std::vector<T>& host) {
    void* device = nullptr;
    EXPECT_EQ(cudaMalloc(&device, std::max<size_t>(1, host.size() * sizeof(T))), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    buffers_.push_back(device);
    return static_cast<T*>(device);
  }
  float* zeros(size_t count) { return copy(std::vector<float>(count)); }
  ~DeviceBuffers() {
    for (void* p : buffers_) cudaFree(p);
  }

 private:
  std::vector<void*> buffers_;
};

// A random matrix in `format` (affine: `bits` at `group`), on the GPU, and its weights exactly as the CPU decodes them.
struct TestMatrix {
  cuda::DeviceMatrix device;
  std::vector<float> values;  // [rows, cols]
};

// Any e4m3 byte but NaN (zero, subnormals and the largest exponent included); without the sign bit when not signed.
uint8_t random_e4m3(std::mt19937& rng, bool allow_sign) {
  std::uniform_int_distribution<int> byte(0, 255);
  for (;;) {
    const uint8_t b = uint8_t(byte(rng) & (allow_sign ? 0xff : 0x7f));
    if ((b & 0x7f) != 0x7f) return b;
  }
}

TestMatrix make_matrix(WeightFormat format, int rows, int cols, int bits, int group, std::mt19937& rng,
                       DeviceBuffers& buffers) {
  TestMatrix t;
  t.values.resize(size_t(rows) * size_t(cols));
  t.device.format = format;
  t.device.rows = rows;
  t.device.cols = cols;
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> byte(0, 255);
  if (format == WeightFormat::NVFP4) {
    std::vector<uint8_t> codes(size_t(rows) * size_t(cols / 2)), scales(size_t(rows) * size_t(cols / 16));
    for (uint8_t& c : codes) c = uint8_t(byte(rng));
    for (uint8_t& s : scales) s = random_e4m3(rng, false);
    Matrix host{"w", DType::BF16, rows, cols, reinterpret_cast<const std::byte*>(codes.data()), 4};
    host.group = 16;
    host.block_scales = scales.data();
    host.tensor_scale = 0.00731f;
    for (int r = 0; r < rows; ++r) dequantize_row(host, r, t.values.data() + size_t(r) * cols);
    t.device.data = buffers.copy(codes);
    t.device.block_scales = buffers.copy(scales);
    t.device.tensor_scale = host.tensor_scale;
  } else if (format == WeightFormat::F8) {
    std::vector<uint8_t> bytes(t.values.size());
    for (size_t i = 0; i < bytes.size(); ++i) {
      bytes[i] = random_e4m3(rng, true);
      t.values[i] = f8_e4m3_to_f32(bytes[i]) * 0.0213f;  // the CPU's order: value, then the tensor scale
    }
    t.device.data = buffers.copy(bytes);
    t.device.tensor_scale = 0.0213f;
  } else {
    std::vector<float> w(t.values.size());
    for (float& v : w) v = normal(rng);
    QuantizedRows q = quantize_rows(w.data(), rows, cols, bits, group);
    Matrix host{"w",  DType::BF16,     rows,           cols, reinterpret_cast<const std::byte*>(q.codes.data()),
                bits, q.scales.data(), q.biases.data()};
    host.group = group;
    for (int r = 0; r < rows; ++r) dequantize_row(host, r, t.values.data() + size_t(r) * cols);
    t.device.data = buffers.copy(q.codes);
    t.device.scales = buffers.copy(q.scales);
    t.device.biases = buffers.copy(q.biases);
    t.device.bits = bits;
    t.device.group = group;
  }
  return t;
}

// y[b, r] within 1e-5 of Σ|w·x| of the double-precision product (fp32 sums; the tensor-core Q3/Q2 kernels keep ~22
// bits of the activations). A wrong code, scale or index gives errors of order one.
void expect_products(const std::vector<float>& values, int rows, int cols, const std::vector<float>& x, int x_rows,
                     const std::vector<float>& y, const std::string& what) {
  for (int b = 0; b < x_rows; ++b)
    for (int r = 0; r < rows; ++r) {
      double want = 0, magnitude = 0;
      for (int k = 0; k < cols; ++k) {
        const double term = double(values[size_t(r) * cols + k]) * x[size_t(b) * cols + k];
        want += term;
        magnitude += std::abs(term);
      }
      ASSERT_NEAR(y[size_t(b) * rows + r], want, 1e-5 * magnitude) << what << " at (" << b << ", " << r << ")";
    }
}

std::vector<float> download(const float* device, size_t count) {
  std::vector<float> host(count);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(host.data(), device, count * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

struct Case {
  WeightFormat format;
  int bits, group, rows, cols;
};

// Every path each new format takes: the fast 1–4 row kernels (gemv.cuh Q3/Q2, nvfp4.cu), split-K (short and wide),
// the row-parallel kernel (5 rows, and widths the fast kernels refuse), and the per-column loader (F8 widths that are
// not a multiple of 8).
TEST(CudaFormats, EveryFormatsProductMatchesDoublePrecision) {
  const std::vector<Case> cases = {
      {WeightFormat::Q3, 3, 64, 200, 2560},    {WeightFormat::Q3, 3, 64, 16, 4096},
      {WeightFormat::Q3, 3, 64, 130, 640},     {WeightFormat::Q2, 2, 64, 200, 2560},
      {WeightFormat::Q2, 2, 64, 8, 1024},      {WeightFormat::Q2, 2, 64, 70, 13312},
      {WeightFormat::Affine, 8, 64, 96, 512},  {WeightFormat::Affine, 4, 32, 100, 160},
      {WeightFormat::Affine, 3, 128, 40, 768}, {WeightFormat::Affine, 5, 64, 33, 320},
      {WeightFormat::Affine, 6, 32, 20, 1024}, {WeightFormat::NVFP4, 4, 16, 640, 2560},
      {WeightFormat::NVFP4, 4, 16, 2560, 640}, {WeightFormat::NVFP4, 4, 16, 37, 4096},
      {WeightFormat::NVFP4, 4, 16, 45, 48},    {WeightFormat::F8, 8, 0, 130, 1024},
      {WeightFormat::F8, 8, 0, 23, 100},       {WeightFormat::F8, 8, 0, 8, 6144},
  };
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  for (const Case& c : cases) {
    DeviceBuffers buffers;
    const TestMatrix m = make_matrix(c.format, c.rows, c.cols, c.bits, c.group, rng, buffers);
    for (int x_rows = 1; x_rows <= 5; ++x_rows) {
      std::vector<float> x(size_t(x_rows) * size_t(c.cols));
      for (float& v : x) v = normal(rng);
      const float* dx = buffers.copy(x);
      float* dy = buffers.zeros(size_t(x_rows) * size_t(c.rows));
      cuda::linear(m.device, dx, x_rows, dy, nullptr);
      const std::string what = "format " + std::to_string(int(c.format)) + " bits " + std::to_string(c.bits) +
                               " group " + std::to_string(c.group) + " " + std::to_string(c.rows) + "x" +
                               std::to_string(c.cols) + " x_rows " + std::to_string(x_rows);
      expect_products(m.values, c.rows, c.cols, x, x_rows, download(dy, size_t(x_rows) * size_t(c.rows)), what);
    }
  }
}

// Experts of one layer in different formats (the Mixed summary): each slot's product uses its own expert's format.
TEST(CudaFormats, MixedExpertsEachUseTheirOwnFormat) {
  const int rows = 96, cols = 512, slots = 12;
  const std::vector<Case> formats = {
      {WeightFormat::Q4, 4, 64, rows, cols},     {WeightFormat::Q3, 3, 64, rows, cols},
      {WeightFormat::Q2, 2, 64, rows, cols},     {WeightFormat::NVFP4, 4, 16, rows, cols},
      {WeightFormat::Affine, 8, 64, rows, cols}, {WeightFormat::F8, 8, 0, rows, cols},
  };
  std::mt19937 rng(9);
  std::normal_distribution<float> normal;
  DeviceBuffers buffers;
  std::vector<TestMatrix> experts;
  std::vector<cuda::DeviceMatrix> devices;
  for (const Case& c : formats) {
    experts.push_back(make_matrix(c.format, rows, cols, c.bits, c.group, rng, buffers));
    devices.push_back(experts.back().device);
  }
  std::vector<int> ids(slots);
  for (int s = 0; s < slots; ++s) ids[size_t(s)] = (s * 5 + 1) % int(experts.size());
  const int x_divisor = 3;  // three slots share each activation row, as the top-k slots of one token do
  std::vector<float> x(size_t(slots / x_divisor) * cols);
  for (float& v : x) v = normal(rng);
  float* dy = buffers.zeros(size_t(slots) * rows);
  cuda::expert_linear(buffers.copy(devices), WeightFormat::Mixed, rows, cols, buffers.copy(ids), slots, buffers.copy(x),
                      x_divisor, dy, nullptr);
  const std::vector<float> y = download(dy, size_t(slots) * rows);
  for (int s = 0; s < slots; ++s) {
    const std::vector<float> row(x.begin() + (s / x_divisor) * cols, x.begin() + (s / x_divisor + 1) * cols);
    const std::vector<float> slot_y(y.begin() + size_t(s) * rows, y.begin() + size_t(s + 1) * rows);
    expect_products(experts[size_t(ids[size_t(s)])].values, rows, cols, row, 1, slot_y,
                    "slot " + std::to_string(s) + " expert " + std::to_string(ids[size_t(s)]));
  }
}

// The n-gram table's gather path at MLX's group 32: rows come out exactly as the CPU decodes them (up to the fused
// multiply-add the GPU may use for scale·q + bias).
TEST(CudaFormats, AffineTableRowsGatherAsDecoded) {
  std::mt19937 rng(3);
  DeviceBuffers buffers;
  const int rows = 300, cols = 160, copies = 2;
  const TestMatrix table = make_matrix(WeightFormat::Affine, rows, cols, 4, 32, rng, buffers);
  const std::vector<int64_t> ids = {0, 299, 17, 150, 17};
  float* out = buffers.zeros(ids.size() * copies * cols);
  cuda::gather_rows(table.device, buffers.copy(ids), int(ids.size()), copies, out, nullptr);
  const std::vector<float> got = download(out, ids.size() * copies * cols);
  for (size_t r = 0; r < ids.size(); ++r)
    for (int c = 0; c < copies; ++c)
      for (int k = 0; k < cols; ++k) {
        const float want = table.values[size_t(ids[r]) * cols + k];
        ASSERT_NEAR(got[(r * copies + size_t(c)) * cols + size_t(k)], want, 1e-6f * (1.0f + std::abs(want)))
            << "row " << ids[r] << " column " << k;
      }
}

// ---- whole models ----

std::vector<float> gpu_logits(const Model& model, const std::vector<int32_t>& prompt, size_t chunk) {
  auto sequence = cuda::sequence_factory(model)();
  const size_t vocab = size_t(model.config.vocab_size);
  std::vector<float> logits(prompt.size() * vocab);
  for (size_t begin = 0; begin < prompt.size(); begin += chunk) {
    const size_t count = std::min(chunk, prompt.size() - begin);
    sequence->forward(std::span<const int32_t>(prompt).subspan(begin, count),
                      {true, logits.data() + begin * vocab, nullptr, false});
  }
  return logits;
}

// GPU logits one-shot, in chunks of 5 and token by token against the CPU engine's on the same weights and, when
// given, against a reference.
void expect_gpu_matches(const Model& model, const std::vector<int32_t>& prompt, const std::vector<float>* reference,
                        const std::string& what) {
  const std::vector<float> cpu = test::engine_logits(model, prompt, prompt.size());
  for (size_t chunk : {prompt.size(), size_t(5), size_t(1)}) {
    const std::vector<float> gpu = gpu_logits(model, prompt, chunk);
    EXPECT_LE(test::relative_error(gpu, cpu), kTolerance) << what << " vs CPU, chunk " << chunk;
    if (reference) {
      EXPECT_LE(test::relative_error(gpu, *reference), kTolerance) << what << " vs reference, chunk " << chunk;
    }
  }
}

// Greedy continuation on the GPU (plain and with 2 MTP drafts when the model has a head) token-identical to the CPU's.
std::vector<int32_t> expect_greedy_matches(const Model& model, const std::vector<int32_t>& prompt, int64_t tokens,
                                           const std::string& what) {
  GenerateOptions options;
  options.max_tokens = tokens;
  options.ignore_eos = true;
  GenerateStats stats;
  const std::vector<int32_t> cpu = generate_greedy(model, prompt, options, stats);
  auto gpu = cuda::sequence_factory(model);
  for (int drafts : {0, 2}) {
    if (drafts > 0 && !model.mtp) continue;
    SpeculativeOptions speculative;
    speculative.drafts = drafts;
    SpeculativeStats spec_stats;
    EXPECT_EQ(generate_speculative(model, prompt, options, speculative, stats, spec_stats, {}, gpu), cpu)
        << what << ", drafts " << drafts;
  }
  return cpu;
}

class GpuFormats : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_GT(cuda::device_count(), 0) << "the GPU tests need a CUDA device"; }
};

// The MLX conversion as stored: Q4 trunk, 3- and 2-bit expert modules, 8-bit routers, the group-32 n-gram table.
TEST_F(GpuFormats, MlxCheckpointMatchesCpuAndReference) {
  const test::ReferenceFixture fixture(kMlx);
  auto model = load_model(kMlx.string());
  EXPECT_TRUE(cli::cuda_selected("cuda", *model));
  auto device = cuda::upload_model(*model);
  EXPECT_EQ(device->layers[1].moe.gate_up_format, WeightFormat::Mixed);  // 3-bit gate beside 4-bit up
  EXPECT_EQ(device->layers[0].moe.down_format, WeightFormat::Q2);
  EXPECT_EQ(device->layers[0].moe.router.format, WeightFormat::Affine);
  EXPECT_EQ(device->layers[1].ple->table.format, WeightFormat::Affine);
  EXPECT_EQ(device->layers[1].ple->table.group, 32);
  expect_gpu_matches(*model, fixture.prompt, &fixture.logits, "MLX");
  EXPECT_EQ(expect_greedy_matches(*model, fixture.prompt, int64_t(fixture.greedy.size()), "MLX"), fixture.greedy);
}

// --experts 3 and 2 on the MLX checkpoint: every routed expert at that width (gemv.cuh's Q3/Q2 kernels for the
// decode rows), against the CPU and against HF on mlx's own re-quantization.
TEST_F(GpuFormats, MlxExpertsAtThreeAndTwoBits) {
  const test::ReferenceFixture fixture(kMlx);
  for (int bits : {3, 2}) {
    auto model = load_model(kMlx.string());
    quantize_experts(*model, bits);
    const std::vector<float> reference =
        test::read_floats(kMlx / fixture.reference["experts_logits_files"][std::to_string(bits)].get<std::string>());
    expect_gpu_matches(*model, fixture.prompt, &reference, "MLX --experts " + std::to_string(bits));
    expect_greedy_matches(*model, fixture.prompt, 12, "MLX --experts " + std::to_string(bits));
  }
}

// ModelOpt's export: NVFP4 routed experts, FP8 shared experts, BF16 elsewhere, uploaded as stored.
TEST_F(GpuFormats, Nvfp4CheckpointMatchesCpuAndReference) {
  const test::ReferenceFixture fixture(kNvfp4);
  auto model = load_model(kNvfp4.string());
  EXPECT_TRUE(cli::cuda_selected("cuda", *model));
  auto device = cuda::upload_model(*model);
  EXPECT_EQ(device->layers[0].moe.gate_up_format, WeightFormat::NVFP4);
  EXPECT_EQ(device->layers[0].moe.shared.gate.format, WeightFormat::F8);
  expect_gpu_matches(*model, fixture.prompt, &fixture.logits, "NVFP4");
  EXPECT_EQ(expect_greedy_matches(*model, fixture.prompt, int64_t(fixture.greedy.size()), "NVFP4"), fixture.greedy);
}

// The NVFP4 fixture (the fixture whose expert widths are multiples of 64) with its BF16 trunk quantized to Q4 and
// its experts re-quantized to 3 and to 2 bits; then with the precision chosen per expert and per projection (Q4, Q3,
// Q2 and NVFP4 side by side in one layer).
TEST_F(GpuFormats, QuantizedAndMixedExpertsMatchCpu) {
  const test::ReferenceFixture fixture(kNvfp4);
  for (int bits : {3, 2}) {
    auto model = load_model(kNvfp4.string());
    ASSERT_GT(quantize_model(*model, 4), 0);
    quantize_experts(*model, bits);
    expect_gpu_matches(*model, fixture.prompt, nullptr, "Q4 trunk, experts " + std::to_string(bits));
    expect_greedy_matches(*model, fixture.prompt, 16, "Q4 trunk, experts " + std::to_string(bits));
  }
  auto mixed = load_model(kNvfp4.string());
  int expert = 0;
  for (LayerWeights& layer : mixed->layers)
    for (FeedForwardWeights& e : layer.moe.experts) {
      const int bits[3] = {4, 3, 2};
      int projection = 0;
      for (Matrix* m : {&e.gate, &e.up, &e.down}) {
        const int choice = (expert + projection++) % 4;  // 3: stays NVFP4
        if (choice < 3) *m = quantize_matrix(*mixed, *m, bits[choice]);
      }
      ++expert;
    }
  auto device = cuda::upload_model(*mixed);
  EXPECT_EQ(device->layers[0].moe.gate_up_format, WeightFormat::Mixed);
  EXPECT_EQ(device->layers[0].moe.down_format, WeightFormat::Mixed);
  expect_gpu_matches(*mixed, fixture.prompt, nullptr, "mixed experts");
  expect_greedy_matches(*mixed, fixture.prompt, 16, "mixed experts");
}

// A packed store (of the NVFP4 fixture: its FP8 shared experts stay FP8 in dense.bin) with 4-, 3- and 2-bit expert
// records, the precision picked per (layer, expert) at load.
TEST_F(GpuFormats, PackedStoreWithMixedRecordsMatchesCpu) {
  const test::ReferenceFixture fixture(kNvfp4);
  const fs::path store = fs::temp_directory_path() / ("vavilov_gpu_mixed_store_" + std::to_string(::getpid()));
  PackOptions options;
  options.expert_bits = {4, 3, 2};
  options.progress = ProgressMode::Quiet;
  pack_model(kNvfp4.string(), store.string(), options);
  ExpertPrecision precision;
  auto probe = load_model(kNvfp4.string());
  const int layers = int(probe->config.num_layers) + (probe->mtp ? 1 : 0);
  for (int l = 0; l < layers; ++l)
    for (int e = 0; e < int(probe->config.num_experts); ++e) precision.per_expert[{l, e}] = 4 - (l + e) % 3;
  auto model = load_packed_model(store.string(), precision);
  EXPECT_EQ(model->layers[0].moe.experts[1].gate.bits, 3);
  EXPECT_EQ(cuda::upload_model(*model)->layers[0].moe.gate_up_format, WeightFormat::Mixed);
  expect_gpu_matches(*model, fixture.prompt, nullptr, "mixed store");
  expect_greedy_matches(*model, fixture.prompt, 16, "mixed store");
  fs::remove_all(store);
}

// What the GPU refuses: affine layouts the kernels cannot address, a per-tensor scale on BF16 weights.
TEST(CudaFormats, RunsOnGpuNamesWhatTheKernelsAddress) {
  std::vector<uint32_t> codes(64);
  std::vector<uint16_t> scales(64);
  Matrix m{"w", DType::BF16, 4, 64, reinterpret_cast<const std::byte*>(codes.data()), 3, scales.data(), scales.data()};
  EXPECT_TRUE(cuda::runs_on_gpu(m));
  m.group = 128;  // 64 columns do not fill a group
  EXPECT_FALSE(cuda::runs_on_gpu(m));
  m.group = 64;
  m.bits = 1;
  EXPECT_FALSE(cuda::runs_on_gpu(m));
  Matrix dense{"d", DType::BF16, 4, 64, reinterpret_cast<const std::byte*>(codes.data())};
  EXPECT_TRUE(cuda::runs_on_gpu(dense));
  dense.tensor_scale = 2.0f;
  EXPECT_FALSE(cuda::runs_on_gpu(dense));
  dense.dtype = DType::F8_E4M3;
  EXPECT_TRUE(cuda::runs_on_gpu(dense));
}

}  // namespace
}  // namespace vavilov
