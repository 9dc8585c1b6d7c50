#pragma once
// Incremental detokenization for generation: text for each new token, never splitting a UTF-8 character across
// two pieces, and in total identical to Tokenizer::decode of the whole sequence.
#include <cstdint>
#include <string>

#include "tokenizer/tokenizer.h"

namespace vavilov::tokenizer {

class StreamDecoder {
 public:
  // `tokenizer` must outlive the decoder.
  explicit StreamDecoder(const Tokenizer& tokenizer, bool skip_special_tokens = false);

  // The text that token `id` completes: whole characters only; bytes of an unfinished character wait for the next
  // token. Invalid bytes become U+FFFD as soon as they are known to be invalid.
  std::string push(uint32_t id);

  // The rest at the end of the sequence: U+FFFD if it ended inside a character, else empty. Resets the decoder.
  std::string finish();

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_tokens_;
  std::string pending_;  // bytes of an incomplete character at the end of what was pushed
};

}  // namespace vavilov::tokenizer
