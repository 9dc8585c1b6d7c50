#pragma once
// Checksums of stored bytes: XXH3 64-bit (libxxhash), written as 16 lowercase hex digits.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace vavilov {

inline constexpr std::string_view kChecksumAlgorithm = "xxh3-64";

uint64_t checksum(const void* data, size_t bytes);
std::string checksum_hex(uint64_t value);
// Parses 16 hex digits; false for anything else.
bool parse_checksum_hex(std::string_view text, uint64_t& value);

}  // namespace vavilov
