#include "tokenizer/prompt.h"

#include <fstream>

#include "core/error.h"

namespace vavilov::tokenizer {
namespace {

std::optional<std::string> eos_token_of(const std::filesystem::path& model_dir) {
  std::ifstream in(model_dir / "tokenizer_config.json");
  if (!in) return std::nullopt;
  const auto config = nlohmann::json::parse(in, nullptr, false);
  if (!config.is_object() || !config.contains("eos_token")) return std::nullopt;
  const auto& token = config["eos_token"];
  if (token.is_string()) return token.get<std::string>();
  if (token.is_object() && token.contains("content") && token["content"].is_string())
    return token["content"].get<std::string>();
  return std::nullopt;
}

}  // namespace

PromptTokenizer::PromptTokenizer(const std::filesystem::path& model_dir)
    : tokenizer_(Tokenizer::from_model_dir(model_dir)) {
  try {
    chat_template_ = ChatTemplate::from_model_dir(model_dir);
  } catch (const Error& e) {
    // Raw prompts need no template, so a missing or broken one only matters to encode_prompt(raw=false).
    chat_template_error_ = e.what();
  }
  if (const auto eos = eos_token_of(model_dir)) eos_token_id_ = tokenizer_.token_to_id(*eos);
}

std::vector<uint32_t> PromptTokenizer::encode_prompt(std::string_view prompt, bool raw) const {
  if (raw) return tokenizer_.encode(prompt);
  check(chat_template_.has_value(), "cannot apply the chat template ({}); use a raw prompt instead",
        chat_template_error_);
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  messages.push_back({{"role", "user"}, {"content", std::string(prompt)}});
  return tokenizer_.encode(chat_template_->render(messages, nullptr, ChatOptions{}));
}

StreamDecoder PromptTokenizer::stream_decoder(bool skip_special_tokens) const {
  return StreamDecoder(tokenizer_, skip_special_tokens);
}

}  // namespace vavilov::tokenizer
