#pragma once
// Each subcommand of `vavilov` registers itself on the CLI11 app from its own file.
#include <CLI/CLI.hpp>

namespace vavilov::cli {

void register_logits(CLI::App& app);
void register_generate(CLI::App& app);
void register_tokenizer_commands(CLI::App& app);  // tokenize, detokenize, template
void register_serve(CLI::App& app);
void register_pack(CLI::App& app);
void register_bench(CLI::App& app);  // GPU benchmark

}  // namespace vavilov::cli
