// Global functions visible to templates: Jinja2's range/namespace/dict and transformers' raise_exception and
// strftime_now.
#include <ctime>

#include "template/arguments.h"
#include "template/builtins.h"

namespace vavilov::jinja {
namespace {

// A range longer than this is a runaway template, not a chat; refusing it keeps rendering bounded.
constexpr int64_t kMaxRangeLength = 1'000'000;

Value range_function(const CallArgs& args) {
  check(args.keyword.empty() && !args.positional.empty() && args.positional.size() <= 3,
        "chat template line {}: range() takes 1 to 3 integer arguments", args.line);
  std::vector<int64_t> bounds;
  for (const Value& v : args.positional) {
    check(v.is_int() || v.is_bool(), "chat template line {}: range() arguments must be integers", args.line);
    bounds.push_back(v.to_int());
  }
  const int64_t start = bounds.size() > 1 ? bounds[0] : 0;
  const int64_t stop = bounds.size() > 1 ? bounds[1] : bounds[0];
  const int64_t step = bounds.size() > 2 ? bounds[2] : 1;
  check(step != 0, "chat template line {}: range() step must not be zero", args.line);
  List values;
  for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
    check(static_cast<int64_t>(values.size()) < kMaxRangeLength, "chat template line {}: range() too long", args.line);
    values.emplace_back(i);
  }
  return Value(std::move(values));
}

Dict keyword_dict(const CallArgs& args, const char* function) {
  Dict dict;
  for (const Value& positional : args.positional) {
    check(positional.is_dict(), "chat template line {}: {}() takes a dict or keyword arguments", args.line, function);
    for (const auto& [key, value] : positional.as_dict().items) dict.set(key, value);
  }
  for (const auto& [key, value] : args.keyword) dict.set(key, value);
  return dict;
}

Value make_callable(std::string name, Function function) {
  return Value(Callable{std::move(name), std::make_shared<Function>(std::move(function))});
}

}  // namespace

Dict global_functions() {
  Dict globals;
  globals.set("range", make_callable("range", range_function));
  globals.set("namespace", make_callable("namespace", [](const CallArgs& args) {
                return Value(Namespace{std::make_shared<Dict>(keyword_dict(args, "namespace"))});
              }));
  globals.set("dict", make_callable("dict", [](const CallArgs& args) { return Value(keyword_dict(args, "dict")); }));
  globals.set("raise_exception", make_callable("raise_exception", [](const CallArgs& args) -> Value {
                const Arguments arguments(args, "raise_exception", {"message"});
                fail("chat template line {}: raise_exception: {}", args.line, arguments.required("message").str());
              }));
  globals.set("strftime_now", make_callable("strftime_now", [](const CallArgs& args) {
                const Arguments arguments(args, "strftime_now", {"format"});
                const std::time_t now = std::time(nullptr);
                std::tm local{};
                localtime_r(&now, &local);
                char buffer[256];
                const size_t length = std::strftime(buffer, sizeof(buffer), arguments.string("format").c_str(), &local);
                return Value(std::string(buffer, length));
              }));
  return globals;
}

}  // namespace vavilov::jinja
