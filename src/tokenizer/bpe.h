#pragma once
// Byte-level BPE: a word's bytes start as one symbol each and adjacent pairs merge by rank until none applies.
// Ids are kept over raw bytes; the GPT-2 alphabet only appears when reading the vocabulary.
#include <array>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace vavilov::tokenizer {

class BytePairModel {
 public:
  // Reads `model` of tokenizer.json (type BPE over a byte-level vocabulary). Errors name `file` and the field.
  static BytePairModel from_json(const nlohmann::json& model, const std::string& file);

  // Appends the ids of one pre-tokenized piece (raw bytes). Results are cached per piece.
  void encode_piece(std::string_view piece, std::vector<uint32_t>& ids);

  size_t vocab_size() const { return token_strings_.size(); }
  // The vocabulary string of `id` (GPT-2 alphabet); empty for ids the vocabulary skips.
  const std::string& token_string(uint32_t id) const { return token_strings_[id]; }
  std::optional<uint32_t> id_of(const std::string& token) const;

 private:
  struct Merge {
    uint32_t rank;
    uint32_t merged_id;
  };
  static uint64_t pair_key(uint32_t left, uint32_t right) { return (uint64_t{left} << 32) | right; }
  void merge_symbols(std::string_view piece, std::vector<uint32_t>& ids) const;

  std::vector<std::string> token_strings_;
  std::unordered_map<std::string, uint32_t> id_of_token_;
  std::unordered_map<uint64_t, Merge> merges_;
  std::unordered_map<std::string, uint32_t> id_of_bytes_;  // whole-word lookup, filled only for ignore_merges
  std::array<int64_t, 256> id_of_byte_{};                  // -1 when the vocabulary lacks the byte (HF then drops it)
  bool ignore_merges_ = false;
  std::unordered_map<std::string, std::vector<uint32_t>> cache_;
};

}  // namespace vavilov::tokenizer
