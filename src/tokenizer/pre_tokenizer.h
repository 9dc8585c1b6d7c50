#pragma once
// The `pre_tokenizer` of tokenizer.json: cuts normalised text into the pieces BPE encodes one at a time.
// Supported: Sequence, Split (regex or literal, all five behaviours, invert) and ByteLevel.
#include <deque>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/regex.h"

namespace vavilov::tokenizer {

// Pieces point into the caller's text or, for pieces a step had to rewrite, into `owned`.
struct PreTokenized {
  std::vector<std::string_view> pieces;
  std::deque<std::string> owned;  // a deque: growing it never moves the strings the views point to
};

class PreTokenizerStep {
 public:
  virtual ~PreTokenizerStep() = default;
  virtual void apply(PreTokenized& text) const = 0;
};

class PreTokenizer {
 public:
  // Reads the `pre_tokenizer` field (null means none). Unsupported types throw, naming `file` and the field.
  static PreTokenizer from_json(const nlohmann::json& spec, const std::string& file);

  // Replaces `text.pieces` by the pre-tokenized pieces, in order; empty pieces are dropped.
  void apply(PreTokenized& text) const;

  // Whether a ByteLevel step maps bytes for the model (then the vocabulary is byte-level).
  bool has_byte_level() const { return has_byte_level_; }

 private:
  std::vector<std::unique_ptr<PreTokenizerStep>> steps_;
  bool has_byte_level_ = false;
};

}  // namespace vavilov::tokenizer
