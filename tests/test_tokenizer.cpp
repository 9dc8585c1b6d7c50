// Tokenizer behaviour on short cases (expected ids from HF `tokenizers`) and on bad input.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "test_tokenizer_support.h"
#include "tokenizer/stream_decoder.h"
#include "tokenizer/utf8.h"

namespace vavilov::testing {
namespace {

using tokenizer::Tokenizer;

TEST(TokenizerEdgeCases, IdsMatchHuggingFace) {
  VAVILOV_REQUIRE_SHARED_TOKENIZERS();
  const auto cases = nlohmann::json::parse(read_binary_file(tokenizer_fixtures_dir() / "edge_cases.json"));
  ASSERT_GT(cases.size(), 20u);
  for (const char* name : {"qwen3", "deepseek_v3"}) {
    for (const auto& item : cases) {
      const std::string text = item["text"];
      EXPECT_EQ(shared_tokenizer(name).encode(text), item[name].get<std::vector<uint32_t>>())
          << name << " on \"" << text << "\"";
    }
  }
}

TEST(TokenizerSpecialTokens, DecodeCanSkipThem) {
  VAVILOV_REQUIRE_SHARED_TOKENIZERS();
  const auto& qwen = shared_tokenizer("qwen3");
  const auto ids = qwen.encode("<|im_start|>user\nhi<|im_end|>");
  EXPECT_EQ(qwen.decode(ids), "<|im_start|>user\nhi<|im_end|>");
  EXPECT_EQ(qwen.decode(ids, true), "user\nhi");
  EXPECT_TRUE(qwen.is_special(ids.front()));
  EXPECT_EQ(qwen.token_to_id("<|im_end|>"), std::optional<uint32_t>(151645));
}

TEST(TokenizerStreaming, NeverSplitsACharacter) {
  VAVILOV_REQUIRE_SHARED_TOKENIZERS();
  const auto& qwen = shared_tokenizer("qwen3");
  // Byte tokens 0xF0 0x9F 0x98 0x80 (U+1F600): the first three give nothing, the fourth the whole emoji.
  std::vector<uint32_t> bytes;
  for (const char* piece : {"ð", "Ł", "ĺ", "Ģ"}) bytes.push_back(*qwen.token_to_id(piece));
  tokenizer::StreamDecoder stream(qwen);
  EXPECT_EQ(stream.push(bytes[0]), "");
  EXPECT_EQ(stream.push(bytes[1]), "");
  EXPECT_EQ(stream.push(bytes[2]), "");
  EXPECT_EQ(stream.push(bytes[3]), "\xF0\x9F\x98\x80");
  // A truncated character at the end becomes one U+FFFD, as decode of the whole sequence gives.
  EXPECT_EQ(stream.push(bytes[0]), "");
  EXPECT_EQ(stream.finish(), "\xEF\xBF\xBD");
  EXPECT_EQ(qwen.decode(std::vector<uint32_t>{bytes[0]}), "\xEF\xBF\xBD");
}

TEST(TokenizerErrors, UnknownIdIsAnError) {
  VAVILOV_REQUIRE_SHARED_TOKENIZERS();
  const auto& qwen = shared_tokenizer("qwen3");
  EXPECT_THROW(qwen.decode(std::vector<uint32_t>{999'999'999}), Error);
}

TEST(TokenizerErrors, MissingTokenizerJsonNamesTheDirectory) {
  try {
    Tokenizer::from_model_dir("/nonexistent/model");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/model: model directory has no tokenizer.json"),
              std::string::npos);
  }
}

std::string error_of(const std::string& json_text) {
  try {
    Tokenizer::from_json_text(json_text, "t.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

const char* kMinimalTokenizer = R"({
  "added_tokens": [], "normalizer": null, "post_processor": null, "decoder": {"type": "ByteLevel"},
  "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
  "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]}})";

TEST(TokenizerErrors, MalformedFilesGiveClearErrors) {
  EXPECT_NE(error_of("{").find("t.json: invalid JSON"), std::string::npos);
  EXPECT_NE(error_of("[]").find("t.json: expected a JSON object"), std::string::npos);
  std::string word_piece = kMinimalTokenizer;
  word_piece.replace(word_piece.find("\"BPE\""), 5, "\"WordPiece\"");
  EXPECT_NE(error_of(word_piece).find("t.json: field model.type"), std::string::npos);
  std::string metaspace = kMinimalTokenizer;
  metaspace.replace(metaspace.find("\"ByteLevel\", \"add_prefix_space\""), 11, "\"Metaspace\"");
  EXPECT_NE(error_of(metaspace).find("field pre_tokenizer.type: unsupported pre-tokenizer \"Metaspace\""),
            std::string::npos);
  std::string bad_merge = kMinimalTokenizer;
  bad_merge.replace(bad_merge.find("\"a b\""), 5, "\"a c\"");
  EXPECT_NE(error_of(bad_merge).find("field model.merges[0]"), std::string::npos);
  std::string bad_regex = R"({"decoder": {"type": "ByteLevel"}, "model": {"type": "BPE", "vocab": {}, "merges": []},
    "pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": "(("},
    "behavior": "Isolated"}, {"type": "ByteLevel"}]}})";
  EXPECT_NE(error_of(bad_regex).find("pre_tokenizer.pretokenizers[0].pattern: cannot compile regex"),
            std::string::npos);
}

TEST(TokenizerMinimal, MergesAndByteLevelWork) {
  const Tokenizer tokenizer = Tokenizer::from_json_text(kMinimalTokenizer, "t.json");
  EXPECT_EQ(tokenizer.encode("ab"), (std::vector<uint32_t>{2}));
  EXPECT_EQ(tokenizer.encode("aab"), (std::vector<uint32_t>{0, 2}));
  EXPECT_EQ(tokenizer.decode(std::vector<uint32_t>{0, 2}), "aab");
}

TEST(TokenizerUtf8, LossyDecodingReplacesMaximalSubparts) {
  // Expected strings from Python: bytes.decode("utf-8", "replace").
  EXPECT_EQ(tokenizer::to_valid_utf8("a\xF0\x9F\x98"
                                     "b"),
            "a\xEF\xBF\xBD"
            "b");
  EXPECT_EQ(tokenizer::to_valid_utf8("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(tokenizer::to_valid_utf8("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(tokenizer::to_valid_utf8("\xE2\x28\xA1"), "\xEF\xBF\xBD(\xEF\xBF\xBD");
  EXPECT_EQ(tokenizer::to_valid_utf8("\xF4\x90\x80\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");
}

}  // namespace
}  // namespace vavilov::testing
