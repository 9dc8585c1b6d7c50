#pragma once
// The quantized GEMV's tensor-core building blocks (Q4/Q3/Q2 codes decoded to fp16 in registers, activations split
// exactly into fp16 halves, mma m16n8k16), shared by the generic GEMV (gemv.cu) and the kernels that fuse a product
// with its neighbours. Everything here is device code of one warp or one block; the work split lives with each kernel.
// Q4 products of 1–2 rows take the integer path of quant_imma.cuh instead, with the same loads and unit loop.
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/gemv.cuh"

namespace vavilov::cuda::qmma {

// Tuning knob of the quantized kernels (set with -D in a variant build, compared by bench/cuda/run.sh); the default is
// the measured best.
#ifndef VAVILOV_GEMV_UNROLL
#define VAVILOV_GEMV_UNROLL 4
#endif
constexpr int kUnroll = VAVILOV_GEMV_UNROLL;  // groups of 64 columns whose loads a warp issues together
constexpr int kTileRows = 16;                 // rows of one tensor-core tile (mma m16n8k16)
constexpr int kMaxWarps = 16;                 // warps of one block
static_assert(kUnroll % 4 == 0, "scales and biases are loaded four groups at a time");

// ---------------------------------------------------------------------------------------------------------------
// Quantized GEMV on the tensor cores.
//
// Work split: a warp owns 16 consecutive rows (one mma tile) and walks along its slice of their columns (all of them,
// or a run of whole kUnroll-group units when gemv_quant_split cuts rows into slices) in groups of 64. In a group, lane
// (g, t) = (lane / 4, lane % 4) holds the 16 columns 16t..16t+15 of rows g and g + 8, which is exactly what the mma A
// fragment asks of that lane once the reduction index k is permuted: a dot product may sum its terms in any order, so
// k-slot → column is free as long as A (weights) and B (activations) use the same map. The codes of one row and group
// therefore arrive as one 8-byte load per lane (Q4), whole 32-byte sectors per row.
//
// Exactness: the activations are fp32; each group of 64 is scaled by a power of two into [2^14, 2^15) and split into
// hi + lo fp16 halves (22 significant bits: error ≤ 2^-22 |x| + 2^-39 · the group's peak). The mma's
// n = 8 columns are (batch row b, half s) at n = 2b + s, so lane t's accumulators c0 + c1 (row g) and c2 + c3
// (row g + 8) are batch row t's dot products with the group's codes. The affine terms follow in fp32:
// Σ (s·q + z)·x = s·2^e·Σ q·x' + z·Σ x.
//
// Code decoding: a register holds two columns ("a pair") in its low and high fp16 halves. One LOP3 ORs the codes at
// bit p of each half into the mantissa of 1024.0h, which gives 1024 + q·2^p exactly; one fp16 subtract (p = 0) or
// fused multiply-add by 2^-p, -1024·2^-p recovers q. pair_column says which of a lane's 16 columns the halves hold.
// (Masking alone, reading q·2^(p-24) as an fp16 subnormal, saves the fp16 op but measured 10-50x less accurate on
// the H200's tensor cores: docs/CUDA-KERNELS.md.)

__host__ __device__ constexpr int pair_column(int bits, int pair, int high) {
  return bits == 4 ? (pair / 4) * 8 + pair % 4 + 4 * high : pair + 8 * high;
}

__device__ inline uint32_t as_bits(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
__device__ inline __half2 as_half2(uint32_t u) { return *reinterpret_cast<__half2*>(&u); }

// fp16 bit pattern of ±2^k in both halves.
__host__ __device__ constexpr uint32_t half2_pow2(int k, bool negative = false) {
  const uint32_t h = (negative ? 0x8000u : 0u) | uint32_t(k + 15) << 10;
  return h | h << 16;
}

template <int Shift, uint32_t Mask>
__device__ inline uint32_t decode_pair(uint32_t word) {
  static_assert((Mask & 0xFC00FC00u) == 0 && (Mask & (0x00010001u << Shift)) != 0, "codes at bit Shift of a mantissa");
  uint32_t biased;  // (word & Mask) | 1024.0h in one LOP3
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(biased) : "r"(word), "n"(Mask), "n"(0x64006400u));
  if constexpr (Shift == 0) return as_bits(__hsub2(as_half2(biased), as_half2(half2_pow2(10))));
  return as_bits(__hfma2(as_half2(biased), as_half2(half2_pow2(-Shift)), as_half2(half2_pow2(10 - Shift, true))));
}

// The raw words of lane t's 16 columns of `group` in one row: Q4 two words; Q3 the 48 bits at bit 48t of the
// group's 6 words (in two words, shifted in decode); Q2 one word.
template <int Bits>
__device__ inline uint2 load_codes(const uint32_t* row, int group, int t) {
  if constexpr (Bits == 4) return __ldg(reinterpret_cast<const uint2*>(row + 8 * group + 2 * t));
  if constexpr (Bits == 2) return make_uint2(__ldg(row + 4 * group + t), 0u);
  const uint32_t* p = row + 6 * group + (3 * t) / 2;
  return make_uint2(__ldg(p), __ldg(p + 1));
}

// The 16 codes of load_codes as 8 half2 registers, register p holding columns pair_column(Bits, p, 0 / 1).
template <int Bits>
__device__ inline void decode(uint2 raw, int t, uint32_t (&h)[8]) {
  if constexpr (Bits == 4) {
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      const uint32_t word = w ? raw.y : raw.x, shifted = word >> 8;
      h[4 * w + 0] = decode_pair<0, 0x000F000Fu>(word);
      h[4 * w + 1] = decode_pair<4, 0x00F000F0u>(word);
      h[4 * w + 2] = decode_pair<0, 0x000F000Fu>(shifted);
      h[4 * w + 3] = decode_pair<4, 0x00F000F0u>(shifted);
    }
  } else if constexpr (Bits == 2) {
    const uint32_t word = raw.x, shifted = word >> 10;  // codes 0..7 in the low half, 8..15 in the high half
    h[0] = decode_pair<0, 0x00030003u>(word);
    h[1] = decode_pair<2, 0x000C000Cu>(word);
    h[2] = decode_pair<4, 0x00300030u>(word);
    h[3] = decode_pair<6, 0x00C000C0u>(word);
    h[4] = decode_pair<8, 0x03000300u>(word);
    h[5] = decode_pair<0, 0x00030003u>(shifted);
    h[6] = decode_pair<2, 0x000C000Cu>(shifted);
    h[7] = decode_pair<4, 0x00300030u>(shifted);
  } else {
    // Code k at bit 3k of v. Registers with codes k in the low half and k + 8 (24 bits further) in the high half.
    const uint64_t v = ((uint64_t(raw.y) << 32) | raw.x) >> (16 * (t & 1));
    const uint32_t low = (uint32_t(v) & 0xFFFFu) | (uint32_t(v >> 8) & 0xFFFF0000u);          // codes 0..4, 8..12
    const uint32_t high = (uint32_t(v >> 15) & 0xFFFFu) | (uint32_t(v >> 23) & 0xFFFF0000u);  // codes 5..7, 13..15
    const uint32_t low_shifted = low >> 9;                                                    // codes 3, 4, 11, 12
    h[0] = decode_pair<0, 0x00070007u>(low);
    h[1] = decode_pair<3, 0x00380038u>(low);
    h[2] = decode_pair<6, 0x01C001C0u>(low);
    h[3] = decode_pair<0, 0x00070007u>(low_shifted);
    h[4] = decode_pair<3, 0x00380038u>(low_shifted);
    h[5] = decode_pair<0, 0x00070007u>(high);
    h[6] = decode_pair<3, 0x00380038u>(high);
    h[7] = decode_pair<6, 0x01C001C0u>(high);
  }
}

