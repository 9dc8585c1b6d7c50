#pragma once
// Argument helpers shared by subcommands.
#include <CLI/CLI.hpp>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/weights.h"

namespace vavilov::cli {

// "1,2,3" → {1, 2, 3}; anything else is an error naming --ids.
std::vector<int32_t> parse_ids(const std::string& text);

// The bundled model when --model is not given: the one directory under models/ (beside the working directory or the
// source tree) with a config.json and a tokenizer.json.
std::string default_model_dir();

// How weights are converted at load: --quantize none|q4|q3|q2 (every matrix whose width allows it, affine group 64,
// bf16 scale and bias) and --experts 4|3|2 (the routed experts alone, after --quantize; 0: as loaded).
struct QuantizeOptions {
  std::string weights = "none";
  int experts = 0;
};
void add_quantize_option(CLI::App* command, QuantizeOptions& quantize);
// --experts 4|3|2 alone (serve).
void add_experts_option(CLI::App* command, int& experts);
// load_model, then the conversions the options ask for.
std::unique_ptr<Model> load_model_quantized(const std::string& directory, const QuantizeOptions& quantize);

// --threads N (0: all hardware threads); applied before the engine starts.
void add_threads_option(CLI::App* command, int& threads);
void apply_threads(int threads);

}  // namespace vavilov::cli
