#include "cpu/linear.h"

#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "core/threads.h"
#include "cpu/simd.h"
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

namespace {

using simd::horizontal_sum;
using simd::load8;

inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) { return bf16_to_f32(*p); }

// y[r·y_stride + o] = Σ_k w[o·w_stride + k]·x[r·n + k] for O weight rows against R input rows. Each weight vector
// is widened once and feeds R accumulators; each input vector is loaded once and feeds O. Decode and verify steps
// (1–4 rows) thus read every weight once, with few loads per multiply-add.
template <int O, int R, typename T>
void dot_block(const T* w, int64_t w_stride, const float* x, int64_t n, float* y, int64_t y_stride) {
  __m256 acc[O][R];
#pragma GCC unroll 8
  for (int o = 0; o < O; ++o)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[o][r] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    __m256 xv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + r * n + k);
#pragma GCC unroll 8
    for (int o = 0; o < O; ++o) {
      const __m256 wv = load8(w + o * w_stride + k);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[o][r] = _mm256_fmadd_ps(wv, xv[r], acc[o][r]);
    }
  }
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r) {
      float sum = horizontal_sum(acc[o][r]);
      for (int64_t tail = k; tail < n; ++tail) sum += load1(w + o * w_stride + tail) * x[r * n + tail];
      y[r * y_stride + o] = sum;
    }
}

// Weight rows [o_begin, o_end) against R input rows, O weight rows at a time: as many as keep every accumulator,
// input and weight vector in the 16 registers.
template <int R, typename T>
void block_rows(const T* w, int64_t w_stride, int64_t o_begin, int64_t o_end, const float* x, int64_t n, float* y,
                int64_t y_stride) {
  constexpr int O = R == 1 ? 8 : R == 2 ? 4 : R == 3 ? 3 : 2;
  int64_t o = o_begin;
  for (; o + O <= o_end; o += O) dot_block<O, R>(w + o * w_stride, w_stride, x, n, y + o, y_stride);
  for (; o < o_end; ++o) dot_block<1, R>(w + o * w_stride, w_stride, x, n, y + o, y_stride);
}

// Weight rows [o_begin, o_end) (w points at row 0) against `rows` input rows, four at a time.
template <typename T>
void rows_times_inputs(const T* w, int64_t w_stride, int64_t o_begin, int64_t o_end, const float* x, int64_t rows,
                       int64_t n, float* y, int64_t out_dim) {
  for (int64_t r = 0; r < rows; r += 4) {
    const float* xr = x + r * n;
    float* yr = y + r * out_dim;
    switch (std::min<int64_t>(4, rows - r)) {
      case 4: block_rows<4>(w, w_stride, o_begin, o_end, xr, n, yr, out_dim); break;
      case 3: block_rows<3>(w, w_stride, o_begin, o_end, xr, n, yr, out_dim); break;
      case 2: block_rows<2>(w, w_stride, o_begin, o_end, xr, n, yr, out_dim); break;
      default: block_rows<1>(w, w_stride, o_begin, o_end, xr, n, yr, out_dim); break;
    }
  }
}

}  // namespace

void matmul(const Matrix& w, const float* x, int64_t rows, float* y) {
  const int64_t out_dim = w.rows, in_dim = w.cols;
  // Enough output rows per task that a task streams at least ~256 KiB of weights: waking a worker costs tens of
  // microseconds, more than a small matrix takes on one core.
  size_t grain = std::max<size_t>(1, (256 << 10) / std::max<size_t>(1, w.row_bytes()));
  // bf16 weights are widened in registers while few rows reuse them; for many rows (prefill) a row is widened once.
  const bool in_registers = !w.quantized() && (w.dtype == DType::F32 || (w.dtype == DType::BF16 && rows <= 4));
  parallel_for(size_t(out_dim), grain, [&](size_t begin, size_t end) {
    if (in_registers && w.dtype == DType::BF16) {
      rows_times_inputs(reinterpret_cast<const uint16_t*>(w.data), in_dim, int64_t(begin), int64_t(end), x, rows,
                        in_dim, y, out_dim);
      return;
    }
    if (in_registers) {
      rows_times_inputs(reinterpret_cast<const float*>(w.data), in_dim, int64_t(begin), int64_t(end), x, rows,
                        in_dim, y, out_dim);
      return;
    }
    std::vector<float> converted(static_cast<size_t>(in_dim));
    for (size_t o = begin; o < end; ++o) {
      matrix_row(w, int64_t(o), converted.data());
      rows_times_inputs(converted.data(), in_dim, 0, 1, x, rows, in_dim, y + o, out_dim);
    }
  });
}

}  // namespace vavilov::cpu
