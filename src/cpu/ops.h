#pragma once
// Elementwise and normalisation primitives shared by the layers, all in fp32.
#include <cmath>
#include <cstdint>

namespace vavilov::cpu {

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
// softplus as torch computes it (threshold 20: linear above).
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

// Zero-centred RMSNorm over `groups` consecutive groups of `width` values: out = x·rsqrt(mean x²+eps)·(1+w),
// with w spanning all groups·width values.
void rms_norm_zero_centred(const float* x, const float* weight, int64_t groups, int64_t width, float eps, float* out);

// x · rsqrt(Σx² + eps), in place.
void l2_normalize(float* x, int64_t n, float eps);

// Rotary embedding on the first `rotary_dim` values of x (rotate_half pairing i with i + rotary_dim/2).
void apply_rope(float* x, const float* cos, const float* sin, int64_t rotary_dim);

// cos/sin tables for one position: rotary_dim values each, the half-table repeated twice as HF builds it.
void rope_tables(int64_t position, double theta, int64_t rotary_dim, float* cos, float* sin);

void softmax(float* x, int64_t n);

// Bulk forms of the gates above (AVX2, within 2 ulp of the scalar forms): x ← σ(x·in_scale)·out_scale,
// x ← silu(x·in_scale), and gate ← silu(gate)·up (SwiGLU).
void sigmoid_inplace(float* x, int64_t n, float in_scale = 1.0f, float out_scale = 1.0f);
void silu_inplace(float* x, int64_t n, float in_scale = 1.0f);
void swiglu_inplace(float* gate, const float* up, int64_t n);

}  // namespace vavilov::cpu
