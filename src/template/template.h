#pragma once
// A Jinja2 template as transformers renders chat templates: trim_blocks and lstrip_blocks on, an immutable
// sandbox, loop controls, tojson/raise_exception/strftime_now. Constructs outside the supported subset fail with
// the line number instead of rendering something different from Jinja2.
#include <memory>
#include <string>
#include <string_view>

#include "template/ast.h"
#include "template/value.h"

namespace vavilov::jinja {

class Template {
 public:
  // Parses `source`; throws vavilov::Error naming the line for syntax errors and unsupported constructs.
  explicit Template(std::string_view source);

  // Renders with the variables of `context` (plus the global functions). Throws vavilov::Error naming the line
  // for runtime errors (undefined attribute of undefined, type errors, raise_exception, runaway templates).
  std::string render(const Dict& context) const;

 private:
  std::shared_ptr<const Body> body_;
};

}  // namespace vavilov::jinja
