// The real Qwen3 and DeepSeek-V3 chat templates must render byte-identically to transformers'
// apply_chat_template (fixtures from tools/tokenizer/make_template_fixtures.py), and fail where it fails.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "test_tokenizer_support.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/prompt.h"

namespace vavilov::testing {
namespace {

nlohmann::ordered_json chat_cases() {
  return nlohmann::ordered_json::parse(read_binary_file(tokenizer_fixtures_dir() / "chat_cases.json"));
}

tokenizer::ChatOptions options_of(const nlohmann::ordered_json& options) {
  tokenizer::ChatOptions chat;
  chat.add_generation_prompt = options.value("add_generation_prompt", true);
  if (options.contains("enable_thinking")) chat.enable_thinking = options["enable_thinking"].get<bool>();
  return chat;
}

class TemplateChat : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { VAVILOV_REQUIRE_SHARED_TOKENIZERS(); }
};

TEST_P(TemplateChat, RendersLikeTransformers) {
  const auto chat = tokenizer::ChatTemplate::from_model_dir(shared_tokenizers_dir() / GetParam());
  size_t rendered = 0;
  for (const auto& item : chat_cases()) {
    const std::string name = item["name"];
    const auto options = options_of(item["options"]);
    if (item["errors"].contains(GetParam())) {
      EXPECT_THROW(chat.render(item["messages"], item["tools"], options), Error) << name;
      continue;
    }
    std::string actual;
    try {
      actual = chat.render(item["messages"], item["tools"], options);
    } catch (const Error& e) {
      ADD_FAILURE() << name << ": " << e.what();
      continue;
    }
    EXPECT_EQ(actual, item["expected"][GetParam()].get<std::string>()) << name;
    ++rendered;
  }
  EXPECT_GE(rendered, 30u);
}

TEST_P(TemplateChat, TemplatedIdsMatchTransformers) {
  const auto& tokenizer = shared_tokenizer(GetParam());
  const auto chat = tokenizer::ChatTemplate::from_model_dir(shared_tokenizers_dir() / GetParam());
  size_t checked = 0;
  for (const auto& item : chat_cases()) {
    if (!item["ids"].contains(GetParam())) continue;
    const std::string text = chat.render(item["messages"], item["tools"], options_of(item["options"]));
    EXPECT_EQ(tokenizer.encode(text), item["ids"][GetParam()].get<std::vector<uint32_t>>()) << item["name"];
    ++checked;
  }
  EXPECT_GT(checked, 3u);
}

INSTANTIATE_TEST_SUITE_P(TemplateReal, TemplateChat, ::testing::Values("qwen3", "deepseek_v3"));

TEST(TemplatePrompt, SingleUserMessageWithGenerationPrompt) {
  VAVILOV_REQUIRE_SHARED_TOKENIZERS();
  const tokenizer::PromptTokenizer prompts(shared_tokenizers_dir() / "qwen3");
  // The "single_user" case: one user message "Hello!" with the generation prompt, as transformers tokenizes it.
  for (const auto& item : chat_cases()) {
    if (item["name"] != "single_user") continue;
    EXPECT_EQ(prompts.encode_prompt("Hello!", false), item["ids"]["qwen3"].get<std::vector<uint32_t>>());
  }
  EXPECT_EQ(prompts.encode_prompt("Hello!", true), shared_tokenizer("qwen3").encode("Hello!"));
  EXPECT_EQ(prompts.eos_token_id(), std::optional<uint32_t>(151645));
  auto stream = prompts.stream_decoder();
  EXPECT_EQ(stream.push(151645), "");  // <|im_end|> is special: skipped by default
}

TEST(TemplatePrompt, MissingTokenizerIsAClearError) {
  try {
    tokenizer::PromptTokenizer prompts("/nonexistent-model-dir");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no tokenizer.json"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace vavilov::testing