__device__ inline void mma_f16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                               uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Shared memory of one block: the activation fragments, then per (batch row, group) the sum of
// the group's activations and the power of two that undoes their scaling, then kUnroll entries of padding.
//   fragments[(group·2 + half)·8B + lane] (uint4): B-fragment registers of two mma steps for lane (g, t), g < 2B.
// The padding: ptxas reads the terms of a unit's groups two at a time (one LDS.128 for groups u and u + 1, issued once
// group u is known to be in range), so the last row's read may reach one entry past its last group; compute-sanitizer
// flagged that read past the allocation (gemv_quant_rounds_kernel<4, 1>, session 8). Its value is never used.
__host__ __device__ constexpr size_t quant_shared_bytes(int groups, int batch) {
  return size_t(groups) * batch * (2 * 8 * sizeof(uint4) + sizeof(float2)) + kUnroll * sizeof(float2);
}

// The peak |x| and the sum of one (batch row, group) item's 64 activations, from the 16 of each of its four lanes
// (consecutive lanes, calling together with the whole warp: shuffles); the sum in the same order in every kernel.
__device__ inline float2 group_peak_and_sum(const float (&x)[16]) {
  float peak = 0.0f, sum = 0.0f;
#pragma unroll
  for (int i = 0; i < 16; ++i) peak = fmaxf(peak, fabsf(x[i])), sum += x[i];
#pragma unroll
  for (int offset = 1; offset < 4; offset <<= 1) {
    peak = fmaxf(peak, __shfl_xor_sync(0xffffffffu, peak, offset));
    sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  }
  return make_float2(peak, sum);
}

