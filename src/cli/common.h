#pragma once
// Argument helpers shared by subcommands.
#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

namespace vavilov::cli {

// "1,2,3" → {1, 2, 3}; anything else is an error naming --ids.
std::vector<int32_t> parse_ids(const std::string& text);

// The bundled model when --model is not given: the one directory under models/ (beside the working directory or the
// source tree) with a config.json and a tokenizer.json.
std::string default_model_dir();

// --threads N (0: all hardware threads); applied before the engine starts.
void add_threads_option(CLI::App* command, int& threads);
void apply_threads(int threads);

}  // namespace vavilov::cli
