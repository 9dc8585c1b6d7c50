#include "tokenizer/normalizer.h"

#include <utf8proc.h>

#include <cstdlib>
#include <memory>

#include "core/error.h"
#include "tokenizer/utf8.h"

namespace vavilov::tokenizer {
namespace {

int normal_form_options(const std::string& type) {
  if (type == "NFC") return UTF8PROC_STABLE | UTF8PROC_COMPOSE;
  if (type == "NFD") return UTF8PROC_STABLE | UTF8PROC_DECOMPOSE;
  if (type == "NFKC") return UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
  if (type == "NFKD") return UTF8PROC_STABLE | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
  return 0;
}

void collect(const nlohmann::json& spec, const std::string& file, std::vector<int>& options) {
  if (spec.is_null()) return;
  check(spec.is_object() && spec.contains("type") && spec["type"].is_string(),
        "{}: field normalizer: expected an object with a string \"type\"", file);
  const std::string type = spec["type"];
  if (type == "Sequence") {
    check(spec.contains("normalizers") && spec["normalizers"].is_array(),
          "{}: field normalizer.normalizers: expected an array", file);
    for (const auto& part : spec["normalizers"]) collect(part, file, options);
    return;
  }
  const int form = normal_form_options(type);
  check(form != 0,
        "{}: field normalizer.type: unsupported normalizer \"{}\" (supported: NFC, NFD, NFKC, NFKD, Sequence)", file,
        type);
  options.push_back(form);
}

// Combining marks encoded after Unicode 9. HF's NFC tables predate them and treat them as plain starters (class 0,
// no compositions); normalising the text between them separately reproduces that. From
// tools/tokenizer/find_nfc_differences.py (Unicode 14 via Python) plus the Unicode 15 marks utf8proc knows.
constexpr std::pair<char32_t, char32_t> kMarksUnknownToHf[] = {
    {0x07FD, 0x07FD},   {0x0898, 0x089F},   {0x08CA, 0x08D3},   {0x09FE, 0x09FE},   {0x0C3C, 0x0C3C},
    {0x0D3B, 0x0D3C},   {0x0EBA, 0x0EBA},   {0x1715, 0x1715},   {0x1ABF, 0x1ACE},   {0x1DF6, 0x1DFA},
    {0xA82C, 0xA82C},   {0x10D24, 0x10D27}, {0x10EAB, 0x10EAC}, {0x10EFD, 0x10EFF}, {0x10F46, 0x10F50},
    {0x10F82, 0x10F85}, {0x11070, 0x11070}, {0x1133B, 0x1133B}, {0x1145E, 0x1145E}, {0x11839, 0x1183A},
    {0x1193D, 0x1193E}, {0x11943, 0x11943}, {0x119E0, 0x119E0}, {0x11A34, 0x11A34}, {0x11A47, 0x11A47},
    {0x11A99, 0x11A99}, {0x11D42, 0x11D42}, {0x11D44, 0x11D45}, {0x11D97, 0x11D97}, {0x11F41, 0x11F42},
    {0x16FF0, 0x16FF1}, {0x1E08F, 0x1E08F}, {0x1E130, 0x1E136}, {0x1E2AE, 0x1E2AE}, {0x1E2EC, 0x1E2EF},
    {0x1E4EC, 0x1E4EF},
};

bool is_mark_unknown_to_hf(char32_t code_point) {
  if (code_point < kMarksUnknownToHf[0].first) return false;
  for (const auto& [low, high] : kMarksUnknownToHf)
    if (code_point >= low && code_point <= high) return true;
  return false;
}

bool is_ascii(std::string_view text) {
  for (char c : text)
    if (static_cast<unsigned char>(c) >= 0x80) return false;
  return true;
}

std::string map_with_utf8proc(std::string_view text, int options) {
  utf8proc_uint8_t* mapped = nullptr;
  const utf8proc_ssize_t length =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()), static_cast<utf8proc_ssize_t>(text.size()),
                   &mapped, static_cast<utf8proc_option_t>(options));
  std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> owner(mapped, &std::free);
  check(length >= 0, "normalizer: utf8proc failed: {}", utf8proc_errmsg(length));
  return std::string(reinterpret_cast<const char*>(mapped), static_cast<size_t>(length));
}

}  // namespace

Normalizer Normalizer::from_json(const nlohmann::json& spec, const std::string& file) {
  Normalizer normalizer;
  collect(spec, file, normalizer.utf8proc_options_);
  return normalizer;
}

std::string Normalizer::apply(std::string_view text) const {
  // Every normal form leaves ASCII alone; skipping it keeps code and English prose cheap.
  if (utf8proc_options_.empty() || is_ascii(text)) return std::string(text);
  std::string result;
  size_t segment_start = 0;
  for (size_t pos = 0; pos < text.size();) {
    const size_t char_start = pos;
    if (!is_mark_unknown_to_hf(next_code_point(text, pos))) continue;
    result += normalize_segment(text.substr(segment_start, char_start - segment_start));
    result.append(text.substr(char_start, pos - char_start));
    segment_start = pos;
  }
  result += normalize_segment(text.substr(segment_start));
  return result;
}

std::string Normalizer::normalize_segment(std::string_view text) const {
  std::string result(text);
  for (int options : utf8proc_options_) result = map_with_utf8proc(result, options);
  return result;
}

}  // namespace vavilov::tokenizer
