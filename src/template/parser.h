#pragma once
// Builds the syntax tree from tokens with Jinja2's grammar and operator precedence (filters and tests bind
// tighter than arithmetic; `not x is y` is `not (x is y)`; ** is left-associative).
#include <string_view>

#include "template/ast.h"

namespace vavilov::jinja {

// Throws vavilov::Error with the line number for syntax errors and for tags or filters we do not support.
Body parse_template(std::string_view source);

}  // namespace vavilov::jinja
