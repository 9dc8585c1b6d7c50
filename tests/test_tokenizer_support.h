#pragma once
// Shared by the tokenizer and template tests: where the real tokenizers and the fixtures live.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>

#include "tokenizer/tokenizer.h"

namespace vavilov::testing {

inline std::filesystem::path shared_tokenizers_dir() {
  return std::filesystem::path(VAVILOV_SOURCE_DIR) / ".." / "shared" / "data" / "tokenizers";
}

inline std::filesystem::path tokenizer_fixtures_dir() {
  return std::filesystem::path(VAVILOV_SOURCE_DIR) / "tests" / "fixtures" / "tokenizer";
}

inline std::string read_binary_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in) << "cannot open " << path;
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

// The real tokenizers live outside the repository; CI must have them, a developer checkout may not.
#define VAVILOV_REQUIRE_SHARED_TOKENIZERS()                                                             \
  do {                                                                                                  \
    if (!std::filesystem::exists(::vavilov::testing::shared_tokenizers_dir())) {                        \
      const char* ci = std::getenv("CI");                                                               \
      if (ci && std::string(ci) == "true") FAIL() << "missing " << shared_tokenizers_dir() << " on CI"; \
      GTEST_SKIP() << "missing " << shared_tokenizers_dir();                                            \
    }                                                                                                   \
  } while (false)

// Loading tokenizer.json takes a fraction of a second; each test binary loads each tokenizer once.
inline const tokenizer::Tokenizer& shared_tokenizer(const std::string& name) {
  static std::map<std::string, std::unique_ptr<tokenizer::Tokenizer>> loaded;
  auto& slot = loaded[name];
  if (!slot)
    slot = std::make_unique<tokenizer::Tokenizer>(tokenizer::Tokenizer::from_model_dir(shared_tokenizers_dir() / name));
  return *slot;
}

}  // namespace vavilov::testing
