// libFuzzer target: arbitrary template sources rendered with a chat-like context, and arbitrary JSON messages
// through the real Qwen3 template. Only vavilov::Error may escape; no crash, hang or runaway memory.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"
#include "template/template.h"
#include "tokenizer/chat_template.h"

namespace {

const vavilov::jinja::Dict& context() {
  static const vavilov::jinja::Dict dict = [] {
    vavilov::jinja::Dict d;
    d.set("messages", vavilov::jinja::Value::from_json(nlohmann::ordered_json::parse(
                          R"([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <think>"},
                              {"role": "assistant", "content": "Hello", "tool_calls": [{"function":
                              {"name": "f", "arguments": {"x": 1.5, "y": [true, null]}}}]}])")));
    d.set("tools", vavilov::jinja::Value(vavilov::jinja::None{}));
    d.set("add_generation_prompt", vavilov::jinja::Value(true));
    d.set("bos_token", vavilov::jinja::Value("<s>"));
    return d;
  }();
  return dict;
}

const vavilov::tokenizer::ChatTemplate& qwen_template() {
  static const auto chat = vavilov::tokenizer::ChatTemplate::from_model_dir(
      std::filesystem::path(VAVILOV_SOURCE_DIR) / ".." / "shared" / "data" / "tokenizers" / "qwen3");
  return chat;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  try {
    if (data[0] % 2 == 0) {
      vavilov::jinja::Template(text).render(context());
    } else {
      const auto messages = nlohmann::ordered_json::parse(text, nullptr, false);
      if (!messages.is_discarded()) qwen_template().render(messages, nullptr, {});
    }
  } catch (const vavilov::Error&) {
  }
  return 0;
}
