// Malformed checkpoints are rejected with one error naming the file and tensor; the CLI exits non-zero without
// leaving a partial output file.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "edited_checkpoint.h"
#include "error_of.h"
#include "fixture_paths.h"
#include "model/weights.h"
#include "run_command.h"
#ifdef VAVILOV_HAVE_CUDA
#include "cuda/backend.h"
#endif

namespace vavilov {
namespace {

namespace fs = std::filesystem;
using ::testing::AllOf;
using ::testing::HasSubstr;

const fs::path kFixture = test::model_fixtures() / "tiny_f32_hc4_ple1";

fs::path edited_copy(const std::string& name, const std::function<void(nlohmann::json&)>& edit) {
  return test::edited_checkpoint(kFixture, name, edit);
}

std::string load_error(const fs::path& dir) {
  return test::error_of([&] { load_model(dir.string()); });
}

TEST(ModelLoading, MissingTensorIsNamed) {
  auto dir = edited_copy("missing", [](auto& h) { h.erase("model.layers.3.self_attn.k_norm.weight"); });
  EXPECT_THAT(load_error(dir), AllOf(HasSubstr("missing tensor"), HasSubstr("model.layers.3.self_attn.k_norm.weight"),
                                     HasSubstr(dir.string())));
}

TEST(ModelLoading, ShapeMismatchIsNamed) {
  auto dir = edited_copy("shape", [](auto& h) {
    auto& shape = h["model.layers.0.linear_attn.in_proj_qkv.weight"]["shape"];
    shape = nlohmann::json::array({shape[1], shape[0]});
  });
  EXPECT_THAT(load_error(dir), AllOf(HasSubstr("model.layers.0.linear_attn.in_proj_qkv.weight"),
                                     HasSubstr("expected shape"), HasSubstr("model.safetensors")));
}

TEST(ModelLoading, NonFloatWeightIsNamed) {
  auto dir = edited_copy("dtype", [](auto& h) { h["lm_head.weight"]["dtype"] = "I32"; });
  EXPECT_THAT(load_error(dir), AllOf(HasSubstr("lm_head.weight"), HasSubstr("not a float type")));
}

TEST(ModelLoading, PleBufferWithWrongDtypeIsNamed) {
  auto dir = edited_copy("ple_dtype", [](auto& h) {
    h["model.layers.1.ple.ple_embedding.layer_multipliers"]["dtype"] = "F32";
    h["model.layers.1.ple.ple_embedding.layer_multipliers"]["shape"] = {6};
  });
  EXPECT_THAT(load_error(dir), HasSubstr("model.layers.1.ple.ple_embedding.layer_multipliers"));
}

using test::CommandResult;

CommandResult run(const std::string& arguments, bool with_stderr = true) {
  return test::run_vavilov(arguments, with_stderr);
}

TEST(Cli, BadCheckpointGivesOneLineErrorAndNoOutputFile) {
  auto dir = edited_copy("cli", [](auto& h) { h.erase("model.embed_tokens.weight"); });
  fs::path out = dir / "logits.f32";
  CommandResult result = run("logits --model " + dir.string() + " --ids 1,2,3 --out " + out.string());
  EXPECT_NE(result.exit_code, 0);
  EXPECT_THAT(result.output, AllOf(HasSubstr("vavilov: error:"), HasSubstr("model.embed_tokens.weight")));
  EXPECT_EQ(std::count(result.output.begin(), result.output.end(), '\n'), 1);
  EXPECT_FALSE(fs::exists(out));
}

TEST(Cli, TokenIdOutsideVocabularyIsRejected) {
  CommandResult result = run("generate --model " + kFixture.string() + " --ids 1,99999 --max-tokens 2");
  EXPECT_NE(result.exit_code, 0);
  EXPECT_THAT(result.output, HasSubstr("99999"));
}

TEST(Cli, MalformedIdsAreRejected) {
  CommandResult result = run("generate --model " + kFixture.string() + " --ids 1,,x --max-tokens 2");
  EXPECT_NE(result.exit_code, 0);
  EXPECT_THAT(result.output, HasSubstr("--ids"));
}

// --device cuda runs on a GPU when there is one; without one (CI) it is a one-line error and writes nothing.
TEST(Cli, DeviceCudaRunsOrNamesWhyNot) {
  fs::path out = fs::temp_directory_path() / "vavilov_device_cuda_logits.f32";
  fs::remove(out);
  CommandResult result =
      run("logits --device cuda --model " + kFixture.string() + " --ids 1,2,3 --out " + out.string());
  if (result.exit_code == 0) {
    EXPECT_TRUE(fs::exists(out));
  } else {
    EXPECT_THAT(result.output, HasSubstr("vavilov: error: --device cuda: "));
    EXPECT_EQ(std::count(result.output.begin(), result.output.end(), '\n'), 1);
    EXPECT_FALSE(fs::exists(out));
  }
  fs::remove(out);
}

// The server chooses its device once the model is loaded: without a GPU (CI) --device cuda is a one-line error. (With
// one, every weight format runs there and serve would start: the GPU tests cover that side.)
TEST(Cli, ServeOnTheGpuWithoutOneIsAnError) {
#ifdef VAVILOV_HAVE_CUDA
  if (cuda::device_count() > 0) GTEST_SKIP() << "a GPU is present: serve --device cuda would start serving";
#endif
  CommandResult result = run("serve --device cuda --experts 3 --port 0");
  EXPECT_NE(result.exit_code, 0);
  EXPECT_THAT(result.output, HasSubstr("vavilov: error: --device cuda: "));
}

TEST(Cli, DeviceCpuAndUnknownDevice) {
  fs::path out = fs::temp_directory_path() / "vavilov_device_cpu_logits.f32";
  EXPECT_EQ(run("logits --device cpu --model " + kFixture.string() + " --ids 1,2,3 --out " + out.string()).exit_code,
            0);
  EXPECT_TRUE(fs::exists(out));
  fs::remove(out);
  EXPECT_NE(run("logits --device tpu --model " + kFixture.string() + " --ids 1,2,3 --out " + out.string()).exit_code,
            0);
  EXPECT_FALSE(fs::exists(out));
}

TEST(Cli, GenerateMatchesHfGreedy) {
  std::ifstream in(kFixture / "reference.json");
  auto reference = nlohmann::json::parse(in);
  std::string ids;
  for (const auto& id : reference["prompt_ids"]) {
    if (!ids.empty()) ids += ',';
    ids += std::to_string(id.get<int>());
  }
  CommandResult result =
      run("generate --model " + kFixture.string() + " --ids " + ids + " --max-tokens 24 --ignore-eos", false);
  ASSERT_EQ(result.exit_code, 0) << result.output;
  EXPECT_EQ(nlohmann::json::parse(result.output.substr(0, result.output.find('\n'))), reference["greedy_ids"]);
}

}  // namespace
}  // namespace vavilov
