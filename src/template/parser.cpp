#include "template/parser.h"

#include <charconv>
#include <set>

#include "core/error.h"
#include "template/builtins.h"
#include "template/lexer.h"

namespace vavilov::jinja {
namespace {

// Deeper nesting than any real template; the limit keeps hostile input from overflowing the stack.
constexpr int kMaxNesting = 200;

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

  Body parse_all() {
    auto [body, end_tag] = parse_body({});
    return std::move(body);
  }

 private:
  // ---- token helpers ----
  const Token& peek(size_t ahead = 0) const { return tokens_[std::min(pos_ + ahead, tokens_.size() - 1)]; }
  const Token& next() { return tokens_[std::min(pos_++, tokens_.size() - 1)]; }
  bool at_operator(std::string_view op) const { return peek().kind == TokenKind::kOperator && peek().value == op; }
  bool at_name(std::string_view name) const { return peek().kind == TokenKind::kName && peek().value == name; }
  bool skip_operator(std::string_view op) {
    if (!at_operator(op)) return false;
    ++pos_;
    return true;
  }
  bool skip_name(std::string_view name) {
    if (!at_name(name)) return false;
    ++pos_;
    return true;
  }
  [[noreturn]] void syntax_error(const std::string& message) const {
    fail("chat template line {}: {}", peek().line, message);
  }
  std::string describe(const Token& token) const {
    switch (token.kind) {
      case TokenKind::kEnd:
        return "end of template";
      case TokenKind::kBlockEnd:
        return "'%}'";
      case TokenKind::kVariableEnd:
        return "'}}'";
      case TokenKind::kText:
        return "text";
      default:
        return "'" + token.value + "'";
    }
  }
  void expect_operator(std::string_view op) {
    if (!skip_operator(op)) syntax_error(fmt::format("expected '{}', found {}", op, describe(peek())));
  }
  std::string expect_name() {
    if (peek().kind != TokenKind::kName) syntax_error(fmt::format("expected a name, found {}", describe(peek())));
    return next().value;
  }
  void expect_block_end() {
    if (peek().kind != TokenKind::kBlockEnd) syntax_error(fmt::format("expected '%}}', found {}", describe(peek())));
    ++pos_;
  }

  struct DepthGuard {
    explicit DepthGuard(Parser& parser) : parser_(parser) {
      if (++parser_.depth_ > kMaxNesting) parser_.syntax_error("nesting too deep");
    }
    ~DepthGuard() { --parser_.depth_; }
    Parser& parser_;
  };

  ExprPtr make(Expr::Kind kind, int line) {
    auto expr = std::make_unique<Expr>();
    expr->kind = kind;
    expr->line = line;
    return expr;
  }

  // ---- statements ----
  // Parses statements until `{% name` for one of `end_names` (consumed, the tag's rest is not); returns that name.
  std::pair<Body, std::string> parse_body(const std::set<std::string>& end_names) {
    DepthGuard guard(*this);
    Body body;
    while (true) {
      const Token& token = peek();
      if (token.kind == TokenKind::kEnd) {
        if (!end_names.empty()) syntax_error(fmt::format("missing {{% {} %}}", closing_tag(end_names)));
        return {std::move(body), ""};
      }
      if (token.kind == TokenKind::kText) {
        auto stmt = std::make_unique<Stmt>();
        stmt->kind = Stmt::Kind::kText;
        stmt->line = token.line;
        stmt->text = next().value;
        body.push_back(std::move(stmt));
      } else if (token.kind == TokenKind::kVariableBegin) {
        auto stmt = std::make_unique<Stmt>();
        stmt->kind = Stmt::Kind::kOutput;
        stmt->line = next().line;
        stmt->expr = parse_tuple(true);
        if (peek().kind != TokenKind::kVariableEnd)
          syntax_error(fmt::format("expected '}}}}', found {}", describe(peek())));
        ++pos_;
        body.push_back(std::move(stmt));
      } else if (token.kind == TokenKind::kBlockBegin) {
        ++pos_;
        if (peek().kind == TokenKind::kName && end_names.count(peek().value)) return {std::move(body), next().value};
        body.push_back(parse_statement());
      } else {
        syntax_error(fmt::format("unexpected {}", describe(token)));
      }
    }
  }

  static std::string closing_tag(const std::set<std::string>& end_names) {
    for (const std::string& name : end_names)
      if (name.rfind("end", 0) == 0) return name;
    return *end_names.begin();
  }