// Lane t's 16 columns x of one (batch row, group) item as fp16 hi and lo halves, registers p holding columns
// pair_column(Bits, p, 0 / 1), and the item's terms: the sum of the group's activations and the power of two that
// undoes their scaling. The four lanes t of an item are consecutive lanes and call this together (shuffles), as do
// all lanes of the warp.
template <int Bits>
__device__ inline float2 split_activations(const float (&x)[16], uint32_t (&hi)[8], uint32_t (&lo)[8]) {
  const auto [peak, sum] = group_peak_and_sum(x);
  // Scale the group's peak into [2^14, 2^15): inside fp16's range, and lo stays a normal number for |x'| ≥ 1/8.
  // Both 2^-e and 2^e stay normal floats for every finite peak.
  const int peak_exponent = int((__float_as_uint(peak) >> 23) & 0xffu) - 127;
  const int exponent = peak > 0.0f ? min(max(peak_exponent - 14, -126), 113) : 0;
  const float down = __uint_as_float(uint32_t(127 - exponent) << 23);
#pragma unroll
  for (int p = 0; p < 8; ++p) {
    const float first = x[pair_column(Bits, p, 0)] * down, second = x[pair_column(Bits, p, 1)] * down;
    const __half2 h = __floats2half2_rn(first, second);
    const float2 rounded = __half22float2(h);
    hi[p] = as_bits(h);
    lo[p] = as_bits(__floats2half2_rn(first - rounded.x, second - rounded.y));
  }
  return make_float2(sum, __uint_as_float(uint32_t(127 + exponent) << 23));
}

// The staging of activations into mma B fragments (the layout the comment above describes), by thread `index` of
// `count` (whole warps, every one of them calling): items index, index + count, ... . load(b, group, t, x) fills x
// with columns 16t..16t+15 of `group` for batch row b (activations read from memory, or computed on the fly: a norm,
// an activation function, a sum of partial products).
template <int Bits, int B, typename Load>
__device__ void stage_fragments(int groups, const Load& load, uint4* fragments, float2* group_terms, int index,
                                int count) {
  // item = (group, batch row, lane column t): divided by the constant B, not by the run-time group count, so that no
  // integer division sits between a kernel's wait and its first activation loads (same items, same values).
  const int items = B * groups * 4;
  for (int base = 0; base < items; base += count) {  // uniform trip count: the shuffles need all
    const int item = base + index, t = item & 3, group = (item >> 2) / B, b = (item >> 2) % B;
    const bool active = item < items;
    float x[16] = {};
    if (active) load(b, group, t, x);
    uint32_t hi[8], lo[8];
    const float2 terms = split_activations<Bits>(x, hi, lo);
    if (!active) continue;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      uint4* entry = fragments + (size_t(group) * 2 + half) * 8 * B + 4 * (2 * b) + t;
      entry[0] = make_uint4(hi[4 * half], hi[4 * half + 1], hi[4 * half + 2], hi[4 * half + 3]);
      entry[4] = make_uint4(lo[4 * half], lo[4 * half + 1], lo[4 * half + 2], lo[4 * half + 3]);
    }
    if (t == 0) group_terms[b * groups + group] = terms;
  }
}

// Columns 16t..16t+15 of `group` of m's activation row b.
__device__ inline void load_activations(const GemvMatrix& m, int b, int group, int t, float (&x)[16]) {
  const float4* source = reinterpret_cast<const float4*>(m.x + size_t(b) * m.cols + group * kQuantGroup + 16 * t);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 v = __ldg(source + i);
    x[4 * i] = v.x, x[4 * i + 1] = v.y, x[4 * i + 2] = v.z, x[4 * i + 3] = v.w;
  }
}

