#include "template/template.h"

#include "template/interpreter.h"
#include "template/parser.h"

namespace vavilov::jinja {

Template::Template(std::string_view source) : body_(std::make_shared<const Body>(parse_template(source))) {}

std::string Template::render(const Dict& context) const { return execute_template(*body_, context); }

}  // namespace vavilov::jinja
