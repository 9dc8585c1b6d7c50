#pragma once
// Argument helpers shared by subcommands.
#include <CLI/CLI.hpp>
#include <cstdint>
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

// --quantize none|q4|q3|q2: weights converted to affine quantization at load (group 64, bf16 scale and bias).
void add_quantize_option(CLI::App* command, std::string& quantize);
// load_model, then the quantization --quantize asks for.
std::unique_ptr<Model> load_model_quantized(const std::string& directory, const std::string& quantize);

// --device auto|cpu|cuda. auto: the GPU when the binary has CUDA, a GPU is present and the weights suit it
// (--quantize none or q4), else the CPU.
void add_device_option(CLI::App* command, std::string& device);
// Whether --device (with --quantize) selects the GPU; a clear error when cuda is asked for but unavailable.
bool cuda_selected(const std::string& device, const std::string& quantize);
// Sequences on the selected device (the GPU one uploads the weights now, once).
SequenceFactory device_sequences(const Model& model, bool cuda);

// --threads N (0: all hardware threads); applied before the engine starts.
void add_threads_option(CLI::App* command, int& threads);
void apply_threads(int threads);

}  // namespace vavilov::cli
