#pragma once
// Splits template source into text and tag tokens with transformers' settings (trim_blocks, lstrip_blocks,
// keep_trailing_newline off) and Jinja2's whitespace control ({%- -%} {%+ +%}).
#include <string>
#include <string_view>
#include <vector>

namespace vavilov::jinja {

enum class TokenKind {
  kText,           // literal output
  kVariableBegin,  // {{
  kVariableEnd,    // }}
  kBlockBegin,     // {%
  kBlockEnd,       // %}
  kName,
  kString,   // value already unescaped
  kInteger,  // text of the literal (underscores removed)
  kFloat,
  kOperator,
  kEnd,
};

struct Token {
  TokenKind kind;
  std::string value;
  int line;
};

// Throws vavilov::Error with the line number on malformed input (unclosed tags, strings, unknown characters).
std::vector<Token> tokenize_template(std::string_view source);

}  // namespace vavilov::jinja
