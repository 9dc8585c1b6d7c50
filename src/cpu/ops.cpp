#include "cpu/ops.h"

#include <algorithm>

namespace vavilov::cpu {

void rms_norm_zero_centred(const float* x, const float* weight, int64_t groups, int64_t width, float eps, float* out) {
  for (int64_t g = 0; g < groups; ++g) {
    const float* xg = x + g * width;
    float sum = 0.0f;
    for (int64_t i = 0; i < width; ++i) sum += xg[i] * xg[i];
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

}  // namespace vavilov::cpu
