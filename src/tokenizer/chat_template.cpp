#include "tokenizer/chat_template.h"

#include <fstream>
#include <sstream>

#include "core/error.h"

namespace vavilov::tokenizer {
namespace {

// The attributes transformers' special_tokens_map exposes to templates.
constexpr const char* kSpecialTokenNames[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                              "pad_token", "cls_token", "mask_token"};

std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  check(static_cast<bool>(in), "{}: cannot open", path.string());
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

// A special token is a string or an AddedToken object {"content": ...}; null or absent means none.
nlohmann::ordered_json special_tokens_of(const nlohmann::ordered_json& config, const std::string& file) {
  nlohmann::ordered_json tokens = nlohmann::ordered_json::object();
  for (const char* name : kSpecialTokenNames) {
    if (!config.contains(name) || config[name].is_null()) continue;
    const auto& token = config[name];
    if (token.is_string()) {
      tokens[name] = token;
    } else {
      check(token.is_object() && token.contains("content") && token["content"].is_string(),
            "{}: field {}: expected a string or an object with a string \"content\"", file, name);
      tokens[name] = token["content"];
    }
  }
  return tokens;
}

// "chat_template" is a string, or a list of {"name", "template"} from which transformers takes "default".
std::string template_from_config(const nlohmann::ordered_json& config, const std::string& file) {
  check(config.contains("chat_template"), "{}: no chat template (no chat_template.jinja and no field chat_template)",
        file);
  const auto& field = config["chat_template"];
  if (field.is_string()) return field.get<std::string>();
  check(field.is_array(), "{}: field chat_template: expected a string or a list of named templates", file);
  for (const auto& entry : field) {
    if (entry.is_object() && entry.value("name", "") == "default" && entry.contains("template") &&
        entry["template"].is_string())
      return entry["template"].get<std::string>();
  }
  fail("{}: field chat_template: no template named \"default\"", file);
}

}  // namespace

ChatTemplate::ChatTemplate(std::string_view source, nlohmann::ordered_json special_tokens)
    : template_(std::make_shared<const jinja::Template>(source)), special_tokens_(std::move(special_tokens)) {}

ChatTemplate ChatTemplate::from_model_dir(const std::filesystem::path& model_dir) {
  const auto config_path = model_dir / "tokenizer_config.json";
  nlohmann::ordered_json config = nlohmann::ordered_json::object();
  if (std::filesystem::exists(config_path)) {
    try {
      config = nlohmann::ordered_json::parse(read_text(config_path));
    } catch (const nlohmann::json::exception& e) {
      fail("{}: invalid JSON: {}", config_path.string(), e.what());
    }
    check(config.is_object(), "{}: expected a JSON object", config_path.string());
  }
  const auto jinja_path = model_dir / "chat_template.jinja";
  const std::string source =
      std::filesystem::exists(jinja_path) ? read_text(jinja_path) : template_from_config(config, config_path.string());
  try {
    return ChatTemplate(source, special_tokens_of(config, config_path.string()));
  } catch (const Error& e) {
    fail("{}: {}", std::filesystem::exists(jinja_path) ? jinja_path.string() : config_path.string(), e.what());
  }
}

std::string ChatTemplate::render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                                 const ChatOptions& options) const {
  check(messages.is_array(), "messages: expected a JSON array of message objects");
  check(tools.is_null() || tools.is_array(), "tools: expected a JSON array of tool schemas");
  jinja::Dict context;
  for (const auto& [name, token] : special_tokens_.items()) context.set(name, jinja::Value::from_json(token));
  context.set("messages", jinja::Value::from_json(messages));
  context.set("tools", jinja::Value::from_json(tools));
  context.set("documents", jinja::Value(jinja::None{}));
  context.set("add_generation_prompt", jinja::Value(options.add_generation_prompt));
  if (options.enable_thinking) context.set("enable_thinking", jinja::Value(*options.enable_thinking));
  return template_->render(context);
}

}  // namespace vavilov::tokenizer
