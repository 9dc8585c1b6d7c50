#pragma once
// The syntax tree of a template: expressions and statements, each with its source line for error messages.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "template/value.h"

namespace vavilov::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    kLiteral,    // literal
    kName,       // name
    kList,       // children; name "tuple" for (a, b), which prints as a Python tuple
    kDict,       // children: key, value, key, value, ...
    kAttribute,  // children[0].name
    kItem,       // children[0][children[1]]
    kSlice,      // children[0][children[1]:children[2]:children[3]], absent bounds null
    kCall,       // children[0](children[1..], keywords)
    kFilter,     // children[0] | name(children[1..], keywords)
    kTest,       // children[0] is [not] name(children[1..])
    kNot,        // not children[0]
    kNegate,     // -children[0]
    kBinary,     // children[0] name children[1], name one of + - * / // % ** ~ in "not in"
    kCompare,    // children[0] operators[0] children[1] operators[1] children[2] ...
    kAnd,
    kOr,
    kConditional,  // children[0] if children[1] else children[2] (null: undefined)
  };
  Kind kind;
  int line;
  Value literal;
  std::string name;
  std::vector<ExprPtr> children;
  std::vector<std::pair<std::string, ExprPtr>> keywords;
  std::vector<std::string> operators;
  bool negated = false;
};

struct Stmt;
using Body = std::vector<std::unique_ptr<Stmt>>;

struct MacroParameter {
  std::string name;
  ExprPtr default_value;  // null when required
};

struct Stmt {
  enum class Kind {
    kText,         // text
    kOutput,       // {{ expr }}
    kIf,           // branches: (condition or null for else, body)
    kFor,          // for targets in expr [if filter]: body [else: else_body]
    kSet,          // set targets = expr; or set object.attribute = expr
    kSetBlock,     // set targets[0] %}body{% endset
    kMacro,        // macro name(parameters): body
    kCallBlock,    // call expr: body (the body is `caller()`)
    kFilterBlock,  // filter expr (a kFilter whose operand is null): body
    kWith,         // with targets = values: body
    kBreak,
    kContinue,
  };
  Kind kind;
  int line;
  std::string text;
  ExprPtr expr;
  ExprPtr loop_filter;
  std::vector<std::string> targets;
  std::string attribute;  // for `set ns.attribute = ...`
  std::vector<ExprPtr> values;
  std::vector<std::pair<ExprPtr, Body>> branches;
  std::vector<MacroParameter> parameters;
  Body body;
  Body else_body;
};

}  // namespace vavilov::jinja
