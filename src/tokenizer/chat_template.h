#pragma once
// A model's chat template (chat_template.jinja, else tokenizer_config.json "chat_template") rendered the way
// transformers' apply_chat_template does: messages, tools, add_generation_prompt, extra keyword arguments, and the
// named special tokens (bos_token, eos_token, ...) of tokenizer_config.json as variables.
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "template/template.h"

namespace vavilov::tokenizer {

struct ChatOptions {
  bool add_generation_prompt = true;
  // Passed as the template variable `enable_thinking` when set; left undefined otherwise, as transformers does.
  std::optional<bool> enable_thinking;
};

class ChatTemplate {
 public:
  // Reads the template and special tokens of a model directory; a clear error when it has no chat template.
  static ChatTemplate from_model_dir(const std::filesystem::path& model_dir);
  // A template from source, with the special-token variables given as a JSON object (e.g. {"bos_token": "<s>"}).
  ChatTemplate(std::string_view source, nlohmann::ordered_json special_tokens);

  // `messages`: array of message objects; `tools`: array of tool schemas or null.
  std::string render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                     const ChatOptions& options) const;

 private:
  std::shared_ptr<const jinja::Template> template_;
  nlohmann::ordered_json special_tokens_;
};

}  // namespace vavilov::tokenizer
