#include "template/value.h"

#include <fmt/format.h>
#include <utf8proc.h>

#include <charconv>
#include <cmath>

#include "core/error.h"

namespace vavilov::jinja {

const Value* Dict::find(std::string_view key) const {
  for (const auto& [name, value] : items)
    if (name == key) return &value;
  return nullptr;
}

void Dict::set(const std::string& key, Value value) {
  for (auto& [name, existing] : items) {
    if (name == key) {
      existing = std::move(value);
      return;
    }
  }
  items.emplace_back(key, std::move(value));
}

Value Value::from_json(const nlohmann::ordered_json& json) {
  switch (json.type()) {
    case nlohmann::ordered_json::value_t::null:
      return None{};
    case nlohmann::ordered_json::value_t::boolean:
      return json.get<bool>();
    case nlohmann::ordered_json::value_t::number_integer:
      return json.get<int64_t>();
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const auto value = json.get<uint64_t>();
      check(value <= static_cast<uint64_t>(INT64_MAX), "integer {} is too large", value);
      return static_cast<int64_t>(value);
    }
    case nlohmann::ordered_json::value_t::number_float:
      return json.get<double>();
    case nlohmann::ordered_json::value_t::string:
      return json.get<std::string>();
    case nlohmann::ordered_json::value_t::array: {
      List list;
      for (const auto& item : json) list.push_back(from_json(item));
      return list;
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict dict;
      for (const auto& [key, item] : json.items()) dict.set(key, from_json(item));
      return dict;
    }
    default:
      fail("unsupported JSON value of type {}", json.type_name());
  }
}

double Value::to_double() const {
  if (is_bool()) return as_bool() ? 1.0 : 0.0;
  if (is_int()) return static_cast<double>(as_int());
  return as_float();
}

int64_t Value::to_int() const { return is_bool() ? (as_bool() ? 1 : 0) : as_int(); }

bool Value::truthy() const {
  return std::visit(
      [](const auto& v) -> bool {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, Undefined> || std::is_same_v<T, None>)
          return false;
        else if constexpr (std::is_same_v<T, bool>)
          return v;
        else if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, double>)
          return v != 0;
        else if constexpr (std::is_same_v<T, std::string>)
          return !v.empty();
        else if constexpr (std::is_same_v<T, std::shared_ptr<const List>>)
          return !v->empty();
        else if constexpr (std::is_same_v<T, std::shared_ptr<const Dict>>)
          return !v->items.empty();
        else
          return true;
      },
      storage_);
}

std::string Value::type_name() const {
  static constexpr const char* kNames[] = {"Undefined", "NoneType", "bool", "int",       "float",
                                           "str",       "list",     "dict", "Namespace", "function"};
  return kNames[storage_.index()];
}

std::string python_float_repr(double value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  // Shortest round-trip digits in scientific form, then laid out the way Python's repr does.
  char buffer[64];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), value, std::chars_format::scientific);
  std::string scientific(buffer, result.ptr);
  const size_t e = scientific.find('e');
  const int exponent = std::stoi(scientific.substr(e + 1));
  std::string sign = scientific[0] == '-' ? "-" : "";
  std::string digits;
  for (char c : scientific.substr(0, e))
    if (c >= '0' && c <= '9') digits.push_back(c);
  if (exponent < -4 || exponent >= 16) {
    std::string mantissa = digits.substr(0, 1);
    if (digits.size() > 1) mantissa.append(".").append(digits, 1);
    return fmt::format("{}{}e{}{:02d}", sign, mantissa, exponent < 0 ? '-' : '+', std::abs(exponent));
  }
  if (exponent < 0) return sign + "0." + std::string(static_cast<size_t>(-exponent - 1), '0') + digits;
  const size_t integer_digits = static_cast<size_t>(exponent) + 1;
  if (digits.size() <= integer_digits) return sign + digits + std::string(integer_digits - digits.size(), '0') + ".0";
  return sign + digits.substr(0, integer_digits) + "." + digits.substr(integer_digits);
}

namespace {

bool is_printable(char32_t c) {
  if (c == ' ') return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_CC:
    case UTF8PROC_CATEGORY_CF:
    case UTF8PROC_CATEGORY_CS:
    case UTF8PROC_CATEGORY_CO:
    case UTF8PROC_CATEGORY_CN:
    case UTF8PROC_CATEGORY_ZL:
    case UTF8PROC_CATEGORY_ZP:
    case UTF8PROC_CATEGORY_ZS:
      return false;
    default:
      return true;
  }
}

}  // namespace

