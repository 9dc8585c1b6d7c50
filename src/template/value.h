#pragma once
// The values a chat template computes with, with Python's semantics as Jinja2 has them: truthiness, equality,
// ordering, str() and repr(). Lists and dicts are shared and immutable (transformers renders in Jinja2's
// ImmutableSandboxedEnvironment); only namespaces can be assigned to.
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace vavilov::jinja {

class Value;
using List = std::vector<Value>;

// An insertion-ordered string-keyed map, like a Python dict built from JSON.
struct Dict {
  std::vector<std::pair<std::string, Value>> items;
  const Value* find(std::string_view key) const;
  void set(const std::string& key, Value value);
};

struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
  int line = 0;
};
using Function = std::function<Value(const CallArgs&)>;

struct Undefined {
  std::string name;  // what was looked up, for error messages
};
struct None {};
struct Namespace {
  std::shared_ptr<Dict> attributes;
};
struct Callable {
  std::string name;
  std::shared_ptr<Function> function;
};

class Value {
 public:
  using Storage = std::variant<Undefined, None, bool, int64_t, double, std::string, std::shared_ptr<const List>,
                               std::shared_ptr<const Dict>, Namespace, Callable>;

  Value() : storage_(Undefined{}) {}
  Value(None) : storage_(None{}) {}
  Value(bool b) : storage_(b) {}
  Value(int64_t i) : storage_(i) {}
  Value(int i) : storage_(int64_t{i}) {}
  Value(double d) : storage_(d) {}
  Value(std::string s) : storage_(std::move(s)) {}
  Value(const char* s) : storage_(std::string(s)) {}
  Value(List list) : storage_(std::make_shared<const List>(std::move(list))) {}
  Value(Dict dict) : storage_(std::make_shared<const Dict>(std::move(dict))) {}
  Value(Namespace ns) : storage_(std::move(ns)) {}
  Value(Callable callable) : storage_(std::move(callable)) {}
  static Value undefined(std::string name) { return Value(Storage(Undefined{std::move(name)})); }
  // A list that prints as a Python tuple: dict.items() pairs and (a, b) literals.
  static Value tuple(List items) {
    Value value(std::move(items));
    value.is_tuple_ = true;
    return value;
  }
  static Value from_json(const nlohmann::ordered_json& json);

  bool is_undefined() const { return std::holds_alternative<Undefined>(storage_); }
  bool is_none() const { return std::holds_alternative<None>(storage_); }
  bool is_bool() const { return std::holds_alternative<bool>(storage_); }
  bool is_int() const { return std::holds_alternative<int64_t>(storage_); }
  bool is_float() const { return std::holds_alternative<double>(storage_); }
  bool is_number() const { return is_int() || is_float() || is_bool(); }
  bool is_string() const { return std::holds_alternative<std::string>(storage_); }
  bool is_list() const { return std::holds_alternative<std::shared_ptr<const List>>(storage_); }
  bool is_dict() const { return std::holds_alternative<std::shared_ptr<const Dict>>(storage_); }
  bool is_namespace() const { return std::holds_alternative<Namespace>(storage_); }
  bool is_callable() const { return std::holds_alternative<Callable>(storage_); }

  bool as_bool() const { return std::get<bool>(storage_); }
  int64_t as_int() const { return std::get<int64_t>(storage_); }
  double as_float() const { return std::get<double>(storage_); }
  const std::string& as_string() const { return std::get<std::string>(storage_); }
  const List& as_list() const { return *std::get<std::shared_ptr<const List>>(storage_); }
  const Dict& as_dict() const { return *std::get<std::shared_ptr<const Dict>>(storage_); }
  const Namespace& as_namespace() const { return std::get<Namespace>(storage_); }
  const Callable& as_callable() const { return std::get<Callable>(storage_); }
  const std::string& undefined_name() const { return std::get<Undefined>(storage_).name; }

  // A number as double (bools and ints included); call only when is_number().
  double to_double() const;
  // An int or bool as int64; call only when is_int() or is_bool().
  int64_t to_int() const;

  bool truthy() const;
  // Python's type name, for error messages ("str", "int", "list", "NoneType", ...).
  std::string type_name() const;
  // str(value): what {{ value }} prints. Undefined prints as empty.
  std::string str() const;
  // repr(value): how values print inside lists and dicts.
  std::string repr() const;

 private:
  explicit Value(Storage storage) : storage_(std::move(storage)) {}
  Storage storage_;
  bool is_tuple_ = false;
};

// Python ==.
bool equals(const Value& a, const Value& b);
// Python <; throws vavilov::Error for unorderable types, naming `line`.
bool less_than(const Value& a, const Value& b, int line);

// Python float repr: shortest round-trip digits, "1.0", "1e+16", "inf", "nan".
std::string python_float_repr(double value);
// Python str repr with its quote choice and escapes.
std::string python_string_repr(std::string_view text);

}  // namespace vavilov::jinja
