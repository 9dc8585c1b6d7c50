#pragma once
// OpenAI request bodies (/v1/chat/completions, /v1/completions) parsed and validated into what generation needs.
// Every wrong type, range or unsupported parameter is an ApiError naming the parameter; unknown fields are ignored
// (clients send many optional ones).
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/sampling.h"
#include "server/tool_calls.h"

namespace vavilov::server {

struct RequestLimits {
  std::string model_name;  // the one model this server serves
  int64_t vocab_size = 0;
};

struct CompletionRequest {
  bool chat = false;
  nlohmann::ordered_json messages;  // chat: template-ready messages (content as text, arguments as objects)
  nlohmann::ordered_json tools;     // chat: the tools array, or null
  std::string prompt;               // completions: prompt text
  std::vector<int32_t> prompt_ids;  // completions: prompt given as token ids instead
  bool stream = false, include_usage = false;
  std::optional<int64_t> max_tokens;
  std::vector<std::string> stop;
  SamplingOptions sampling;
  std::optional<bool> enable_thinking;  // chat_template_kwargs.enable_thinking
  bool parse_tools = false;             // tools offered and tool_choice is not "none"
  ToolParameterTypes parameter_types;
};

// `chat` selects the endpoint's schema. Throws ApiError (400 for malformed input, 404 for an unknown model).
CompletionRequest parse_request(std::string_view body, bool chat, const RequestLimits& limits);

}  // namespace vavilov::server
