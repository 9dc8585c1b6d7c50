#pragma once
// GPT-2's byte-level alphabet: every byte is shown as one printable code point, so byte-level BPE vocabularies
// are strings of those code points. We keep token ids over raw bytes and use this only at the edges.
#include <array>
#include <optional>
#include <string>
#include <string_view>

namespace vavilov::tokenizer {

// The code point that stands for `byte` in vocabulary strings.
char32_t byte_to_code_point(unsigned char byte);

// The byte a code point stands for, or nothing when it is not in the alphabet.
std::optional<unsigned char> code_point_to_byte(char32_t code_point);

// Maps a vocabulary string back to bytes; nothing when one of its code points is outside the alphabet.
std::optional<std::string> byte_level_to_bytes(std::string_view token);

// Maps raw bytes to their vocabulary string.
std::string bytes_to_byte_level(std::string_view bytes);

}  // namespace vavilov::tokenizer
