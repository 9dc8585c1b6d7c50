#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/regex.h"

#include <pcre2.h>

#include "core/error.h"

namespace vavilov::tokenizer {

struct Regex::Compiled {
  pcre2_code* code = nullptr;
  pcre2_match_data* match_data = nullptr;  // one per regex: matching is single-threaded per tokenizer call

  ~Compiled() {
    pcre2_match_data_free(match_data);
    pcre2_code_free(code);
  }
};

Regex::Regex(const std::string& pattern, bool literal, const std::string& where)
    : compiled_(std::make_unique<Compiled>()) {
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  const uint32_t options = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0);
  compiled_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), options, &error_code,
                                  &error_offset, nullptr);
  if (!compiled_->code) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error_code, message, sizeof(message));
    fail("{}: cannot compile regex at offset {}: {}", where, error_offset, reinterpret_cast<const char*>(message));
  }
  // JIT is an optimisation; the interpreter gives the same matches when it is unavailable.
  pcre2_jit_compile(compiled_->code, PCRE2_JIT_COMPLETE);
  compiled_->match_data = pcre2_match_data_create_from_pattern(compiled_->code, nullptr);
}

Regex::~Regex() = default;
Regex::Regex(Regex&&) noexcept = default;
Regex& Regex::operator=(Regex&&) noexcept = default;

namespace {

// Runs one match from `start`; returns false when there is none. Input is already valid UTF-8.
bool match_from(pcre2_code* code, pcre2_match_data* match_data, std::string_view text, size_t start,
                MatchRange& match) {
  const int rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), start, PCRE2_NO_UTF_CHECK,
                             match_data, nullptr);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) fail("regex match failed with PCRE2 error {}", rc);
  const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match_data);
  match = {ovector[0], ovector[1]};
  return true;
}

size_t next_character(std::string_view text, size_t pos) {
  ++pos;
  while (pos < text.size() && (static_cast<unsigned char>(text[pos]) & 0xC0) == 0x80) ++pos;
  return pos;
}

}  // namespace

void Regex::find_all(std::string_view text, std::vector<MatchRange>& matches) const {
  size_t start = 0;
  MatchRange match{};
  while (start < text.size() && match_from(compiled_->code, compiled_->match_data, text, start, match)) {
    if (match.end == match.begin) {
      // Empty matches produce no piece; step over one character like Oniguruma's find_iter.
      start = next_character(text, match.end);
      continue;
    }
    matches.push_back(match);
    start = match.end;
  }
}

}  // namespace vavilov::tokenizer
