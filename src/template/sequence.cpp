// Python's len() and iteration over template values.
#include "core/error.h"
#include "template/builtins.h"
#include "template/python_string.h"

namespace vavilov::jinja {

int64_t python_length(const Value& value, int line) {
  if (value.is_string()) return static_cast<int64_t>(to_code_points(value.as_string()).size());
  if (value.is_list()) return static_cast<int64_t>(value.as_list().size());
  if (value.is_dict()) return static_cast<int64_t>(value.as_dict().items.size());
  if (value.is_undefined()) return 0;
  fail("chat template line {}: object of type {} has no len()", line, value.type_name());
}

List iterate(const Value& value, int line) {
  if (value.is_list()) return value.as_list();
  if (value.is_undefined()) return {};
  if (value.is_dict()) {
    List keys;
    for (const auto& [key, item] : value.as_dict().items) keys.emplace_back(key);
    return keys;
  }
  if (value.is_string()) {
    List characters;
    for (char32_t c : to_code_points(value.as_string())) characters.emplace_back(from_code_points({c}));
    return characters;
  }
  fail("chat template line {}: object of type {} is not iterable", line, value.type_name());
}

}  // namespace vavilov::jinja
