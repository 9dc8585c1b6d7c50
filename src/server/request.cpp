#include "server/request.h"

#include <fmt/format.h>

#include <random>

#include "server/api_error.h"
#include "tokenizer/utf8.h"

namespace vavilov::server {
namespace {

using nlohmann::ordered_json;

[[noreturn]] void bad(const std::string& param, const std::string& message) { throw ApiError(400, message, param); }

const ordered_json* field(const ordered_json& body, const char* name) {
  auto it = body.find(name);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

std::optional<double> number(const ordered_json& body, const char* name, double low, double high) {
  const ordered_json* value = field(body, name);
  if (!value) return std::nullopt;
  if (!value->is_number()) bad(name, fmt::format("'{}' must be a number", name));
  const double x = value->get<double>();
  if (!(x >= low && x <= high)) bad(name, fmt::format("'{}' must be between {} and {}, got {}", name, low, high, x));
  return x;
}

std::optional<int64_t> integer(const ordered_json& body, const char* name, int64_t low, int64_t high) {
  const ordered_json* value = field(body, name);
  if (!value) return std::nullopt;
  if (!value->is_number_integer()) bad(name, fmt::format("'{}' must be an integer", name));
  if (value->is_number_unsigned() && value->get<uint64_t>() > uint64_t(INT64_MAX))
    bad(name, fmt::format("'{}' is out of range", name));
  const int64_t x = value->get<int64_t>();
  if (x < low || x > high) bad(name, fmt::format("'{}' must be between {} and {}, got {}", name, low, high, x));
  return x;
}

std::optional<bool> boolean(const ordered_json& body, const char* name) {
  const ordered_json* value = field(body, name);
  if (!value) return std::nullopt;
  if (!value->is_boolean()) bad(name, fmt::format("'{}' must be a boolean", name));
  return value->get<bool>();
}

void parse_sampling(const ordered_json& body, const RequestLimits& limits, SamplingOptions& s) {
  s.temperature = float(number(body, "temperature", 0, 2).value_or(1.0));  // OpenAI's default
  s.top_p = float(number(body, "top_p", 0, 1).value_or(1.0));
  if (s.top_p <= 0) bad("top_p", "'top_p' must be greater than 0");
  const int64_t top_k = integer(body, "top_k", -1, limits.vocab_size).value_or(0);
  s.top_k = int(top_k < 0 ? 0 : top_k);  // -1 means off, as in vLLM
  s.min_p = float(number(body, "min_p", 0, 1).value_or(0));
  s.presence_penalty = float(number(body, "presence_penalty", -2, 2).value_or(0));
  s.frequency_penalty = float(number(body, "frequency_penalty", -2, 2).value_or(0));
  s.repetition_penalty = float(number(body, "repetition_penalty", 0, 1e6).value_or(1));
  if (s.repetition_penalty <= 0) bad("repetition_penalty", "'repetition_penalty' must be greater than 0");
  if (auto seed = integer(body, "seed", INT64_MIN, INT64_MAX))
    s.seed = uint64_t(*seed);
  else
    s.seed = (uint64_t(std::random_device{}()) << 32) | std::random_device{}();
  if (const ordered_json* bias = field(body, "logit_bias")) {
    if (!bias->is_object()) bad("logit_bias", "'logit_bias' must be an object of token id to bias");
    for (const auto& [key, value] : bias->items()) {
      size_t used = 0;
      long long id = -1;
      try {
        id = std::stoll(key, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != key.size() || id < 0 || id >= limits.vocab_size)
        bad("logit_bias", fmt::format("'logit_bias' key '{}' is not a token id below {}", key, limits.vocab_size));
      if (!value.is_number() || value.get<double>() < -100 || value.get<double>() > 100)
        bad("logit_bias", fmt::format("'logit_bias' value for {} must be a number in [-100, 100]", key));
      s.logit_bias.emplace_back(int32_t(id), value.get<float>());
    }
  }
}

std::vector<std::string> parse_stop(const ordered_json& body) {
  const ordered_json* stop = field(body, "stop");
  if (!stop) return {};
  if (stop->is_string()) return {stop->get<std::string>()};
  if (!stop->is_array() || stop->size() > 16) bad("stop", "'stop' must be a string or an array of up to 16 strings");
  std::vector<std::string> stops;
  for (const auto& item : *stop) {
    if (!item.is_string()) bad("stop", "'stop' must be a string or an array of up to 16 strings");
    stops.push_back(item.get<std::string>());
  }
  return stops;
}

// Parameters this server does not implement: a clear error rather than silently different behaviour.
void reject_unsupported(const ordered_json& body, bool chat) {
  if (integer(body, "n", 1, INT64_MAX).value_or(1) != 1) bad("n", "only n = 1 is supported");
  if (integer(body, "best_of", 1, INT64_MAX).value_or(1) != 1) bad("best_of", "only best_of = 1 is supported");
  if (const ordered_json* logprobs = field(body, "logprobs"); logprobs && *logprobs != false)
    bad("logprobs", "logprobs are not supported");
  if (field(body, "top_logprobs")) bad("top_logprobs", "logprobs are not supported");
  if (!chat && boolean(body, "echo").value_or(false)) bad("echo", "echo is not supported");
  if (const ordered_json* suffix = field(body, "suffix"); !chat && suffix && *suffix != "")
    bad("suffix", "suffix is not supported");
  if (const ordered_json* format = field(body, "response_format")) {
    if (!format->is_object() || format->value("type", "") != "text")
      bad("response_format", "only response_format {\"type\": \"text\"} is supported");
  }
  if (field(body, "functions")) bad("functions", "'functions' is deprecated; use 'tools'");
}

std::string content_text(const ordered_json& content, size_t index) {
  const std::string param = fmt::format("messages[{}].content", index);
  if (content.is_null()) return {};
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) bad(param, fmt::format("'{}' must be a string or an array of text parts", param));
  std::string text;
  for (const auto& part : content) {
    if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") || !part["text"].is_string())
      bad(param, fmt::format("'{}': only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported", param));
    text += part["text"].get<std::string>();
  }
  return text;
}

// Tool-call arguments arrive as JSON text; templates expect objects (they iterate or re-serialise them).
ordered_json template_tool_calls(const ordered_json& calls, size_t index) {
  const std::string param = fmt::format("messages[{}].tool_calls", index);
  if (!calls.is_array()) bad(param, fmt::format("'{}' must be an array", param));
  ordered_json out = ordered_json::array();
  for (const auto& call : calls) {
    if (!call.is_object() || !call.contains("function") || !call["function"].is_object() ||
        !call["function"].contains("name") || !call["function"]["name"].is_string())
      bad(param, fmt::format("'{}' entries need function.name", param));
    ordered_json function = call["function"];
    if (function.contains("arguments") && function["arguments"].is_string()) {
      auto parsed = ordered_json::parse(function["arguments"].get<std::string>(), nullptr, false);
      if (parsed.is_discarded()) bad(param, fmt::format("'{}': arguments are not valid JSON", param));
      function["arguments"] = parsed;
    }
    ordered_json entry = call;
    entry["function"] = function;
    out.push_back(entry);
  }
  return out;
}

ordered_json parse_messages(const ordered_json& body) {
  const ordered_json* messages = field(body, "messages");
  if (!messages || !messages->is_array() || messages->empty()) bad("messages", "'messages' must be a non-empty array");
  ordered_json out = ordered_json::array();
  for (size_t i = 0; i < messages->size(); ++i) {
    const ordered_json& message = (*messages)[i];
    const std::string param = fmt::format("messages[{}]", i);
    if (!message.is_object() || !message.contains("role") || !message["role"].is_string())
      bad(param, fmt::format("'{}' must be an object with a string 'role'", param));
    std::string role = message["role"].get<std::string>();
    if (role == "developer") role = "system";
    if (role != "system" && role != "user" && role != "assistant" && role != "tool")
      bad(param + ".role", fmt::format("'{}.role' must be system, developer, user, assistant or tool", param));
    ordered_json entry = {{"role", role}, {"content", content_text(message.value("content", ordered_json()), i)}};
    if (role == "assistant" && field(message, "tool_calls"))
      entry["tool_calls"] = template_tool_calls(message["tool_calls"], i);
    if (role == "assistant" && field(message, "reasoning_content") && message["reasoning_content"].is_string())
      entry["reasoning_content"] = message["reasoning_content"];
    for (const char* key : {"tool_call_id", "name"})
      if (field(message, key) && message[key].is_string()) entry[key] = message[key];
    out.push_back(entry);
  }
  return out;
}

void parse_tools(const ordered_json& body, CompletionRequest& request) {
  const ordered_json* tools = field(body, "tools");
  if (!tools) return;
  if (!tools->is_array()) bad("tools", "'tools' must be an array");
  for (size_t i = 0; i < tools->size(); ++i) {
    const ordered_json& tool = (*tools)[i];
    const std::string param = fmt::format("tools[{}]", i);
    if (!tool.is_object() || tool.value("type", "") != "function" || !tool.contains("function") ||
        !tool["function"].is_object() || !tool["function"].contains("name") || !tool["function"]["name"].is_string())
      bad(param, fmt::format("'{}' must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}", param));
    auto& types = request.parameter_types[tool["function"]["name"].get<std::string>()];
    const ordered_json properties =
        tool["function"].value("parameters", ordered_json::object()).value("properties", ordered_json::object());
    if (properties.is_object())
      for (const auto& [name, schema] : properties.items())
        if (schema.is_object() && schema.contains("type") && schema["type"].is_string())
          types[name] = schema["type"].get<std::string>();
  }
  if (!tools->empty()) request.tools = *tools;
  std::string choice = "auto";
  if (const ordered_json* tool_choice = field(body, "tool_choice")) {
    if (!tool_choice->is_string() || (*tool_choice != "auto" && *tool_choice != "none"))
      bad("tool_choice", "only tool_choice \"auto\" and \"none\" are supported");
    choice = tool_choice->get<std::string>();
  }
  request.parse_tools = !request.tools.is_null() && choice == "auto";
}

void parse_prompt(const ordered_json& body, const RequestLimits& limits, CompletionRequest& request) {
  const ordered_json* prompt = field(body, "prompt");
  const auto token_ids = [&](const ordered_json& ids) {
    for (const auto& id : ids) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= limits.vocab_size)
        bad("prompt", fmt::format("'prompt' token ids must be integers below {}", limits.vocab_size));
      request.prompt_ids.push_back(int32_t(id.get<int64_t>()));
    }
  };
  if (prompt && prompt->is_string()) {
    request.prompt = prompt->get<std::string>();
  } else if (prompt && prompt->is_array() && prompt->size() == 1 && (*prompt)[0].is_string()) {
    request.prompt = (*prompt)[0].get<std::string>();
  } else if (prompt && prompt->is_array() && prompt->size() == 1 && (*prompt)[0].is_array()) {
    token_ids((*prompt)[0]);
  } else if (prompt && prompt->is_array() && !prompt->empty() && (*prompt)[0].is_number()) {
    token_ids(*prompt);
  } else if (prompt && prompt->is_array() && prompt->size() > 1) {
    bad("prompt", "only one prompt per request is supported");
  } else {
    bad("prompt", "'prompt' must be a string or an array of token ids");
  }
  if (request.prompt.empty() && request.prompt_ids.empty()) bad("prompt", "'prompt' is empty");
}

void parse_options(const ordered_json& body, CompletionRequest& request) {
  request.stream = boolean(body, "stream").value_or(false);
  if (const ordered_json* options = field(body, "stream_options")) {
    if (!options->is_object()) bad("stream_options", "'stream_options' must be an object");
    if (!request.stream) bad("stream_options", "'stream_options' needs stream = true");
    request.include_usage = boolean(*options, "include_usage").value_or(false);
  }
  request.max_tokens = integer(body, "max_completion_tokens", 1, INT32_MAX);
  if (!request.max_tokens) request.max_tokens = integer(body, "max_tokens", 1, INT32_MAX);
  request.stop = parse_stop(body);
  if (const ordered_json* kwargs = field(body, "chat_template_kwargs")) {
    if (!kwargs->is_object()) bad("chat_template_kwargs", "'chat_template_kwargs' must be an object");
    request.enable_thinking = boolean(*kwargs, "enable_thinking");
  }
}

}  // namespace

CompletionRequest parse_request(std::string_view body, bool chat, const RequestLimits& limits) {
  if (!tokenizer::is_valid_utf8(body)) throw ApiError(400, "the request body is not valid UTF-8");
  const auto json = ordered_json::parse(body, nullptr, false);
  if (json.is_discarded()) throw ApiError(400, "the request body is not valid JSON");
  if (!json.is_object()) throw ApiError(400, "the request body must be a JSON object");
  const ordered_json* model = field(json, "model");
  if (!model || !model->is_string()) bad("model", "'model' must be a string");
  if (*model != limits.model_name)
    throw ApiError(404,
                   fmt::format("the model '{}' does not exist; this server serves '{}'", model->get<std::string>(),
                               limits.model_name),
                   "model", "model_not_found");
  reject_unsupported(json, chat);
  CompletionRequest request;
  request.chat = chat;
  if (chat) {
    request.messages = parse_messages(json);
    parse_tools(json, request);
  } else {
    parse_prompt(json, limits, request);
  }
  parse_options(json, request);
  parse_sampling(json, limits, request.sampling);
  return request;
}

}  // namespace vavilov::server
