// Conversions of stored element types to fp32, checked on bit patterns whose values the formats define.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "core/dtype.h"

namespace vavilov {
namespace {

TEST(Dtype, Float16) {
  EXPECT_EQ(f16_to_f32(0x3C00), 1.0f);
  EXPECT_EQ(f16_to_f32(0xC000), -2.0f);
  EXPECT_EQ(f16_to_f32(0x7BFF), 65504.0f);               // largest finite
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(f16_to_f32(0x3555), 0.333251953125f);
  EXPECT_TRUE(std::isinf(f16_to_f32(0x7C00)));
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7E00)));
  EXPECT_TRUE(std::signbit(f16_to_f32(0x8000)));
}

TEST(Dtype, Float8E4M3) {
  EXPECT_EQ(f8_e4m3_to_f32(0x38), 1.0f);                  // exponent bias 7
  EXPECT_EQ(f8_e4m3_to_f32(0xB8), -1.0f);
  EXPECT_EQ(f8_e4m3_to_f32(0x7E), 448.0f);                // largest finite (the fn variant has no infinity)
  EXPECT_EQ(f8_e4m3_to_f32(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(f8_e4m3_to_f32(0x3C), 1.5f);
  EXPECT_TRUE(std::isnan(f8_e4m3_to_f32(0x7F)));
  EXPECT_TRUE(std::isnan(f8_e4m3_to_f32(0xFF)));
}

TEST(Dtype, Bfloat16RoundsToNearestEven) {
  EXPECT_EQ(bf16_to_f32(0x3F80), 1.0f);
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3F80);  // halfway: ties to even (down)
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);  // halfway: ties to even (up)
  EXPECT_EQ(f32_to_bf16(1.0f + std::ldexp(1.0f, -7) + std::ldexp(1.0f, -9)), 0x3F81);
}

uint32_t bits_of(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  return bits;
}

// The vectorised paths agree bit for bit with the scalar ones, NaNs and infinities included.
TEST(Dtype, BulkConversionMatchesScalarOnes) {
  std::vector<uint16_t> halves(37), brains(37);
  for (size_t i = 0; i < halves.size(); ++i) {
    halves[i] = uint16_t(0x3000 + 977 * i);
    brains[i] = uint16_t(0x3E00 + 131 * i);
  }
  std::vector<float> out(37);
  to_f32(DType::F16, halves.data(), out.data(), out.size());
  for (size_t i = 0; i < out.size(); ++i) EXPECT_EQ(bits_of(out[i]), bits_of(f16_to_f32(halves[i]))) << i;
  to_f32(DType::BF16, brains.data(), out.data(), out.size());
  for (size_t i = 0; i < out.size(); ++i) EXPECT_EQ(bits_of(out[i]), bits_of(bf16_to_f32(brains[i]))) << i;
}

}  // namespace
}  // namespace vavilov
