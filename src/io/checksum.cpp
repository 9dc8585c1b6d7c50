#include "io/checksum.h"

#include <fmt/format.h>
#include <xxhash.h>

#include <charconv>

namespace vavilov {

uint64_t checksum(const void* data, size_t bytes) { return XXH3_64bits(data, bytes); }

std::string checksum_hex(uint64_t value) { return fmt::format("{:016x}", value); }

bool parse_checksum_hex(std::string_view text, uint64_t& value) {
  if (text.size() != 16) return false;
  for (char c : text)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value, 16);
  return error == std::errc() && end == text.data() + text.size();
}

}  // namespace vavilov
