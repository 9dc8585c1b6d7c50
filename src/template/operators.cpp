#include "template/operators.h"

#include <cmath>
#include <limits>

#include "core/error.h"
#include "template/builtins.h"
#include "template/python_string.h"

namespace vavilov::jinja {
namespace {

// Repetition beyond this is a runaway template; refusing it avoids exhausting memory.
constexpr int64_t kMaxRepeatedBytes = 16 << 20;

[[noreturn]] void unsupported(const std::string& op, const Value& a, const Value& b, int line) {
  if (a.is_undefined() || b.is_undefined()) {
    fail("chat template line {}: '{}' is undefined", line, a.is_undefined() ? a.undefined_name() : b.undefined_name());
  }
  fail("chat template line {}: unsupported operand types for {}: '{}' and '{}'", line, op, a.type_name(),
       b.type_name());
}

bool both_integers(const Value& a, const Value& b) {
  return (a.is_int() || a.is_bool()) && (b.is_int() || b.is_bool());
}

// Applies a __builtin_*_overflow operation and turns overflow into an error.
template <typename Operation>
int64_t checked(Operation operation, int64_t x, int64_t y, int line) {
  int64_t result = 0;
  check(!operation(x, y, &result), "chat template line {}: integer overflow", line);
  return result;
}

bool add_overflows(int64_t x, int64_t y, int64_t* r) { return __builtin_add_overflow(x, y, r); }
bool sub_overflows(int64_t x, int64_t y, int64_t* r) { return __builtin_sub_overflow(x, y, r); }
bool mul_overflows(int64_t x, int64_t y, int64_t* r) { return __builtin_mul_overflow(x, y, r); }

Value repeat(const Value& sequence, int64_t times, int line) {
  times = std::max<int64_t>(0, times);
  if (sequence.is_string()) {
    const std::string& text = sequence.as_string();
    check(static_cast<int64_t>(text.size()) * times <= kMaxRepeatedBytes, "chat template line {}: string too long",
          line);
    std::string out;
    for (int64_t i = 0; i < times; ++i) out += text;
    return Value(out);
  }
  const List& list = sequence.as_list();
  check(static_cast<int64_t>(list.size()) * times <= kMaxRepeatedBytes, "chat template line {}: list too long", line);
  List out;
  for (int64_t i = 0; i < times; ++i) out.insert(out.end(), list.begin(), list.end());
  return Value(std::move(out));
}

Value arithmetic(const std::string& op, const Value& a, const Value& b, int line) {
  if (both_integers(a, b)) {
    const int64_t x = a.to_int(), y = b.to_int();
    if (op == "+") return Value(checked(add_overflows, x, y, line));
    if (op == "-") return Value(checked(sub_overflows, x, y, line));
    if (op == "*") return Value(checked(mul_overflows, x, y, line));
    if (op == "/") {
      check(y != 0, "chat template line {}: division by zero", line);
      return Value(static_cast<double>(x) / static_cast<double>(y));
    }
    if (op == "//" || op == "%") {
      check(y != 0, "chat template line {}: integer division or modulo by zero", line);
      check(!(x == std::numeric_limits<int64_t>::min() && y == -1), "chat template line {}: integer overflow", line);
      int64_t quotient = x / y, remainder = x % y;
      if (remainder != 0 && ((remainder < 0) != (y < 0))) {  // Python floors toward negative infinity
        --quotient;
        remainder += y;
      }
      return Value(op == "//" ? quotient : remainder);
    }
    if (op == "**") {
      if (y < 0) return Value(std::pow(static_cast<double>(x), static_cast<double>(y)));
      if (x == 0 || x == 1) return Value(y == 0 ? int64_t{1} : x);
      if (x == -1) return Value(y % 2 == 0 ? int64_t{1} : int64_t{-1});
      int64_t result = 1;  // |x| >= 2 overflows within 63 steps, so this loop is short
      for (int64_t i = 0; i < y; ++i) result = checked(mul_overflows, result, x, line);
      return Value(result);
    }
  }
  const double x = a.to_double(), y = b.to_double();
  if (op == "+") return Value(x + y);
  if (op == "-") return Value(x - y);
  if (op == "*") return Value(x * y);
  if (op == "**") return Value(std::pow(x, y));
  check(y != 0, "chat template line {}: float division by zero", line);
  if (op == "/") return Value(x / y);
  const double quotient = std::floor(x / y);
  return Value(op == "//" ? quotient : x - quotient * y);
}

// Python slice bounds for a sequence of `length` elements.
std::vector<int64_t> slice_indices(int64_t length, const Value& start, const Value& stop, const Value& step, int line) {
  auto bound = [&](const Value& v, const char* which) -> std::optional<int64_t> {
    if (v.is_undefined() || v.is_none()) return std::nullopt;
    check(v.is_int() || v.is_bool(), "chat template line {}: slice {} must be an integer", line, which);
    return v.to_int();
  };
  const int64_t stride = bound(step, "step").value_or(1);
  check(stride != 0, "chat template line {}: slice step cannot be zero", line);
  auto clamp = [&](std::optional<int64_t> index, int64_t fallback) {
    if (!index) return fallback;
    int64_t i = *index < 0 ? *index + length : *index;
    if (stride > 0) return std::clamp<int64_t>(i, 0, length);
    return std::clamp<int64_t>(i, -1, length - 1);
  };
  const int64_t first = clamp(bound(start, "start"), stride > 0 ? 0 : length - 1);
  const int64_t last = clamp(bound(stop, "stop"), stride > 0 ? length : -1);
  std::vector<int64_t> indices;
  for (int64_t i = first; stride > 0 ? i < last : i > last; i += stride) indices.push_back(i);
  return indices;
}

}  // namespace

Value binary_operation(const std::string& op, const Value& a, const Value& b, int line) {
  if (op == "~") return Value(a.str() + b.str());
  if (a.is_number() && b.is_number()) return arithmetic(op, a, b, line);
  if (op == "+" && a.is_string() && b.is_string()) return Value(a.as_string() + b.as_string());
  if (op == "+" && a.is_list() && b.is_list()) {
    List joined = a.as_list();
    joined.insert(joined.end(), b.as_list().begin(), b.as_list().end());
    return Value(std::move(joined));
  }
  if (op == "*" && (a.is_string() || a.is_list()) && (b.is_int() || b.is_bool())) return repeat(a, b.to_int(), line);
  if (op == "*" && (b.is_string() || b.is_list()) && (a.is_int() || a.is_bool())) return repeat(b, a.to_int(), line);
  unsupported(op, a, b, line);
}

Value negate(const Value& value, int line) {
  if (value.is_float()) return Value(-value.as_float());
  if (value.is_int() || value.is_bool()) {
    check(value.to_int() != std::numeric_limits<int64_t>::min(), "chat template line {}: integer overflow", line);
    return Value(-value.to_int());
  }
  fail("chat template line {}: bad operand type for unary -: '{}'", line, value.type_name());
}

bool contains(const Value& container, const Value& item, int line) {
  if (container.is_string()) {
    check(item.is_string(), "chat template line {}: 'in <string>' requires a string, not {}", line, item.type_name());
    return container.as_string().find(item.as_string()) != std::string::npos;
  }
  if (container.is_dict()) return item.is_string() && container.as_dict().find(item.as_string()) != nullptr;
  for (const Value& element : iterate(container, line))
    if (equals(element, item)) return true;
  return false;
}

bool compare(const std::string& op, const Value& a, const Value& b, int line) {
  if (op == "==") return equals(a, b);
  if (op == "!=") return !equals(a, b);
  if (op == "<") return less_than(a, b, line);
  if (op == ">") return less_than(b, a, line);
  if (op == "<=") return !less_than(b, a, line);
  if (op == ">=") return !less_than(a, b, line);
  if (op == "in") return contains(b, a, line);
  return !contains(b, a, line);  // "not in"
}

Value get_attribute(const Value& object, const std::string& name, int line) {
  if (object.is_undefined()) {
    fail("chat template line {}: cannot read '{}' of undefined '{}'", line, name, object.undefined_name());
  }
  if (auto method = bound_method(object, name)) return *method;
  if (object.is_dict()) {
    const Value* found = object.as_dict().find(name);
    return found ? *found : Value::undefined(name);
  }
  if (object.is_namespace()) {
    const Value* found = object.as_namespace().attributes->find(name);
    return found ? *found : Value::undefined(name);
  }
  return Value::undefined(name);
}

Value get_item(const Value& object, const Value& key, int line) {
  if (object.is_undefined()) {
    fail("chat template line {}: cannot index undefined '{}'", line, object.undefined_name());
  }
  if (object.is_dict() && key.is_string()) {
    const Value* found = object.as_dict().find(key.as_string());
    if (found) return *found;
  }
  if ((object.is_list() || object.is_string()) && (key.is_int() || key.is_bool())) {
    const int64_t length = python_length(object, line);
    int64_t index = key.to_int();
    if (index < 0) index += length;
    if (index < 0 || index >= length) return Value::undefined("index " + std::to_string(key.to_int()));
    if (object.is_list()) return object.as_list()[static_cast<size_t>(index)];
    return Value(from_code_points({to_code_points(object.as_string())[static_cast<size_t>(index)]}));
  }
  if (key.is_string()) return get_attribute(object, key.as_string(), line);
  return Value::undefined(key.str());
}

Value slice(const Value& object, const Value& start, const Value& stop, const Value& step, int line) {
  if (object.is_string()) {
    const std::vector<char32_t> code_points = to_code_points(object.as_string());
    std::vector<char32_t> out;
    for (int64_t i : slice_indices(static_cast<int64_t>(code_points.size()), start, stop, step, line))
      out.push_back(code_points[static_cast<size_t>(i)]);
    return Value(from_code_points(out));
  }
  check(object.is_list(), "chat template line {}: cannot slice {}", line, object.type_name());
  const List& list = object.as_list();
  List out;
  for (int64_t i : slice_indices(static_cast<int64_t>(list.size()), start, stop, step, line))
    out.push_back(list[static_cast<size_t>(i)]);
  return Value(std::move(out));
}

}  // namespace vavilov::jinja
