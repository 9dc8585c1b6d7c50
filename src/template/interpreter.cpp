#include "template/interpreter.h"

#include <unordered_map>

#include "core/error.h"
#include "template/builtins.h"
#include "template/operators.h"

namespace vavilov::jinja {
namespace {

// Bounds that no chat template comes near; they turn runaway or hostile templates into errors.
constexpr size_t kMaxOutputBytes = 64 << 20;
constexpr int64_t kMaxSteps = 10'000'000;  // loop iterations plus macro calls
constexpr int kMaxCallDepth = 64;

enum class Flow { kNormal, kBreak, kContinue };

// Variables of one scope; lookups walk out to the enclosing scopes.
struct Frame {
  std::unordered_map<std::string, Value> variables;
  const Frame* parent = nullptr;

  const Value* find(const std::string& name) const {
    for (const Frame* frame = this; frame; frame = frame->parent) {
      const auto it = frame->variables.find(name);
      if (it != frame->variables.end()) return &it->second;
    }
    return nullptr;
  }
};

class Interpreter {
 public:
  Interpreter(const Dict& context) {
    for (const auto& [name, value] : global_functions().items) globals_.variables[name] = value;
    for (const auto& [name, value] : context.items) globals_.variables[name] = value;
    root_.parent = &globals_;
  }

  std::string run(const Body& body) {
    std::string out;
    execute(body, root_, out);
    return out;
  }

 private:
  // ---- statements ----
  Flow execute(const Body& body, Frame& frame, std::string& out) {
    for (const auto& stmt : body) {
      const Flow flow = execute(*stmt, frame, out);
      if (flow != Flow::kNormal) return flow;
      check(out.size() <= kMaxOutputBytes, "chat template line {}: output exceeds {} bytes", stmt->line,
            kMaxOutputBytes);
    }
    return Flow::kNormal;
  }

  Flow execute(const Stmt& stmt, Frame& frame, std::string& out) {
    switch (stmt.kind) {
      case Stmt::Kind::kText:
        out += stmt.text;
        return Flow::kNormal;
      case Stmt::Kind::kOutput:
        out += evaluate(*stmt.expr, frame).str();
        return Flow::kNormal;
      case Stmt::Kind::kIf:
        return execute_if(stmt, frame, out);
      case Stmt::Kind::kFor:
        execute_for(stmt, frame, out);
        return Flow::kNormal;
      case Stmt::Kind::kSet:
        execute_set(stmt, frame);
        return Flow::kNormal;
      case Stmt::Kind::kSetBlock: {
        std::string captured;
        execute_in_child(stmt.body, frame, captured);
        frame.variables[stmt.targets[0]] = Value(std::move(captured));
        return Flow::kNormal;
      }
      case Stmt::Kind::kMacro:
        frame.variables[stmt.text] = make_macro(stmt);
        return Flow::kNormal;
      case Stmt::Kind::kCallBlock:
        out += call_with_caller(stmt, frame).str();
        return Flow::kNormal;
      case Stmt::Kind::kFilterBlock: {
        std::string captured;
        execute_in_child(stmt.body, frame, captured);
        out += apply_filter_chain(*stmt.expr, Value(std::move(captured)), frame).str();
        return Flow::kNormal;
      }
      case Stmt::Kind::kWith: {
        Frame child{{}, &frame};
        for (size_t i = 0; i < stmt.targets.size(); ++i)
          child.variables[stmt.targets[i]] = evaluate(*stmt.values[i], frame);
        return execute(stmt.body, child, out);
      }
      case Stmt::Kind::kBreak:
        return Flow::kBreak;
      case Stmt::Kind::kContinue:
        return Flow::kContinue;
    }
    return Flow::kNormal;
  }

  void execute_in_child(const Body& body, const Frame& frame, std::string& out) {
    Frame child{{}, &frame};
    execute(body, child, out);
  }

  Flow execute_if(const Stmt& stmt, Frame& frame, std::string& out) {
    for (const auto& [condition, body] : stmt.branches) {
      if (!condition || evaluate(*condition, frame).truthy()) return execute(body, frame, out);
    }
    return Flow::kNormal;
  }

  void bind_targets(const std::vector<std::string>& targets, const Value& value, Frame& frame, int line) {
    if (targets.size() == 1) {
      frame.variables[targets[0]] = value;
      return;
    }
    const List items = iterate(value, line);
    check(items.size() == targets.size(), "chat template line {}: cannot unpack {} values into {} names", line,
          items.size(), targets.size());
    for (size_t i = 0; i < targets.size(); ++i) frame.variables[targets[i]] = items[i];
  }

  void count_step(int line) {
    check(++steps_ <= kMaxSteps, "chat template line {}: too many loop iterations or macro calls", line);
  }

