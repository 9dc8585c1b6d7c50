// The CPU draft head: its vocabulary file (draft_vocab.json) and its int8 lm_head. A draft vocabulary restricts what
// the head proposes, so greedy speculative decoding with one must still equal plain greedy decoding, and every draft
// must come from the vocabulary.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "cpu/mtp.h"
#include "engine/backend.h"
#include "engine/generate.h"
#include "engine/speculative.h"
#include "fixture_paths.h"
#include "model/weights.h"

namespace vavilov {
namespace {

namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir()
      : path_(fs::temp_directory_path() /
              ("vavilov_draft_" + std::to_string(::getpid()) + "_" + std::to_string(counter_++))) {
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }

 private:
  static inline int counter_ = 0;
  fs::path path_;
};

void write(const fs::path& path, const std::string& text) { std::ofstream(path) << text; }

Model model_in(const fs::path& dir, int64_t vocab) {
  Model model;
  model.directory = dir.string();
  model.config.vocab_size = vocab;
  return model;
}

TEST(DraftVocabulary, NoFileMeansEveryId) {
  TempDir dir;
  EXPECT_TRUE(draft_vocabulary(model_in(dir.path(), 16)).empty());
}

TEST(DraftVocabulary, TakesTheFirstIdsInOrder) {
  TempDir dir;
  write(dir.path() / "draft_vocab.json", R"({"token_ids": [7, 3, 15, 0, 9]})");
  EXPECT_EQ(draft_vocabulary(model_in(dir.path(), 16), 3), (std::vector<int32_t>{7, 3, 15}));
  EXPECT_EQ(draft_vocabulary(model_in(dir.path(), 16), 10), (std::vector<int32_t>{7, 3, 15, 0, 9}));
}

TEST(DraftVocabulary, BadFilesAreErrorsNamingTheFile) {
  for (const char* text : {"not json", R"({"ids": [1]})", R"({"token_ids": [1, 1]})", R"({"token_ids": [16]})",
                           R"({"token_ids": [-1]})", R"({"token_ids": ["a"]})", R"({"token_ids": []})"}) {
    TempDir dir;
    write(dir.path() / "draft_vocab.json", text);
    try {
      draft_vocabulary(model_in(dir.path(), 16));
      ADD_FAILURE() << "accepted " << text;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("draft_vocab.json"), std::string::npos) << e.what();
    }
  }
}

// The bundled model ships the list its default uses: kDraftVocabulary distinct ids of its vocabulary.
TEST(DraftVocabulary, BundledModelHasOne) {
  const fs::path dir = test::source_dir() / "models" / "flash-next-mini";
  if (!fs::exists(dir / "draft_vocab.json")) GTEST_SKIP() << "no bundled model";
  const std::vector<int32_t> ids = draft_vocabulary(model_in(dir, 8192));
  EXPECT_EQ(int64_t(ids.size()), kDraftVocabulary);
  EXPECT_EQ(std::set<int32_t>(ids.begin(), ids.end()).size(), ids.size());
}

// A fixture with a draft vocabulary of every third id: the drafts all come from it, the draft logits of every other
// id are -inf, and greedy speculative decoding still equals plain greedy decoding.
TEST(DraftHead, VocabularySubsetKeepsGreedyDecodingExact) {
  const fs::path fixture = test::mtp_fixtures() / "mtp_f32_hc4";
  if (!fs::exists(fixture / "reference.json")) GTEST_SKIP() << "no fixture " << fixture;
  TempDir dir;
  for (const auto& entry : fs::directory_iterator(fixture))
    fs::copy(entry.path(), dir.path() / entry.path().filename());
  auto model = load_model(dir.path().string());
  const int64_t vocab = model->config.vocab_size;
  nlohmann::json ids = nlohmann::json::array();
  std::set<int32_t> allowed;
  for (int32_t id = int32_t(vocab) - 1; id >= 0; id -= 3) {
    ids.push_back(id);
    allowed.insert(id);
  }
  write(dir.path() / "draft_vocab.json", nlohmann::json{{"token_ids", ids}}.dump());

  std::ifstream in(fixture / "reference.json");
  const auto prompt = nlohmann::json::parse(in)["prompt_ids"].get<std::vector<int32_t>>();
  GenerateOptions options;
  options.max_tokens = 48;
  options.ignore_eos = true;
  GenerateStats plain_stats;
  const std::vector<int32_t> want = generate_greedy(*model, prompt, options, plain_stats);

  SpeculativeOptions speculative;
  speculative.drafts = 2;
  int64_t drafts_seen = 0;
  speculative.draft_override = [&](int64_t, int32_t draft) {
    EXPECT_TRUE(allowed.count(draft)) << "draft " << draft << " is outside the draft vocabulary";
    ++drafts_seen;
    return draft;
  };
  GenerateStats stats;
  SpeculativeStats spec_stats;
  const std::vector<int32_t> got = generate_speculative(*model, prompt, options, speculative, stats, spec_stats);
  EXPECT_EQ(got, want);
  EXPECT_GT(drafts_seen, 0);

  const cpu::DraftLmHead head = cpu::draft_lm_head(*model, draft_vocabulary(*model));
  std::vector<float> stack(size_t(model->config.hc_hidden()), 0.5f), logits(static_cast<size_t>(vocab));
  for (size_t i = 0; i < stack.size(); ++i) stack[i] = std::sin(float(i));
  cpu::mtp_draft_logits(*model, head, stack.data(), logits.data());
  for (int64_t id = 0; id < vocab; ++id)
    EXPECT_EQ(std::isfinite(logits[size_t(id)]), allowed.count(int32_t(id)) == 1) << "id " << id;
}

}  // namespace
}  // namespace vavilov