std::string python_string_repr(std::string_view text) {
  const bool use_double = text.find('\'') != std::string_view::npos && text.find('"') == std::string_view::npos;
  const char quote = use_double ? '"' : '\'';
  std::string out(1, quote);
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t start = pos;
    utf8proc_int32_t c = 0;
    const auto length = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(text.data() + pos),
                                         static_cast<utf8proc_ssize_t>(text.size() - pos), &c);
    pos += length > 0 ? static_cast<size_t>(length) : 1;
    if (c == quote || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (length <= 0 || !is_printable(static_cast<char32_t>(c))) {
      if (length <= 0 || c < 0x100) {
        out += fmt::format("\\x{:02x}", length <= 0 ? static_cast<unsigned char>(text[start]) : c);
      } else if (c < 0x10000) {
        out += fmt::format("\\u{:04x}", c);
      } else {
        out += fmt::format("\\U{:08x}", c);
      }
    } else {
      out.append(text.substr(start, pos - start));
    }
  }
  out += quote;
  return out;
}

std::string Value::str() const {
  if (is_undefined()) return "";
  if (is_string()) return as_string();
  return repr();
}

std::string Value::repr() const {
  if (is_tuple_) {
    const List& items = as_list();
    std::string out = "(";
    for (size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + items[i].repr();
    return out + (items.size() == 1 ? ",)" : ")");
  }
  return std::visit(
      [](const auto& v) -> std::string {
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, Undefined>)
          return "";
        else if constexpr (std::is_same_v<T, None>)
          return "None";
        else if constexpr (std::is_same_v<T, bool>)
          return v ? "True" : "False";
        else if constexpr (std::is_same_v<T, int64_t>)
          return std::to_string(v);
        else if constexpr (std::is_same_v<T, double>)
          return python_float_repr(v);
        else if constexpr (std::is_same_v<T, std::string>)
          return python_string_repr(v);
        else if constexpr (std::is_same_v<T, std::shared_ptr<const List>>) {
          std::string out = "[";
          for (size_t i = 0; i < v->size(); ++i) out += (i ? ", " : "") + (*v)[i].repr();
          return out + "]";
        } else if constexpr (std::is_same_v<T, std::shared_ptr<const Dict>>) {
          std::string out = "{";
          for (size_t i = 0; i < v->items.size(); ++i)
            out += (i ? ", " : "") + python_string_repr(v->items[i].first) + ": " + v->items[i].second.repr();
          return out + "}";
        } else if constexpr (std::is_same_v<T, Namespace>)
          return "<Namespace>";
        else
          return "<function " + v.name + ">";
      },
      storage_);
}

bool equals(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if ((a.is_int() || a.is_bool()) && (b.is_int() || b.is_bool())) return a.to_int() == b.to_int();
    return a.to_double() == b.to_double();
  }
  if (a.is_string() && b.is_string()) return a.as_string() == b.as_string();
  if (a.is_none() && b.is_none()) return true;
  if (a.is_undefined() && b.is_undefined()) return true;
  if (a.is_list() && b.is_list()) {
    const List &x = a.as_list(), &y = b.as_list();
    if (x.size() != y.size()) return false;
    for (size_t i = 0; i < x.size(); ++i)
      if (!equals(x[i], y[i])) return false;
    return true;
  }
  if (a.is_dict() && b.is_dict()) {
    const Dict &x = a.as_dict(), &y = b.as_dict();
    if (x.items.size() != y.items.size()) return false;
    for (const auto& [key, value] : x.items) {
      const Value* other = y.find(key);
      if (!other || !equals(value, *other)) return false;
    }
    return true;
  }
  if (a.is_namespace() && b.is_namespace()) return a.as_namespace().attributes == b.as_namespace().attributes;
  return false;
}

bool less_than(const Value& a, const Value& b, int line) {
  if (a.is_number() && b.is_number()) {
    if ((a.is_int() || a.is_bool()) && (b.is_int() || b.is_bool())) return a.to_int() < b.to_int();
    return a.to_double() < b.to_double();
  }
  // UTF-8 byte order is code point order, which is how Python compares str.
  if (a.is_string() && b.is_string()) return a.as_string() < b.as_string();
  if (a.is_list() && b.is_list()) {
    const List &x = a.as_list(), &y = b.as_list();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (!equals(x[i], y[i])) return less_than(x[i], y[i], line);
    }
    return x.size() < y.size();
  }
  fail("chat template line {}: cannot compare {} with {}", line, a.type_name(), b.type_name());
}

}  // namespace vavilov::jinja
