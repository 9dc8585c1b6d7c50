#pragma once
// Q4 products on the integer tensor cores: the codes as unsigned bytes, the activations as signed-byte digits, mma
// m16n8k32 with exact s32 sums. The work split, the weight loads (WarpLoads, load_group_block) and the affine terms are
// quant_mma.cuh's; what differs is the arithmetic of a group, which takes about half the instructions of the fp16 path:
// a code needs one mask (and, for the odd ones, a shift) per four instead of a LOP3 and an fp16 op per two, and two mma
// cover a group's 64 columns for up to two batch rows.
//
// Activations: each group of 64 values of a batch row is scaled by a power of two so that its peak lies in
// [2^21, 2^22) and rounded to an integer X (error ≤ 1/2: 2^-22 of the group's peak), written as three digits
// X = d0 + d1·2^8 + d2·2^16 with d0, d1 signed bytes and |d2| ≤ 65. A column's sum over a group, Σ q·d ≤ 64·15·128, is
// exact in s32 and far inside ±2^22, so it is read as a float without a conversion: the mma adds it to 0x4B400000,
// whose float is 1.5·2^23 + the sum exactly.
//
// B fragments: column tile j (of imma_column_tiles(B)) holds batch rows 2j and 2j + 1, column n = 4·(b % 2) + digit
// (columns 3 and 7 unused). Lane (g, t)'s accumulators (columns 2t and 2t + 1) therefore all belong to batch row
// 2j + t/2: digits 0 and 1 when t is even, digit 2 when it is odd. The k-slot → column map follows the codes: in step s
// (of two a group), A register a0/a1 (k = 4t..4t+3) holds columns 8s + 0, 2, 4, 6 of lane t's 16 (the low nibbles of
// its code word s) and a2/a3 (k = 16 + 4t..) columns 8s + 1, 3, 5, 7 (the high nibbles); B's k-rows 4t.. are held by
// the lanes of the same t, so the staging puts the same columns there.
#include "cuda/quant_mma.cuh"

namespace vavilov::cuda::qmma {

__host__ __device__ constexpr int imma_column_tiles(int batch) { return (batch + 1) / 2; }

// Shared memory of one block: per group and column tile 32 lanes' B fragments (uint4: two steps × b0, b1), then per
// (batch row, group) the group's sum and the power of two that undoes its scaling, then padding as in
// quant_shared_bytes.
__host__ __device__ constexpr size_t imma_shared_bytes(int groups, int batch) {
  return size_t(groups) * (imma_column_tiles(batch) * 32 * sizeof(uint4) + batch * sizeof(float2)) +
         kUnroll * sizeof(float2);
}

// Where the terms start behind the fragments (in uint4).
__host__ __device__ constexpr size_t imma_terms_offset(int groups, int batch) {
  return size_t(groups) * imma_column_tiles(batch) * 32;
}

// The low bytes of four integers as one word (first in the lowest byte).
__device__ inline uint32_t pack_low_bytes(int a, int b, int c, int d) {
  return __byte_perm(__byte_perm(a, b, 0x0040), __byte_perm(c, d, 0x0040), 0x5410);
}

// Staging as stage_fragments (same items, same load callback, thread `index` of `count`, whole warps), into the digit
// fragments above.
template <int B, typename Load>
__device__ void stage_digits(int groups, const Load& load, uint4* fragments, float2* group_terms, int index,
                             int count) {
  constexpr int kTiles = imma_column_tiles(B);
  const int items = B * groups * 4;
  for (int base = 0; base < items; base += count) {  // uniform trip count: the shuffles need all
    const int item = base + index, t = item & 3, group = (item >> 2) / B, b = (item >> 2) % B;
    const bool active = item < items;
    float x[16] = {};
    if (active) load(b, group, t, x);
    const auto [peak, sum] = group_peak_and_sum(x);
    if (!active) continue;
    // The peak into [2^21, 2^22); 2^-e and 2^e stay normal floats.
    const int peak_exponent = int((__float_as_uint(peak) >> 23) & 0xffu) - 127;
    const int exponent = peak > 0.0f ? min(max(peak_exponent - 21, -126), 126) : 0;
    const float down = __uint_as_float(uint32_t(127 - exponent) << 23);
    int digit[3][16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      // Rounded to the nearest integer (ties to even) by adding 1.5·2^23, where a float's unit is 1: the same value as
      // __float2int_rn without its quarter-rate conversion.
      const int value = __float_as_int(fmaf(x[i], down, 12582912.0f)) - 0x4B400000;
      const int d0 = int(int8_t(value)), rest = (value - d0) >> 8, d1 = int(int8_t(rest));
      digit[0][i] = d0, digit[1][i] = d1, digit[2][i] = (rest - d1) >> 8;
    }
    uint4* tile = fragments + (size_t(group) * kTiles + b / 2) * 32 + 4 * (4 * (b % 2)) + t;
#pragma unroll
    for (int d = 0; d < 3; ++d) {
      const int(&c)[16] = digit[d];
      tile[4 * d] = make_uint4(pack_low_bytes(c[0], c[2], c[4], c[6]), pack_low_bytes(c[1], c[3], c[5], c[7]),
                               pack_low_bytes(c[8], c[10], c[12], c[14]), pack_low_bytes(c[9], c[11], c[13], c[15]));
    }
    if (t == 0) group_terms[b * groups + group] = make_float2(sum, __uint_as_float(uint32_t(127 + exponent) << 23));
  }
}

__device__ inline void mma_u8s8(int (&d)[4], const int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"
      : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]));
}

