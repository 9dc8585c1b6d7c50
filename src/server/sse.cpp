#include "server/sse.h"

namespace vavilov::server {

std::string json_text(const nlohmann::ordered_json& value) {
  return value.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
}

// JSON text holds no raw newline, so one `data:` line carries the whole chunk.
std::string sse_event(const nlohmann::ordered_json& chunk) { return "data: " + json_text(chunk) + "\n\n"; }

}  // namespace vavilov::server
