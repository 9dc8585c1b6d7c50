#pragma once
// Server-sent events as OpenAI streams them: one `data: {json}` event per chunk, then `data: [DONE]`.
#include <nlohmann/json.hpp>
#include <string>

namespace vavilov::server {

// JSON text that never throws: invalid UTF-8 (which a model can emit mid-character) becomes U+FFFD.
std::string json_text(const nlohmann::ordered_json& value);

std::string sse_event(const nlohmann::ordered_json& chunk);
inline constexpr const char* kSseDone = "data: [DONE]\n\n";

}  // namespace vavilov::server
