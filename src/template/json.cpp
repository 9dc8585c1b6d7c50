// tojson as transformers defines it: Python's json.dumps with ensure_ascii=False.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "template/builtins.h"

namespace vavilov::jinja {
namespace {

void append_json_string(std::string& out, std::string_view text) {
  out += '"';
  for (char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += fmt::format("\\u{:04x}", static_cast<unsigned char>(c));
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

class JsonWriter {
 public:
  JsonWriter(const JsonOptions& options, int line)
      : options_(options),
        line_(line),
        item_separator_(options.item_separator.value_or(options.indent ? "," : ", ")),
        key_separator_(options.key_separator.value_or(": ")) {}

  void write(const Value& value, int depth) {
    check(depth < 512, "chat template line {}: tojson: value nested too deeply", line_);
    if (value.is_none()) {
      out_ += "null";
    } else if (value.is_bool()) {
      out_ += value.as_bool() ? "true" : "false";
    } else if (value.is_int()) {
      out_ += std::to_string(value.as_int());
    } else if (value.is_float()) {
      write_float(value.as_float());
    } else if (value.is_string()) {
      append_json_string(out_, value.as_string());
    } else if (value.is_list()) {
      write_list(value.as_list(), depth);
    } else if (value.is_dict()) {
      write_dict(value.as_dict(), depth);
    } else {
      fail("chat template line {}: tojson: object of type {} is not JSON serializable", line_, value.type_name());
    }
  }

  std::string take() { return std::move(out_); }

 private:
  void write_float(double value) {
    if (std::isnan(value)) {
      out_ += "NaN";
    } else if (std::isinf(value)) {
      out_ += value > 0 ? "Infinity" : "-Infinity";
    } else {
      out_ += python_float_repr(value);
    }
  }

  void newline(int depth) {
    if (!options_.indent) return;
    out_ += '\n';
    out_.append(static_cast<size_t>(std::max<int64_t>(0, *options_.indent) * depth), ' ');
  }

  void write_list(const List& list, int depth) {
    if (list.empty()) {
      out_ += "[]";
      return;
    }
    out_ += '[';
    for (size_t i = 0; i < list.size(); ++i) {
      if (i) out_ += item_separator_;
      newline(depth + 1);
      write(list[i], depth + 1);
    }
    newline(depth);
    out_ += ']';
  }

  void write_dict(const Dict& dict, int depth) {
    if (dict.items.empty()) {
      out_ += "{}";
      return;
    }
    std::vector<const std::pair<std::string, Value>*> items;
    for (const auto& item : dict.items) items.push_back(&item);
    if (options_.sort_keys)
      std::stable_sort(items.begin(), items.end(), [](auto* a, auto* b) { return a->first < b->first; });
    out_ += '{';
    for (size_t i = 0; i < items.size(); ++i) {
      if (i) out_ += item_separator_;
      newline(depth + 1);
      append_json_string(out_, items[i]->first);
      out_ += key_separator_;
      write(items[i]->second, depth + 1);
    }
    newline(depth);
    out_ += '}';
  }

  const JsonOptions& options_;
  int line_;
  std::string item_separator_;
  std::string key_separator_;
  std::string out_;
};

}  // namespace

std::string to_json(const Value& value, const JsonOptions& options, int line) {
  JsonWriter writer(options, line);
  writer.write(value, 0);
  return writer.take();
}

}  // namespace vavilov::jinja
