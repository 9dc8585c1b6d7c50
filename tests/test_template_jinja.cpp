// Small templates, one construct each, must render exactly as Jinja2 with transformers' settings does
// (fixtures from tools/tokenizer/make_jinja_fixtures.py), and fail where Jinja2 fails.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "template/template.h"
#include "test_tokenizer_support.h"

namespace vavilov::testing {
namespace {

TEST(TemplateJinja, SmallTemplatesMatchJinja2) {
  const auto fixture = nlohmann::ordered_json::parse(read_binary_file(tokenizer_fixtures_dir() / "jinja_cases.json"));
  jinja::Dict context;
  for (const auto& [name, value] : fixture["context"].items()) context.set(name, jinja::Value::from_json(value));
  ASSERT_GT(fixture["cases"].size(), 60u);
  for (const auto& item : fixture["cases"]) {
    const std::string source = item["template"];
    if (item.contains("error")) {
      EXPECT_THROW(jinja::Template(source).render(context), Error) << source << "\nJinja2: " << item["error"];
      continue;
    }
    try {
      EXPECT_EQ(jinja::Template(source).render(context), item["expected"].get<std::string>()) << source;
    } catch (const Error& e) {
      ADD_FAILURE() << source << "\n" << e.what();
    }
  }
}

std::string error_of(const std::string& source) {
  try {
    jinja::Template(source).render({});
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(TemplateJinja, ErrorsNameTheLine) {
  EXPECT_NE(error_of("line one\n{% include 'x' %}").find("line 2: unsupported tag 'include'"), std::string::npos);
  EXPECT_NE(error_of("\n\n{{ x | nope }}").find("line 3: no filter named 'nope'"), std::string::npos);
  EXPECT_NE(error_of("{% for x in y %}").find("missing {% endfor %}"), std::string::npos);
  EXPECT_NE(error_of("a\n{{ missing.attr }}").find("line 2"), std::string::npos);
  EXPECT_NE(error_of("{{ raise_exception('no system role') }}").find("no system role"), std::string::npos);
}

TEST(TemplateJinja, RunawayTemplatesStop) {
  EXPECT_THROW(jinja::Template("{% for i in range(100000000) %}{% endfor %}").render({}), Error);
  EXPECT_THROW(jinja::Template("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}").render({}), Error);
  EXPECT_THROW(jinja::Template("{{ 'x' * 100000000 }}").render({}), Error);
  EXPECT_THROW(jinja::Template("{{" + std::string(5000, '(') + "}}").render({}), Error);
}

}  // namespace
}  // namespace vavilov::testing
