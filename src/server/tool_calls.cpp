#include "server/tool_calls.h"

#include <nlohmann/json.hpp>

namespace vavilov::server {
namespace {

using nlohmann::ordered_json;

std::string_view trim(std::string_view text) {
  const auto space = [](char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; };
  while (!text.empty() && space(text.front())) text.remove_prefix(1);
  while (!text.empty() && space(text.back())) text.remove_suffix(1);
  return text;
}

std::optional<ToolCall> parse_json_form(std::string_view body) {
  const auto call = ordered_json::parse(body, nullptr, false);
  if (call.is_discarded() || !call.is_object() || !call.contains("name") || !call["name"].is_string())
    return std::nullopt;
  ordered_json arguments = ordered_json::object();
  for (const char* key : {"arguments", "parameters"})
    if (call.contains(key)) arguments = call[key];
  // Some models write the arguments as a JSON string already.
  if (arguments.is_string()) {
    const auto parsed = ordered_json::parse(arguments.get<std::string>(), nullptr, false);
    if (parsed.is_discarded() || !parsed.is_object()) return std::nullopt;
    arguments = parsed;
  }
  if (!arguments.is_object()) return std::nullopt;
  return ToolCall{call["name"].get<std::string>(), arguments.dump()};
}

// A parameter value: one newline on each side belongs to the markup, not to the value.
ordered_json parameter_value(std::string_view raw, const std::string& type) {
  if (raw.starts_with('\n')) raw.remove_prefix(1);
  if (raw.ends_with('\n')) raw.remove_suffix(1);
  if (type != "string") {
    const auto parsed = ordered_json::parse(raw, nullptr, false);
    if (!parsed.is_discarded()) return parsed;
  }
  return std::string(raw);
}

// <function=NAME> … </function>, starting at `pos`; advances `pos` past it.
std::optional<ToolCall> parse_function(std::string_view body, size_t& pos, const ToolParameterTypes& types) {
  constexpr std::string_view kOpen = "<function=", kParameter = "<parameter=", kParameterEnd = "</parameter>",
                             kEnd = "</function>";
  if (body.substr(pos, kOpen.size()) != kOpen) return std::nullopt;
  const size_t name_end = body.find('>', pos);
  const size_t end = body.find(kEnd, pos);
  if (name_end == std::string_view::npos || end == std::string_view::npos || name_end > end) return std::nullopt;
  ToolCall call{std::string(trim(body.substr(pos + kOpen.size(), name_end - pos - kOpen.size()))), {}};
  if (call.name.empty()) return std::nullopt;
  const auto tool = types.find(call.name);
  ordered_json arguments = ordered_json::object();
  std::string_view inner = body.substr(name_end + 1, end - name_end - 1);
  for (size_t at = 0;;) {
    const size_t open = inner.find(kParameter, at);
    if (open == std::string_view::npos) break;
    const size_t key_end = inner.find('>', open);
    const size_t close = inner.find(kParameterEnd, open);
    if (key_end == std::string_view::npos || close == std::string_view::npos || key_end > close) return std::nullopt;
    const std::string key(trim(inner.substr(open + kParameter.size(), key_end - open - kParameter.size())));
    std::string type;
    if (tool != types.end())
      if (auto found = tool->second.find(key); found != tool->second.end()) type = found->second;
    arguments[key] = parameter_value(inner.substr(key_end + 1, close - key_end - 1), type);
    at = close + kParameterEnd.size();
  }
  call.arguments = arguments.dump();
  pos = end + kEnd.size();
  return call;
}

std::optional<std::vector<ToolCall>> parse_xml_form(std::string_view body, const ToolParameterTypes& types) {
  std::vector<ToolCall> calls;
  size_t pos = 0;
  while (pos < body.size()) {
    while (pos < body.size() && std::string_view(" \n\r\t").find(body[pos]) != std::string_view::npos) ++pos;
    if (pos == body.size()) break;
    auto call = parse_function(body, pos, types);
    if (!call) return std::nullopt;
    calls.push_back(std::move(*call));
  }
  if (calls.empty()) return std::nullopt;
  return calls;
}

}  // namespace

std::optional<std::vector<ToolCall>> parse_tool_call_block(std::string_view body, const ToolParameterTypes& types) {
  body = trim(body);
  if (body.starts_with('{')) {
    auto call = parse_json_form(body);
    if (!call) return std::nullopt;
    return std::vector<ToolCall>{std::move(*call)};
  }
  return parse_xml_form(body, types);
}

}  // namespace vavilov::server
