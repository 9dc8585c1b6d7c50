#pragma once
// Affine quantization of weight matrices (group kQuantGroup along the input dimension, bf16 scale and bias).
#include <cstdint>
#include <vector>

#include "model/weights.h"

namespace vavilov {

struct QuantizedRows {
  std::vector<uint32_t> codes;   // [rows, cols·bits/32]
  std::vector<uint16_t> scales;  // [rows, cols/group] bf16
  std::vector<uint16_t> biases;
};

// Quantizes fp32 rows [rows, cols] to `bits` (4, 3 or 2); cols must be a multiple of kQuantGroup.
QuantizedRows quantize_rows(const float* weights, int64_t rows, int64_t cols, int bits);

// One row of a quantized matrix back to fp32: w = scale·q + bias.
void dequantize_row(const Matrix& w, int64_t row, float* out);

// Replaces every matrix whose input width is a multiple of kQuantGroup with its `bits` affine quantization
// (--quantize q4); others stay dense. Returns how many matrices were quantized.
int quantize_model(Model& model, int bits);

}  // namespace vavilov
