#include "cli/common.h"

#include <fmt/core.h>

#include <algorithm>
#include <charconv>
#include <filesystem>

#include "core/error.h"
#include "core/threads.h"
#include "model/quantize.h"

namespace vavilov::cli {

std::vector<int32_t> parse_ids(const std::string& text) {
  std::vector<int32_t> ids;
  size_t begin = 0;
  while (begin <= text.size()) {
    size_t end = text.find(',', begin);
    if (end == std::string::npos) end = text.size();
    int32_t value = 0;
    auto [ptr, ec] = std::from_chars(text.data() + begin, text.data() + end, value);
    check(ec == std::errc() && ptr == text.data() + end && end > begin && value >= 0,
          "--ids: expected comma-separated non-negative integers, got '{}'", text.substr(begin, end - begin));
    ids.push_back(value);
    begin = end + 1;
  }
  return ids;
}

std::string default_model_dir() {
  for (const std::filesystem::path& root :
       {std::filesystem::path("models"), std::filesystem::path(VAVILOV_SOURCE_DIR) / "models"}) {
    std::error_code error;
    std::vector<std::filesystem::path> found;
    for (const auto& entry : std::filesystem::directory_iterator(root, error))
      if (std::filesystem::exists(entry.path() / "config.json") &&
          std::filesystem::exists(entry.path() / "tokenizer.json"))
        found.push_back(entry.path());
    std::sort(found.begin(), found.end());
    if (!found.empty()) return found.front().string();
  }
  fail("--model is required: there is no bundled model under models/");
}

void add_quantize_option(CLI::App* command, QuantizeOptions& quantize) {
  command->add_option("--quantize", quantize.weights, "Quantize weights at load: none, q4, q3 or q2 (affine, group 64)")
      ->check(CLI::IsMember({"none", "q4", "q3", "q2"}));
  add_experts_option(command, quantize.experts);
}

void add_experts_option(CLI::App* command, int& experts) {
  command
      ->add_option("--experts", experts,
                   "Routed experts at 4, 3 or 2 bits (affine, group 64; from BF16 weights or derived from a Q4 "
                   "checkpoint's codes)")
      ->check(CLI::IsMember({4, 3, 2}));
}

std::unique_ptr<Model> load_model_quantized(const std::string& directory, const QuantizeOptions& quantize) {
  auto model = load_model(directory);
  if (quantize.weights != "none") {
    int count = quantize_model(*model, quantize.weights[1] - '0');
    fmt::print(stderr, "quantized {} weight matrices to {}\n", count, quantize.weights);
  }
  if (quantize.experts != 0) {
    int count = quantize_experts(*model, quantize.experts);
    fmt::print(stderr, "quantized {} expert matrices to {} bits\n", count, quantize.experts);
  }
  return model;
}

void add_threads_option(CLI::App* command, int& threads) {
  command->add_option("--threads", threads, "CPU threads (0: all hardware threads)")->check(CLI::NonNegativeNumber);
}

void apply_threads(int threads) { set_thread_count(threads); }

}  // namespace vavilov::cli
