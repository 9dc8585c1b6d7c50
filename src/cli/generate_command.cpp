// vavilov generate: greedy decoding from prompt ids; the ids on stdout, a statistics line on stderr.
#include <fmt/core.h>
#include <fmt/ranges.h>

#include <cstdio>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "cli/common.h"
#include "engine/generate.h"
#include "engine/speculative.h"
#include "model/weights.h"

namespace vavilov::cli {

namespace {
// Measured on the bundled model (bench/results): see docs/MTP.md.
constexpr int kDefaultDrafts = 2;

struct GenerateArgs {
  std::string model, ids;
  int64_t max_tokens = 64;
  int64_t chunk = 0;
  bool ignore_eos = false;
  int threads = 0;
  int drafts = -1;  // -1: the default for the model
  std::string draft_mode = "adaptive";
};

void print_speculative_stats(const SpeculativeStats& stats) {
  std::string positions;
  for (size_t j = 0; j < stats.proposed.size(); ++j)
    positions += fmt::format(" d{}: {}/{} ({:.0f}%)", j + 1, stats.accepted[j], stats.proposed[j],
                             stats.proposed[j] ? 100.0 * double(stats.accepted[j]) / double(stats.proposed[j]) : 0.0);
  fmt::print(stderr, "mtp: {} verify steps, accepted{} | mean accepted {:.2f}, {:.2f} tokens/step\n",
             stats.verify_steps, positions, stats.mean_accepted(), stats.tokens_per_step());
}

void run_generate(const GenerateArgs& args) {
  apply_threads(args.threads);
  std::vector<int32_t> prompt = parse_ids(args.ids);
  auto model = load_model(args.model);
  GenerateOptions options;
  options.max_tokens = args.max_tokens;
  options.prefill_chunk = args.chunk;
  options.ignore_eos = args.ignore_eos;
  GenerateStats stats;
  SpeculativeOptions speculative;
  speculative.drafts = args.drafts >= 0 ? args.drafts : (model->mtp ? kDefaultDrafts : 0);
  speculative.adaptive = args.draft_mode == "adaptive";
  std::vector<int32_t> generated;
  SpeculativeStats spec_stats;
  if (speculative.drafts > 0)
    generated = generate_speculative(*model, prompt, options, speculative, stats, spec_stats);
  else
    generated = generate_greedy(*model, prompt, options, stats);
  fmt::print("[{}]\n", fmt::join(generated, ", "));
  std::fflush(stdout);
  if (speculative.drafts > 0) print_speculative_stats(spec_stats);
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
  command->add_option("--drafts", args->drafts,
                      "MTP drafts per step, 0-3 (default: " + std::to_string(kDefaultDrafts) +
                          " when the checkpoint has an MTP head, else 0)")
      ->check(CLI::Range(0, 3));
  command->add_option("--draft-mode", args->draft_mode,
                      "fixed: always --drafts; adaptive: --drafts after a fully accepted step, 1 after a rejection")
      ->check(CLI::IsMember({"fixed", "adaptive"}));
  add_threads_option(command, args->threads);
  command->callback([args] { run_generate(*args); });
}

}  // namespace vavilov::cli
