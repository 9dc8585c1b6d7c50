#pragma once
// What `vavilov generate` needs from a model directory: prompt ids and streaming text.
//
//   vavilov::tokenizer::PromptTokenizer prompts(model_dir);           // throws if DIR has no tokenizer.json
//   std::vector<uint32_t> ids = prompts.encode_prompt(text, raw);     // chat-templated unless raw
//   vavilov::tokenizer::StreamDecoder stream = prompts.stream_decoder();
//   for each generated id: std::fputs(stream.push(id).c_str(), stdout);
//   at the end:            std::fputs(stream.finish().c_str(), stdout);
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string_view>
#include <vector>

#include "tokenizer/chat_template.h"
#include "tokenizer/stream_decoder.h"
#include "tokenizer/tokenizer.h"

namespace vavilov::tokenizer {

class PromptTokenizer {
 public:
  // Loads DIR/tokenizer.json (a clear vavilov::Error when missing) and, when present, DIR's chat template.
  explicit PromptTokenizer(const std::filesystem::path& model_dir);

  // `raw`: the ids of `prompt` itself. Otherwise `prompt` as one user message through the chat template with
  // add_generation_prompt, then encoded, as transformers' apply_chat_template(tokenize=True) gives; an error when
  // the directory has no chat template.
  std::vector<uint32_t> encode_prompt(std::string_view prompt, bool raw) const;

  // A decoder for generated ids; it refers to this object, which must outlive it. Special tokens (such as
  // <|im_end|>) print nothing unless `skip_special_tokens` is false.
  StreamDecoder stream_decoder(bool skip_special_tokens = true) const;

  // The id of tokenizer_config.json's eos_token, when it names a known token.
  std::optional<uint32_t> eos_token_id() const { return eos_token_id_; }

  const Tokenizer& tokenizer() const { return tokenizer_; }

 private:
  Tokenizer tokenizer_;
  std::optional<ChatTemplate> chat_template_;
  std::string chat_template_error_;  // why there is no chat template, for encode_prompt(raw=false)
  std::optional<uint32_t> eos_token_id_;
};

}  // namespace vavilov::tokenizer
