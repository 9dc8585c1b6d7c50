#pragma once
// Affine quantization of weight matrices exactly as MLX does it (mlx.core.quantize / dequantize, mode "affine"):
// per group of columns a scale and bias in bf16, codes packed least-significant first.
#include <cstdint>
#include <vector>

#include "model/weights.h"

namespace vavilov {

struct QuantizedRows {
  std::vector<uint32_t> codes;   // [rows, cols·bits/32]
  std::vector<uint16_t> scales;  // [rows, cols/group] bf16
  std::vector<uint16_t> biases;
};

// Quantizes fp32 rows [rows, cols] to `bits` (4, 3, 2; also MLX's 5, 6 and 8) with MLX's rounding, bit for bit: per
// group the larger of |min| and |max| (the "edge") is kept exactly as a grid point, scale = ±(max − min)/(2^bits − 1)
// nudged so that edge = q0·scale, codes = clamp(rint((w − bias)/scale)) computed with the fp32 scale and bias, which
// are then stored rounded to bf16. cols must be a multiple of `group` (32, 64 or 128).
QuantizedRows quantize_rows(const float* weights, int64_t rows, int64_t cols, int bits, int64_t group = kQuantGroup);

// One row of a quantized matrix back to fp32: w = scale·q + bias (any group size).
void dequantize_row(const Matrix& w, int64_t row, float* out);

// A copy of `m` quantized to `bits`, its storage kept in model.owned. A quantized `m` is dequantized first, so
// 3- and 2-bit experts derive from a Q4 checkpoint's codes the same way they derive from BF16 weights.
Matrix quantize_matrix(Model& model, const Matrix& m, int bits);

// Replaces every matrix whose input width is a multiple of kQuantGroup with its `bits` affine quantization
// (--quantize q4); others stay dense. Returns how many matrices were quantized.
int quantize_model(Model& model, int bits);

// Re-quantizes every routed expert matrix (trunk and MTP layer) to `bits` (--experts 4|3|2); a matrix already at
// that precision is left untouched. Returns how many matrices changed.
int quantize_experts(Model& model, int bits);

}  // namespace vavilov
