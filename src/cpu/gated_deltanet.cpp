// Gated DeltaNet (linear_attn): causal depthwise conv over q|k|v, then the gated delta rule with an fp32
// recurrent state per value head, a gated RMS norm and the output projection.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "core/threads.h"
#include "cpu/layers.h"
#include "cpu/linear.h"
#include "cpu/ops.h"

namespace vavilov::cpu {

namespace {

// Causal depthwise conv with silu; state holds the last kernel−1 inputs and is advanced past `rows` inputs.
void causal_conv(const Vector& taps, int64_t channels, int64_t kernel, std::vector<float>& state, float* x,
                 int64_t rows, std::vector<GatedDeltaNetState>* row_states) {
  const int64_t history = kernel - 1;
  std::vector<float> window(size_t((history + rows) * channels));
  std::copy(state.begin(), state.end(), window.begin());
  std::copy(x, x + rows * channels, window.begin() + history * channels);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t ch = 0; ch < channels; ++ch) {
      float sum = 0.0f;
      for (int64_t k = 0; k < kernel; ++k) sum += taps[ch * kernel + k] * window[(t + k) * channels + ch];
      x[t * channels + ch] = silu(sum);
    }
  std::copy(window.end() - history * channels, window.end(), state.begin());
  if (row_states)
    for (size_t t = 0; t < row_states->size(); ++t)
      std::copy_n(window.begin() + int64_t(t + 1) * channels, history * channels, (*row_states)[t].conv.begin());
}

struct DeltaInputs {
  const float* qkv;  // after conv: [rows, conv_dim]
  const float* beta;
  const float* decay;  // g, log-space
  int64_t rows;
};

// The two passes a row makes over one head's state [dk, dv], on B·8 columns from j0 with B accumulators in registers.
// Within a column every sum runs over i in order, as the scalar loops for the last dv mod 8 columns do.

// next = decay·previous (previous may be next) and delta = nextᵀk.
template <int B>
void decay_and_transpose_product(const float* previous, float decay, const float* k, int64_t dk, int64_t dv, int64_t j0,
                                 float* next, float* delta) {
  const __m256 factor = _mm256_set1_ps(decay);
  __m256 acc[B];
  for (int b = 0; b < B; ++b) acc[b] = _mm256_setzero_ps();
  for (int64_t i = 0; i < dk; ++i) {
    const __m256 ki = _mm256_set1_ps(k[i]);
    for (int b = 0; b < B; ++b) {
      const __m256 decayed = _mm256_mul_ps(_mm256_loadu_ps(previous + i * dv + j0 + 8 * b), factor);
      _mm256_storeu_ps(next + i * dv + j0 + 8 * b, decayed);
      acc[b] = _mm256_fmadd_ps(decayed, ki, acc[b]);
    }
  }
  for (int b = 0; b < B; ++b) _mm256_storeu_ps(delta + j0 + 8 * b, acc[b]);
}

// next += k·deltaᵀ and out = nextᵀq.
template <int B>
void rank_one_update_and_read(const float* k, const float* delta, const float* q, int64_t dk, int64_t dv, int64_t j0,
                              float* next, float* out) {
  __m256 acc[B], d[B];
  for (int b = 0; b < B; ++b) {
    acc[b] = _mm256_setzero_ps();
    d[b] = _mm256_loadu_ps(delta + j0 + 8 * b);
  }
  for (int64_t i = 0; i < dk; ++i) {
    const __m256 ki = _mm256_set1_ps(k[i]), qi = _mm256_set1_ps(q[i]);
    for (int b = 0; b < B; ++b) {
      float* cell = next + i * dv + j0 + 8 * b;
      const __m256 updated = _mm256_fmadd_ps(ki, d[b], _mm256_loadu_ps(cell));
      _mm256_storeu_ps(cell, updated);
      acc[b] = _mm256_fmadd_ps(updated, qi, acc[b]);
    }
  }
  for (int b = 0; b < B; ++b) _mm256_storeu_ps(out + j0 + 8 * b, acc[b]);
}

// Calls columns(B, j0) over dv's columns in runs of B·8 (B = 4, then 2, then 1), B as a std::integral_constant;
// returns where the runs end (the scalar tail starts).
template <typename Columns>
int64_t vector_columns(int64_t dv, Columns columns) {
  int64_t j = 0;
  for (; j + 32 <= dv; j += 32) columns(std::integral_constant<int, 4>{}, j);
  for (; j + 16 <= dv; j += 16) columns(std::integral_constant<int, 2>{}, j);
  for (; j + 8 <= dv; j += 8) columns(std::integral_constant<int, 1>{}, j);
  return j;
}

void decay_and_transpose_product(const float* previous, float decay, const float* k, int64_t dk, int64_t dv,
                                 float* next, float* delta) {
  int64_t j = vector_columns(dv, [&](auto b, int64_t j0) {
    decay_and_transpose_product<decltype(b)::value>(previous, decay, k, dk, dv, j0, next, delta);
  });
  for (; j < dv; ++j) {
    float sum = 0.0f;
    for (int64_t i = 0; i < dk; ++i) {
      next[i * dv + j] = previous[i * dv + j] * decay;
      sum = std::fma(next[i * dv + j], k[i], sum);
    }
    delta[j] = sum;
  }
}

void rank_one_update_and_read(const float* k, const float* delta, const float* q, int64_t dk, int64_t dv, float* next,
                              float* out) {
  int64_t j = vector_columns(dv, [&](auto b, int64_t j0) {
    rank_one_update_and_read<decltype(b)::value>(k, delta, q, dk, dv, j0, next, out);
  });
  for (; j < dv; ++j) {
    float sum = 0.0f;
    for (int64_t i = 0; i < dk; ++i) {
      next[i * dv + j] = std::fma(k[i], delta[j], next[i * dv + j]);
      sum = std::fma(next[i * dv + j], q[i], sum);
    }
    out[j] = sum;
  }
}

// The recurrence for one value head over all rows: S ← e^g S; δ = β(v − Sᵀk); S ← S + kδᵀ; o = Sᵀq. Two passes over
// S a row: the decay is applied as Sᵀk is summed. When row states are recorded, row t's state is written straight into
// its record (row t + 1 reads it from there) and only the last row's into the live state, so recording copies nothing.
void delta_rule_head(const ModelConfig& c, int64_t head, const DeltaInputs& in, float* state, float* out,
                     std::vector<GatedDeltaNetState>* row_states) {
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim, heads = c.linear_num_value_heads;
  const int64_t key_head = head / (heads / c.linear_num_key_heads);
  const int64_t conv_dim = c.gdn_conv_dim(), key_dim = c.gdn_key_dim();
  std::vector<float> q(static_cast<size_t>(dk)), k(static_cast<size_t>(dk)), delta(static_cast<size_t>(dv));
  const float* previous = state;
  for (int64_t t = 0; t < in.rows; ++t) {
    const bool recorded = row_states && size_t(t) < row_states->size();
    float* next = recorded ? (*row_states)[size_t(t)].recurrent.data() + head * dk * dv : state;
    const float* row = in.qkv + t * conv_dim;
    std::copy(row + key_head * dk, row + (key_head + 1) * dk, q.begin());
    std::copy(row + key_dim + key_head * dk, row + key_dim + (key_head + 1) * dk, k.begin());
    const float* v = row + 2 * key_dim + head * dv;
    l2_normalize(q.data(), dk, 1e-6f);
    l2_normalize(k.data(), dk, 1e-6f);
    float q_scale = 1.0f / std::sqrt(float(dk));
    for (auto& value : q) value *= q_scale;
    float decay = std::exp(in.decay[t * heads + head]), beta = in.beta[t * heads + head];
    decay_and_transpose_product(previous, decay, k.data(), dk, dv, next, delta.data());
    for (int64_t j = 0; j < dv; ++j) delta[j] = beta * (v[j] - delta[j]);
    rank_one_update_and_read(k.data(), delta.data(), q.data(), dk, dv, next, out + t * heads * dv + head * dv);
    previous = next;
  }
}

}  // namespace

