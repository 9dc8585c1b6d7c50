// vavilov logits: the trunk's (or the MTP head's) logits at every position of a prompt, as little-endian float32.
#include <fmt/core.h>

#include <memory>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/common.h"
#include "core/error.h"
#include "io/atomic_file.h"
#include "model/weights.h"

namespace vavilov::cli {

namespace {
struct LogitsArgs {
  std::string model, ids, out;
  int64_t chunk = 0;
  int threads = 0;
  bool mtp = false;
  QuantizeOptions quantize;
  std::string device = "auto";
  int64_t expert_cache_mb = -1;
};

// Row i: the MTP head's logits given the trunk stack at position i and the token ids[i + 1].
std::vector<float> mtp_logits(const Model& model, SequenceBackend& sequence, const std::vector<int32_t>& ids) {
  const size_t vocab = size_t(model.config.vocab_size), sh = size_t(model.config.hc_hidden()), n = ids.size();
  check(n >= 2, "--mtp needs at least two ids");
  check(model.mtp.has_value(), "{}: the checkpoint has no MTP head (mtp.* tensors)", model.directory);
  std::vector<float> stacks(n * sh), head((n - 1) * sh), logits((n - 1) * vocab);
  sequence.forward(ids, {false, nullptr, stacks.data(), false});
  sequence.mtp_forward(stacks.data(), std::span<const int32_t>(ids).subspan(1), head.data(), MtpRows::All);
  sequence.mtp_logits(head.data(), int64_t(n - 1), logits.data());
  return logits;
}

void run_logits(const LogitsArgs& args) {
  apply_threads(args.threads);
  std::vector<int32_t> ids = parse_ids(args.ids);
  auto model = load_model_quantized(args.model, args.quantize);
  const bool cuda = cuda_selected(args.device, *model);
  std::function<std::string()> cache_stats;
  std::unique_ptr<SequenceBackend> sequence = device_sequences(*model, cuda, args.expert_cache_mb, &cache_stats)();
  if (args.mtp) {
    std::vector<float> logits = mtp_logits(*model, *sequence, ids);
    write_file_atomically(args.out, logits.data(), logits.size() * sizeof(float));
    return;
  }
  const int64_t vocab = model->config.vocab_size;
  std::vector<float> logits(ids.size() * size_t(vocab));
  size_t step = args.chunk > 0 ? size_t(args.chunk) : ids.size();
  for (size_t begin = 0; begin < ids.size(); begin += step) {
    size_t count = std::min(step, ids.size() - begin);
    sequence->forward(std::span<const int32_t>(ids).subspan(begin, count),
                      {true, logits.data() + begin * size_t(vocab), nullptr, false});
  }
  write_file_atomically(args.out, logits.data(), logits.size() * sizeof(float));
  if (cache_stats) fmt::print(stderr, "{}\n", cache_stats());
}
}  // namespace

void register_logits(CLI::App& app) {
  auto args = std::make_shared<LogitsArgs>();
  CLI::App* command = app.add_subcommand("logits", "Write the trunk's logits at every prompt position");
  command->add_option("--model", args->model, "Model directory or packed store")->required();
  command->add_option("--ids", args->ids, "Prompt token ids, comma-separated")->required();
  command->add_option("--out", args->out, "Output file: little-endian float32 [ids x vocab]")->required();
  command->add_option("--chunk", args->chunk, "Prefill in chunks of N tokens (0: all at once)")
      ->check(CLI::NonNegativeNumber);
  command->add_flag("--mtp", args->mtp,
                    "Write the MTP head's logits instead: row i given the trunk at i and ids[i+1], [(ids-1) x vocab]");
  add_quantize_option(command, args->quantize);
  add_device_option(command, args->device);
  add_expert_cache_option(command, args->expert_cache_mb);
  add_threads_option(command, args->threads);
  command->callback([args] { run_logits(*args); });
}

}  // namespace vavilov::cli
