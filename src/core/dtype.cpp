#include "core/dtype.h"

#include <immintrin.h>

#include <cmath>

namespace vavilov {

namespace {
struct NamedType {
  std::string_view name;
  DType dtype;
  size_t size;
};
constexpr NamedType kTypes[] = {
    {"F32", DType::F32, 4}, {"BF16", DType::BF16, 2}, {"F16", DType::F16, 2}, {"F8_E4M3", DType::F8_E4M3, 1},
    {"I64", DType::I64, 8}, {"I32", DType::I32, 4},   {"U32", DType::U32, 4}, {"U8", DType::U8, 1},
};
}  // namespace

std::string_view dtype_name(DType dtype) {
  for (const auto& t : kTypes)
    if (t.dtype == dtype) return t.name;
  return "?";
}

bool dtype_from_name(std::string_view name, DType& out) {
  for (const auto& t : kTypes)
    if (t.name == name) {
      out = t.dtype;
      return true;
    }
  return false;
}

size_t dtype_size(DType dtype) {
  for (const auto& t : kTypes)
    if (t.dtype == dtype) return t.size;
  return 0;
}

bool is_float(DType dtype) {
  return dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16 || dtype == DType::F8_E4M3;
}

float f16_to_f32(uint16_t bits) {
  uint32_t sign = uint32_t(bits & 0x8000) << 16;
  uint32_t exponent = (bits >> 10) & 0x1f;
  uint32_t mantissa = bits & 0x3ff;
  float magnitude;
  if (exponent == 0) {
    magnitude = std::ldexp(float(mantissa), -24);
  } else if (exponent == 31) {
    // Infinity, or a NaN that keeps its payload and is made quiet, as the F16C instruction does.
    uint32_t bits = sign | (mantissa ? 0x7FC00000u | (mantissa << 13) : 0x7F800000u);
    float special;
    std::memcpy(&special, &bits, 4);
    return special;
  } else {
    magnitude = std::ldexp(float(mantissa | 0x400), int(exponent) - 25);
  }
  uint32_t out;
  std::memcpy(&out, &magnitude, 4);
  out |= sign;
  float value;
  std::memcpy(&value, &out, 4);
  return value;
}

// OCP FP8 E4M3 (the "fn" variant): no infinities, S.1111.111 is NaN, bias 7.
float f8_e4m3_to_f32(uint8_t bits) {
  float sign = (bits & 0x80) ? -1.0f : 1.0f;
  int exponent = (bits >> 3) & 0xf;
  int mantissa = bits & 0x7;
  if (exponent == 0xf && mantissa == 0x7) return NAN;
  if (exponent == 0) return sign * std::ldexp(float(mantissa), -9);
  return sign * std::ldexp(float(8 + mantissa), exponent - 10);
}

void to_f32(DType dtype, const void* src, float* dst, size_t n) {
  switch (dtype) {
    case DType::F32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::BF16: {
      const auto* in = static_cast<const uint16_t*>(src);
      size_t i = 0;
      for (; i + 8 <= n; i += 8) {
        __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
        __m256i wide = _mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16);
        _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(wide));
      }
      for (; i < n; ++i) dst[i] = bf16_to_f32(in[i]);
      return;
    }
    case DType::F16: {
      const auto* in = static_cast<const uint16_t*>(src);
      size_t i = 0;
      for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
      for (; i < n; ++i) dst[i] = f16_to_f32(in[i]);
      return;
    }
    case DType::F8_E4M3: {
      const auto* in = static_cast<const uint8_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = f8_e4m3_to_f32(in[i]);
      return;
    }
    default:
      for (size_t i = 0; i < n; ++i) dst[i] = NAN;
  }
}

}  // namespace vavilov
