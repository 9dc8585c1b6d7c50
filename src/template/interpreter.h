#pragma once
// Executes a parsed template: Jinja2's scoping (a loop iteration or macro call gets its own variables, `set` writes
// the innermost scope, namespaces are shared), Python operators, and limits that stop runaway templates.
#include <string>

#include "template/ast.h"
#include "template/value.h"

namespace vavilov::jinja {

std::string execute_template(const Body& body, const Dict& context);

}  // namespace vavilov::jinja
