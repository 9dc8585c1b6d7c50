// Jinja2's built-in filters as chat templates use them, plus transformers' tojson.
#include <algorithm>
#include <cmath>
#include <functional>
#include <map>

#include "template/arguments.h"
#include "template/builtins.h"
#include "template/python_string.h"

namespace vavilov::jinja {
namespace {

using Filter = std::function<Value(const Value&, const CallArgs&)>;

// environment.getattr for filter arguments such as attribute="function.name": dict items, list indices.
Value lookup_path(const Value& value, const std::string& path) {
  Value current = value;
  for (const std::string& part : python_split(path, std::string("."), -1, false)) {
    if (current.is_dict()) {
      const Value* found = current.as_dict().find(part);
      current = found ? *found : Value::undefined(part);
    } else if (current.is_list() && !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit)) {
      const size_t index = std::stoul(part);
      current = index < current.as_list().size() ? current.as_list()[index] : Value::undefined(part);
    } else if (current.is_namespace()) {
      const Value* found = current.as_namespace().attributes->find(part);
      current = found ? *found : Value::undefined(part);
    } else {
      current = Value::undefined(part);
    }
  }
  return current;
}

// Sort key for sort/unique/min/max: lower-cased strings unless case_sensitive.
Value sort_key(const Value& value, bool case_sensitive) {
  return !case_sensitive && value.is_string() ? Value(python_lower(value.as_string())) : value;
}

CallArgs shifted(const CallArgs& args, size_t skip) {
  CallArgs rest;
  rest.line = args.line;
  rest.positional.assign(args.positional.begin() + static_cast<long>(std::min(skip, args.positional.size())),
                         args.positional.end());
  return rest;
}

// select/reject/selectattr/rejectattr: keep items whose test (or truthiness) equals `keep`.
Filter selecting(bool keep, bool by_attribute) {
  return [=](const Value& operand, const CallArgs& args) {
    check(args.keyword.empty(), "chat template line {}: select filters take positional arguments", args.line);
    size_t next = 0;
    std::string attribute;
    if (by_attribute) {
      check(!args.positional.empty() && args.positional[0].is_string(),
            "chat template line {}: selectattr/rejectattr need an attribute name", args.line);
      attribute = args.positional[next++].as_string();
    }
    std::string test;
    if (next < args.positional.size()) {
      check(args.positional[next].is_string(), "chat template line {}: the test name must be a string", args.line);
      test = args.positional[next++].as_string();
    }
    const CallArgs test_args = shifted(args, next);
    List kept;
    for (const Value& item : iterate(operand, args.line)) {
      const Value subject = by_attribute ? lookup_path(item, attribute) : item;
      const bool passes = test.empty() ? subject.truthy() : apply_test(test, subject, test_args);
      if (passes == keep) kept.push_back(item);
    }
    return Value(std::move(kept));
  };
}

Value map_filter(const Value& operand, const CallArgs& args) {
  List mapped;
  const List items = iterate(operand, args.line);
  if (args.positional.empty()) {
    const Arguments arguments(args, "map", {"attribute", "default"});
    const std::string attribute = arguments.string("attribute");
    check(!attribute.empty(), "chat template line {}: map needs a filter name or attribute=", args.line);
    for (const Value& item : items) {
      Value value = lookup_path(item, attribute);
      mapped.push_back(value.is_undefined() && arguments.has("default") ? arguments.get("default") : value);
    }
  } else {
    check(args.positional[0].is_string(), "chat template line {}: map's filter name must be a string", args.line);
    const std::string filter = args.positional[0].as_string();
    check(has_filter(filter), "chat template line {}: no filter named '{}'", args.line, filter);
    CallArgs filter_args = shifted(args, 1);
    filter_args.keyword = args.keyword;
    for (const Value& item : items) mapped.push_back(apply_filter(filter, item, filter_args));
  }
  return Value(std::move(mapped));
}

Value sort_filter(const Value& operand, const CallArgs& args) {
  const Arguments arguments(args, "sort", {"reverse", "case_sensitive", "attribute"});
  const bool reverse = arguments.flag("reverse", false), case_sensitive = arguments.flag("case_sensitive", false);
  const std::string attribute = arguments.string("attribute");
  List items = iterate(operand, args.line);
  auto key = [&](const Value& item) {
    return sort_key(attribute.empty() ? item : lookup_path(item, attribute), case_sensitive);
  };
  std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
    return reverse ? less_than(key(b), key(a), args.line) : less_than(key(a), key(b), args.line);
  });
  return Value(std::move(items));
}

