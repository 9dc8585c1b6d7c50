#pragma once
// Reads the arguments of a filter, test, method or global function the way Python binds them: by position or by
// name, with defaults; too many or unknown arguments are errors that name the function and the line.
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "template/value.h"

namespace vavilov::jinja {

class Arguments {
 public:
  // `parameters` in order; binding fails for extra positional arguments or unknown names.
  Arguments(const CallArgs& args, std::string_view function, std::initializer_list<std::string_view> parameters)
      : args_(args), function_(function), parameters_(parameters) {
    check(args.positional.size() <= parameters_.size(), "chat template line {}: {}() takes at most {} arguments",
          args.line, function, parameters_.size());
    for (const auto& [name, value] : args.keyword) {
      bool known = false;
      for (std::string_view parameter : parameters_) known |= parameter == name;
      check(known, "chat template line {}: {}() got an unexpected argument '{}'", args.line, function, name);
    }
  }

  // The argument for `parameter`, or `fallback` when it was not given.
  Value get(std::string_view parameter, Value fallback = Value()) const {
    for (size_t i = 0; i < parameters_.size(); ++i) {
      if (parameters_[i] != parameter) continue;
      if (i < args_.positional.size()) return args_.positional[i];
      for (const auto& [name, value] : args_.keyword)
        if (name == parameter) return value;
    }
    return fallback;
  }

  Value required(std::string_view parameter) const {
    Value value = get(parameter);
    check(!value.is_undefined() || has(parameter), "chat template line {}: {}() missing argument '{}'", args_.line,
          function_, parameter);
    return value;
  }

  bool has(std::string_view parameter) const {
    for (size_t i = 0; i < parameters_.size(); ++i) {
      if (parameters_[i] != parameter) continue;
      if (i < args_.positional.size()) return true;
      for (const auto& [name, value] : args_.keyword)
        if (name == parameter) return true;
    }
    return false;
  }

  std::string string(std::string_view parameter, std::string fallback = {}) const {
    const Value value = get(parameter);
    if (!has(parameter) || value.is_none()) return fallback;
    check(value.is_string(), "chat template line {}: {}() argument '{}' must be a string, not {}", args_.line,
          function_, parameter, value.type_name());
    return value.as_string();
  }

  int64_t integer(std::string_view parameter, int64_t fallback) const {
    const Value value = get(parameter);
    if (!has(parameter) || value.is_none()) return fallback;
    check(value.is_int() || value.is_bool(), "chat template line {}: {}() argument '{}' must be an integer, not {}",
          args_.line, function_, parameter, value.type_name());
    return value.to_int();
  }

  bool flag(std::string_view parameter, bool fallback) const {
    return has(parameter) ? get(parameter).truthy() : fallback;
  }

  int line() const { return args_.line; }
  size_t positional_count() const { return args_.positional.size(); }

 private:
  const CallArgs& args_;
  std::string_view function_;
  std::vector<std::string_view> parameters_;
};

}  // namespace vavilov::jinja
