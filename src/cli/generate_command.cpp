// vavilov generate: greedy decoding from prompt ids; the ids on stdout, a statistics line on stderr.
#include <fmt/core.h>
#include <fmt/ranges.h>

#include <memory>
#include <string>

#include "cli/commands.h"
#include "cli/common.h"
#include "engine/generate.h"
#include "model/weights.h"

namespace vavilov::cli {

namespace {
struct GenerateArgs {
  std::string model, ids;
  int64_t max_tokens = 64;
  int64_t chunk = 0;
  bool ignore_eos = false;
  int threads = 0;
};

void run_generate(const GenerateArgs& args) {
  apply_threads(args.threads);
  std::vector<int32_t> prompt = parse_ids(args.ids);
  auto model = load_model(args.model);
  GenerateOptions options;
  options.max_tokens = args.max_tokens;
  options.prefill_chunk = args.chunk;
  options.ignore_eos = args.ignore_eos;
  GenerateStats stats;
  std::vector<int32_t> generated = generate_greedy(*model, prompt, options, stats);
  fmt::print("[{}]\n", fmt::join(generated, ", "));
  fmt::print(stderr, "prefill: {} tokens, {:.1f} tok/s | decode: {} tokens, {:.2f} tok/s\n", stats.prompt_tokens,
             stats.prompt_tokens / std::max(stats.prefill_seconds, 1e-9), stats.generated_tokens,
             stats.generated_tokens / std::max(stats.decode_seconds, 1e-9));
}
}  // namespace

void register_generate(CLI::App& app) {
  auto args = std::make_shared<GenerateArgs>();
  CLI::App* command = app.add_subcommand("generate", "Generate tokens greedily");
  command->add_option("--model", args->model, "Model directory")->required();
  command->add_option("--ids", args->ids, "Prompt token ids, comma-separated")->required();
  command->add_option("--max-tokens", args->max_tokens, "Tokens to generate")->check(CLI::PositiveNumber);
  command->add_option("--chunk", args->chunk, "Prefill in chunks of N tokens (0: all at once)")
      ->check(CLI::NonNegativeNumber);
  command->add_flag("--ignore-eos", args->ignore_eos, "Keep generating past EOS");
  add_threads_option(command, args->threads);
  command->callback([args] { run_generate(*args); });
}

}  // namespace vavilov::cli