Value unique_filter(const Value& operand, const CallArgs& args) {
  const Arguments arguments(args, "unique", {"case_sensitive", "attribute"});
  const bool case_sensitive = arguments.flag("case_sensitive", false);
  const std::string attribute = arguments.string("attribute");
  List kept, seen;
  for (const Value& item : iterate(operand, args.line)) {
    const Value key = sort_key(attribute.empty() ? item : lookup_path(item, attribute), case_sensitive);
    if (std::any_of(seen.begin(), seen.end(), [&](const Value& s) { return equals(s, key); })) continue;
    seen.push_back(key);
    kept.push_back(item);
  }
  return Value(std::move(kept));
}

Filter extreme(bool want_max) {
  return [=](const Value& operand, const CallArgs& args) {
    const Arguments arguments(args, want_max ? "max" : "min", {"case_sensitive", "attribute"});
    const bool case_sensitive = arguments.flag("case_sensitive", false);
    const std::string attribute = arguments.string("attribute");
    const List items = iterate(operand, args.line);
    if (items.empty()) return Value::undefined("min/max of an empty sequence");
    auto key = [&](const Value& item) {
      return sort_key(attribute.empty() ? item : lookup_path(item, attribute), case_sensitive);
    };
    const Value* best = &items[0];
    for (const Value& item : items) {
      if (want_max ? less_than(key(*best), key(item), args.line) : less_than(key(item), key(*best), args.line))
        best = &item;
    }
    return *best;
  };
}

Value indent_filter(const Value& operand, const CallArgs& args) {
  const Arguments arguments(args, "indent", {"width", "first", "blank"});
  const Value width = arguments.get("width", Value(4));
  const std::string indentation = width.is_string()
                                      ? width.as_string()
                                      : std::string(static_cast<size_t>(std::max<int64_t>(0, width.to_int())), ' ');
  const bool first = arguments.flag("first", false), blank = arguments.flag("blank", false);
  std::string text = operand.str(), out;
  std::vector<std::string> lines = python_split(text, std::string("\n"), -1, false);
  for (size_t i = 0; i < lines.size(); ++i) {
    if (i) out += '\n';
    const bool indent_line = (i > 0 || first) && (blank || !python_strip(lines[i], std::nullopt, true, true).empty());
    if (indent_line) out += indentation;
    out += lines[i];
  }
  return Value(out);
}

Value int_filter(const Value& operand, const CallArgs& args) {
  const Arguments arguments(args, "int", {"default", "base"});
  const Value fallback = arguments.get("default", Value(0));
  if (operand.is_int() || operand.is_bool()) return Value(operand.to_int());
  if (operand.is_float()) {
    return std::isfinite(operand.as_float()) ? Value(static_cast<int64_t>(operand.as_float())) : fallback;
  }
  if (!operand.is_string()) return fallback;
  const std::string text = python_strip(operand.as_string(), std::nullopt, true, true);
  try {
    size_t used = 0;
    const long long value = std::stoll(text, &used, static_cast<int>(arguments.integer("base", 10)));
    if (used == text.size()) return Value(static_cast<int64_t>(value));
    const double real = std::stod(text, &used);
    if (used == text.size() && std::isfinite(real)) return Value(static_cast<int64_t>(real));
  } catch (const std::exception&) {
  }
  return fallback;
}

Value float_filter(const Value& operand, const CallArgs& args) {
  const Arguments arguments(args, "float", {"default"});
  const Value fallback = arguments.get("default", Value(0.0));
  if (operand.is_number()) return Value(operand.to_double());
  if (!operand.is_string()) return fallback;
  const std::string text = python_strip(operand.as_string(), std::nullopt, true, true);
  try {
    size_t used = 0;
    const double value = std::stod(text, &used);
    if (used == text.size()) return Value(value);
  } catch (const std::exception&) {
  }
  return fallback;
}

