// A tiny qwen4_exp checkpoint in MLX's affine layout (tests/fixtures/models_mlx, made with mlx by
// tools/make_mlx_model_fixture.py) runs end to end and matches HF transformers run on its dequantized weights;
// malformed quantized tensors and quantization configs are rejected with errors that name them.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "cpu/forward.h"
#include "cpu/linear.h"
#include "edited_checkpoint.h"
#include "error_of.h"
#include "fixture_paths.h"
#include "model/mlx_quantization.h"
#include "model/quantize.h"
#include "model/weights.h"
#include "reference_logits.h"
#include "run_command.h"

namespace vavilov {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::HasSubstr;

const fs::path kFixture = test::source_dir() / "tests/fixtures/models_mlx/tiny_mlx_q4";
const std::string kLayer0 = "language_model.model.layers.0.";

// The engine (fp32 arithmetic on the stored codes) against HF in fp32 on exactly the dequantized values: both sides
// see the same weights, so only rounding order differs; the bound is the one of the dense fixtures (1e-4 of the
// largest logit, observed ~1e-6).
constexpr double kTolerance = 1e-4;

// One-shot (quantized rows widened once per matrix), chunks of 5 and token by token (codes decoded in registers).
TEST(MlxCheckpoint, LogitsMatchHfOnTheDequantizedWeights) {
  const test::ReferenceFixture fixture(kFixture);
  const auto& prompt = fixture.prompt;
  const auto& want = fixture.logits;
  auto model = load_model(kFixture.string());
  ASSERT_EQ(want.size(), prompt.size() * size_t(model->config.vocab_size));
  for (size_t chunk : {prompt.size(), size_t(5), size_t(1)})
    EXPECT_LE(test::relative_error(test::engine_logits(*model, prompt, chunk), want), kTolerance) << "chunk " << chunk;
}

TEST(MlxCheckpoint, GreedyContinuationMatchesHf) {
  const test::ReferenceFixture fixture(kFixture);
  EXPECT_EQ(test::engine_greedy(*load_model(kFixture.string()), fixture), fixture.greedy);
}

// The layout maps onto our matrices without conversion: Q4 codes, scales and biases are the checkpoint's own bytes;
// per-module overrides give each matrix its own precision.
TEST(MlxCheckpoint, EachMatrixKeepsItsOwnPrecisionAndBytes) {
  auto model = load_model(kFixture.string());
  const std::string embed = "language_model.model.embed_tokens.";
  EXPECT_EQ(model->embed.bits, 4);
  EXPECT_EQ(model->embed.data, model->store->get(embed + "weight").data);  // memory-mapped in place, not copied
  EXPECT_EQ(static_cast<const void*>(model->embed.scales), model->store->get(embed + "scales").data);
  EXPECT_EQ(static_cast<const void*>(model->embed.biases), model->store->get(embed + "biases").data);
  EXPECT_EQ(model->lm_head.bits, 4);
  EXPECT_EQ(model->layers[0].moe.router.bits, 8);  // mlx-vlm's 8-bit router override
  EXPECT_EQ(model->layers[2].moe.router.bits, 0);  // `false`: left BF16
  EXPECT_EQ(model->layers[2].moe.router.dtype, DType::BF16);
  for (const auto& expert : model->layers[0].moe.experts) {
    EXPECT_EQ(expert.gate.bits, 4);
    EXPECT_EQ(expert.down.bits, 2);
  }
  EXPECT_EQ(model->layers[1].moe.experts[7].gate.bits, 3);
  EXPECT_EQ(model->layers[1].moe.experts[7].up.bits, 4);
  const PleWeights& ple = *model->layers[1].ple;
  EXPECT_EQ(ple.table_shards.size(), 2u);
  EXPECT_EQ(ple.table_shards[0].group, 32);
  EXPECT_EQ(ple.table_shards[0].bits, 4);
}

// --experts 3 and 2: every routed expert re-quantized from its dequantized values (Q4 and the mixed 3/2-bit ones),
// against HF on weights mlx re-quantized the same way.
TEST(MlxCheckpoint, ExpertsAtThreeAndTwoBitsMatchHf) {
  const test::ReferenceFixture fixture(kFixture);
  const auto& prompt = fixture.prompt;
  const auto& ref = fixture.reference;
  for (int bits : {3, 2}) {
    auto model = load_model(kFixture.string());
    int changed = quantize_experts(*model, bits);
    const int64_t layers = model->config.num_layers, experts = model->config.num_experts;
    EXPECT_EQ(changed, layers * experts * 3 - experts) << bits;  // one stacked module is already at `bits`
    for (const auto& layer : model->layers)
      for (const auto& expert : layer.moe.experts)
        for (const Matrix* m : {&expert.gate, &expert.up, &expert.down}) EXPECT_EQ(m->bits, bits) << m->name;
    auto want = test::read_floats(kFixture / ref["experts_logits_files"][std::to_string(bits)].get<std::string>());
    for (size_t chunk : {prompt.size(), size_t(1)})
      EXPECT_LE(test::relative_error(test::engine_logits(*model, prompt, chunk), want), kTolerance) << bits << " bits";
  }
}

// Dense fp32 copy of a matrix's values (dequantized when quantized), owned by `model`.
Matrix dense_copy(Model& model, const Matrix& m) {
  std::vector<std::byte> bytes(size_t(m.rows * m.cols) * sizeof(float));
  auto* values = reinterpret_cast<float*>(bytes.data());
  for (int64_t r = 0; r < m.rows; ++r) cpu::matrix_row(m, r, values + r * m.cols);
  model.owned.push_back(std::move(bytes));
  return Matrix{m.name, DType::F32, m.rows, m.cols, model.owned.back().data()};
}

// Precision chosen per expert inside one layer (2, 3 and 4 bits side by side, as the streaming work needs): the
// quantized kernels give what dense fp32 products of the very same values give. 1e-5 of the largest logit: fp32
// rounding order only.
TEST(MlxCheckpoint, MixedPrecisionPerExpertEqualsDenseCopiesOfTheSameValues) {
  const test::ReferenceFixture fixture(kFixture);
  const auto& prompt = fixture.prompt;
  auto mixed = load_model(kFixture.string());
  auto dense = load_model(kFixture.string());
  for (size_t l = 0; l < mixed->layers.size(); ++l)
    for (size_t e = 0; e < mixed->layers[l].moe.experts.size(); ++e) {
      FeedForwardWeights& expert = mixed->layers[l].moe.experts[e];
      FeedForwardWeights& copy = dense->layers[l].moe.experts[e];
      int bits = e % 3 == 0 ? 2 : e % 3 == 1 ? 3 : 0;  // 0: keep the checkpoint's own precision
      for (auto [m, d] : {std::pair{&expert.gate, &copy.gate}, {&expert.up, &copy.up}, {&expert.down, &copy.down}}) {
        if (bits) *m = quantize_matrix(*mixed, *m, bits);
        *d = dense_copy(*dense, *m);
      }
    }
  EXPECT_EQ(mixed->layers[0].moe.experts[0].gate.bits, 2);
  EXPECT_EQ(mixed->layers[0].moe.experts[1].gate.bits, 3);
  EXPECT_EQ(mixed->layers[0].moe.experts[2].gate.bits, 4);
  for (size_t chunk : {prompt.size(), size_t(1)})
    EXPECT_LE(
        test::relative_error(test::engine_logits(*mixed, prompt, chunk), test::engine_logits(*dense, prompt, chunk)),
        1e-5)
        << "chunk " << chunk;
}

// The CLI wiring: `logits --experts 3` on the MLX checkpoint writes HF's logits for 3-bit experts; a precision
// other than 4, 3 or 2 is refused before anything is loaded.
TEST(MlxCheckpoint, LogitsCommandTakesExperts) {
  const test::ReferenceFixture fixture(kFixture);
  const auto& ref = fixture.reference;
  std::string ids;
  for (const auto& id : ref["prompt_ids"]) {
    if (!ids.empty()) ids += ',';
    ids += std::to_string(id.get<int>());
  }
  fs::path out = fs::temp_directory_path() / ("vavilov_mlx_experts_" + std::to_string(::getpid()) + ".f32");
  auto result =
      test::run_vavilov("logits --model " + kFixture.string() + " --ids " + ids + " --experts 3 --out " + out.string());
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_THAT(result.output, HasSubstr("to 3 bits"));
  auto want = test::read_floats(kFixture / ref["experts_logits_files"]["3"].get<std::string>());
  EXPECT_LE(test::relative_error(test::read_floats(out), want), kTolerance);
  fs::remove(out);
  auto refused =
      test::run_vavilov("logits --model " + kFixture.string() + " --ids 1,2 --experts 5 --out " + out.string());
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_THAT(refused.output, HasSubstr("--experts"));
  EXPECT_FALSE(fs::exists(out));
}

fs::path edited_copy(const std::string& name, const std::function<void(nlohmann::json&)>& edit_header,
                     const std::function<void(nlohmann::json&)>& edit_config = {}) {
  return test::edited_checkpoint(kFixture, "mlx_" + name, edit_header, edit_config);
}

std::string load_error(const fs::path& dir) {
  return test::error_of([&] { load_model(dir.string()); });
}

TEST(MlxCheckpoint, MissingScalesAreNamed) {
  const std::string module = kLayer0 + "linear_attn.out_proj";
  auto dir = edited_copy("no_scales", [&](auto& h) { h.erase(module + ".scales"); });
  EXPECT_THAT(load_error(dir), AllOf(HasSubstr("missing tensor"), HasSubstr(module + ".scales")));
}

TEST(MlxCheckpoint, ScalesOfTheWrongShapeAreNamed) {
  const std::string module = kLayer0 + "mlp.switch_mlp.gate_proj";
  auto dir = edited_copy("scales_shape", [&](auto& h) { h[module + ".biases"]["shape"] = {8, 1, 64}; });
  EXPECT_THAT(load_error(dir), AllOf(HasSubstr(module + ".biases"), HasSubstr("expected shape [8, 64, 1]")));
}

TEST(MlxCheckpoint, CodesOfTheWrongShapeAreNamed) {
  const std::string name = kLayer0 + "mlp.switch_mlp.up_proj.weight";
  auto dir = edited_copy("codes_shape", [&](auto& h) { h[name]["shape"] = {8, 8, 64}; });
  EXPECT_THAT(load_error(dir),
              AllOf(HasSubstr(name), HasSubstr("expected shape [8, 64, 8]"), HasSubstr("4-bit codes of 64 columns")));
}

TEST(MlxCheckpoint, CodesThatAreNotU32AreNamed) {
  const std::string name = kLayer0 + "linear_attn.in_proj_z.weight";
  auto dir = edited_copy("codes_dtype", [&](auto& h) { h[name]["dtype"] = "F32"; });
  EXPECT_THAT(load_error(dir), AllOf(HasSubstr(name), HasSubstr("expected U32")));
}

TEST(MlxCheckpoint, BitsThatDisagreeWithTheCodesAreNamed) {
  const std::string module = kLayer0 + "linear_attn.in_proj_qkv";
  auto dir = edited_copy("bits_mismatch", {}, [&](auto& c) {
    c["quantization"][module] = {{"group_size", 64}, {"bits", 3}};
  });
  EXPECT_THAT(load_error(dir), AllOf(HasSubstr(module + ".weight"), HasSubstr("3-bit codes")));
}

TEST(MlxCheckpoint, QuantizedTensorsWithoutAQuantizationConfigAreRejected) {
  auto dir = edited_copy("no_config", {}, [](auto& c) {
    c.erase("quantization");
    c.erase("quantization_config");
  });
  EXPECT_THAT(load_error(dir), AllOf(HasSubstr("declares no quantization"), HasSubstr("embed_tokens")));
}

TEST(MlxCheckpoint, QuantizedModuleMarkedDenseIsRejected) {
  const std::string module = kLayer0 + "linear_attn.in_proj_a";
  auto dir = edited_copy("marked_dense", {}, [&](auto& c) { c["quantization"][module] = false; });
  EXPECT_THAT(load_error(dir), AllOf(HasSubstr(module), HasSubstr("not quantized")));
}

TEST(MlxQuantizationConfig, BadBitsGroupsAndModesAreNamed) {
  auto error = [](const std::string& text) {
    return test::error_of([&] { parse_mlx_quantization(text, "config.json"); });
  };
  EXPECT_THAT(error(R"({"quantization": {"bits": 7, "group_size": 64}})"),
              AllOf(HasSubstr("config.json"), HasSubstr("quantization.bits")));
  EXPECT_THAT(error(R"({"quantization": {"bits": 4, "group_size": 16}})"), HasSubstr("quantization.group_size"));
  EXPECT_THAT(error(R"({"quantization": {"bits": 4, "group_size": 32, "mode": "mxfp4"}})"),
              HasSubstr("quantization.mode"));
  EXPECT_THAT(error(R"({"quantization": {"bits": 4, "group_size": 64, "a.b": {"bits": "x"}}})"),
              HasSubstr("quantization[\"a.b\"].bits"));
  EXPECT_THAT(error(R"({"quantization": {"bits": 4, "group_size": 64, "a.b": 3}})"),
              HasSubstr("quantization[\"a.b\"]"));
}

TEST(MlxQuantizationConfig, OverridesAndOtherFormats) {
  auto q = parse_mlx_quantization(
      R"({"quantization": {"bits": 4, "group_size": 64, "m.gate": false, "m.table": {"group_size": 32}}})", "c");
  ASSERT_TRUE(q.has_value());
  EXPECT_EQ(q->for_module("m.other")->bits, 4);
  EXPECT_FALSE(q->for_module("m.gate").has_value());
  EXPECT_EQ(q->for_module("m.table")->group, 32);
  EXPECT_EQ(q->for_module("m.table")->bits, 4);
  auto from_text_config =
      parse_mlx_quantization(R"({"text_config": {"quantization_config": {"bits": 3, "group_size": 128}}})", "c");
  ASSERT_TRUE(from_text_config.has_value());
  EXPECT_EQ(from_text_config->defaults.bits, 3);
  EXPECT_FALSE(parse_mlx_quantization(R"({"quantization_config": {"quant_method": "fp8"}})", "c").has_value());
  EXPECT_FALSE(parse_mlx_quantization(R"({"model_type": "qwen4_exp"})", "c").has_value());
}

}  // namespace
}  // namespace vavilov