// The codes of one row's 16 columns (load_codes<4>) as bytes: [step][low / high nibbles].
__device__ inline void code_bytes(uint2 raw, uint32_t (&bytes)[2][2]) {
  bytes[0][0] = raw.x & 0x0F0F0F0Fu, bytes[0][1] = (raw.x >> 4) & 0x0F0F0F0Fu;
  bytes[1][0] = raw.y & 0x0F0F0F0Fu, bytes[1][1] = (raw.y >> 4) & 0x0F0F0F0Fu;
}

// What lane (g, t) reads and weighs in every group: its B-fragment column g (the unused columns 3 and 7, and the
// missing second row of an odd batch's last tile, read a used one: their accumulators are weighted by 0 or belong to no
// batch row), its batch row's terms in each column tile, its digits' weights (digits 0 and 1, or digit 2 and nothing)
// and its share of the bias term (even t only).
template <int B>
struct DigitLane {
  static constexpr int kTiles = imma_column_tiles(B);
  const uint4* fragments[kTiles];
  const float2* terms[kTiles];
  float weight0, weight1, bias_share;

  __device__ DigitLane(const uint4* staged, const float2* group_terms, int groups) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, column = (g & 3) == 3 ? g - 1 : g;
#pragma unroll
    for (int j = 0; j < kTiles; ++j) {
      const bool half = B % 2 == 1 && j == kTiles - 1;
      fragments[j] = staged + j * 32 + 4 * (half ? column & 3 : column) + t;
      terms[j] = group_terms + min(2 * j + t / 2, B - 1) * groups;
    }
    weight0 = t & 1 ? 65536.0f : 1.0f, weight1 = t & 1 ? 0.0f : 256.0f, bias_share = t & 1 ? 0.0f : 1.0f;
  }
};

// One group of a 16-row tile: rows g and g + 8 (their codes as load_codes<4> returns them, their scales and biases)
// times the group's digits, added into sums[column tile][row].
template <int B>
__device__ inline void digit_group(const DigitLane<B>& lane, int group, uint2 codes0, uint2 codes1,
                                   const float (&scale)[2], const float (&bias)[2],
                                   float (&sums)[DigitLane<B>::kTiles][2]) {
  constexpr int kTiles = DigitLane<B>::kTiles;
  constexpr int kMagic = 0x4B400000;  // 1.5·2^23 as a float
  const int magic[4] = {kMagic, kMagic, kMagic, kMagic};
  uint32_t row0[2][2], row1[2][2];
  code_bytes(codes0, row0);
  code_bytes(codes1, row1);
#pragma unroll
  for (int j = 0; j < kTiles; ++j) {
    const uint4 b = lane.fragments[j][size_t(group) * kTiles * 32];
    int c[4];
    mma_u8s8(c, magic, row0[0][0], row1[0][0], row0[0][1], row1[0][1], b.x, b.y);
    mma_u8s8(c, c, row0[1][0], row1[1][0], row0[1][1], row1[1][1], b.z, b.w);
    const float2 terms = lane.terms[j][group];
    const float f0 = lane.weight0 * terms.y, f1 = lane.weight1 * terms.y, share = lane.bias_share * terms.x;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float low = __int_as_float(c[2 * r]) - 12582912.0f, high = __int_as_float(c[2 * r + 1]) - 12582912.0f;
      sums[j][r] = fmaf(fmaf(high, f1, low * f0), scale[r], fmaf(bias[r], share, sums[j][r]));
    }
  }
}