Value round_filter(const Value& operand, const CallArgs& args) {
  const Arguments arguments(args, "round", {"precision", "method"});
  check(operand.is_number(), "chat template line {}: round needs a number, not {}", args.line, operand.type_name());
  const double scale = std::pow(10.0, static_cast<double>(arguments.integer("precision", 0)));
  const std::string method = arguments.string("method", "common");
  const double scaled = operand.to_double() * scale;
  double rounded = 0;
  if (method == "common") {
    rounded = std::nearbyint(scaled);  // Python's round(): halves go to the even neighbour
  } else if (method == "ceil") {
    rounded = std::ceil(scaled);
  } else if (method == "floor") {
    rounded = std::floor(scaled);
  } else {
    fail("chat template line {}: round method must be common, ceil or floor", args.line);
  }
  return Value(rounded / scale);
}

Value tojson_filter(const Value& operand, const CallArgs& args) {
  const Arguments arguments(args, "tojson", {"ensure_ascii", "indent", "separators", "sort_keys"});
  check(!arguments.flag("ensure_ascii", false), "chat template line {}: tojson(ensure_ascii=True) is not supported",
        args.line);
  JsonOptions options;
  if (arguments.has("indent") && !arguments.get("indent").is_none()) options.indent = arguments.integer("indent", 0);
  const Value separators = arguments.get("separators");
  if (separators.is_list()) {
    const List& pair = separators.as_list();
    check(pair.size() == 2 && pair[0].is_string() && pair[1].is_string(),
          "chat template line {}: tojson separators must be two strings", args.line);
    options.item_separator = pair[0].as_string();
    options.key_separator = pair[1].as_string();
  }
  options.sort_keys = arguments.flag("sort_keys", false);
  return Value(to_json(operand, options, args.line));
}

Value default_filter(const Value& operand, const CallArgs& args) {
  const Arguments arguments(args, "default", {"default_value", "boolean"});
  const bool use_default = operand.is_undefined() || (arguments.flag("boolean", false) && !operand.truthy());
  return use_default ? arguments.get("default_value", Value("")) : operand;
}

Value join_filter(const Value& operand, const CallArgs& args) {
  const Arguments arguments(args, "join", {"d", "attribute"});
  const std::string separator = arguments.string("d"), attribute = arguments.string("attribute");
  std::string out;
  bool first = true;
  for (const Value& item : iterate(operand, args.line)) {
    if (!first) out += separator;
    out += (attribute.empty() ? item : lookup_path(item, attribute)).str();
    first = false;
  }
  return Value(out);
}

Value html_escape(const Value& operand, const CallArgs&) {
  std::string out;
  for (char c : operand.str()) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return Value(out);
}

Value sum_filter(const Value& operand, const CallArgs& args) {
  const Arguments arguments(args, "sum", {"attribute", "start"});
  const std::string attribute = arguments.string("attribute");
  Value total = arguments.get("start", Value(0));
  for (const Value& item : iterate(operand, args.line)) {
    const Value term = attribute.empty() ? item : lookup_path(item, attribute);
    check(term.is_number() && total.is_number(), "chat template line {}: sum needs numbers", args.line);
    if ((total.is_int() || total.is_bool()) && (term.is_int() || term.is_bool())) {
      total = Value(total.to_int() + term.to_int());
    } else {
      total = Value(total.to_double() + term.to_double());
    }
  }
  return total;
}

Value dictsort_filter(const Value& operand, const CallArgs& args) {
  const Arguments arguments(args, "dictsort", {"case_sensitive", "by", "reverse"});
  check(operand.is_dict(), "chat template line {}: dictsort needs a dict", args.line);
  const bool case_sensitive = arguments.flag("case_sensitive", false), reverse = arguments.flag("reverse", false);
  const size_t by = arguments.string("by", "key") == "value" ? 1 : 0;
  List items;
  for (const auto& [key, value] : operand.as_dict().items) items.push_back(Value::tuple(List{Value(key), value}));
  std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
    const Value ka = sort_key(a.as_list()[by], case_sensitive), kb = sort_key(b.as_list()[by], case_sensitive);
    return reverse ? less_than(kb, ka, args.line) : less_than(ka, kb, args.line);
  });
  return Value(std::move(items));
}

Filter simple(std::function<Value(const Value&, int line)> body) {
  return [=](const Value& operand, const CallArgs& args) {
    check(args.positional.empty() && args.keyword.empty(), "chat template line {}: this filter takes no arguments",
          args.line);
    return body(operand, args.line);
  };
}