  void execute_for(const Stmt& stmt, Frame& frame, std::string& out) {
    const Value iterable = evaluate(*stmt.expr, frame);
    check(!iterable.is_none(), "chat template line {}: 'NoneType' object is not iterable", stmt.line);
    List items = iterate(iterable, stmt.line);
    if (stmt.loop_filter) {
      List kept;
      for (const Value& item : items) {
        Frame probe{{}, &frame};
        bind_targets(stmt.targets, item, probe, stmt.line);
        if (evaluate(*stmt.loop_filter, probe).truthy()) kept.push_back(item);
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      execute_in_child(stmt.else_body, frame, out);
      return;
    }
    for (size_t i = 0; i < items.size(); ++i) {
      count_step(stmt.line);
      Frame iteration{{}, &frame};
      bind_targets(stmt.targets, items[i], iteration, stmt.line);
      iteration.variables["loop"] = loop_object(items, i);
      if (execute(stmt.body, iteration, out) == Flow::kBreak) break;
    }
  }

  static Value loop_object(const List& items, size_t index) {
    const auto length = static_cast<int64_t>(items.size());
    const auto i = static_cast<int64_t>(index);
    Dict loop;
    loop.set("index", Value(i + 1));
    loop.set("index0", Value(i));
    loop.set("revindex", Value(length - i));
    loop.set("revindex0", Value(length - i - 1));
    loop.set("first", Value(i == 0));
    loop.set("last", Value(i == length - 1));
    loop.set("length", Value(length));
    loop.set("depth", Value(1));
    loop.set("depth0", Value(0));
    loop.set("previtem", i > 0 ? items[index - 1] : Value::undefined("loop.previtem"));
    loop.set("nextitem", i + 1 < length ? items[index + 1] : Value::undefined("loop.nextitem"));
    loop.set("cycle", Value(Callable{"loop.cycle", std::make_shared<Function>([index](const CallArgs& args) {
                                       check(!args.positional.empty(),
                                             "chat template line {}: loop.cycle() needs values", args.line);
                                       return args.positional[index % args.positional.size()];
                                     })}));
    return Value(std::move(loop));
  }

  void execute_set(const Stmt& stmt, Frame& frame) {
    const Value value = evaluate(*stmt.expr, frame);
    if (stmt.attribute.empty()) {
      bind_targets(stmt.targets, value, frame, stmt.line);
      return;
    }
    const Value* object = frame.find(stmt.targets[0]);
    check(object && object->is_namespace(),
          "chat template line {}: cannot assign attribute '{}' of '{}', which is not a namespace", stmt.line,
          stmt.attribute, stmt.targets[0]);
    object->as_namespace().attributes->set(stmt.attribute, value);
  }

  // ---- macros ----
  Value make_macro(const Stmt& stmt) {
    const Stmt* definition = &stmt;
    return Value(Callable{stmt.text, std::make_shared<Function>([this, definition](const CallArgs& args) {
                            return call_macro(*definition, args);
                          })});
  }

  Value call_macro(const Stmt& macro, const CallArgs& args) {
    count_step(args.line);
    check(call_depth_ < kMaxCallDepth, "chat template line {}: macro calls nested too deeply", args.line);
    check(args.positional.size() <= macro.parameters.size(), "chat template line {}: macro '{}' takes {} arguments",
          args.line, macro.text, macro.parameters.size());
    // Macros see the template's top-level variables, not the caller's locals, as in Jinja2.
    Frame frame{{}, &root_};
    for (size_t i = 0; i < macro.parameters.size(); ++i) {
      const MacroParameter& parameter = macro.parameters[i];
      Value value = i < args.positional.size() ? args.positional[i] : Value::undefined(parameter.name);
      if (i >= args.positional.size() && parameter.default_value) value = evaluate(*parameter.default_value, frame);
      frame.variables[parameter.name] = std::move(value);
    }
    for (const auto& [name, value] : args.keyword) {
      bool known = name == "caller";  // passed by {% call %}
      for (const auto& parameter : macro.parameters) known |= parameter.name == name;
      check(known, "chat template line {}: macro '{}' has no parameter '{}'", args.line, macro.text, name);
      frame.variables[name] = value;
    }
    std::string out;
    ++call_depth_;
    execute(macro.body, frame, out);
    --call_depth_;
    return Value(std::move(out));
  }

  // {% call macro(args) %}body{% endcall %}: the macro runs with caller() rendering the body.
  Value call_with_caller(const Stmt& stmt, Frame& frame) {
    const Frame* body_frame = &frame;
    const Body* body = &stmt.body;
    auto caller = Value(Callable{"caller", std::make_shared<Function>([this, body, body_frame](const CallArgs&) {
                                   std::string out;
                                   execute_in_child(*body, *body_frame, out);
                                   return Value(std::move(out));
                                 })});
    const Expr& call = *stmt.expr;
    const Value callee = evaluate(*call.children[0], frame);
    CallArgs args = evaluate_arguments(call, frame);
    args.keyword.emplace_back("caller", caller);
    return invoke(callee, args, call.line);
  }

  // ---- expressions ----
  CallArgs evaluate_arguments(const Expr& expr, const Frame& frame, size_t first_positional = 1) {
    CallArgs args;
    args.line = expr.line;
    for (size_t i = first_positional; i < expr.children.size(); ++i)
      args.positional.push_back(evaluate(*expr.children[i], frame));
    for (const auto& [name, value] : expr.keywords) args.keyword.emplace_back(name, evaluate(*value, frame));
    return args;
  }

  Value invoke(const Value& callee, const CallArgs& args, int line) {
    if (callee.is_undefined()) fail("chat template line {}: '{}' is undefined", line, callee.undefined_name());
    check(callee.is_callable(), "chat template line {}: '{}' object is not callable", line, callee.type_name());
    return (*callee.as_callable().function)(args);
  }

  Value apply_filter_chain(const Expr& filter, const Value& innermost, const Frame& frame) {
    const Value operand = filter.children[0] ? apply_filter_chain(*filter.children[0], innermost, frame) : innermost;
    return apply_filter(filter.name, operand, evaluate_arguments(filter, frame));
  }

  Value evaluate(const Expr& expr, const Frame& frame) {
    switch (expr.kind) {
      case Expr::Kind::kLiteral:
        return expr.literal;
      case Expr::Kind::kName: {
        const Value* value = frame.find(expr.name);
        return value ? *value : Value::undefined(expr.name);
      }
      case Expr::Kind::kList: {
        List items;
        for (const auto& child : expr.children) items.push_back(evaluate(*child, frame));
        return expr.name == "tuple" ? Value::tuple(std::move(items)) : Value(std::move(items));
      }
      case Expr::Kind::kDict:
        return evaluate_dict(expr, frame);
      case Expr::Kind::kAttribute:
        return get_attribute(evaluate(*expr.children[0], frame), expr.name, expr.line);
      case Expr::Kind::kItem:
        return get_item(evaluate(*expr.children[0], frame), evaluate(*expr.children[1], frame), expr.line);
      case Expr::Kind::kSlice: {
        auto bound = [&](size_t i) { return expr.children[i] ? evaluate(*expr.children[i], frame) : Value(); };
        return slice(evaluate(*expr.children[0], frame), bound(1), bound(2), bound(3), expr.line);
      }
      case Expr::Kind::kCall:
        return invoke(evaluate(*expr.children[0], frame), evaluate_arguments(expr, frame), expr.line);
      case Expr::Kind::kFilter:
        return apply_filter(expr.name, evaluate(*expr.children[0], frame), evaluate_arguments(expr, frame));
      case Expr::Kind::kTest:
        return Value(apply_test(expr.name, evaluate(*expr.children[0], frame), evaluate_arguments(expr, frame)) !=
                     expr.negated);
      case Expr::Kind::kNot:
        return Value(!evaluate(*expr.children[0], frame).truthy());
      case Expr::Kind::kNegate:
        return negate(evaluate(*expr.children[0], frame), expr.line);
      case Expr::Kind::kBinary:
        return binary_operation(expr.name, evaluate(*expr.children[0], frame), evaluate(*expr.children[1], frame),
                                expr.line);
      case Expr::Kind::kCompare:
        return evaluate_compare(expr, frame);
      case Expr::Kind::kAnd: {
        Value left = evaluate(*expr.children[0], frame);
        return left.truthy() ? evaluate(*expr.children[1], frame) : left;
      }
      case Expr::Kind::kOr: {
        Value left = evaluate(*expr.children[0], frame);
        return left.truthy() ? left : evaluate(*expr.children[1], frame);
      }
      case Expr::Kind::kConditional:
        if (evaluate(*expr.children[1], frame).truthy()) return evaluate(*expr.children[0], frame);
        return expr.children[2] ? evaluate(*expr.children[2], frame) : Value::undefined("conditional without else");
    }
    fail("chat template line {}: unknown expression", expr.line);
  }

  Value evaluate_dict(const Expr& expr, const Frame& frame) {
    Dict dict;
    for (size_t i = 0; i + 1 < expr.children.size(); i += 2) {
      const Value key = evaluate(*expr.children[i], frame);
      check(key.is_string(), "chat template line {}: only string dict keys are supported, not {}", expr.line,
            key.type_name());
      dict.set(key.as_string(), evaluate(*expr.children[i + 1], frame));
    }
    return Value(std::move(dict));
  }

  Value evaluate_compare(const Expr& expr, const Frame& frame) {
    Value left = evaluate(*expr.children[0], frame);
    for (size_t i = 0; i < expr.operators.size(); ++i) {
      Value right = evaluate(*expr.children[i + 1], frame);
      if (!compare(expr.operators[i], left, right, expr.line)) return Value(false);
      left = std::move(right);
    }
    return Value(true);
  }

  Frame globals_;
  Frame root_;
  int64_t steps_ = 0;
  int call_depth_ = 0;
};

}  // namespace

std::string execute_template(const Body& body, const Dict& context) { return Interpreter(context).run(body); }

}  // namespace vavilov::jinja
