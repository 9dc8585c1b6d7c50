#pragma once
// Sums that many blocks add into without a launch to combine them, with the same bits in any order: each term is
// rounded to a multiple of 2^-kFixedFractionBits and added as a 64-bit integer (integer addition is associative, so
// the order in which blocks arrive does not change the result, unlike float atomics). Terms and sums must stay within
// ±2^(63 - kFixedFractionBits) = ±2^31; a term's rounding error is at most 2^-33, no more than a float's rounding at
// magnitudes of 2^-9 and above, and the reader rounds the sum to a float once.
#include <cstdint>

namespace vavilov::cuda {

constexpr int kFixedFractionBits = 32;

// `value` as a fixed-point term (two's complement: added as unsigned, it adds as signed).
__device__ __forceinline__ unsigned long long to_fixed(float value) {
  return static_cast<unsigned long long>(__float2ll_rn(value * 4294967296.0f));  // 2^kFixedFractionBits: exact
}

// Adds `value` into `sum` (a reduction: the result is not read back, so the warp does not wait for it).
__device__ __forceinline__ void add_fixed(unsigned long long* sum, float value) { atomicAdd(sum, to_fixed(value)); }

// A sum as the nearest float.
__device__ __forceinline__ float fixed_to_float(unsigned long long sum) {
  return __ll2float_rn(static_cast<long long>(sum)) * 2.3283064365386963e-10f;  // 2^-kFixedFractionBits: exact
}

static_assert(kFixedFractionBits == 32, "the constants above are 2^32 and 2^-32");

}  // namespace vavilov::cuda
