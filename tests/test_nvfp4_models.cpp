// A tiny qwen4_exp checkpoint in NVIDIA ModelOpt's export layout (tests/fixtures/models_nvfp4, made by
// tools/make_nvfp4_fixture.py): NVFP4 routed experts, FP8 E4M3 shared experts with per-tensor scales, BF16
// elsewhere. It matches HF transformers run on the dequantized weights; malformed scales are rejected by name.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "cpu/forward.h"
#include "cpu/linear.h"
#include "edited_checkpoint.h"
#include "error_of.h"
#include "fixture_paths.h"
#include "model/quantize.h"
#include "model/weights.h"
#include "reference_logits.h"

namespace vavilov {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::HasSubstr;

const fs::path kFixture = test::source_dir() / "tests/fixtures/models_nvfp4/tiny_nvfp4";
const std::string kExpert = "model.layers.2.mlp.experts.5.down_proj";

// Same weights on both sides (HF runs on the dequantized values in fp32): rounding order only, the dense fixtures'
// bound of 1e-4 of the largest logit.
constexpr double kTolerance = 1e-4;

TEST(Nvfp4Checkpoint, LogitsMatchHfOnTheDequantizedWeights) {
  const test::ReferenceFixture fixture(kFixture);
  const auto& prompt = fixture.prompt;
  const auto& want = fixture.logits;
  auto model = load_model(kFixture.string());
  ASSERT_EQ(want.size(), prompt.size() * size_t(model->config.vocab_size));
  for (size_t chunk : {prompt.size(), size_t(1)})
    EXPECT_LE(test::relative_error(test::engine_logits(*model, prompt, chunk), want), kTolerance) << "chunk " << chunk;
}

TEST(Nvfp4Checkpoint, GreedyContinuationMatchesHf) {
  const test::ReferenceFixture fixture(kFixture);
  EXPECT_EQ(test::engine_greedy(*load_model(kFixture.string()), fixture), fixture.greedy);
}

// Codes and block scales stay in the mapped checkpoint; the FP8 shared expert keeps its e4m3 bytes and scale.
TEST(Nvfp4Checkpoint, WeightsMapWithoutConversion) {
  auto model = load_model(kFixture.string());
  const Matrix& down = model->layers[2].moe.experts[5].down;
  EXPECT_TRUE(down.nvfp4());
  EXPECT_EQ(down.group, 16);
  EXPECT_EQ(down.data, model->store->get(kExpert + ".weight").data);
  EXPECT_EQ(static_cast<const void*>(down.block_scales), model->store->get(kExpert + ".weight_scale").data);
  float scale_2;
  std::memcpy(&scale_2, model->store->get(kExpert + ".weight_scale_2").data, 4);
  EXPECT_EQ(down.tensor_scale, scale_2);
  const Matrix& shared = model->layers[0].moe.shared.up;
  EXPECT_EQ(shared.dtype, DType::F8_E4M3);
  EXPECT_NE(shared.tensor_scale, 1.0f);
  EXPECT_EQ(model->layers[0].moe.router.dtype, DType::BF16);
}

// --experts 4 turns NVFP4 experts into MLX-style affine Q4 from their dequantized values: the logits move by the
// re-quantization only (a loose sanity bound; exact affine products are tested in test_mlx_*).
TEST(Nvfp4Checkpoint, ExpertsCanBeRequantizedToAffine) {
  const test::ReferenceFixture fixture(kFixture);
  auto model = load_model(kFixture.string());
  const int64_t matrices = model->config.num_layers * model->config.num_experts * 3;
  EXPECT_EQ(quantize_experts(*model, 4), matrices);
  EXPECT_FALSE(model->layers[2].moe.experts[5].down.nvfp4());
  EXPECT_LE(test::relative_error(test::engine_logits(*model, fixture.prompt, fixture.prompt.size()), fixture.logits),
            0.2);
}

// The AVX2 NVFP4 products (codes decoded in registers for 1-4 rows, rows widened once for more) against float64
// products of the scalar dequantization, on random codes and block scales: 1e-5 of Σ|x·w| (fp32 rounding only).
TEST(Nvfp4Kernels, MatmulEqualsDequantizedProduct) {
  const int64_t rows = 19, cols = 320;
  std::mt19937 rng(5);
  std::vector<uint8_t> codes(size_t(rows * cols / 2)), scales(size_t(rows * cols / 16));
  for (auto& c : codes) c = uint8_t(rng());
  for (auto& s : scales) s = uint8_t(0x28 + rng() % 40);  // e4m3 values from 2^-4 to ~8
  Matrix m{"nvfp4", DType::BF16, rows, cols, reinterpret_cast<const std::byte*>(codes.data()), 4};
  m.group = 16;
  m.block_scales = scales.data();
  m.tensor_scale = 0.0123f;
  std::vector<float> dense(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r) dequantize_row(m, r, dense.data() + r * cols);
  std::normal_distribution<float> normal;
  for (int64_t batch : {1, 3, 4, 9}) {
    std::vector<float> x(size_t(batch * cols)), y(size_t(batch * rows));
    for (auto& v : x) v = normal(rng);
    cpu::matmul(m, x.data(), batch, y.data());
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t o = 0; o < rows; ++o) {
        double want = 0, magnitude = 0;
        for (int64_t i = 0; i < cols; ++i) {
          want += double(x[size_t(b * cols + i)]) * dense[size_t(o * cols + i)];
          magnitude += std::fabs(double(x[size_t(b * cols + i)]) * dense[size_t(o * cols + i)]);
        }
        EXPECT_NEAR(y[size_t(b * rows + o)], want, 1e-5 * magnitude) << "batch " << batch << " out " << o;
      }
  }
  std::vector<float> row(static_cast<size_t>(cols));
  cpu::matrix_row(m, 7, row.data());
  for (int64_t i = 0; i < cols; ++i) EXPECT_EQ(row[size_t(i)], dense[size_t(7 * cols + i)]) << i;
}

