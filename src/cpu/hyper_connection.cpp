// Qwen4ExpTextGatedResidual: the read of the S-stream residual and the gated write back.
#include <vector>

#include "cpu/layers.h"
#include "cpu/linear.h"
#include "cpu/ops.h"

namespace vavilov::cpu {

void hyper_read(const GatedResidualWeights& w, const ModelConfig& c, const float* stack, int64_t rows, float* input,
                float* inject) {
  const int64_t s_count = c.hc_count, h = c.hidden_size, sh = c.hc_hidden(), rank = c.hc_lowrank;
  const float inv_streams = 1.0f / float(s_count);
  // Reused across calls: a decode step reads the stack 2·layers + 1 times, and fresh zeroed buffers cost more than
  // the mixing itself at small widths.
  thread_local std::vector<float> normed, low, mix;
  normed.resize(size_t(rows * sh));
  low.resize(size_t(rows * rank));
  mix.resize(size_t(rows * sh));
  for (int64_t r = 0; r < rows; ++r)
    rms_norm_zero_centred(stack + r * sh, w.norm.data(), s_count, h, c.rms_norm_eps, normed.data() + r * sh);
  matmul(w.mix_down, normed.data(), rows, low.data());
  silu_inplace(low.data(), rows * rank, inv_streams);
  matmul(w.mix_up, low.data(), rows, mix.data());
  sigmoid_inplace(mix.data(), rows * sh);
  for (int64_t r = 0; r < rows; ++r) {
    const float* gates = mix.data() + r * sh;
    const float* streams = normed.data() + r * sh;
    float* out = input + r * h;
    for (int64_t d = 0; d < h; ++d) out[d] = gates[d] * streams[d];
    for (int64_t s = 1; s < s_count; ++s)
      for (int64_t d = 0; d < h; ++d) out[d] += gates[s * h + d] * streams[s * h + d];
    for (int64_t d = 0; d < h; ++d) out[d] *= inv_streams;
  }
  if (w.inject.empty() || !inject) return;
  matmul(w.inject, normed.data(), rows, inject);
  sigmoid_inplace(inject, rows * s_count, inv_streams, 2.0f);
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
