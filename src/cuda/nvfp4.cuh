#pragma once
// NVIDIA ModelOpt NVFP4 and FP8 weights on the GPU: the scalar decoders every kernel shares (bit manipulation in
// registers, no tables) and the decode GEMV for 1–4 activation rows.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device_matrix.h"

namespace vavilov::cuda {

// OCP FP8 E4M3 ("fn": no infinities, S.1111.111 is NaN, bias 7), exactly as the CPU's f8_e4m3_to_f32.
__device__ inline float e4m3_value(uint32_t bits) {
  const uint32_t exponent = (bits >> 3) & 0xfu, mantissa = bits & 7u;
  float magnitude = exponent == 0 ? float(mantissa) * (1.0f / 512.0f)  // subnormal: m · 2^-9
                                  : __uint_as_float(((exponent + 120u) << 23) | (mantissa << 20));
  if (exponent == 0xfu && mantissa == 7u) magnitude = __uint_as_float(0x7fc00000u);
  return bits & 0x80u ? -magnitude : magnitude;
}

// The e2m1 code in bits 0-3 of `code` (bit 3 the sign; bits 0-2 index {0, 0.5, 1, 1.5, 2, 3, 4, 6}, i.e. exponent e
// = bits 1-2 and mantissa m = bit 0: 2^(e-1)·(1 + m/2), or m/2 when e is 0). Bits 0-2 placed at fp32 bits 22-24 are
// exactly that value times 2^-126 (e = 0 lands on the subnormals, m·2^-127), so one exact multiplication by 2^126
// finishes it (the kernels are built without flush-to-zero); the sign goes to bit 31.
__device__ inline float e2m1_value(uint32_t code) {
  return __uint_as_float(((code & 7u) << 22) | ((code & 8u) << 28)) * 0x1p126f;
}

// y[r, :] = W · x[r, :] for r < x_rows ≤ 4, W in NVFP4 with cols a multiple of 32 and codes 16-byte aligned; x 16-byte
// aligned. Returns false (nothing launched) when the matrix does not meet that.
bool nvfp4_gemv(const DeviceMatrix& w, const float* x, int x_rows, float* y, cudaStream_t stream);

}  // namespace vavilov::cuda
