#include "tokenizer/added_vocabulary.h"

#include <utf8proc.h>

#include <algorithm>

#include "core/error.h"
#include "tokenizer/utf8.h"

namespace vavilov::tokenizer {
namespace {

// Rust regex's Unicode \w: letters, marks, decimal and letter numbers, connector punctuation, joiners.
bool is_word_character(char32_t c) {
  if (c == 0x200C || c == 0x200D) return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_PC:
      return true;
    default:
      return false;
  }
}

// The Unicode White_Space property (Rust's \s).
bool is_white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

char32_t last_code_point(std::string_view text) {
  size_t start = text.size() - 1;
  while (start > 0 && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
  return next_code_point(text, start);
}

char32_t first_code_point(std::string_view text) {
  size_t pos = 0;
  return next_code_point(text, pos);
}

// Byte offset where the trailing white space of `text` begins.
size_t trailing_space_start(std::string_view text) {
  size_t end = text.size();
  while (end > 0) {
    size_t start = end - 1;
    while (start > 0 && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
    size_t pos = start;
    if (!is_white_space(next_code_point(text, pos))) break;
    end = start;
  }
  return end;
}

// Byte length of the leading white space of `text`.
size_t leading_space_length(std::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    size_t next = pos;
    if (!is_white_space(next_code_point(text, next))) break;
    pos = next;
  }
  return pos;
}

bool read_flag(const nlohmann::json& entry, const char* name, const std::string& where) {
  if (!entry.contains(name)) return false;
  check(entry[name].is_boolean(), "{}.{}: expected a boolean", where, name);
  return entry[name].get<bool>();
}

}  // namespace

void AddedVocabulary::Trie::insert(std::string_view key, int token) {
  size_t node = 0;
  for (char c : key) {
    const auto byte = static_cast<unsigned char>(c);
    auto& children = nodes[node].children;
    auto it = std::lower_bound(children.begin(), children.end(), byte,
                               [](const auto& child, unsigned char b) { return child.first < b; });
    if (it == children.end() || it->first != byte) {
      const int child = static_cast<int>(nodes.size());
      it = children.insert(it, {byte, child});
      nodes.emplace_back();
    }
    node = static_cast<size_t>(it->second);
  }
  // On duplicate contents the last entry wins, as in HF's map from content to token.
  nodes[node].token = token;
}

std::pair<int, size_t> AddedVocabulary::Trie::longest_match(std::string_view text, size_t pos) const {
  std::pair<int, size_t> best{-1, 0};
  size_t node = 0;
  for (size_t i = pos; i < text.size(); ++i) {
    const auto byte = static_cast<unsigned char>(text[i]);
    const auto& children = nodes[node].children;
    auto it = std::lower_bound(children.begin(), children.end(), byte,
                               [](const auto& child, unsigned char b) { return child.first < b; });
    if (it == children.end() || it->first != byte) break;
    node = static_cast<size_t>(it->second);
    if (nodes[node].token >= 0) best = {nodes[node].token, i + 1 - pos};
  }
  return best;
}

AddedVocabulary AddedVocabulary::from_json(const nlohmann::json& added_tokens, const Normalizer& normalizer,
                                           const std::string& file) {
  AddedVocabulary vocabulary;
  if (added_tokens.is_null()) return vocabulary;
  check(added_tokens.is_array(), "{}: field added_tokens: expected an array", file);
  for (size_t i = 0; i < added_tokens.size(); ++i) {
    const std::string where = fmt::format("{}: field added_tokens[{}]", file, i);
    const auto& entry = added_tokens[i];
    check(entry.is_object() && entry.contains("id") && entry["id"].is_number_unsigned() && entry.contains("content") &&
              entry["content"].is_string(),
          "{}: expected an object with an unsigned \"id\" and a string \"content\"", where);
    AddedToken token{
        entry["id"].get<uint32_t>(),       entry["content"].get<std::string>(), read_flag(entry, "single_word", where),
        read_flag(entry, "lstrip", where), read_flag(entry, "rstrip", where),   read_flag(entry, "normalized", where),
        read_flag(entry, "special", where)};
    check(!token.content.empty() && is_valid_utf8(token.content), "{}.content: expected non-empty UTF-8", where);
    const int index = static_cast<int>(vocabulary.tokens_.size());
    if (token.normalized) {
      vocabulary.normalized_trie_.insert(normalizer.apply(token.content), index);
    } else {
      vocabulary.raw_trie_.insert(token.content, index);
    }
    vocabulary.index_of_id_[token.id] = vocabulary.tokens_.size();
    vocabulary.tokens_.push_back(std::move(token));
  }
  return vocabulary;
}

const AddedToken* AddedVocabulary::find(uint32_t id) const {
  const auto it = index_of_id_.find(id);
  return it == index_of_id_.end() ? nullptr : &tokens_[it->second];
}

// HF's AddedVocabulary::find_matches: non-overlapping leftmost-longest matches; a rejected single_word match is
// skipped whole; lstrip/rstrip widen a match over white space that no earlier match consumed.
std::vector<TextSegment> AddedVocabulary::split(std::string_view text, bool normalized_pass) const {
  const Trie& trie = normalized_pass ? normalized_trie_ : raw_trie_;
  std::vector<TextSegment> segments;
  size_t consumed = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    const auto [index, length] = trie.longest_match(text, pos);
    if (index < 0) {
      ++pos;
      continue;
    }
    const AddedToken& token = tokens_[static_cast<size_t>(index)];
    size_t start = pos, stop = pos + length;
    pos = stop;
    if (token.single_word) {
      const bool word_before = start > 0 && is_word_character(last_code_point(text.substr(0, start)));
      const bool word_after = stop < text.size() && is_word_character(first_code_point(text.substr(stop)));
      if (word_before || word_after) continue;
    }
    if (token.lstrip) start = std::max(trailing_space_start(text.substr(0, start)), consumed);
    if (token.rstrip) stop += leading_space_length(text.substr(stop));
    if (consumed < start) segments.push_back({consumed, start, std::nullopt});
    segments.push_back({start, stop, token.id});
    consumed = stop;
    pos = stop;
  }
  if (consumed < text.size()) segments.push_back({consumed, text.size(), std::nullopt});
  return segments;
}

}  // namespace vavilov::tokenizer
