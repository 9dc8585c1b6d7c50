// --expert-cache-mb on the CPU: a one-line error naming the option, and no output file.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <filesystem>

#include "fixture_paths.h"
#include "run_command.h"

namespace vavilov {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

const fs::path kFixture = test::model_fixtures() / "tiny_f32_hc4_ple1";

TEST(ExpertCacheCli, OnTheCpuIsAnErrorNamingTheOption) {
  const test::CommandResult generate = test::run_vavilov("generate --device cpu --expert-cache-mb 0 --model " +
                                                         kFixture.string() + " --ids 1,2 --max-tokens 1");
  EXPECT_NE(generate.exit_code, 0);
  EXPECT_THAT(generate.output, HasSubstr("--expert-cache-mb: the expert cache is for the GPU"));
  const fs::path out = fs::temp_directory_path() / "vavilov_expert_cache_cli.f32";
  fs::remove(out);
  const test::CommandResult logits = test::run_vavilov("logits --device cpu --expert-cache-mb 64 --model " +
                                                       kFixture.string() + " --ids 1,2 --out " + out.string());
  EXPECT_NE(logits.exit_code, 0);
  EXPECT_THAT(logits.output, HasSubstr("--expert-cache-mb"));
  EXPECT_FALSE(fs::exists(out));
}

TEST(ExpertCacheCli, NegativeSizeIsRefused) {
  const test::CommandResult r = test::run_vavilov("generate --device cpu --expert-cache-mb -5 --model " +
                                                  kFixture.string() + " --ids 1,2 --max-tokens 1");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.output, HasSubstr("--expert-cache-mb"));
}

}  // namespace
}  // namespace vavilov
