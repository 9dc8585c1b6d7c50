#pragma once
// Python str behaviour the templates rely on, over UTF-8: literal unescaping, whitespace, strip/split, case.
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace vavilov::jinja {

// The body of a Python string literal with its escapes resolved (\n, \t, \xNN, \uNNNN, \UNNNNNNNN, octal, ...).
// Unknown escapes stay as written, as in Python.
std::string unescape_python_literal(std::string_view body);

// str.isspace() for one code point.
bool is_python_space(char32_t c);

std::vector<char32_t> to_code_points(std::string_view utf8);
std::string from_code_points(const std::vector<char32_t>& code_points);

// str.strip/lstrip/rstrip: `chars` absent strips white space.
std::string python_strip(std::string_view text, const std::optional<std::string>& chars, bool left, bool right);
// str.split / str.rsplit: `separator` absent splits on runs of white space; max_split < 0 means no limit.
std::vector<std::string> python_split(std::string_view text, const std::optional<std::string>& separator,
                                      long max_split, bool from_right);
std::string python_upper(std::string_view text);
std::string python_lower(std::string_view text);
std::string python_title(std::string_view text);
std::string python_capitalize(std::string_view text);

}  // namespace vavilov::jinja
