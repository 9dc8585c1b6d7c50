#include "cpu/int8_linear.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "core/threads.h"
#include "cpu/linear.h"

namespace vavilov::cpu {

namespace {

constexpr int kWeightLevels = 63;  // codes −63…63 before the +64 offset
constexpr int kWeightOffset = 64;
constexpr int kInputLevels = 127;
constexpr int64_t kBytesPerRegister = 32;

int64_t padded(int64_t cols) { return (cols + kBytesPerRegister - 1) / kBytesPerRegister * kBytesPerRegister; }

float max_abs(const float* v, int64_t n) {
  float m = 0.0f;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::abs(v[i]));
  return m;
}

// Σ codes·x over the padded rows of R consecutive weight rows (R accumulators share each load of x), in int32:
// vpmaddubsw adds two byte products into 16 bits, vpmaddwd widens pairs of those into 32.
template <int R>
void code_dots(const uint8_t* codes, int64_t stride, const int8_t* x, int32_t* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
  for (int64_t k = 0; k < stride; k += kBytesPerRegister) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + k));
    for (int r = 0; r < R; ++r) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + r * stride + k));
      acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(w, v), ones));
    }
  }
  for (int r = 0; r < R; ++r) {
    __m128i sum = _mm_add_epi32(_mm256_castsi256_si128(acc[r]), _mm256_extracti128_si256(acc[r], 1));
    sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, _MM_SHUFFLE(1, 0, 3, 2)));
    sum = _mm_add_epi32(sum, _mm_shuffle_epi32(sum, _MM_SHUFFLE(2, 3, 0, 1)));
    out[r] = _mm_cvtsi128_si32(sum);
  }
}

// Round to nearest (ties to even): rint compiles to one instruction where lround is a libm call.
int round_to_int(float v) { return int(std::rint(v)); }

}  // namespace

Int8Matrix quantize_int8(const Matrix& w, std::span<const int32_t> rows) {
  for (int32_t row : rows) check(row >= 0 && row < w.rows, "{}: row {} is outside [0, {})", w.name, row, w.rows);
  Int8Matrix q;
  q.rows = rows.empty() ? w.rows : int64_t(rows.size());
  q.cols = w.cols;
  q.padded_cols = padded(w.cols);
  q.codes.assign(size_t(q.rows * q.padded_cols), uint8_t(kWeightOffset));
  q.scales.assign(size_t(q.rows), 0.0f);
  parallel_for(size_t(q.rows), 256, [&](size_t begin, size_t end) {
    std::vector<float> row(static_cast<size_t>(w.cols));
    for (size_t o = begin; o < end; ++o) {
      matrix_row(w, rows.empty() ? int64_t(o) : rows[o], row.data());
      const float scale = max_abs(row.data(), w.cols) / kWeightLevels;
      q.scales[o] = scale;
      if (scale == 0.0f) continue;
      uint8_t* codes = q.codes.data() + o * size_t(q.padded_cols);
      for (int64_t k = 0; k < w.cols; ++k) codes[k] = uint8_t(round_to_int(row[size_t(k)] / scale) + kWeightOffset);
    }
  });
  return q;
}

void int8_matvec(const Int8Matrix& w, const float* x, float* y) {
  const float x_scale = max_abs(x, w.cols) / kInputLevels;
  if (x_scale == 0.0f || !std::isfinite(x_scale)) {
    std::fill(y, y + w.rows, x_scale == 0.0f ? 0.0f : NAN);
    return;
  }
  std::vector<int8_t> xq(size_t(w.padded_cols), 0);
  int32_t x_sum = 0;  // removes the codes' +64 offset: Σ (q + 64)·x = Σ q·x + 64·Σ x
  for (int64_t k = 0; k < w.cols; ++k) {
    xq[size_t(k)] = int8_t(round_to_int(x[k] / x_scale));
    x_sum += xq[size_t(k)];
  }
  // Enough rows per task to stream ~256 KiB of codes: waking a worker costs more than a few rows.
  const size_t grain = std::max<size_t>(1, (256 << 10) / size_t(w.padded_cols));
  parallel_for(size_t(w.rows), grain, [&](size_t begin, size_t end) {
    int32_t dots[4];
    for (size_t o = begin; o < end;) {
      const uint8_t* codes = w.codes.data() + o * size_t(w.padded_cols);
      const int count = end - o >= 4 ? 4 : 1;
      if (count == 4)
        code_dots<4>(codes, w.padded_cols, xq.data(), dots);
      else
        code_dots<1>(codes, w.padded_cols, xq.data(), dots);
      for (int r = 0; r < count; ++r, ++o) y[o] = float(dots[r] - kWeightOffset * x_sum) * (w.scales[o] * x_scale);
    }
  });
}

}  // namespace vavilov::cpu
