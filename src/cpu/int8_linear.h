#pragma once
// An int8 copy of a weight matrix for products that only need to be close: the MTP head's draft logits. A draft only
// proposes a token; verification by the trunk is exact, and when sampling the acceptance test uses the distribution
// the draft was actually drawn from, so an approximate draft lm_head changes speed, never the output.
#include <cstdint>
#include <span>
#include <vector>

#include "model/weights.h"

namespace vavilov::cpu {

struct Int8Matrix {
  int64_t rows = 0, cols = 0, padded_cols = 0;  // padded_cols: cols rounded up to 32 (one AVX2 register of codes)
  // round(w / scale) + 64, in [1, 127]: 7-bit symmetric codes stored unsigned, so that one unsigned×signed byte
  // product pair (vpmaddubsw) cannot saturate 16 bits (2·127·127 < 32768). Padding holds 64 (a zero weight).
  std::vector<uint8_t> codes;
  std::vector<float> scales;  // per row: max |w| / 63
};

// Rows `rows` of w in that order (all rows when empty); row i of the copy is row rows[i] of w.
Int8Matrix quantize_int8(const Matrix& w, std::span<const int32_t> rows = {});

// y[i] = row i of W · x for one input row, with x rounded to int8 (one scale, max |x| / 127) and exact integer sums, so
// the result does not depend on the thread count. Error bound per output: scale_o/2 · Σ|x| + scale_x/2 · Σ|ŵ_o|.
void int8_matvec(const Int8Matrix& w, const float* x, float* y);

}  // namespace vavilov::cpu