void gated_deltanet(const GatedDeltaNetWeights& w, const ModelConfig& c, std::span<const Segment> segments,
                    const float* x, int64_t rows, float* y) {
  const int64_t heads = c.linear_num_value_heads, dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
  const int64_t conv_dim = c.gdn_conv_dim(), value_dim = c.gdn_value_dim();
  std::vector<float> qkv(size_t(rows * conv_dim)), z(size_t(rows * value_dim));
  std::vector<float> beta(size_t(rows * heads)), decay(size_t(rows * heads));
  matmul(w.in_qkv, x, rows, qkv.data());
  matmul(w.in_z, x, rows, z.data());
  matmul(w.in_b, x, rows, beta.data());
  matmul(w.in_a, x, rows, decay.data());
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      float& b = beta[t * heads + h];
      b = sigmoid(b);
      float& g = decay[t * heads + h];
      g = -std::exp(w.a_log[h]) * softplus(g + w.dt_bias[h]);
    }

  std::vector<float> core(size_t(rows * value_dim));
  for (const Segment& seg : segments) {
    GatedDeltaNetState& state = seg.state->gdn;
    if (seg.gdn_rows) shape_row_states(*seg.gdn_rows, size_t(seg.rows - 1), state);
    float* seg_qkv = qkv.data() + seg.row_begin * conv_dim;
    causal_conv(w.conv, conv_dim, c.linear_conv_kernel_dim, state.conv, seg_qkv, seg.rows, seg.gdn_rows);
    DeltaInputs inputs{seg_qkv, beta.data() + seg.row_begin * heads, decay.data() + seg.row_begin * heads, seg.rows};
    float* seg_core = core.data() + seg.row_begin * value_dim;
    // Heads per task: at least ~64 K state updates, so small layers stay on the calling thread.
    const size_t grain = std::max<size_t>(1, (64 << 10) / size_t(dk * dv * seg.rows));
    parallel_for(size_t(heads), grain, [&](size_t begin, size_t end) {
      for (size_t h = begin; h < end; ++h)
        delta_rule_head(c, int64_t(h), inputs, state.recurrent.data() + h * dk * dv, seg_core, seg.gdn_rows);
    });
  }

  // Gated RMS norm per value head (plain weight), gate sigmoid or silu per output_gate_type.
  if (c.gdn_gate_sigmoid)
    sigmoid_inplace(z.data(), rows * value_dim);
  else
    silu_inplace(z.data(), rows * value_dim);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      float* o = core.data() + t * value_dim + h * dv;
      const float* gate = z.data() + t * value_dim + h * dv;
      float sum = 0.0f;
      for (int64_t j = 0; j < dv; ++j) sum += o[j] * o[j];
      float scale = 1.0f / std::sqrt(sum / float(dv) + c.rms_norm_eps);
      for (int64_t j = 0; j < dv; ++j) o[j] = w.norm[j] * (o[j] * scale) * gate[j];
    }
  matmul(w.out, core.data(), rows, y);
}

}  // namespace vavilov::cpu
