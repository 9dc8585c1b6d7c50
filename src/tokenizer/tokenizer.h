#pragma once
// A tokenizer read from HF's tokenizer.json, giving the same ids as HF `tokenizers` for byte-level BPE models
// (Qwen, DeepSeek, Llama 3, GPT-2 style). Invalid UTF-8 input is first decoded lossily (U+FFFD per maximal
// invalid subpart), so ids match HF on the string Python's bytes.decode("utf-8", "replace") gives.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/added_vocabulary.h"
#include "tokenizer/bpe.h"
#include "tokenizer/normalizer.h"
#include "tokenizer/pre_tokenizer.h"

namespace vavilov::tokenizer {

class Tokenizer {
 public:
  // Reads `path` (a tokenizer.json). Unsupported components throw vavilov::Error naming the file and field.
  static Tokenizer from_file(const std::filesystem::path& path);
  // Reads DIR/tokenizer.json; a clear error when the directory has none.
  static Tokenizer from_model_dir(const std::filesystem::path& model_dir);
  static Tokenizer from_json_text(std::string_view json_text, const std::string& file_name);

  // Ids for `text`, added and special tokens recognised in it. Safe to call from several threads.
  std::vector<uint32_t> encode(std::string_view text) const;

  // Text of `ids` as HF's decode: bytes of all tokens joined, then invalid UTF-8 replaced by U+FFFD.
  // Unknown ids throw (HF silently drops them).
  std::string decode(std::span<const uint32_t> ids, bool skip_special_tokens = false) const;

  // The raw bytes token `id` stands for (possibly part of a UTF-8 character). Throws on unknown ids.
  std::string_view token_bytes(uint32_t id) const;
  bool is_special(uint32_t id) const;
  std::optional<uint32_t> token_to_id(const std::string& token) const;
  // One past the largest id (model vocabulary and added tokens).
  size_t vocab_size() const { return token_bytes_.size(); }

 private:
  Tokenizer() = default;
  void encode_text(std::string_view text, std::vector<uint32_t>& ids) const;

  Normalizer normalizer_;
  PreTokenizer pre_tokenizer_;
  AddedVocabulary added_vocabulary_;
  std::unique_ptr<BytePairModel> model_;
  std::vector<std::string> token_bytes_;  // what the ByteLevel decoder yields for each id
  std::vector<bool> known_id_;
  std::unique_ptr<std::mutex> model_mutex_ = std::make_unique<std::mutex>();  // guards the model's piece cache
};

}  // namespace vavilov::tokenizer
