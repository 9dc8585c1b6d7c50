// vavilov pack: rewrite a checkpoint as a packed store for streaming experts, or re-check an existing store.
#include <fmt/core.h>

#include <memory>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"
#include "core/interrupt.h"
#include "io/packed_store.h"
#include "model/pack.h"

namespace vavilov::cli {

namespace {
struct PackArgs {
  std::string model, out, verify;
  std::string experts = "4";
};

// "4,3,2" or "dense" entries → bits (dense: 0).
std::vector<int> parse_expert_bits(const std::string& text) {
  std::vector<int> bits;
  size_t begin = 0;
  while (begin <= text.size()) {
    size_t end = std::min(text.find(',', begin), text.size());
    std::string item = text.substr(begin, end - begin);
    if (item == "dense")
      bits.push_back(0);
    else if (item == "4" || item == "3" || item == "2")
      bits.push_back(item[0] - '0');
    else
      fail("--experts: expected a comma-separated list of 4, 3, 2 or dense, got '{}'", item);
    begin = end + 1;
  }
  return bits;
}

void run_verify(const std::string& store) {
  std::vector<std::string> problems = verify_store(store, ProgressMode::Auto);
  for (const auto& problem : problems) fmt::print(stderr, "{}\n", problem);
  check(problems.empty(), "{}: {} checksum mismatch(es); the store is damaged, pack it again", store, problems.size());
  fmt::print(stderr, "{}: every checksum matches\n", store);
}

void run_pack(const PackArgs& args) {
  if (!args.verify.empty()) {
    check(args.model.empty() && args.out.empty(), "--verify checks an existing store; give it alone");
    run_verify(args.verify);
    return;
  }
  check(!args.model.empty() && !args.out.empty(), "pack needs --model DIR and --out STORE (or --verify STORE)");
  PackOptions options;
  options.expert_bits = parse_expert_bits(args.experts);
  install_interrupt_handlers();
  PackSummary summary = pack_model(args.model, args.out, options);
  fmt::print(stderr, "{}: {} bytes written in {:.1f} s\n", args.out, summary.bytes, summary.seconds);
}
}  // namespace

void register_pack(CLI::App& app) {
  auto args = std::make_shared<PackArgs>();
  CLI::App* command = app.add_subcommand(
      "pack", "Rewrite a checkpoint as a packed store (dense file, expert records per precision, manifest)");
  command->add_option("--model", args->model, "Checkpoint directory (or a store to repack)");
  command->add_option("--out", args->out, "Store directory to create (must not exist)");
  command->add_option("--experts", args->experts,
                      "Expert precisions, one file each: comma-separated 4, 3, 2 (affine, group 64) or dense "
                      "(the checkpoint's dtype); default 4");
  command->add_option("--verify", args->verify, "Re-check every checksum of an existing store instead of packing");
  command->callback([args] { run_pack(*args); });
}

}  // namespace vavilov::cli
