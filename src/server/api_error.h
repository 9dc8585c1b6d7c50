#pragma once
// Errors a client gets as OpenAI-style bodies: {"error": {"message", "type", "param", "code"}} with an HTTP status.
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

namespace vavilov::server {

struct ApiError : std::runtime_error {
  ApiError(int status, const std::string& message, std::string param = "", std::string code = "",
           std::string type = "invalid_request_error")
      : std::runtime_error(message),
        status(status),
        type(std::move(type)),
        param(std::move(param)),
        code(std::move(code)) {}

  int status;
  std::string type, param, code;
};

inline nlohmann::ordered_json error_body(const ApiError& error) {
  const auto or_null = [](const std::string& text) {
    return text.empty() ? nlohmann::ordered_json() : nlohmann::ordered_json(text);
  };
  return {{"error",
           {{"message", error.what()},
            {"type", error.type},
            {"param", or_null(error.param)},
            {"code", or_null(error.code)}}}};
}

}  // namespace vavilov::server
