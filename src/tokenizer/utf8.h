#pragma once
// UTF-8 scanning with the Unicode "maximal subpart" rule for invalid input: each maximal invalid prefix of a
// would-be sequence becomes one U+FFFD, exactly as Python's errors="replace" and Rust's from_utf8_lossy do.
#include <cstddef>
#include <string>
#include <string_view>

namespace vavilov::tokenizer {

inline constexpr std::string_view kReplacementCharacter = "\xEF\xBF\xBD";

enum class Utf8Status { kValid, kInvalid, kIncomplete };

struct Utf8Unit {
  Utf8Status status;
  size_t length;  // bytes of the character, of the maximal invalid subpart, or of the incomplete tail
};

// Classifies the bytes starting at `pos` (which must be < text.size()).
Utf8Unit scan_utf8_unit(std::string_view text, size_t pos);

// Replaces every invalid or truncated sequence by U+FFFD.
std::string to_valid_utf8(std::string_view bytes);

bool is_valid_utf8(std::string_view bytes);

// Decodes one code point of valid UTF-8 at `pos` and advances `pos`.
char32_t next_code_point(std::string_view valid_utf8, size_t& pos);

void append_utf8(std::string& out, char32_t code_point);

}  // namespace vavilov::tokenizer
