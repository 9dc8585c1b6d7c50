#pragma once
// Added and special tokens (tokenizer.json `added_tokens`): found in the text before pre-tokenization, with the
// leftmost-longest rule and the lstrip/rstrip/single_word/normalized flags of HF `tokenizers`.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tokenizer/normalizer.h"

namespace vavilov::tokenizer {

struct AddedToken {
  uint32_t id = 0;
  std::string content;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
  bool special = false;
};

// A run of text: either an added token (`id` set) or ordinary text for the model.
struct TextSegment {
  size_t begin;
  size_t end;
  std::optional<uint32_t> id;
};

class AddedVocabulary {
 public:
  static AddedVocabulary from_json(const nlohmann::json& added_tokens, const Normalizer& normalizer,
                                   const std::string& file);

  // Segments covering `text`, matching tokens with normalized=false (`normalized_pass` false) or the
  // normalised contents of tokens with normalized=true (`normalized_pass` true, on normalised text).
  std::vector<TextSegment> split(std::string_view text, bool normalized_pass) const;

  const AddedToken* find(uint32_t id) const;
  const std::vector<AddedToken>& tokens() const { return tokens_; }

 private:
  // A byte trie over token contents; `token` is the index in tokens_ of the content ending here, or -1.
  struct TrieNode {
    std::vector<std::pair<unsigned char, int>> children;  // sorted by byte
    int token = -1;
  };
  struct Trie {
    std::vector<TrieNode> nodes{1};
    void insert(std::string_view key, int token);
    // The longest key starting at `pos`: (token index, length), or token -1.
    std::pair<int, size_t> longest_match(std::string_view text, size_t pos) const;
  };

  std::vector<AddedToken> tokens_;
  std::unordered_map<uint32_t, size_t> index_of_id_;
  Trie raw_trie_;
  Trie normalized_trie_;
};

}  // namespace vavilov::tokenizer
