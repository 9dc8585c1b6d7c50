#include "cpu/ops.h"

#include <algorithm>

#include "cpu/simd.h"

namespace vavilov::cpu {

namespace {

// Σ x² in eight lanes (a scalar sum is a chain of dependent adds the compiler may not reorder), then the tail.
float sum_of_squares(const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float sum = simd::horizontal_sum(acc);
  for (; i < n; ++i) sum += x[i] * x[i];
  return sum;
}

}  // namespace

void rms_norm_zero_centred(const float* x, const float* weight, int64_t groups, int64_t width, float eps, float* out) {
  for (int64_t g = 0; g < groups; ++g) {
    const float* xg = x + g * width;
    const float sum = sum_of_squares(xg, width);
    float scale = 1.0f / std::sqrt(sum / float(width) + eps);
    for (int64_t i = 0; i < width; ++i) out[g * width + i] = xg[i] * scale * (1.0f + weight[g * width + i]);
  }
}

void l2_normalize(float* x, int64_t n, float eps) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  float scale = 1.0f / std::sqrt(sum + eps);
  for (int64_t i = 0; i < n; ++i) x[i] *= scale;
}

void apply_rope(float* x, const float* cos, const float* sin, int64_t rotary_dim) {
  int64_t half = rotary_dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    float a = x[i], b = x[i + half];
    x[i] = a * cos[i] - b * sin[i];
    x[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

void rope_tables(int64_t position, double theta, int64_t rotary_dim, float* cos, float* sin) {
  int64_t half = rotary_dim / 2;
  for (int64_t j = 0; j < half; ++j) {
    // HF: inv_freq = 1 / theta^(2j/dim) in fp32, then an fp32 product with the position.
    float inv_freq = float(1.0 / std::pow(theta, double(2 * j) / double(rotary_dim)));
    float angle = inv_freq * float(position);
    cos[j] = cos[j + half] = std::cos(angle);
    sin[j] = sin[j + half] = std::sin(angle);
  }
}

void softmax(float* x, int64_t n) {
  float peak = *std::max_element(x, x + n);
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += (x[i] = std::exp(x[i] - peak));
  for (int64_t i = 0; i < n; ++i) x[i] /= sum;
}

void sigmoid_inplace(float* x, int64_t n, float in_scale, float out_scale) {
  const __m256 in = _mm256_set1_ps(in_scale), out = _mm256_set1_ps(out_scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(x + i, _mm256_mul_ps(out, simd::sigmoid8(_mm256_mul_ps(in, _mm256_loadu_ps(x + i)))));
  for (; i < n; ++i) x[i] = out_scale * sigmoid(in_scale * x[i]);
}

void silu_inplace(float* x, int64_t n, float in_scale) {
  const __m256 in = _mm256_set1_ps(in_scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_mul_ps(in, _mm256_loadu_ps(x + i));
    _mm256_storeu_ps(x + i, _mm256_mul_ps(v, simd::sigmoid8(v)));
  }
  for (; i < n; ++i) x[i] = silu(in_scale * x[i]);
}

void swiglu_inplace(float* gate, const float* up, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 g = _mm256_loadu_ps(gate + i);
    _mm256_storeu_ps(gate + i, _mm256_mul_ps(_mm256_mul_ps(g, simd::sigmoid8(g)), _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) gate[i] = silu(gate[i]) * up[i];
}

}  // namespace vavilov::cpu
