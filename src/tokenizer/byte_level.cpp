#include "tokenizer/byte_level.h"

#include "tokenizer/utf8.h"

namespace vavilov::tokenizer {
namespace {

// Printable Latin-1 bytes map to themselves; the other 68 bytes take code points 256, 257, ... in byte order.
struct ByteAlphabet {
  std::array<char32_t, 256> code_point_of_byte{};
  std::array<int, 324> byte_of_code_point{};  // -1 where the code point is not in the alphabet

  ByteAlphabet() {
    byte_of_code_point.fill(-1);
    char32_t next_extra = 256;
    for (int byte = 0; byte < 256; ++byte) {
      const bool printable = (byte >= '!' && byte <= '~') || (byte >= 0xA1 && byte <= 0xAC) || byte >= 0xAE;
      code_point_of_byte[byte] = printable ? static_cast<char32_t>(byte) : next_extra++;
      byte_of_code_point[code_point_of_byte[byte]] = byte;
    }
  }
};

const ByteAlphabet& alphabet() {
  static const ByteAlphabet instance;
  return instance;
}

}  // namespace

char32_t byte_to_code_point(unsigned char byte) { return alphabet().code_point_of_byte[byte]; }

std::optional<unsigned char> code_point_to_byte(char32_t code_point) {
  if (code_point >= alphabet().byte_of_code_point.size()) return std::nullopt;
  const int byte = alphabet().byte_of_code_point[code_point];
  if (byte < 0) return std::nullopt;
  return static_cast<unsigned char>(byte);
}

std::optional<std::string> byte_level_to_bytes(std::string_view token) {
  std::string bytes;
  for (size_t pos = 0; pos < token.size();) {
    if (scan_utf8_unit(token, pos).status != Utf8Status::kValid) return std::nullopt;
    const auto byte = code_point_to_byte(next_code_point(token, pos));
    if (!byte) return std::nullopt;
    bytes.push_back(static_cast<char>(*byte));
  }
  return bytes;
}

std::string bytes_to_byte_level(std::string_view bytes) {
  std::string out;
  for (char byte : bytes) append_utf8(out, byte_to_code_point(static_cast<unsigned char>(byte)));
  return out;
}

}  // namespace vavilov::tokenizer
