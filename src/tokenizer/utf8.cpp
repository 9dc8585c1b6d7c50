#include "tokenizer/utf8.h"

namespace vavilov::tokenizer {
namespace {

bool is_continuation(unsigned char byte, unsigned char low = 0x80, unsigned char high = 0xBF) {
  return byte >= low && byte <= high;
}

}  // namespace

Utf8Unit scan_utf8_unit(std::string_view text, size_t pos) {
  const auto lead = static_cast<unsigned char>(text[pos]);
  if (lead < 0x80) return {Utf8Status::kValid, 1};
  size_t length = 0;
  // The second byte's range is narrower after some leads: that excludes overlongs and surrogates.
  unsigned char second_low = 0x80, second_high = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) {
    length = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    length = 3;
    if (lead == 0xE0) second_low = 0xA0;
    if (lead == 0xED) second_high = 0x9F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    length = 4;
    if (lead == 0xF0) second_low = 0x90;
    if (lead == 0xF4) second_high = 0x8F;
  } else {
    return {Utf8Status::kInvalid, 1};
  }
  for (size_t i = 1; i < length; ++i) {
    if (pos + i >= text.size()) return {Utf8Status::kIncomplete, i};
    const auto byte = static_cast<unsigned char>(text[pos + i]);
    const bool ok = i == 1 ? is_continuation(byte, second_low, second_high) : is_continuation(byte);
    if (!ok) return {Utf8Status::kInvalid, i};
  }
  return {Utf8Status::kValid, length};
}

std::string to_valid_utf8(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t pos = 0;
  while (pos < bytes.size()) {
    const Utf8Unit unit = scan_utf8_unit(bytes, pos);
    if (unit.status == Utf8Status::kValid) {
      out.append(bytes.substr(pos, unit.length));
    } else {
      out.append(kReplacementCharacter);
    }
    pos += unit.length;
  }
  return out;
}

bool is_valid_utf8(std::string_view bytes) {
  for (size_t pos = 0; pos < bytes.size();) {
    const Utf8Unit unit = scan_utf8_unit(bytes, pos);
    if (unit.status != Utf8Status::kValid) return false;
    pos += unit.length;
  }
  return true;
}

char32_t next_code_point(std::string_view text, size_t& pos) {
  const auto lead = static_cast<unsigned char>(text[pos]);
  if (lead < 0x80) {
    ++pos;
    return lead;
  }
  const size_t length = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : 2;
  char32_t code_point = lead & (0x7F >> length);
  for (size_t i = 1; i < length; ++i)
    code_point = (code_point << 6) | (static_cast<unsigned char>(text[pos + i]) & 0x3F);
  pos += length;
  return code_point;
}

void append_utf8(std::string& out, char32_t code_point) {
  if (code_point < 0x80) {
    out.push_back(static_cast<char>(code_point));
  } else if (code_point < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (code_point >> 6)));
    out.push_back(static_cast<char>(0x80 | (code_point & 0x3F)));
  } else if (code_point < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (code_point >> 12)));
    out.push_back(static_cast<char>(0x80 | ((code_point >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (code_point & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (code_point >> 18)));
    out.push_back(static_cast<char>(0x80 | ((code_point >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((code_point >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (code_point & 0x3F)));
  }
}

}  // namespace vavilov::tokenizer
