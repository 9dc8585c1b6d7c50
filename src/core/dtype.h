#pragma once
// Element types of stored tensors and their conversion to fp32 (all engine math is fp32).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace vavilov {

enum class DType { F32, BF16, F16, F8_E4M3, I64, I32, U32, U8 };

std::string_view dtype_name(DType dtype);
// Returns false for a name safetensors may use but we do not support.
bool dtype_from_name(std::string_view name, DType& out);
size_t dtype_size(DType dtype);
bool is_float(DType dtype);

inline float bf16_to_f32(uint16_t bits) {
  uint32_t widened = uint32_t(bits) << 16;
  float value;
  std::memcpy(&value, &widened, 4);
  return value;
}

// Round to nearest even, as torch does when casting fp32 to bf16.
inline uint16_t f32_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

float f16_to_f32(uint16_t bits);
float f8_e4m3_to_f32(uint8_t bits);

// Converts n elements of a float dtype to fp32.
void to_f32(DType dtype, const void* src, float* dst, size_t n);

}  // namespace vavilov
