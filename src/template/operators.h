#pragma once
// Python's operators on template values, and Jinja2's attribute and item lookup (obj.name tries the attribute,
// then the item; obj[key] the item, then the attribute).
#include <string>

#include "template/value.h"

namespace vavilov::jinja {

// + - * / // % ** ~ with Python semantics; errors name `line`.
Value binary_operation(const std::string& op, const Value& a, const Value& b, int line);
Value negate(const Value& value, int line);
// Python `item in container`.
bool contains(const Value& container, const Value& item, int line);
// Comparison operators == != < > <= >= in, "not in".
bool compare(const std::string& op, const Value& a, const Value& b, int line);

Value get_attribute(const Value& object, const std::string& name, int line);
Value get_item(const Value& object, const Value& key, int line);
// object[start:stop:step]; absent bounds are undefined values.
Value slice(const Value& object, const Value& start, const Value& stop, const Value& step, int line);

}  // namespace vavilov::jinja
