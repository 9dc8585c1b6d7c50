#include "server/responses.h"

#include <chrono>
#include <random>

namespace vavilov::server {
namespace {

using nlohmann::ordered_json;

std::string random_suffix(size_t length) {
  static constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  thread_local std::mt19937_64 generator{std::random_device{}()};
  std::uniform_int_distribution<size_t> pick(0, sizeof(kAlphabet) - 2);
  std::string out;
  for (size_t i = 0; i < length; ++i) out += kAlphabet[pick(generator)];
  return out;
}

ordered_json reason_json(const std::string& reason) { return reason.empty() ? ordered_json() : ordered_json(reason); }

ordered_json head(const ResponseHeader& header, const char* object) {
  return {{"id", header.id}, {"object", object}, {"created", header.created}, {"model", header.model}};
}

}  // namespace

ResponseHeader new_header(bool chat, const std::string& model) {
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  return {(chat ? "chatcmpl-" : "cmpl-") + random_suffix(24),
          std::chrono::duration_cast<std::chrono::seconds>(now).count(), model};
}

ordered_json usage_json(const Usage& usage) {
  return {{"prompt_tokens", usage.prompt_tokens},
          {"completion_tokens", usage.completion_tokens},
          {"total_tokens", usage.prompt_tokens + usage.completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", usage.cached_tokens}}}};
}

ordered_json tool_calls_json(const std::vector<ToolCall>& calls, size_t first_index) {
  ordered_json out = ordered_json::array();
  for (size_t i = 0; i < calls.size(); ++i)
    out.push_back({{"index", first_index + i},
                   {"id", "call_" + random_suffix(24)},
                   {"type", "function"},
                   {"function", {{"name", calls[i].name}, {"arguments", calls[i].arguments}}}});
  return out;
}

ordered_json chat_completion(const ResponseHeader& header, const OutputDelta& output, const std::string& finish_reason,
                             const Usage& usage) {
  ordered_json message = {
      {"role", "assistant"},
      {"content",
       output.content.empty() && !output.tool_calls.empty() ? ordered_json() : ordered_json(output.content)}};
  if (!output.reasoning.empty()) message["reasoning_content"] = output.reasoning;
  if (!output.tool_calls.empty()) message["tool_calls"] = tool_calls_json(output.tool_calls, 0);
  ordered_json out = head(header, "chat.completion");
  out["choices"] = ordered_json::array(
      {{{"index", 0}, {"message", message}, {"logprobs", nullptr}, {"finish_reason", finish_reason}}});
  out["usage"] = usage_json(usage);
  return out;
}

ordered_json chat_chunk(const ResponseHeader& header, ordered_json delta, const std::string& finish_reason) {
  ordered_json out = head(header, "chat.completion.chunk");
  out["choices"] = ordered_json::array({{{"index", 0},
                                         {"delta", std::move(delta)},
                                         {"logprobs", nullptr},
                                         {"finish_reason", reason_json(finish_reason)}}});
  return out;
}

ordered_json text_completion(const ResponseHeader& header, const std::string& text, const std::string& finish_reason,
                             const Usage& usage) {
  ordered_json out = head(header, "text_completion");
  out["choices"] =
      ordered_json::array({{{"index", 0}, {"text", text}, {"logprobs", nullptr}, {"finish_reason", finish_reason}}});
  out["usage"] = usage_json(usage);
  return out;
}

ordered_json text_chunk(const ResponseHeader& header, const std::string& text, const std::string& finish_reason) {
  ordered_json out = head(header, "text_completion");
  out["choices"] = ordered_json::array(
      {{{"index", 0}, {"text", text}, {"logprobs", nullptr}, {"finish_reason", reason_json(finish_reason)}}});
  return out;
}

ordered_json usage_chunk(const ResponseHeader& header, bool chat, const Usage& usage) {
  ordered_json out = head(header, chat ? "chat.completion.chunk" : "text_completion");
  out["choices"] = ordered_json::array();
  out["usage"] = usage_json(usage);
  return out;
}

}  // namespace vavilov::server
