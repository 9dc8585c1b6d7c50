#include "cpu/argmax.h"

#include <immintrin.h>

#include <cmath>

namespace vavilov::cpu {

namespace {

// The largest non-NaN value of x[0, n): _mm256_max_ps(a, b) returns b when either lane is NaN, so NaNs in `a` (the
// data) leave the running maximum `b` as it was.
float largest(const float* x, int64_t n) {
  __m256 best0 = _mm256_set1_ps(-INFINITY), best1 = best0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    best0 = _mm256_max_ps(_mm256_loadu_ps(x + i), best0);
    best1 = _mm256_max_ps(_mm256_loadu_ps(x + i + 8), best1);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(best0, best1));
  float best = -INFINITY;
  for (float lane : lanes) best = lane > best ? lane : best;
  for (; i < n; ++i) best = x[i] > best ? x[i] : best;
  return best;
}

int32_t first_index_of(const float* x, int64_t n, float value) {
  const __m256 target = _mm256_set1_ps(value);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    if (const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ)); mask != 0)
      return int32_t(i + __builtin_ctz(unsigned(mask)));
  for (; i < n; ++i)
    if (x[i] == value) return int32_t(i);
  return 0;  // unreachable: `value` is an element of x
}

}  // namespace

int32_t argmax(const float* x, int64_t n) {
  if (std::isnan(x[0])) return 0;
  return first_index_of(x, n, largest(x, n));
}

}  // namespace vavilov::cpu