// Each batch row's total from its two lanes (t = 2·(b % 2) and the next), to lane t = b: acc[r] += it.
template <int B>
__device__ inline void digit_totals(const float (&sums)[DigitLane<B>::kTiles][2], float (&acc)[2]) {
  constexpr int kTiles = DigitLane<B>::kTiles;
  const int lane = threadIdx.x % 32, t = lane % 4, source = (lane & ~3) | (t & 1) << 1;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float total[kTiles];
#pragma unroll
    for (int j = 0; j < kTiles; ++j) {
      total[j] = sums[j][r] + __shfl_xor_sync(0xffffffffu, sums[j][r], 1);
      total[j] = __shfl_sync(0xffffffffu, total[j], source);
    }
    acc[r] += kTiles == 1 || t < 2 ? total[0] : total[kTiles - 1];
  }
}

// tile_products (same loads, same contract: acc[r] += row g + 8r's product with batch row t for lanes t < B) on the
// digit fragments of stage_digits.
template <int B>
__device__ inline void tile_products_q4_digits(WarpLoads& current, const uint32_t* const (&codes)[2],
                                               const __nv_bfloat16* affine, AffineWidth width, int begin, int end,
                                               int groups, const uint4* fragments, const float2* group_terms,
                                               float (&acc)[2]) {
  const DigitLane<B> digits(fragments, group_terms, groups);
  float sums[DigitLane<B>::kTiles][2] = {};
  const auto group_products = [&](int u, int group, const uint32_t(&scale_bias)[4]) {
    const auto pick = [&](uint32_t pair) { return u % 2 ? bf16_high(pair) : bf16_low(pair); };
    const float scale[2] = {pick(scale_bias[0]), pick(scale_bias[1])};
    const float bias[2] = {pick(scale_bias[2]), pick(scale_bias[3])};
    digit_group<B>(digits, group, current.codes[u][0], current.codes[u][1], scale, bias, sums);
  };
  walk_units<4, false>(current, codes, affine, width, begin, end, group_products);
  digit_totals<B>(sums, acc);
}

// Where Q4 products take the digits: up to two batch rows (one column tile). At three and four the third digit needs
// a second tile, whose mma and epilogue cost more than the decoding saves (H200: the 3-draft step 3 % slower).
template <int Bits, int B>
constexpr bool kQ4Digits = Bits == 4 && B <= 2;

// The staged activations' bytes of a Bits-bit product of `groups` groups for `batch` rows.
__host__ __device__ constexpr size_t staged_bytes(int bits, int groups, int batch) {
  return bits == 4 && batch <= 2 ? imma_shared_bytes(groups, batch) : quant_shared_bytes(groups, batch);
}

// Where the group terms follow the fragments.
template <int Bits, int B>
__device__ inline float2* staged_terms(uint4* fragments, int groups) {
  const size_t offset = kQ4Digits<Bits, B> ? imma_terms_offset(groups, B) : size_t(groups) * 16 * B;
  return reinterpret_cast<float2*>(fragments + offset);
}

// Activations (load as for stage_fragments) staged by thread `index` of `count`, in the layout the products read.
template <int Bits, int B, typename Load>
__device__ void stage_for_products(int groups, const Load& load, uint4* fragments, float2* group_terms, int index,
                                   int count) {
  if constexpr (kQ4Digits<Bits, B>)
    stage_digits<B>(groups, load, fragments, group_terms, index, count);
  else
    stage_fragments<Bits, B>(groups, load, fragments, group_terms, index, count);
}

// tile_products on that layout.
template <int Bits, int B>
__device__ inline void staged_tile_products(WarpLoads& current, const uint32_t* const (&codes)[2],
                                            const __nv_bfloat16* affine, AffineWidth width, int begin, int end,
                                            int groups, const uint4* fragments, const float2* group_terms,
                                            float (&acc)[2]) {
  if constexpr (kQ4Digits<Bits, B>)
    tile_products_q4_digits<B>(current, codes, affine, width, begin, end, groups, fragments, group_terms, acc);
  else
    tile_products<Bits, B>(current, codes, affine, width, begin, end, groups, fragments, group_terms, acc);
}

}  // namespace vavilov::cuda::qmma
