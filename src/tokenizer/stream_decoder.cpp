#include "tokenizer/stream_decoder.h"

#include "tokenizer/utf8.h"

namespace vavilov::tokenizer {

StreamDecoder::StreamDecoder(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(&tokenizer), skip_special_tokens_(skip_special_tokens) {}

std::string StreamDecoder::push(uint32_t id) {
  const std::string_view bytes = tokenizer_->token_bytes(id);
  if (skip_special_tokens_ && tokenizer_->is_special(id)) return {};
  pending_.append(bytes);
  std::string text;
  size_t pos = 0;
  while (pos < pending_.size()) {
    const Utf8Unit unit = scan_utf8_unit(pending_, pos);
    if (unit.status == Utf8Status::kIncomplete) break;
    if (unit.status == Utf8Status::kValid) {
      text.append(pending_, pos, unit.length);
    } else {
      text.append(kReplacementCharacter);
    }
    pos += unit.length;
  }
  pending_.erase(0, pos);
  return text;
}

std::string StreamDecoder::finish() {
  // Whatever is left is one truncated sequence, which lossy decoding of the whole text turns into one U+FFFD.
  std::string rest = pending_.empty() ? std::string() : std::string(kReplacementCharacter);
  pending_.clear();
  return rest;
}

}  // namespace vavilov::tokenizer