// Activations a kernel computes on the fly (load as for stage_fragments), staged by the whole block.
template <int Bits, int B, typename Load>
__device__ void stage_computed_activations(int groups, const Load& load, uint4* fragments, float2* group_terms) {
  stage_fragments<Bits, B>(groups, load, fragments, group_terms, threadIdx.x, blockDim.x);
}

// What one warp loads for kUnroll groups: codes of rows g and g + 8 of its tile, and the groups' scales and biases,
// lane t holding those of (t = 0: scales of row g, 1: scales of row g + 8, 2: biases of row g, 3: biases of g + 8).
struct WarpLoads {
  uint2 codes[kUnroll][2];
  uint32_t affine[kUnroll / 2];  // bf16 pairs: groups 2i and 2i + 1
};

// How the scale and bias rows may be read: 8 bytes (four groups) at a time, 4, or 2.
enum class AffineWidth { k8, k4, k2 };

__device__ inline AffineWidth affine_width(const GemvMatrix& m, int groups) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(m.scales) | reinterpret_cast<uintptr_t>(m.biases);
  if (groups % 4 == 0 && address % 8 == 0) return AffineWidth::k8;
  if (groups % 2 == 0 && address % 4 == 0) return AffineWidth::k4;
  return AffineWidth::k2;
}

// Loads groups [first_group, first_group + kUnroll) ∩ [.., end); first_group is a multiple of kUnroll. What lies past
// end is left as it was: tile_products never reads it (no zeroing of registers nobody reads).
template <int Bits>
__device__ inline void load_group_block(WarpLoads& loads, const uint32_t* const (&codes)[2],
                                        const __nv_bfloat16* affine, int first_group, int end, AffineWidth width,
                                        int t) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      if (first_group + u < end) loads.codes[u][r] = load_codes<Bits>(codes[r], first_group + u, t);
  const __nv_bfloat16* source = affine + first_group;
#pragma unroll
  for (int i = 0; i < kUnroll / 2; ++i) {
    const int group = first_group + 2 * i;
    if (width == AffineWidth::k8) {
      if (i % 2 == 1 || group >= end) continue;
      const uint2 four = __ldg(reinterpret_cast<const uint2*>(source + 2 * i));
      loads.affine[i] = four.x;
      loads.affine[i + 1] = four.y;
      continue;
    }
    if (width == AffineWidth::k4) {
      if (group < end) loads.affine[i] = __ldg(reinterpret_cast<const uint32_t*>(source + 2 * i));
      continue;
    }
    const unsigned short* halves = reinterpret_cast<const unsigned short*>(source + 2 * i);
    if (group + 1 < end)
      loads.affine[i] = __ldg(halves) | uint32_t(__ldg(halves + 1)) << 16;
    else if (group < end)
      loads.affine[i] = __ldg(halves);
  }
}

__device__ inline float bf16_low(uint32_t pair) { return __uint_as_float(pair << 16); }
__device__ inline float bf16_high(uint32_t pair) { return __uint_as_float(pair & 0xFFFF0000u); }

// The columns of a matrix are cut into `slices` runs of whole kUnroll-group units (so that every slice starts at an
// aligned group); slice k starts at slice_start(k).
__device__ inline int slice_start(int k, int slices, int groups) {
  const int units = (groups + kUnroll - 1) / kUnroll;
  return min(k * units / slices * kUnroll, groups);
}