  std::unique_ptr<Stmt> parse_statement() {
    const int line = peek().line;
    const std::string tag = expect_name();
    auto stmt = std::make_unique<Stmt>();
    stmt->line = line;
    if (tag == "if") return parse_if(std::move(stmt));
    if (tag == "for") return parse_for(std::move(stmt));
    if (tag == "set") return parse_set(std::move(stmt));
    if (tag == "macro") return parse_macro(std::move(stmt));
    if (tag == "call") return parse_call_block(std::move(stmt));
    if (tag == "filter") return parse_filter_block(std::move(stmt));
    if (tag == "with") return parse_with(std::move(stmt));
    if (tag == "generation") {
      // transformers' AssistantTracker tag: it only marks a span, the output is the body.
      expect_block_end();
      stmt->kind = Stmt::Kind::kWith;
      stmt->body = parse_body({"endgeneration"}).first;
      expect_block_end();
      return stmt;
    }
    if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) fail("chat template line {}: '{}' outside a loop", line, tag);
      stmt->kind = tag == "break" ? Stmt::Kind::kBreak : Stmt::Kind::kContinue;
      expect_block_end();
      return stmt;
    }
    fail("chat template line {}: unsupported tag '{}'", line, tag);
  }

  std::unique_ptr<Stmt> parse_if(std::unique_ptr<Stmt> stmt) {
    stmt->kind = Stmt::Kind::kIf;
    ExprPtr condition = parse_tuple(true);
    while (true) {
      expect_block_end();
      auto [body, end_tag] = parse_body({"elif", "else", "endif"});
      stmt->branches.emplace_back(std::move(condition), std::move(body));
      if (end_tag == "elif") {
        condition = parse_tuple(true);
      } else if (end_tag == "else") {
        expect_block_end();
        auto [else_body, end] = parse_body({"endif"});
        stmt->branches.emplace_back(nullptr, std::move(else_body));
        expect_block_end();
        return stmt;
      } else {
        expect_block_end();
        return stmt;
      }
    }
  }

  std::vector<std::string> parse_targets() {
    std::vector<std::string> targets{expect_name()};
    while (skip_operator(",")) targets.push_back(expect_name());
    return targets;
  }

  std::unique_ptr<Stmt> parse_for(std::unique_ptr<Stmt> stmt) {
    stmt->kind = Stmt::Kind::kFor;
    if (skip_operator("(")) {
      stmt->targets = parse_targets();
      expect_operator(")");
    } else {
      stmt->targets = parse_targets();
    }
    if (!skip_name("in")) syntax_error("expected 'in' in for loop");
    stmt->expr = parse_tuple(false);
    if (skip_name("if")) stmt->loop_filter = parse_expression(true);
    if (at_name("recursive")) syntax_error("recursive loops are not supported");
    expect_block_end();
    ++loop_depth_;
    auto [body, end_tag] = parse_body({"else", "endfor"});
    --loop_depth_;
    stmt->body = std::move(body);
    if (end_tag == "else") {
      expect_block_end();
      stmt->else_body = parse_body({"endfor"}).first;
    }
    expect_block_end();
    return stmt;
  }

  std::unique_ptr<Stmt> parse_set(std::unique_ptr<Stmt> stmt) {
    stmt->targets = parse_targets();
    if (stmt->targets.size() == 1 && skip_operator(".")) stmt->attribute = expect_name();
    if (peek().kind == TokenKind::kBlockEnd) {
      if (!stmt->attribute.empty() || stmt->targets.size() != 1) syntax_error("a block set takes one plain name");
      ++pos_;
      stmt->kind = Stmt::Kind::kSetBlock;
      stmt->body = parse_body({"endset"}).first;
      expect_block_end();
      return stmt;
    }
    stmt->kind = Stmt::Kind::kSet;
    expect_operator("=");
    stmt->expr = parse_tuple(true);
    expect_block_end();
    return stmt;
  }

  std::unique_ptr<Stmt> parse_macro(std::unique_ptr<Stmt> stmt) {
    stmt->kind = Stmt::Kind::kMacro;
    stmt->text = expect_name();
    expect_operator("(");
    while (!skip_operator(")")) {
      if (!stmt->parameters.empty()) expect_operator(",");
      if (skip_operator(")")) break;
      MacroParameter parameter{expect_name(), nullptr};
      if (skip_operator("=")) parameter.default_value = parse_expression(true);
      stmt->parameters.push_back(std::move(parameter));
    }
    expect_block_end();
    const int saved_loop_depth = std::exchange(loop_depth_, 0);
    stmt->body = parse_body({"endmacro"}).first;
    loop_depth_ = saved_loop_depth;
    if (peek().kind == TokenKind::kName) ++pos_;  // {% endmacro name %}
    expect_block_end();
    return stmt;
  }

  std::unique_ptr<Stmt> parse_call_block(std::unique_ptr<Stmt> stmt) {
    stmt->kind = Stmt::Kind::kCallBlock;
    if (at_operator("(")) syntax_error("call blocks with caller arguments are not supported");
    stmt->expr = parse_expression(true);
    if (stmt->expr->kind != Expr::Kind::kCall) syntax_error("expected a macro call after 'call'");
    expect_block_end();
    stmt->body = parse_body({"endcall"}).first;
    expect_block_end();
    return stmt;
  }

  std::unique_ptr<Stmt> parse_filter_block(std::unique_ptr<Stmt> stmt) {
    stmt->kind = Stmt::Kind::kFilterBlock;
    stmt->expr = parse_filter(nullptr);
    while (at_operator("|")) {
      ++pos_;
      stmt->expr = parse_filter(std::move(stmt->expr));
    }
    expect_block_end();
    stmt->body = parse_body({"endfilter"}).first;
    expect_block_end();
    return stmt;
  }

  std::unique_ptr<Stmt> parse_with(std::unique_ptr<Stmt> stmt) {
    stmt->kind = Stmt::Kind::kWith;
    while (peek().kind != TokenKind::kBlockEnd) {
      if (!stmt->targets.empty()) expect_operator(",");
      stmt->targets.push_back(expect_name());
      expect_operator("=");
      stmt->values.push_back(parse_expression(true));
    }
    expect_block_end();
    stmt->body = parse_body({"endwith"}).first;
    expect_block_end();
    return stmt;
  }

  // ---- expressions ----
  // An expression, or an implicit tuple `a, b` (which becomes a list).
  ExprPtr parse_tuple(bool with_conditional) {
    const int line = peek().line;
    ExprPtr first = parse_expression(with_conditional);
    if (!at_operator(",")) return first;
    auto tuple = make(Expr::Kind::kList, line);
    tuple->name = "tuple";
    tuple->children.push_back(std::move(first));
    while (skip_operator(",")) {
      if (peek().kind == TokenKind::kBlockEnd || peek().kind == TokenKind::kVariableEnd) break;
      tuple->children.push_back(parse_expression(with_conditional));
    }
    return tuple;
  }

  ExprPtr parse_expression(bool with_conditional) {
    DepthGuard guard(*this);
    ExprPtr expr = parse_or();
    while (with_conditional && at_name("if")) {
      auto conditional = make(Expr::Kind::kConditional, next().line);
      conditional->children.push_back(std::move(expr));
      conditional->children.push_back(parse_or());
      conditional->children.push_back(skip_name("else") ? parse_expression(true) : nullptr);
      expr = std::move(conditional);
    }
    return expr;
  }

  ExprPtr parse_binary_chain(Expr::Kind kind, std::string_view keyword, ExprPtr (Parser::*operand)()) {
    ExprPtr left = (this->*operand)();
    while (at_name(keyword)) {
      auto node = make(kind, next().line);
      node->children.push_back(std::move(left));
      node->children.push_back((this->*operand)());
      left = std::move(node);
    }
    return left;
  }
  ExprPtr parse_or() { return parse_binary_chain(Expr::Kind::kOr, "or", &Parser::parse_and); }
  ExprPtr parse_and() { return parse_binary_chain(Expr::Kind::kAnd, "and", &Parser::parse_not); }

  ExprPtr parse_not() {
    if (at_name("not")) {
      DepthGuard guard(*this);
      auto node = make(Expr::Kind::kNot, next().line);
      node->children.push_back(parse_not());
      return node;
    }
    return parse_compare();
  }

  ExprPtr parse_compare() {
    const int line = peek().line;
    ExprPtr first = parse_math1();
    ExprPtr compare;
    while (true) {
      std::string op;
      if (peek().kind == TokenKind::kOperator &&
          (peek().value == "==" || peek().value == "!=" || peek().value == "<" || peek().value == ">" ||
           peek().value == "<=" || peek().value == ">=")) {
        op = next().value;
      } else if (skip_name("in")) {
        op = "in";
      } else if (at_name("not") && peek(1).kind == TokenKind::kName && peek(1).value == "in") {
        pos_ += 2;
        op = "not in";
      } else {
        break;
      }
      if (!compare) {
        compare = make(Expr::Kind::kCompare, line);
        compare->children.push_back(std::move(first));
      }
      compare->operators.push_back(op);
      compare->children.push_back(parse_math1());
    }
    return compare ? std::move(compare) : std::move(first);
  }

  ExprPtr parse_left_associative(std::initializer_list<std::string_view> ops, ExprPtr (Parser::*operand)()) {
    ExprPtr left = (this->*operand)();
    while (peek().kind == TokenKind::kOperator && std::find(ops.begin(), ops.end(), peek().value) != ops.end()) {
      auto node = make(Expr::Kind::kBinary, peek().line);
      node->name = next().value;
      node->children.push_back(std::move(left));
      node->children.push_back((this->*operand)());
      left = std::move(node);
    }
    return left;
  }
  ExprPtr parse_math1() { return parse_left_associative({"+", "-"}, &Parser::parse_concat); }
  ExprPtr parse_concat() { return parse_left_associative({"~"}, &Parser::parse_math2); }
  ExprPtr parse_math2() { return parse_left_associative({"*", "/", "//", "%"}, &Parser::parse_pow); }
  ExprPtr parse_pow() { return parse_left_associative({"**"}, &Parser::parse_unary_with_filters); }
  ExprPtr parse_unary_with_filters() { return parse_unary(true); }

  ExprPtr parse_unary(bool with_filters) {
    DepthGuard guard(*this);
    ExprPtr node;
    if (at_operator("-") || at_operator("+")) {
      const bool negate = next().value == "-";
      ExprPtr operand = parse_unary(false);
      if (negate) {
        node = make(Expr::Kind::kNegate, operand->line);
        node->children.push_back(std::move(operand));
      } else {
        node = std::move(operand);
      }
    } else {
      node = parse_primary();
    }
    node = parse_postfix(std::move(node));
    return with_filters ? parse_filters_and_tests(std::move(node)) : std::move(node);
  }

  ExprPtr parse_primary() {
    const Token& token = peek();
    const int line = token.line;
    switch (token.kind) {
      case TokenKind::kName: {
        const std::string name = next().value;
        if (name == "true" || name == "True") return literal(Value(true), line);
        if (name == "false" || name == "False") return literal(Value(false), line);
        if (name == "none" || name == "None") return literal(Value(None{}), line);
        auto node = make(Expr::Kind::kName, line);
        node->name = name;
        return node;
      }
      case TokenKind::kString: {
        std::string text = next().value;
        while (peek().kind == TokenKind::kString) text += next().value;  // adjacent literals concatenate
        return literal(Value(std::move(text)), line);
      }
      case TokenKind::kInteger: {
        const std::string& text = next().value;
        int64_t value = 0;
        const auto result = std::from_chars(text.data(), text.data() + text.size(), value);
        if (result.ec != std::errc()) fail("chat template line {}: integer {} is too large", line, text);
        return literal(Value(value), line);
      }
      case TokenKind::kFloat:
        return literal(Value(std::stod(next().value)), line);
      case TokenKind::kOperator:
        if (token.value == "(") return parse_parenthesized();
        if (token.value == "[") return parse_list();
        if (token.value == "{") return parse_dict();
        [[fallthrough]];
      default:
        syntax_error(fmt::format("unexpected {}", describe(token)));
    }
  }

  ExprPtr literal(Value value, int line) {
    auto node = make(Expr::Kind::kLiteral, line);
    node->literal = std::move(value);
    return node;
  }

  ExprPtr parse_parenthesized() {
    const int line = next().line;
    auto tuple = make(Expr::Kind::kList, line);
    tuple->name = "tuple";
    if (skip_operator(")")) return tuple;
    ExprPtr first = parse_expression(true);
    if (skip_operator(")")) return first;
    tuple->children.push_back(std::move(first));
    while (skip_operator(",")) {
      if (at_operator(")")) break;
      tuple->children.push_back(parse_expression(true));
    }
    expect_operator(")");
    return tuple;
  }

  ExprPtr parse_list() {
    auto list = make(Expr::Kind::kList, next().line);
    while (!skip_operator("]")) {
      if (!list->children.empty()) expect_operator(",");
      if (skip_operator("]")) break;
      list->children.push_back(parse_expression(true));
    }
    return list;
  }

  ExprPtr parse_dict() {
    auto dict = make(Expr::Kind::kDict, next().line);
    while (!skip_operator("}")) {
      if (!dict->children.empty()) expect_operator(",");
      if (skip_operator("}")) break;
      dict->children.push_back(parse_expression(true));
      expect_operator(":");
      dict->children.push_back(parse_expression(true));
    }
    return dict;
  }

  ExprPtr parse_postfix(ExprPtr node) {
    while (true) {
      if (at_operator(".")) {
        const int line = next().line;
        if (peek().kind == TokenKind::kInteger) {
          auto item = make(Expr::Kind::kItem, line);
          item->children.push_back(std::move(node));
          item->children.push_back(parse_primary());
          node = std::move(item);
          continue;
        }
        auto attribute = make(Expr::Kind::kAttribute, line);
        attribute->name = expect_name();
        attribute->children.push_back(std::move(node));
        node = std::move(attribute);
      } else if (at_operator("[")) {
        node = parse_subscript(std::move(node));
      } else if (at_operator("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  ExprPtr parse_subscript(ExprPtr object) {
    const int line = next().line;
    ExprPtr parts[3];
    int part = 0;
    bool is_slice = false;
    while (!at_operator("]")) {
      if (skip_operator(":")) {
        is_slice = true;
        if (++part > 2) syntax_error("too many ':' in a slice");
        continue;
      }
      if (parts[part]) syntax_error("expected ':' or ']'");
      parts[part] = parse_expression(true);
    }
    ++pos_;
    if (!is_slice) {
      if (!parts[0]) syntax_error("empty subscript");
      auto item = make(Expr::Kind::kItem, line);
      item->children.push_back(std::move(object));
      item->children.push_back(std::move(parts[0]));
      return item;
    }
    auto slice = make(Expr::Kind::kSlice, line);
    slice->children.push_back(std::move(object));
    for (auto& bound : parts) slice->children.push_back(std::move(bound));
    return slice;
  }

  // Arguments of a call, filter or test: positional first, then name=value.
  void parse_arguments(Expr& node) {
    expect_operator("(");
    bool first = true;
    while (!skip_operator(")")) {
      if (!first) expect_operator(",");
      first = false;
      if (skip_operator(")")) break;
      if (at_operator("*") || at_operator("**")) syntax_error("*args and **kwargs are not supported");
      if (peek().kind == TokenKind::kName && peek(1).kind == TokenKind::kOperator && peek(1).value == "=") {
        std::string name = next().value;
        ++pos_;
        node.keywords.emplace_back(std::move(name), parse_expression(true));
      } else {
        if (!node.keywords.empty()) syntax_error("positional argument after a keyword argument");
        node.children.push_back(parse_expression(true));
      }
    }
  }

  ExprPtr parse_call(ExprPtr callee) {
    auto call = make(Expr::Kind::kCall, peek().line);
    call->children.push_back(std::move(callee));
    parse_arguments(*call);
    return call;
  }

  ExprPtr parse_filter(ExprPtr operand) {
    auto filter = make(Expr::Kind::kFilter, peek().line);
    filter->name = expect_name();
    if (!has_filter(filter->name)) fail("chat template line {}: no filter named '{}'", filter->line, filter->name);
    filter->children.push_back(std::move(operand));
    if (at_operator("(")) parse_arguments(*filter);
    return filter;
  }

  ExprPtr parse_test(ExprPtr operand) {
    auto test = make(Expr::Kind::kTest, peek().line);
    test->negated = skip_name("not");
    test->name = expect_name();
    if (!has_test(test->name)) fail("chat template line {}: no test named '{}'", test->line, test->name);
    test->children.push_back(std::move(operand));
    if (at_operator("(")) {
      parse_arguments(*test);
    } else if ((peek().kind == TokenKind::kName || peek().kind == TokenKind::kString ||
                peek().kind == TokenKind::kInteger || peek().kind == TokenKind::kFloat || at_operator("[") ||
                at_operator("{")) &&
               !at_name("else") && !at_name("or") && !at_name("and") && !at_name("if") && !at_name("in") &&
               !at_name("not")) {
      // Jinja2 allows one argument without parentheses: `x is divisibleby 3`, `x is sameas false`.
      if (at_name("is")) syntax_error("tests cannot be chained with 'is'");
      test->children.push_back(parse_postfix(parse_primary()));
    }
    return test;
  }

  ExprPtr parse_filters_and_tests(ExprPtr node) {
    while (true) {
      if (skip_operator("|")) {
        node = parse_filter(std::move(node));
      } else if (skip_name("is")) {
        node = parse_test(std::move(node));
      } else if (at_operator("(")) {
        node = parse_call(std::move(node));
      } else {
        return node;
      }
    }
  }

  std::vector<Token> tokens_;
  size_t pos_ = 0;
  int depth_ = 0;
  int loop_depth_ = 0;
};

}  // namespace

Body parse_template(std::string_view source) { return Parser(tokenize_template(source)).parse_all(); }

}  // namespace vavilov::jinja
