// vavilov tokenize | detokenize | template: the tokenizer and chat template from the command line.
#include <fmt/format.h>

#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "cli/commands.h"
#include "core/error.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace vavilov::cli {
namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  check(static_cast<bool>(in), "{}: cannot open", path);
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

nlohmann::ordered_json read_json_file(const std::string& path) {
  try {
    return nlohmann::ordered_json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    fail("{}: invalid JSON: {}", path, e.what());
  }
}

std::vector<uint32_t> parse_ids(const std::string& text) {
  std::vector<uint32_t> ids;
  std::stringstream stream(text);
  for (std::string item; std::getline(stream, item, ',');) {
    size_t used = 0;
    unsigned long value = 0;
    try {
      value = std::stoul(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    check(used == item.size() && !item.empty() && value <= UINT32_MAX, "--ids: '{}' is not a token id", item);
    ids.push_back(static_cast<uint32_t>(value));
  }
  return ids;
}

void register_tokenize(CLI::App& app) {
  struct Options {
    std::string model, text, file;
  };
  auto options = std::make_shared<Options>();
  auto* command = app.add_subcommand("tokenize", "Print the token ids of a text as a JSON array");
  command->add_option("--model", options->model, "Model directory with tokenizer.json")->required();
  auto* text = command->add_option("--text", options->text, "Text to tokenize");
  auto* file = command->add_option("--file", options->file, "File whose bytes to tokenize");
  text->excludes(file);
  command->callback([options, text, file] {
    check(text->count() + file->count() == 1, "tokenize: give --text or --file");
    const auto tokenizer = tokenizer::Tokenizer::from_model_dir(options->model);
    const auto ids = tokenizer.encode(file->count() ? read_file(options->file) : options->text);
    fmt::print("[{}]\n", fmt::join(ids, ", "));
  });
}

void register_detokenize(CLI::App& app) {
  struct Options {
    std::string model, ids;
    bool skip_special = false;
  };
  auto options = std::make_shared<Options>();
  auto* command = app.add_subcommand("detokenize", "Print the text of comma-separated token ids");
  command->add_option("--model", options->model, "Model directory with tokenizer.json")->required();
  command->add_option("--ids", options->ids, "Token ids, e.g. 1,2,3")->required();
  command->add_flag("--skip-special-tokens", options->skip_special, "Leave out special tokens");
  command->callback([options] {
    const auto tokenizer = tokenizer::Tokenizer::from_model_dir(options->model);
    std::cout << tokenizer.decode(parse_ids(options->ids), options->skip_special) << '\n';
  });
}

void register_template(CLI::App& app) {
  struct Options {
    std::string model, messages, tools;
    bool no_generation_prompt = false;
    std::optional<bool> enable_thinking;
  };
  auto options = std::make_shared<Options>();
  auto* command = app.add_subcommand("template", "Print a conversation rendered with the model's chat template");
  command->add_option("--model", options->model, "Model directory with tokenizer_config.json")->required();
  command->add_option("--messages", options->messages, "JSON file with the array of messages")->required();
  command->add_option("--tools", options->tools, "JSON file with the array of tool schemas");
  command->add_flag("--no-generation-prompt", options->no_generation_prompt, "Do not open an assistant turn");
  command->add_flag("--enable-thinking{true}", options->enable_thinking,
                    "Set the template variable enable_thinking (--enable-thinking=false turns thinking off)");
  command->callback([options] {
    const auto chat = tokenizer::ChatTemplate::from_model_dir(options->model);
    const auto tools = options->tools.empty() ? nlohmann::ordered_json() : read_json_file(options->tools);
    const tokenizer::ChatOptions chat_options{!options->no_generation_prompt, options->enable_thinking};
    std::cout << chat.render(read_json_file(options->messages), tools, chat_options);
  });
}

}  // namespace

void register_tokenizer_commands(CLI::App& app) {
  register_tokenize(app);
  register_detokenize(app);
  register_template(app);
}

}  // namespace vavilov::cli