// The unit loop of a warp's tile: scales and biases shared to the quad, group_products(u, group, scale_bias) for each
// group of [begin, end) in order, and each unit's loads issued at the previous unit's top into `current`. PartialApart:
// the whole units in a loop of their own and the partial one after it (the same work; ptxas then allocates the loop
// differently, faster at 2–4 rows and slower at one: docs/CUDA-KERNELS.md).
template <int Bits, bool PartialApart, typename GroupProducts>
__device__ inline void walk_units(WarpLoads& current, const uint32_t* const (&codes)[2], const __nv_bfloat16* affine,
                                  AffineWidth width, int begin, int end, const GroupProducts& group_products) {
  const int lane = threadIdx.x % 32;
  // The bf16 pairs of groups 2·pair and 2·pair + 1 from the lanes that loaded them: scale row g, scale row g + 8, bias
  // g, bias g + 8.
  const auto share_affine = [&](int pair, uint32_t(&scale_bias)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) scale_bias[i] = __shfl_sync(0xffffffffu, current.affine[pair], (lane & ~3) | i);
  };
  // A whole unit's groups run with no exit between them, so that the compiler may overlap one group's decoding and mma
  // chain with the next's (an exit after each group kept them one after another: docs/CUDA-KERNELS.md).
  const auto whole_unit = [&](int first) {
    uint32_t scale_bias[kUnroll / 2][4];
#pragma unroll
    for (int pair = 0; pair < kUnroll / 2; ++pair) share_affine(pair, scale_bias[pair]);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) group_products(u, first + u, scale_bias[u / 2]);
  };
  const auto partial_unit = [&](int first) {
    uint32_t scale_bias[kUnroll / 2][4];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (first + u >= end) break;
      if (u % 2 == 0) share_affine(u / 2, scale_bias[u / 2]);
      group_products(u, first + u, scale_bias[u / 2]);
    }
  };
  // All of a unit's loads go out at the previous unit's top (issued group by group into `current`'s registers instead,
  // with no copy, the step measured 3-5 % slower: docs/CUDA-KERNELS.md).
  if constexpr (!PartialApart) {
    for (int first = begin; first < end; first += kUnroll) {
      WarpLoads next;
      load_group_block<Bits>(next, codes, affine, first + kUnroll, end, width, lane % 4);
      if (first + kUnroll <= end)
        whole_unit(first);
      else
        partial_unit(first);
      current = next;
    }
  } else {
    int first = begin;
    for (; first + kUnroll <= end; first += kUnroll) {
      WarpLoads next;
      load_group_block<Bits>(next, codes, affine, first + kUnroll, end, width, lane % 4);
      whole_unit(first);
      current = next;
    }
    partial_unit(first);
  }
}

// Σ over groups [begin, end) of one warp's tile: acc[r] = row g + 8r's product with batch row t (lane (g, t), t < B;
// the accumulators of lanes t ≥ B hold sums that mean nothing).
template <int Bits, int B>
__device__ inline void tile_products(WarpLoads& current, const uint32_t* const (&codes)[2], const __nv_bfloat16* affine,
                                     AffineWidth width, int begin, int end, int groups, const uint4* fragments,
                                     const float2* group_terms, float (&acc)[2]) {
  const int lane = threadIdx.x % 32, t = lane % 4;
  // Lanes past the batch's B columns (lane ≥ 8B: columns n ≥ 2B) and terms (t ≥ B) read the last batch row's instead
  // of zeros: they only feed the accumulators of lanes t ≥ B, which no caller reads, and no predicate or zeroing is
  // left in the loop.
  const uint4* b_lane = fragments + min(lane, 8 * B - 1);
  const float2* terms_row = group_terms + min(t, B - 1) * groups;
  // Group u of the current unit: the mma over its 64 columns, then the affine terms into acc in group order.
  const auto group_products = [&](int u, int group, const uint32_t(&scale_bias)[4]) {
    const uint4 b_fragment[2] = {b_lane[(group * 2) * 8 * B], b_lane[(group * 2 + 1) * 8 * B]};
    const float2 terms = terms_row[group];
    uint32_t a0[8], a1[8];
    decode<Bits>(current.codes[u][0], t, a0);
    decode<Bits>(current.codes[u][1], t, a1);
    float c[4] = {};
    mma_f16(c, a0[0], a1[0], a0[1], a1[1], b_fragment[0].x, b_fragment[0].y);
    mma_f16(c, a0[2], a1[2], a0[3], a1[3], b_fragment[0].z, b_fragment[0].w);
    mma_f16(c, a0[4], a1[4], a0[5], a1[5], b_fragment[1].x, b_fragment[1].y);
    mma_f16(c, a0[6], a1[6], a0[7], a1[7], b_fragment[1].z, b_fragment[1].w);
    const auto pick = [&](uint32_t pair) { return u % 2 ? bf16_high(pair) : bf16_low(pair); };
    acc[0] = fmaf(c[0] + c[1], pick(scale_bias[0]) * terms.y, fmaf(pick(scale_bias[2]), terms.x, acc[0]));
    acc[1] = fmaf(c[2] + c[3], pick(scale_bias[1]) * terms.y, fmaf(pick(scale_bias[3]), terms.x, acc[1]));
  };
  walk_units<Bits, B != 1>(current, codes, affine, width, begin, end, group_products);
}

}  // namespace vavilov::cuda::qmma