const std::map<std::string, Filter, std::less<>>& filters() {
  static const std::map<std::string, Filter, std::less<>> registry = [] {
    std::map<std::string, Filter, std::less<>> f;
    f["tojson"] = tojson_filter;
    f["default"] = f["d"] = default_filter;
    f["join"] = join_filter;
    f["map"] = map_filter;
    f["select"] = selecting(true, false);
    f["reject"] = selecting(false, false);
    f["selectattr"] = selecting(true, true);
    f["rejectattr"] = selecting(false, true);
    f["sort"] = sort_filter;
    f["unique"] = unique_filter;
    f["min"] = extreme(false);
    f["max"] = extreme(true);
    f["indent"] = indent_filter;
    f["int"] = int_filter;
    f["float"] = float_filter;
    f["round"] = round_filter;
    f["sum"] = sum_filter;
    f["dictsort"] = dictsort_filter;
    f["e"] = f["escape"] = html_escape;
    f["length"] = f["count"] = simple([](const Value& v, int line) { return Value(python_length(v, line)); });
    f["list"] = simple([](const Value& v, int line) { return Value(iterate(v, line)); });
    f["string"] = simple([](const Value& v, int) { return Value(v.str()); });
    f["safe"] = simple([](const Value& v, int) { return v; });
    f["upper"] = simple([](const Value& v, int) { return Value(python_upper(v.str())); });
    f["lower"] = simple([](const Value& v, int) { return Value(python_lower(v.str())); });
    f["title"] = simple([](const Value& v, int) { return Value(python_title(v.str())); });
    f["capitalize"] = simple([](const Value& v, int) { return Value(python_capitalize(v.str())); });
    f["wordcount"] = simple([](const Value& v, int) {
      return Value(static_cast<int64_t>(python_split(v.str(), std::nullopt, -1, false).size()));
    });
    f["abs"] = simple([](const Value& v, int line) {
      check(v.is_number(), "chat template line {}: abs needs a number", line);
      return v.is_float() ? Value(std::fabs(v.as_float())) : Value(v.to_int() < 0 ? -v.to_int() : v.to_int());
    });
    f["first"] = simple([](const Value& v, int line) {
      const List items = iterate(v, line);
      return items.empty() ? Value::undefined("first of an empty sequence") : items.front();
    });
    f["last"] = simple([](const Value& v, int line) {
      const List items = iterate(v, line);
      return items.empty() ? Value::undefined("last of an empty sequence") : items.back();
    });
    f["reverse"] = simple([](const Value& v, int line) {
      List items = iterate(v, line);
      std::reverse(items.begin(), items.end());
      if (!v.is_string()) return Value(std::move(items));
      std::string out;
      for (const Value& c : items) out += c.as_string();
      return Value(out);
    });
    f["items"] = simple([](const Value& v, int line) {
      if (v.is_undefined()) return Value(List{});
      check(v.is_dict(), "chat template line {}: items needs a dict, not {}", line, v.type_name());
      List items;
      for (const auto& [key, value] : v.as_dict().items) items.push_back(Value::tuple(List{Value(key), value}));
      return Value(std::move(items));
    });
    f["trim"] = [](const Value& v, const CallArgs& args) {
      const Arguments arguments(args, "trim", {"chars"});
      std::optional<std::string> chars;
      if (arguments.has("chars") && !arguments.get("chars").is_none()) chars = arguments.string("chars");
      return Value(python_strip(v.str(), chars, true, true));
    };
    f["replace"] = [](const Value& v, const CallArgs& args) {
      const Arguments arguments(args, "replace", {"old", "new", "count"});
      const std::optional<Value> method = bound_method(Value(v.str()), "replace");
      return method->as_callable().function->operator()(args);
    };
    f["attr"] = [](const Value& v, const CallArgs& args) {
      const Arguments arguments(args, "attr", {"name"});
      return lookup_path(v, arguments.string("name"));
    };
    return f;
  }();
  return registry;
}

}  // namespace

bool has_filter(std::string_view name) { return filters().count(name) > 0; }

Value apply_filter(std::string_view name, const Value& operand, const CallArgs& args) {
  const auto it = filters().find(name);
  check(it != filters().end(), "chat template line {}: no filter named '{}'", args.line, name);
  return it->second(operand, args);
}

}  // namespace vavilov::jinja
