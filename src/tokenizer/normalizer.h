#pragma once
// The `normalizer` of tokenizer.json: Unicode normal forms (via utf8proc) and sequences of them.
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace vavilov::tokenizer {

class Normalizer {
 public:
  // Reads the `normalizer` field (null means none). Unsupported types throw, naming `file`.
  static Normalizer from_json(const nlohmann::json& spec, const std::string& file);

  // `valid_utf8` normalised; pure ASCII is returned unchanged without calling utf8proc.
  std::string apply(std::string_view valid_utf8) const;
  bool is_identity() const { return utf8proc_options_.empty(); }

 private:
  std::string normalize_segment(std::string_view valid_utf8) const;

  std::vector<int> utf8proc_options_;  // one utf8proc_option_t mask per normal form, applied in order
};

}  // namespace vavilov::tokenizer
