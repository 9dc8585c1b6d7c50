// Ids on the 1.5 MB corpus must equal HF `tokenizers` 0.23.3 (fixtures from tools/tokenizer/), and decoding must
// give back HF's text.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include "test_tokenizer_support.h"
#include "tokenizer/stream_decoder.h"
#include "tokenizer/utf8.h"

namespace vavilov::testing {
namespace {

uint32_t read_u32(const std::string& data, size_t& offset) {
  uint32_t value = 0;
  EXPECT_LE(offset + 4, data.size());
  std::memcpy(&value, data.data() + offset, 4);  // fixtures are little-endian, like every target of this engine
  offset += 4;
  return value;
}

std::vector<std::string> read_corpus() {
  const std::string data = read_binary_file(tokenizer_fixtures_dir() / "corpus.bin");
  std::vector<std::string> documents;
  for (size_t offset = 0; offset < data.size();) {
    const uint32_t length = read_u32(data, offset);
    documents.push_back(data.substr(offset, length));
    offset += length;
  }
  return documents;
}

std::vector<std::vector<uint32_t>> read_expected_ids(const std::string& name) {
  const std::string data = read_binary_file(tokenizer_fixtures_dir() / (name + ".ids"));
  std::vector<std::vector<uint32_t>> per_document;
  for (size_t offset = 0; offset < data.size();) {
    std::vector<uint32_t>& ids = per_document.emplace_back(read_u32(data, offset));
    for (uint32_t& id : ids) id = read_u32(data, offset);
  }
  return per_document;
}

uint64_t fnv1a64(std::string_view data) {
  uint64_t hash = 0xCBF29CE484222325ull;
  for (char c : data) hash = (hash ^ static_cast<unsigned char>(c)) * 0x100000001B3ull;
  return hash;
}

std::string describe_difference(const std::vector<uint32_t>& actual, const std::vector<uint32_t>& expected) {
  size_t first = 0;
  while (first < actual.size() && first < expected.size() && actual[first] == expected[first]) ++first;
  std::string text = fmt::format("lengths {} vs {}, first difference at {}:", actual.size(), expected.size(), first);
  for (size_t i = first; i < first + 6; ++i) {
    text += fmt::format(" [{} vs {}]", i < actual.size() ? std::to_string(actual[i]) : "-",
                        i < expected.size() ? std::to_string(expected[i]) : "-");
  }
  return text;
}

class TokenizerCorpus : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { VAVILOV_REQUIRE_SHARED_TOKENIZERS(); }
};

TEST_P(TokenizerCorpus, IdsMatchHuggingFace) {
  const auto& tokenizer = shared_tokenizer(GetParam());
  const auto documents = read_corpus();
  const auto expected = read_expected_ids(GetParam());
  ASSERT_EQ(documents.size(), expected.size());
  const auto sources = nlohmann::json::parse(read_binary_file(tokenizer_fixtures_dir() / "corpus_sources.json"));
  size_t mismatches = 0;
  for (size_t i = 0; i < documents.size(); ++i) {
    const auto ids = tokenizer.encode(documents[i]);
    if (ids != expected[i] && ++mismatches <= 5) {
      ADD_FAILURE() << "document " << i << " (" << sources["sources"][i].get<std::string>()
                    << "): " << describe_difference(ids, expected[i]);
    }
  }
  EXPECT_EQ(mismatches, 0u);
}

TEST_P(TokenizerCorpus, DecodeMatchesHuggingFace) {
  const auto& tokenizer = shared_tokenizer(GetParam());
  const auto expected = read_expected_ids(GetParam());
  const auto meta = nlohmann::json::parse(read_binary_file(tokenizer_fixtures_dir() / (GetParam() + ".decoded.json")));
  ASSERT_EQ(meta["decoded_fnv1a64"].size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(fmt::format("{:016x}", fnv1a64(tokenizer.decode(expected[i]))),
              meta["decoded_fnv1a64"][i].get<std::string>())
        << "document " << i;
    EXPECT_EQ(fmt::format("{:016x}", fnv1a64(tokenizer.decode(expected[i], true))),
              meta["decoded_skip_special_fnv1a64"][i].get<std::string>())
        << "document " << i << " without special tokens";
  }
}

TEST_P(TokenizerCorpus, StreamingDecodeEqualsWholeDecode) {
  const auto& tokenizer = shared_tokenizer(GetParam());
  for (const auto& ids : read_expected_ids(GetParam())) {
    tokenizer::StreamDecoder stream(tokenizer);
    std::string streamed;
    for (uint32_t id : ids) {
      const std::string piece = stream.push(id);
      ASSERT_TRUE(tokenizer::is_valid_utf8(piece)) << "a piece split a character";
      streamed += piece;
    }
    streamed += stream.finish();
    ASSERT_EQ(streamed, tokenizer.decode(ids));
  }
}

INSTANTIATE_TEST_SUITE_P(TokenizerReal, TokenizerCorpus, ::testing::Values("qwen3", "deepseek_v3"));

// DeepSeek-V3 has no normaliser, so decoding the ids of any text gives the text back (after lossy UTF-8 repair).
TEST(TokenizerRoundTrip, DecodeOfEncodeIsTheText) {
  VAVILOV_REQUIRE_SHARED_TOKENIZERS();
  const auto& tokenizer = shared_tokenizer("deepseek_v3");
  for (const std::string& document : read_corpus()) {
    ASSERT_EQ(tokenizer.decode(tokenizer.encode(document)), tokenizer::to_valid_utf8(document));
  }
}

// Qwen3 normalises to NFC; text already in NFC (all the stdlib sources) round-trips exactly.
TEST(TokenizerRoundTrip, NfcTextRoundTripsThroughQwen3) {
  VAVILOV_REQUIRE_SHARED_TOKENIZERS();
  const auto& tokenizer = shared_tokenizer("qwen3");
  const auto sources = nlohmann::json::parse(read_binary_file(tokenizer_fixtures_dir() / "corpus_sources.json"));
  const auto documents = read_corpus();
  for (size_t i = 0; i < documents.size(); ++i) {
    if (sources["sources"][i].get<std::string>().rfind("python-stdlib:", 0) != 0) continue;
    ASSERT_EQ(tokenizer.decode(tokenizer.encode(documents[i])), documents[i]) << "document " << i;
  }
}

}  // namespace
}  // namespace vavilov::testing
