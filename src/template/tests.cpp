// Jinja2's built-in tests (`x is defined`, `x is string`, ...).
#include <cmath>
#include <functional>
#include <map>

#include "template/arguments.h"
#include "template/builtins.h"

namespace vavilov::jinja {
namespace {

using Test = std::function<bool(const Value&, const CallArgs&)>;

bool is_lower_text(const std::string& text, bool lower) {
  bool cased = false;
  for (char c : text) {
    if (std::isupper(static_cast<unsigned char>(c))) {
      if (lower) return false;
      cased = true;
    } else if (std::islower(static_cast<unsigned char>(c))) {
      if (!lower) return false;
      cased = true;
    }
  }
  return cased;
}

Test compare_with(std::function<bool(const Value&, const Value&, int)> relation) {
  return [relation](const Value& value, const CallArgs& args) {
    const Arguments arguments(args, "test", {"other"});
    return relation(value, arguments.required("other"), args.line);
  };
}

Test no_arguments(std::function<bool(const Value&)> predicate) {
  return [predicate](const Value& value, const CallArgs& args) {
    const Arguments arguments(args, "test", {});
    return predicate(value);
  };
}

const std::map<std::string, Test, std::less<>>& tests() {
  static const std::map<std::string, Test, std::less<>> registry = [] {
    std::map<std::string, Test, std::less<>> t;
    t["defined"] = no_arguments([](const Value& v) { return !v.is_undefined(); });
    t["undefined"] = no_arguments([](const Value& v) { return v.is_undefined(); });
    t["none"] = no_arguments([](const Value& v) { return v.is_none(); });
    t["boolean"] = no_arguments([](const Value& v) { return v.is_bool(); });
    t["true"] = no_arguments([](const Value& v) { return v.is_bool() && v.as_bool(); });
    t["false"] = no_arguments([](const Value& v) { return v.is_bool() && !v.as_bool(); });
    t["integer"] = no_arguments([](const Value& v) { return v.is_int(); });
    t["float"] = no_arguments([](const Value& v) { return v.is_float(); });
    t["number"] = no_arguments([](const Value& v) { return v.is_number(); });
    t["string"] = no_arguments([](const Value& v) { return v.is_string(); });
    t["mapping"] = no_arguments([](const Value& v) { return v.is_dict(); });
    t["sequence"] = no_arguments([](const Value& v) { return v.is_list() || v.is_string() || v.is_dict(); });
    t["iterable"] = no_arguments([](const Value& v) { return v.is_list() || v.is_string() || v.is_dict(); });
    t["callable"] = no_arguments([](const Value& v) { return v.is_callable(); });
    t["lower"] = no_arguments([](const Value& v) { return v.is_string() && is_lower_text(v.as_string(), true); });
    t["upper"] = no_arguments([](const Value& v) { return v.is_string() && is_lower_text(v.as_string(), false); });
    t["odd"] = no_arguments([](const Value& v) { return (v.is_int() || v.is_bool()) && v.to_int() % 2 != 0; });
    t["even"] = no_arguments([](const Value& v) { return (v.is_int() || v.is_bool()) && v.to_int() % 2 == 0; });
    t["divisibleby"] = [](const Value& v, const CallArgs& args) {
      const Arguments arguments(args, "divisibleby", {"num"});
      const int64_t divisor = arguments.integer("num", 1);
      check(divisor != 0 && (v.is_int() || v.is_bool()), "chat template line {}: divisibleby needs integers",
            args.line);
      return v.to_int() % divisor == 0;
    };
    const auto equal = compare_with([](const Value& a, const Value& b, int) { return equals(a, b); });
    t["eq"] = t["equalto"] = t["=="] = equal;
    t["ne"] = t["!="] = compare_with([](const Value& a, const Value& b, int) { return !equals(a, b); });
    t["lt"] = t["lessthan"] = t["<"] = compare_with(less_than);
    t["gt"] = t["greaterthan"] = t[">"] =
        compare_with([](const Value& a, const Value& b, int line) { return less_than(b, a, line); });
    t["le"] = t["<="] = compare_with([](const Value& a, const Value& b, int line) { return !less_than(b, a, line); });
    t["ge"] = t[">="] = compare_with([](const Value& a, const Value& b, int line) { return !less_than(a, b, line); });
    t["sameas"] = compare_with([](const Value& a, const Value& b, int) {
      // Python identity: only the singletons and shared containers can be the same object.
      if (a.is_none() || a.is_bool()) return equals(a, b) && a.type_name() == b.type_name();
      return false;
    });
    t["in"] = [](const Value& v, const CallArgs& args) {
      const Arguments arguments(args, "in", {"seq"});
      const Value container = arguments.required("seq");
      if (container.is_string()) return v.is_string() && container.as_string().find(v.as_string()) != std::string::npos;
      for (const Value& item : iterate(container, args.line))
        if (equals(item, v)) return true;
      return false;
    };
    return t;
  }();
  return registry;
}

}  // namespace

bool has_test(std::string_view name) { return tests().count(name) > 0; }

bool apply_test(std::string_view name, const Value& operand, const CallArgs& args) {
  const auto it = tests().find(name);
  check(it != tests().end(), "chat template line {}: no test named '{}'", args.line, name);
  return it->second(operand, args);
}

}  // namespace vavilov::jinja
