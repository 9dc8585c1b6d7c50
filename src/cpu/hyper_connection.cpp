// Qwen4ExpTextGatedResidual: the read of the S-stream residual and the gated write back.
#include <vector>

#include "cpu/layers.h"
#include "cpu/linear.h"
#include "cpu/ops.h"

namespace vavilov::cpu {

void hyper_read(const GatedResidualWeights& w, const ModelConfig& c, const float* stack, int64_t rows, float* input,
                float* inject) {
  const int64_t s_count = c.hc_count, h = c.hidden_size, sh = c.hc_hidden(), rank = c.hc_lowrank;
  std::vector<float> normed(size_t(rows * sh)), low(size_t(rows * rank)), mix(size_t(rows * sh));
  for (int64_t r = 0; r < rows; ++r)
    rms_norm_zero_centred(stack + r * sh, w.norm.data(), s_count, h, c.rms_norm_eps, normed.data() + r * sh);
  matmul(w.mix_down, normed.data(), rows, low.data());
  for (auto& v : low) v = silu(v / float(s_count));
  matmul(w.mix_up, low.data(), rows, mix.data());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t d = 0; d < h; ++d) {
      float sum = 0.0f;
      for (int64_t s = 0; s < s_count; ++s) sum += sigmoid(mix[r * sh + s * h + d]) * normed[r * sh + s * h + d];
      input[r * h + d] = sum / float(s_count);
    }
  }
  if (w.inject.empty()) return;
  matmul(w.inject, normed.data(), rows, inject);
  for (int64_t i = 0; i < rows * s_count; ++i) inject[i] = 2.0f * sigmoid(inject[i] / float(s_count));
}

void hyper_write(const float* inject, const float* y, int64_t rows, const ModelConfig& c, float* stack) {
  const int64_t s_count = c.hc_count, h = c.hidden_size;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t s = 0; s < s_count; ++s) {
      float weight = inject[r * s_count + s];
      float* dst = stack + (r * s_count + s) * h;
      for (int64_t d = 0; d < h; ++d) dst[d] += weight * y[r * h + d];
    }
}

}  // namespace vavilov::cpu
