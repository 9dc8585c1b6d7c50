#pragma once
// A compiled PCRE2 pattern (UTF + Unicode properties, JIT) for the Split pre-tokenizers.
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace vavilov::tokenizer {

struct MatchRange {
  size_t begin;
  size_t end;
};

class Regex {
 public:
  // `literal` matches `pattern` as plain text. Errors name `where` (file and field).
  Regex(const std::string& pattern, bool literal, const std::string& where);
  ~Regex();
  Regex(Regex&&) noexcept;
  Regex& operator=(Regex&&) noexcept;

  // Appends every non-overlapping non-empty match in `valid_utf8`, leftmost first.
  void find_all(std::string_view valid_utf8, std::vector<MatchRange>& matches) const;

 private:
  struct Compiled;
  std::unique_ptr<Compiled> compiled_;
};

}  // namespace vavilov::tokenizer
