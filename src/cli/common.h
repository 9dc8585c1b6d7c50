#pragma once
// Argument helpers shared by subcommands.
#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/backend.h"
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

// --device auto|cpu|cuda. auto: the GPU when the binary has CUDA, a GPU is present and every weight is in a format
// it runs (cuda::runs_on_gpu: dense, NVFP4/FP8, MLX affine 2-8 bits, mixed experts), else the CPU.
void add_device_option(CLI::App* command, std::string& device);
// Whether --device selects the GPU for this loaded model; a clear error when cuda is asked for but unavailable.
bool cuda_selected(const std::string& device, Model& model);
// --expert-cache-mb N (GPU): the routed experts in pinned host memory behind a device cache of N MB (0: every expert
// read from host memory); absent (-1): every weight on the GPU.
void add_expert_cache_option(CLI::App* command, int64_t& expert_cache_mb);
// Sequences on the selected device (the GPU one uploads the weights now, once). `stats_line` (GPU with an expert
// cache): set to a function giving the cache's statistics line, else left empty.
SequenceFactory device_sequences(const Model& model, bool cuda, int64_t expert_cache_mb = -1,
                                 std::function<std::string()>* stats_line = nullptr);

// --threads N (0: all hardware threads); applied before the engine starts.
void add_threads_option(CLI::App* command, int& threads);
void apply_threads(int threads);

}  // namespace vavilov::cli