fs::path edited_copy(const std::string& name, const std::function<void(nlohmann::json&)>& edit) {
  return test::edited_checkpoint(kFixture, "nvfp4_" + name, edit);
}

std::string load_error(const fs::path& dir) {
  return test::error_of([&] { load_model(dir.string()); });
}

TEST(Nvfp4Checkpoint, MissingGlobalScaleIsNamed) {
  auto dir = edited_copy("no_scale_2", [](auto& h) { h.erase(kExpert + ".weight_scale_2"); });
  EXPECT_THAT(load_error(dir), AllOf(HasSubstr("missing tensor"), HasSubstr(kExpert + ".weight_scale_2")));
}

TEST(Nvfp4Checkpoint, BlockScalesOfTheWrongShapeOrDtypeAreNamed) {
  auto shape = edited_copy("scale_shape", [](auto& h) {
    auto& s = h[kExpert + ".weight_scale"]["shape"];
    s = nlohmann::json::array({s[1], s[0]});
  });
  EXPECT_THAT(load_error(shape), AllOf(HasSubstr(kExpert + ".weight_scale"), HasSubstr("expected shape")));
  auto dtype = edited_copy("scale_dtype", [](auto& h) { h[kExpert + ".weight_scale"]["dtype"] = "U8"; });
  EXPECT_THAT(load_error(dtype), AllOf(HasSubstr(kExpert + ".weight_scale"), HasSubstr("F8_E4M3")));
}

TEST(Nvfp4Checkpoint, PackedCodesOfTheWrongShapeAreNamed) {
  auto dir = edited_copy("codes_shape", [](auto& h) {
    auto& s = h[kExpert + ".weight"]["shape"];
    s = nlohmann::json::array({s[1], s[0]});
  });
  EXPECT_THAT(load_error(dir), AllOf(HasSubstr(kExpert + ".weight"), HasSubstr("two e2m1 codes a byte")));
}

TEST(Nvfp4Checkpoint, Fp8ScaleThatIsNotOneF32IsNamed) {
  const std::string scale = "model.layers.1.mlp.shared_expert.gate_proj.weight_scale";
  auto dir = edited_copy("fp8_scale", [&](auto& h) { h[scale]["dtype"] = "I32"; });
  EXPECT_THAT(load_error(dir), AllOf(HasSubstr(scale), HasSubstr("expected one F32 value")));
}

}  // namespace
}  // namespace vavilov
