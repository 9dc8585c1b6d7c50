#include "cli/common.h"

#include <fmt/core.h>

#include <algorithm>
#include <charconv>
#include <filesystem>

#include "core/error.h"
#include "core/threads.h"
#include "model/quantize.h"
#ifdef VAVILOV_HAVE_CUDA
#include "cuda/backend.h"
#endif

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
  auto model = load_model(directory, quantize.experts);
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

void add_device_option(CLI::App* command, std::string& device) {
  command
      ->add_option("--device", device, "auto, cpu or cuda (auto: the GPU when one is present and the binary has CUDA)")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}));
}

namespace {

#ifdef VAVILOV_HAVE_CUDA
// The first matrix the GPU backend cannot run as stored (cuda::runs_on_gpu), or an empty string.
std::string first_matrix_off_gpu(Model& model) {
  std::string name;
  const auto visit = [&](const Matrix& m) {
    if (name.empty() && !m.empty() && !cuda::runs_on_gpu(m)) name = m.name;
  };
  for_each_matrix(model, visit);
  for (const LayerWeights& layer : model.layers)
    if (layer.ple)
      for (const Matrix& shard : layer.ple->table_shards) visit(shard);
  return name;
}
#endif

}  // namespace

bool cuda_selected(const std::string& device, Model& model) {
#ifdef VAVILOV_HAVE_CUDA
  const std::string unsupported = first_matrix_off_gpu(model);
  if (device == "auto") return unsupported.empty() && cuda::device_count() > 0;
  if (device == "cpu") return false;
  check(cuda::device_count() > 0, "--device cuda: no CUDA device is available");
  check(unsupported.empty(),
        "--device cuda: tensor {} is in a format the GPU backend does not run (it runs dense F32/BF16/F16/FP8 weights, "
        "NVFP4, and MLX affine weights of 2-8 bits in whole groups of a multiple of 8 columns)",
        unsupported);
  return true;
#else
  check(device != "cuda", "--device cuda: this binary was built without CUDA");
  (void)model;
  return false;
#endif
}

void add_expert_cache_option(CLI::App* command, int64_t& expert_cache_mb) {
  command
      ->add_option("--expert-cache-mb", expert_cache_mb,
                   "GPU: keep the routed experts in pinned host memory and copies of the most used ones in a device "
                   "cache of N MB (0: none, every expert read over PCIe); for models larger than the GPU (default: "
                   "every weight on the GPU)")
      ->check(CLI::NonNegativeNumber);
}

SequenceFactory device_sequences(const Model& model, bool cuda, int64_t expert_cache_mb,
                                 std::function<std::string()>* stats_line) {
#ifdef VAVILOV_HAVE_CUDA
  if (cuda) return cuda::sequence_factory(model, expert_cache_mb, stats_line);
#else
  (void)stats_line;
#endif
  check(expert_cache_mb < 0, "--expert-cache-mb: the expert cache is for the GPU (--device cuda)");
  return [&model] { return cpu_sequence(model); };
}

void add_threads_option(CLI::App* command, int& threads) {
  command->add_option("--threads", threads, "CPU threads (0: all hardware threads)")->check(CLI::NonNegativeNumber);
}

void apply_threads(int threads) { set_thread_count(threads); }

}  // namespace vavilov::cli
