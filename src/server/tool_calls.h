#pragma once
// The model's tool-call markup, the body of one <tool_call>…</tool_call> block, in either form Qwen models emit:
//   JSON: {"name": "get_weather", "arguments": {"city": "Paris"}}
//   XML:  <function=get_weather><parameter=city>Paris</parameter></function>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace vavilov::server {

struct ToolCall {
  std::string name;
  std::string arguments;  // a JSON object as text, as OpenAI's `function.arguments`
};

// Parameter JSON-schema types by tool name and parameter name, from the request's `tools`: an XML parameter whose
// declared type is "string" stays a string; others are read as JSON when they parse (numbers, booleans, objects).
using ToolParameterTypes = std::map<std::string, std::map<std::string, std::string>>;

// The calls in one block body (the XML form may hold several functions); nullopt when it is not valid markup.
std::optional<std::vector<ToolCall>> parse_tool_call_block(std::string_view body, const ToolParameterTypes& types);

}  // namespace vavilov::server
