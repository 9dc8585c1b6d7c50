#pragma once
// Jinja2's built-in filters and tests, Python's str/dict methods, transformers' globals and tojson, as far as chat
// templates use them. Each lives in its own file; this header is their common interface.
#include <optional>
#include <string>
#include <string_view>

#include "template/value.h"

namespace vavilov::jinja {

bool has_filter(std::string_view name);
bool has_test(std::string_view name);
// `operand` | name(args). Throws vavilov::Error naming args.line on bad input.
Value apply_filter(std::string_view name, const Value& operand, const CallArgs& args);
bool apply_test(std::string_view name, const Value& operand, const CallArgs& args);

// `object.name` when it is a method (str.strip, dict.items, ...): a callable bound to `object`.
std::optional<Value> bound_method(const Value& object, const std::string& name);

// The global functions: range, namespace, dict, raise_exception, strftime_now.
Dict global_functions();

// transformers' tojson: json.dumps(value, ensure_ascii=False, indent=..., separators=..., sort_keys=...).
struct JsonOptions {
  std::optional<int64_t> indent;
  std::optional<std::string> item_separator;
  std::optional<std::string> key_separator;
  bool sort_keys = false;
};
std::string to_json(const Value& value, const JsonOptions& options, int line);

// Python len(): code points of a string, items of a list or dict; throws for other types.
int64_t python_length(const Value& value, int line);
// Python iteration: list items, dict keys, string characters; undefined is empty; throws for other types.
List iterate(const Value& value, int line);

}  // namespace vavilov::jinja
