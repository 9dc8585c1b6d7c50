#include "template/lexer.h"

#include <algorithm>

#include "core/error.h"
#include "template/python_string.h"

namespace vavilov::jinja {
namespace {

// Python's str.splitlines() line boundaries; Jinja2 rewrites each as "\n" before lexing.
std::string normalize_newlines(std::string_view source) {
  std::string out;
  out.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    const auto c = static_cast<unsigned char>(source[i]);
    if (c == '\r') {
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
      out += '\n';
    } else if (c == '\x0b' || c == '\x0c' || (c >= 0x1c && c <= 0x1e)) {
      out += '\n';
    } else if (c == 0xC2 && i + 1 < source.size() && static_cast<unsigned char>(source[i + 1]) == 0x85) {
      out += '\n';
      ++i;
    } else if (c == 0xE2 && i + 2 < source.size() && static_cast<unsigned char>(source[i + 1]) == 0x80 &&
               (static_cast<unsigned char>(source[i + 2]) == 0xA8 ||
                static_cast<unsigned char>(source[i + 2]) == 0xA9)) {
      out += '\n';
      i += 2;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(std::string source) : source_(std::move(source)) {
    if (!source_.empty() && source_.back() == '\n') source_.pop_back();  // keep_trailing_newline=False
  }

  std::vector<Token> run() {
    while (pos_ < source_.size()) {
      const size_t tag = find_tag(pos_);
      std::string text = source_.substr(pos_, tag - pos_);
      if (tag == source_.size()) {
        emit_text(std::move(text), line_at(pos_));
        break;
      }
      lex_tag(tag, std::move(text));
    }
    tokens_.push_back({TokenKind::kEnd, "", line_at(source_.size())});
    return std::move(tokens_);
  }

 private:
  size_t find_tag(size_t from) const {
    for (size_t i = source_.find('{', from); i != std::string::npos; i = source_.find('{', i + 1)) {
      if (i + 1 < source_.size() && (source_[i + 1] == '{' || source_[i + 1] == '%' || source_[i + 1] == '#')) return i;
    }
    return source_.size();
  }

  int line_at(size_t pos) {
    // Tokens come in source order, so counting from the last position keeps this linear.
    line_ += static_cast<int>(
        std::count(source_.begin() + static_cast<long>(line_pos_), source_.begin() + static_cast<long>(pos), '\n'));
    line_pos_ = pos;
    return line_;
  }

  void emit_text(std::string text, int line) {
    if (!text.empty()) tokens_.push_back({TokenKind::kText, std::move(text), line});
  }

  // Applies the whitespace control of the tag starting at `tag` to the text before it.
  void strip_before_tag(std::string& text, char kind, char modifier) const {
    if (modifier == '-') {
      text.erase(text.find_last_not_of(" \t\n\r\f\v") + 1);
      return;
    }
    if (kind == '{' || modifier == '+') return;
    // lstrip_blocks: drop spaces and tabs between the line start and a block or comment tag.
    const size_t line_start = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
    if (line_start == 0 && !line_starting_) return;
    if (text.find_first_not_of(" \t", line_start) == std::string::npos) text.erase(line_start);
  }

  void lex_tag(size_t tag, std::string text) {
    const char kind = source_[tag + 1];
    size_t pos = tag + 2;
    const char modifier = pos < source_.size() && (source_[pos] == '-' || source_[pos] == '+') ? source_[pos] : 0;
    if (modifier) ++pos;
    strip_before_tag(text, kind, modifier);
    emit_text(std::move(text), line_at(pos_));
    const int line = line_at(tag);
    if (kind == '#') {
      const size_t end = source_.find("#}", pos);
      check(end != std::string::npos, "chat template line {}: unclosed comment", line);
      finish_tag(end + 2, source_[end - 1] == '-' && end > pos, source_[end - 1] == '+' && end > pos, true);
      return;
    }
    tokens_.push_back({kind == '{' ? TokenKind::kVariableBegin : TokenKind::kBlockBegin, "", line});
    pos = lex_expression(pos, kind == '{' ? '}' : '%', line);
    if (kind == '%' && is_raw_block()) lex_raw_block();
  }

  // Lexes tokens up to the closing delimiter; returns the position after it.
  size_t lex_expression(size_t pos, char closer, int line) {
    int depth = 0;
    while (true) {
      pos = source_.find_first_not_of(" \t\n\r", pos);
      check(pos != std::string::npos, "chat template line {}: unclosed tag", line);
      const char c = source_[pos];
      const bool trims =
          (c == '-' || c == '+') && pos + 2 < source_.size() && source_[pos + 1] == closer && source_[pos + 2] == '}';
      if (depth == 0 && (trims || (c == closer && pos + 1 < source_.size() && source_[pos + 1] == '}'))) {
        const size_t end = pos + (trims ? 3 : 2);
        tokens_.push_back({closer == '}' ? TokenKind::kVariableEnd : TokenKind::kBlockEnd, "", line_at(pos)});
        finish_tag(end, trims && c == '-', trims && c == '+', closer == '%');
        return end;
      }
      pos = lex_one(pos, depth);
    }
  }

  // After a tag: "-" eats all following white space, trim_blocks one newline after block and comment tags.
  void finish_tag(size_t end, bool strip_after, bool keep_newline, bool is_block) {
    size_t next = end;
    if (strip_after) {
      next = source_.find_first_not_of(" \t\n\r\f\v", end);
      if (next == std::string::npos) next = source_.size();
    } else if (is_block && !keep_newline && end < source_.size() && source_[end] == '\n') {
      next = end + 1;
    }
    line_starting_ = next > end && source_[next - 1] == '\n';
    pos_ = next;
  }

  size_t lex_one(size_t pos, int& depth) {
    const int line = line_at(pos);
    const char c = source_[pos];
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t end = pos;
      while (end < source_.size() && (std::isalnum(static_cast<unsigned char>(source_[end])) || source_[end] == '_'))
        ++end;
      tokens_.push_back({TokenKind::kName, source_.substr(pos, end - pos), line});
      return end;
    }
    if (std::isdigit(static_cast<unsigned char>(c))) return lex_number(pos, line);
    if (c == '\'' || c == '"') {
      size_t end = pos + 1;
      while (end < source_.size() && source_[end] != c) end += source_[end] == '\\' ? 2 : 1;
      check(end < source_.size(), "chat template line {}: unclosed string literal", line);
      tokens_.push_back({TokenKind::kString, unescape_python_literal(source_.substr(pos + 1, end - pos - 1)), line});
      return end + 1;
    }
    for (const char* op : {"//", "**", "==", "!=", "<=", ">="}) {
      if (source_.compare(pos, 2, op) == 0) {
        tokens_.push_back({TokenKind::kOperator, op, line});
        return pos + 2;
      }
    }
    check(std::string_view("+-*/%~<>=()[]{}.,:|").find(c) != std::string_view::npos,
          "chat template line {}: unexpected character '{}'", line, c);
    if (c == '(' || c == '[' || c == '{') ++depth;
    if (c == ')' || c == ']' || c == '}') --depth;
    tokens_.push_back({TokenKind::kOperator, std::string(1, c), line});
    return pos + 1;
  }

  size_t lex_number(size_t pos, int line) {
    auto digits_end = [&](size_t from) {
      while (from < source_.size() && (std::isdigit(static_cast<unsigned char>(source_[from])) || source_[from] == '_'))
        ++from;
      return from;
    };
    size_t end = digits_end(pos);
    bool is_float = false;
    if (end + 1 < source_.size() && source_[end] == '.' && std::isdigit(static_cast<unsigned char>(source_[end + 1]))) {
      end = digits_end(end + 1);
      is_float = true;
    }
    if (end < source_.size() && (source_[end] == 'e' || source_[end] == 'E')) {
      size_t exponent = end + 1;
      if (exponent < source_.size() && (source_[exponent] == '+' || source_[exponent] == '-')) ++exponent;
      if (exponent < source_.size() && std::isdigit(static_cast<unsigned char>(source_[exponent]))) {
        end = digits_end(exponent);
        is_float = true;
      }
    }
    std::string text = source_.substr(pos, end - pos);
    std::erase(text, '_');
    tokens_.push_back({is_float ? TokenKind::kFloat : TokenKind::kInteger, std::move(text), line});
    return end;
  }

  bool is_raw_block() const {
    const size_t n = tokens_.size();
    return n >= 3 && tokens_[n - 1].kind == TokenKind::kBlockEnd && tokens_[n - 2].kind == TokenKind::kName &&
           tokens_[n - 2].value == "raw" && tokens_[n - 3].kind == TokenKind::kBlockBegin;
  }

  // {% raw %}...{% endraw %}: the body is text, whatever tags it contains.
  void lex_raw_block() {
    const int line = tokens_.back().line;
    tokens_.resize(tokens_.size() - 3);
    for (size_t search = pos_;;) {
      const size_t tag = source_.find("{%", search);
      check(tag != std::string::npos, "chat template line {}: {{% raw %}} without {{% endraw %}}", line);
      size_t pos = tag + 2;
      const bool strip_before = pos < source_.size() && source_[pos] == '-';
      if (pos < source_.size() && (source_[pos] == '-' || source_[pos] == '+')) ++pos;
      pos = source_.find_first_not_of(" \t\n\r", pos);
      if (pos == std::string::npos || source_.compare(pos, 6, "endraw") != 0) {
        search = tag + 2;
        continue;
      }
      pos = source_.find_first_not_of(" \t\n\r", pos + 6);
      if (pos == std::string::npos) {
        search = tag + 2;
        continue;
      }
      const bool trims = source_[pos] == '-' || source_[pos] == '+';
      const size_t close = pos + (trims ? 1 : 0);
      if (source_.compare(close, 2, "%}") != 0) {
        search = tag + 2;
        continue;
      }
      std::string body = source_.substr(pos_, tag - pos_);
      if (strip_before) body.erase(body.find_last_not_of(" \t\n\r\f\v") + 1);
      emit_text(std::move(body), line);
      finish_tag(close + 2, trims && source_[pos] == '-', trims && source_[pos] == '+', true);
      return;
    }
  }

  std::string source_;
  size_t pos_ = 0;
  int line_ = 1;
  size_t line_pos_ = 0;
  bool line_starting_ = true;
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> tokenize_template(std::string_view source) { return Lexer(normalize_newlines(source)).run(); }

}  // namespace vavilov::jinja
