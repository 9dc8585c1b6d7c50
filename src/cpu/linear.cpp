#include "cpu/linear.h"

#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "core/threads.h"
#include "model/quantize.h"

namespace vavilov::cpu {

float dot(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  __m256 acc2 = _mm256_setzero_ps(), acc3 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), acc2);
    acc3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), acc3);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  __m256 acc = _mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3));
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  float sum = _mm_cvtss_f32(half);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

void matrix_row(const Matrix& w, int64_t row, float* out) {
  if (w.quantized())
    dequantize_row(w, row, out);
  else
    to_f32(w.dtype, w.row(row), out, size_t(w.cols));
}

void matmul(const Matrix& w, const float* x, int64_t rows, float* y) {
  const int64_t out_dim = w.rows, in_dim = w.cols;
  // Enough output rows per task that a task streams at least ~64 KiB of weights.
  size_t grain = std::max<size_t>(1, (64 << 10) / std::max<size_t>(1, w.row_bytes()));
  parallel_for(size_t(out_dim), grain, [&](size_t begin, size_t end) {
    const bool direct = w.dtype == DType::F32 && !w.quantized();
    std::vector<float> converted(direct ? 0 : size_t(in_dim));
    for (size_t o = begin; o < end; ++o) {
      const float* weights;
      if (direct) {
        weights = reinterpret_cast<const float*>(w.row(int64_t(o)));
      } else {
        matrix_row(w, int64_t(o), converted.data());
        weights = converted.data();
      }
      for (int64_t r = 0; r < rows; ++r) y[r * out_dim + int64_t(o)] = dot(weights, x + r * in_dim, in_dim);
    }
  });
}

}  // namespace vavilov::cpu
