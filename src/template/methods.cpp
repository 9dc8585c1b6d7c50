// The Python methods templates call on values: str.strip(), str.split(), dict.items(), dict.get(), ...
// The sandbox transformers uses forbids mutating methods (list.append, dict.update); they are errors here too.
#include <utf8proc.h>

#include <algorithm>
#include <functional>
#include <map>

#include "template/arguments.h"
#include "template/builtins.h"
#include "template/python_string.h"

namespace vavilov::jinja {
namespace {

using Method = std::function<Value(const Value& self, const CallArgs& args)>;

std::optional<std::string> optional_string(const Arguments& arguments, std::string_view name) {
  if (!arguments.has(name) || arguments.get(name).is_none()) return std::nullopt;
  return arguments.string(name);
}

Method strip_method(const char* name, bool left, bool right) {
  return [=](const Value& self, const CallArgs& args) {
    const Arguments arguments(args, name, {"chars"});
    return Value(python_strip(self.as_string(), optional_string(arguments, "chars"), left, right));
  };
}

Method split_method(const char* name, bool from_right) {
  return [=](const Value& self, const CallArgs& args) {
    const Arguments arguments(args, name, {"sep", "maxsplit"});
    List parts;
    for (auto& part : python_split(self.as_string(), optional_string(arguments, "sep"),
                                   static_cast<long>(arguments.integer("maxsplit", -1)), from_right))
      parts.emplace_back(std::move(part));
    return Value(std::move(parts));
  };
}

Method affix_method(const char* name, bool prefix) {
  return [=](const Value& self, const CallArgs& args) {
    const Arguments arguments(args, name, {"affix"});
    const Value affix = arguments.required("affix");
    const std::string& text = self.as_string();
    auto matches = [&](const Value& candidate) {
      check(candidate.is_string(), "chat template line {}: {}() takes a string or a tuple of strings", args.line, name);
      const std::string& s = candidate.as_string();
      return s.size() <= text.size() &&
             (prefix ? text.compare(0, s.size(), s) == 0 : text.compare(text.size() - s.size(), s.size(), s) == 0);
    };
    if (affix.is_list()) return Value(std::any_of(affix.as_list().begin(), affix.as_list().end(), matches));
    return Value(matches(affix));
  };
}

Method mapping_method(const char* name, std::string (*mapping)(std::string_view)) {
  return [=](const Value& self, const CallArgs& args) {
    const Arguments arguments(args, name, {});
    return Value(mapping(self.as_string()));
  };
}

Method predicate_method(const char* name, bool (*predicate)(char32_t)) {
  return [=](const Value& self, const CallArgs& args) {
    const Arguments arguments(args, name, {});
    const auto code_points = to_code_points(self.as_string());
    return Value(!code_points.empty() && std::all_of(code_points.begin(), code_points.end(), predicate));
  };
}

bool is_python_alpha(char32_t c) {
  const auto category = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return category >= UTF8PROC_CATEGORY_LU && category <= UTF8PROC_CATEGORY_LO;
}

bool is_python_digit(char32_t c) { return utf8proc_category(static_cast<utf8proc_int32_t>(c)) == UTF8PROC_CATEGORY_ND; }

// Index in code points of `needle` in `haystack`, or -1.
int64_t code_point_find(const std::string& haystack, const std::string& needle, bool from_right) {
  const size_t at = from_right ? haystack.rfind(needle) : haystack.find(needle);
  if (at == std::string::npos) return -1;
  return static_cast<int64_t>(to_code_points(std::string_view(haystack).substr(0, at)).size());
}

const std::map<std::string, Method, std::less<>>& string_methods() {
  static const std::map<std::string, Method, std::less<>> registry = [] {
    std::map<std::string, Method, std::less<>> m;
    m["strip"] = strip_method("strip", true, true);
    m["lstrip"] = strip_method("lstrip", true, false);
    m["rstrip"] = strip_method("rstrip", false, true);
    m["split"] = split_method("split", false);
    m["rsplit"] = split_method("rsplit", true);
    m["startswith"] = affix_method("startswith", true);
    m["endswith"] = affix_method("endswith", false);
    m["upper"] = mapping_method("upper", python_upper);
    m["lower"] = mapping_method("lower", python_lower);
    m["title"] = mapping_method("title", python_title);
    m["capitalize"] = mapping_method("capitalize", python_capitalize);
    m["isdigit"] = predicate_method("isdigit", is_python_digit);
    m["isspace"] = predicate_method("isspace", is_python_space);
    m["isalpha"] = predicate_method("isalpha", is_python_alpha);
    m["isalnum"] = predicate_method("isalnum", [](char32_t c) { return is_python_alpha(c) || is_python_digit(c); });
    m["replace"] = [](const Value& self, const CallArgs& args) {
      const Arguments arguments(args, "replace", {"old", "new", "count"});
      const std::string old_text = arguments.string("old"), new_text = arguments.string("new");
      int64_t remaining = arguments.integer("count", -1);
      std::string text = self.as_string(), out;
      if (old_text.empty()) return Value(text);  // Python inserts between characters; no template relies on it
      size_t pos = 0;
      for (size_t at; remaining != 0 && (at = text.find(old_text, pos)) != std::string::npos; --remaining) {
        out.append(text, pos, at - pos);
        out += new_text;
        pos = at + old_text.size();
      }
      return Value(out + text.substr(pos));
    };
    m["find"] = [](const Value& self, const CallArgs& args) {
      const Arguments arguments(args, "find", {"sub"});
      return Value(code_point_find(self.as_string(), arguments.string("sub"), false));
    };
    m["rfind"] = [](const Value& self, const CallArgs& args) {
      const Arguments arguments(args, "rfind", {"sub"});
      return Value(code_point_find(self.as_string(), arguments.string("sub"), true));
    };
    m["count"] = [](const Value& self, const CallArgs& args) {
      const Arguments arguments(args, "count", {"sub"});
      const std::string sub = arguments.string("sub");
      const std::string& text = self.as_string();
      if (sub.empty()) return Value(static_cast<int64_t>(to_code_points(text).size()) + 1);
      int64_t count = 0;
      for (size_t at = text.find(sub); at != std::string::npos; at = text.find(sub, at + sub.size())) ++count;
      return Value(count);
    };
    m["join"] = [](const Value& self, const CallArgs& args) {
      const Arguments arguments(args, "join", {"iterable"});
      std::string out;
      bool first = true;
      for (const Value& item : iterate(arguments.required("iterable"), args.line)) {
        check(item.is_string(), "chat template line {}: str.join() expects strings, found {}", args.line,
              item.type_name());
        if (!first) out += self.as_string();
        out += item.as_string();
        first = false;
      }
      return Value(out);
    };
    m["splitlines"] = [](const Value& self, const CallArgs& args) {
      const Arguments arguments(args, "splitlines", {});
      List lines;
      const std::string& text = self.as_string();
      size_t start = 0;
      for (size_t i = 0; i < text.size(); ++i) {
        if (text[i] != '\n' && text[i] != '\r') continue;
        lines.emplace_back(text.substr(start, i - start));
        if (text[i] == '\r' && i + 1 < text.size() && text[i + 1] == '\n') ++i;
        start = i + 1;
      }
      if (start < text.size()) lines.emplace_back(text.substr(start));
      return Value(std::move(lines));
    };
    return m;
  }();
  return registry;
}

const std::map<std::string, Method, std::less<>>& dict_methods() {
  static const std::map<std::string, Method, std::less<>> registry = [] {
    std::map<std::string, Method, std::less<>> m;
    m["items"] = [](const Value& self, const CallArgs& args) {
      const Arguments arguments(args, "items", {});
      List items;
      for (const auto& [key, value] : self.as_dict().items) items.push_back(Value::tuple(List{Value(key), value}));
      return Value(std::move(items));
    };
    m["keys"] = [](const Value& self, const CallArgs& args) {
      const Arguments arguments(args, "keys", {});
      return Value(iterate(self, args.line));
    };
    m["values"] = [](const Value& self, const CallArgs& args) {
      const Arguments arguments(args, "values", {});
      List values;
      for (const auto& [key, value] : self.as_dict().items) values.push_back(value);
      return Value(std::move(values));
    };
    m["get"] = [](const Value& self, const CallArgs& args) {
      const Arguments arguments(args, "get", {"key", "default"});
      const Value key = arguments.required("key");
      const Value* found = key.is_string() ? self.as_dict().find(key.as_string()) : nullptr;
      return found ? *found : arguments.get("default", Value(None{}));
    };
    return m;
  }();
  return registry;
}

bool is_mutating_method(const Value& object, std::string_view name) {
  static const std::string_view kList[] = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse"};
  static const std::string_view kDict[] = {"pop", "popitem", "setdefault", "update", "clear"};
  if (object.is_list()) return std::find(std::begin(kList), std::end(kList), name) != std::end(kList);
  if (object.is_dict()) return std::find(std::begin(kDict), std::end(kDict), name) != std::end(kDict);
  return false;
}

}  // namespace

std::optional<Value> bound_method(const Value& object, const std::string& name) {
  const std::map<std::string, Method, std::less<>>* methods = nullptr;
  if (object.is_string()) methods = &string_methods();
  if (object.is_dict()) methods = &dict_methods();
  if (methods) {
    const auto it = methods->find(name);
    if (it != methods->end()) {
      Method method = it->second;
      return Value(Callable{
          name, std::make_shared<Function>([object, method](const CallArgs& args) { return method(object, args); })});
    }
  }
  if (is_mutating_method(object, name)) {
    return Value(
        Callable{name, std::make_shared<Function>([name, type = object.type_name()](const CallArgs& args) -> Value {
                   fail("chat template line {}: {}.{}() would modify an immutable value", args.line, type, name);
                 })});
  }
  return std::nullopt;
}

}  // namespace vavilov::jinja
