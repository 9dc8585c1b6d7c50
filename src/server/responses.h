#pragma once
// OpenAI response bodies: chat.completion / text_completion objects and their streaming chunks.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "server/output_parser.h"

namespace vavilov::server {

struct ResponseHeader {
  std::string id;  // the same on every chunk of a stream
  int64_t created = 0;
  std::string model;
};

// A fresh header for one response: "chatcmpl-…" or "cmpl-…" with a random suffix, the current time.
ResponseHeader new_header(bool chat, const std::string& model);

struct Usage {
  int64_t prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;
};
nlohmann::ordered_json usage_json(const Usage& usage);

// Tool calls as `tool_calls` entries; `first_index` numbers them across a stream.
nlohmann::ordered_json tool_calls_json(const std::vector<ToolCall>& calls, size_t first_index);

nlohmann::ordered_json chat_completion(const ResponseHeader& header, const OutputDelta& output,
                                       const std::string& finish_reason, const Usage& usage);
// `delta`: the message delta object; `finish_reason` empty: null (every chunk but the last).
nlohmann::ordered_json chat_chunk(const ResponseHeader& header, nlohmann::ordered_json delta,
                                  const std::string& finish_reason);
nlohmann::ordered_json text_completion(const ResponseHeader& header, const std::string& text,
                                       const std::string& finish_reason, const Usage& usage);
nlohmann::ordered_json text_chunk(const ResponseHeader& header, const std::string& text,
                                  const std::string& finish_reason);
// The last chunk of a stream with stream_options.include_usage: no choices, the usage.
nlohmann::ordered_json usage_chunk(const ResponseHeader& header, bool chat, const Usage& usage);

}  // namespace vavilov::server
