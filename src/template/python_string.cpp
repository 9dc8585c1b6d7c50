#include "template/python_string.h"

#include <utf8proc.h>

#include <algorithm>

#include "core/error.h"

namespace vavilov::jinja {
namespace {

void append_code_point(std::string& out, char32_t c) {
  utf8proc_uint8_t buffer[4];
  const auto length = utf8proc_encode_char(static_cast<utf8proc_int32_t>(c), buffer);
  out.append(reinterpret_cast<const char*>(buffer), static_cast<size_t>(length));
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Reads exactly `count` hex digits after position `pos`; Python rejects literals with fewer.
char32_t read_hex(std::string_view body, size_t pos, size_t count) {
  check(pos + count <= body.size(), "truncated \\x, \\u or \\U escape in a string literal");
  char32_t value = 0;
  for (size_t i = 0; i < count; ++i) {
    const int digit = hex_value(body[pos + i]);
    check(digit >= 0, "bad hex digit in a string literal escape");
    value = value * 16 + static_cast<char32_t>(digit);
  }
  check(value <= 0x10FFFF && !(value >= 0xD800 && value <= 0xDFFF), "escape \\U{:08x} is not a character",
        static_cast<uint32_t>(value));
  return value;
}

bool is_cased_letter(char32_t c) {
  const auto category = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return category == UTF8PROC_CATEGORY_LU || category == UTF8PROC_CATEGORY_LL || category == UTF8PROC_CATEGORY_LT;
}

std::string map_code_points(std::string_view text, utf8proc_int32_t (*mapping)(utf8proc_int32_t)) {
  std::string out;
  for (char32_t c : to_code_points(text))
    append_code_point(out, static_cast<char32_t>(mapping(static_cast<utf8proc_int32_t>(c))));
  return out;
}

}  // namespace

std::string unescape_python_literal(std::string_view body) {
  std::string out;
  for (size_t i = 0; i < body.size(); ++i) {
    if (body[i] != '\\' || i + 1 == body.size()) {
      out += body[i];
      continue;
    }
    const char e = body[++i];
    switch (e) {
      case '\n':
        break;  // a backslash-newline continues the line
      case '\\':
        out += '\\';
        break;
      case '\'':
        out += '\'';
        break;
      case '"':
        out += '"';
        break;
      case 'a':
        out += '\a';
        break;
      case 'b':
        out += '\b';
        break;
      case 'f':
        out += '\f';
        break;
      case 'n':
        out += '\n';
        break;
      case 'r':
        out += '\r';
        break;
      case 't':
        out += '\t';
        break;
      case 'v':
        out += '\v';
        break;
      case 'x':
        append_code_point(out, read_hex(body, i + 1, 2));
        i += 2;
        break;
      case 'u':
        append_code_point(out, read_hex(body, i + 1, 4));
        i += 4;
        break;
      case 'U':
        append_code_point(out, read_hex(body, i + 1, 8));
        i += 8;
        break;
      default:
        if (e >= '0' && e <= '7') {
          char32_t value = 0;
          size_t digits = 0;
          for (; digits < 3 && i < body.size() && body[i] >= '0' && body[i] <= '7'; ++digits, ++i)
            value = value * 8 + static_cast<char32_t>(body[i] - '0');
          --i;
          append_code_point(out, value);
        } else {
          out += '\\';
          out += e;
        }
    }
  }
  return out;
}

bool is_python_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

std::vector<char32_t> to_code_points(std::string_view utf8) {
  std::vector<char32_t> out;
  size_t pos = 0;
  while (pos < utf8.size()) {
    utf8proc_int32_t c = 0;
    const auto length = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(utf8.data() + pos),
                                         static_cast<utf8proc_ssize_t>(utf8.size() - pos), &c);
    if (length <= 0) {  // not UTF-8: keep the byte as U+FFFD so nothing is silently lost
      out.push_back(0xFFFD);
      ++pos;
    } else {
      out.push_back(static_cast<char32_t>(c));
      pos += static_cast<size_t>(length);
    }
  }
  return out;
}

std::string from_code_points(const std::vector<char32_t>& code_points) {
  std::string out;
  for (char32_t c : code_points) append_code_point(out, c);
  return out;
}

std::string python_strip(std::string_view text, const std::optional<std::string>& chars, bool left, bool right) {
  const std::vector<char32_t> strip_set = chars ? to_code_points(*chars) : std::vector<char32_t>();
  auto stripped = [&](char32_t c) {
    return chars ? std::find(strip_set.begin(), strip_set.end(), c) != strip_set.end() : is_python_space(c);
  };
  const std::vector<char32_t> code_points = to_code_points(text);
  size_t begin = 0, end = code_points.size();
  if (left)
    while (begin < end && stripped(code_points[begin])) ++begin;
  if (right)
    while (end > begin && stripped(code_points[end - 1])) --end;
  return from_code_points(
      {code_points.begin() + static_cast<long>(begin), code_points.begin() + static_cast<long>(end)});
}

std::vector<std::string> python_split(std::string_view text, const std::optional<std::string>& separator,
                                      long max_split, bool from_right) {
  std::vector<std::string> parts;
  if (separator) {
    check(!separator->empty(), "empty separator");
    std::string_view rest = text;
    while (max_split < 0 || static_cast<long>(parts.size()) < max_split) {
      const size_t at = from_right ? rest.rfind(*separator) : rest.find(*separator);
      if (at == std::string_view::npos) break;
      if (from_right) {
        parts.emplace_back(rest.substr(at + separator->size()));
        rest = rest.substr(0, at);
      } else {
        parts.emplace_back(rest.substr(0, at));
        rest = rest.substr(at + separator->size());
      }
    }
    parts.emplace_back(rest);
    if (from_right) std::reverse(parts.begin(), parts.end());
    return parts;
  }
  // Runs of white space separate; leading and trailing white space yields no empty parts.
  std::vector<char32_t> code_points = to_code_points(text);
  if (from_right) std::reverse(code_points.begin(), code_points.end());
  size_t pos = 0;
  while (pos < code_points.size()) {
    while (pos < code_points.size() && is_python_space(code_points[pos])) ++pos;
    if (pos == code_points.size()) break;
    size_t end = pos;
    if (max_split >= 0 && static_cast<long>(parts.size()) == max_split) {
      end = code_points.size();  // the remainder keeps its white space
    } else {
      while (end < code_points.size() && !is_python_space(code_points[end])) ++end;
    }
    std::vector<char32_t> part(code_points.begin() + static_cast<long>(pos),
                               code_points.begin() + static_cast<long>(end));
    if (from_right) std::reverse(part.begin(), part.end());
    parts.push_back(from_code_points(part));
    pos = end;
  }
  if (from_right) std::reverse(parts.begin(), parts.end());
  return parts;
}

std::string python_upper(std::string_view text) { return map_code_points(text, utf8proc_toupper); }
std::string python_lower(std::string_view text) { return map_code_points(text, utf8proc_tolower); }

std::string python_title(std::string_view text) {
  std::string out;
  bool previous_cased = false;
  for (char32_t c : to_code_points(text)) {
    const auto mapped = previous_cased ? utf8proc_tolower(static_cast<utf8proc_int32_t>(c))
                                       : utf8proc_totitle(static_cast<utf8proc_int32_t>(c));
    append_code_point(out, static_cast<char32_t>(mapped));
    previous_cased = is_cased_letter(c);
  }
  return out;
}

std::string python_capitalize(std::string_view text) {
  std::string out;
  bool first = true;
  for (char32_t c : to_code_points(text)) {
    const auto mapped =
        first ? utf8proc_totitle(static_cast<utf8proc_int32_t>(c)) : utf8proc_tolower(static_cast<utf8proc_int32_t>(c));
    append_code_point(out, static_cast<char32_t>(mapped));
    first = false;
  }
  return out;
}

}  // namespace vavilov::jinja
