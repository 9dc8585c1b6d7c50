#pragma once
// Matrix products with weights in their stored dtype; the arithmetic is fp32.
#include <cstdint>

#include "model/weights.h"

namespace vavilov::cpu {

float dot(const float* a, const float* b, int64_t n);

// y[r, :] = W · x[r, :] for `rows` input rows; x is [rows, W.cols], y is [rows, W.rows]. Multithreaded.
void matmul(const Matrix& w, const float* x, int64_t rows, float* y);

// One row of W as fp32 (for gathers such as embeddings).
void matrix_row(const Matrix& w, int64_t row, float* out);

}  // namespace vavilov::cpu
