#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/gdn_common.cuh"
#include "cuda/gemm.cuh"
#include "cuda/launch.cuh"

namespace vavilov::cuda {

namespace {

using namespace gdn;

constexpr int kC = kGdnChunk;  // tokens per chunk

// ---- Prefill: the chunk-parallel form ----------------------------------------------------------------------------
//
// Per value head and chunk of C = 64 tokens with normalised q_t, k_t, β_t, log decays g_t and their inclusive
// cumulative sums γ_t (γ_C: at the chunk's last token), and S₀ the state before the chunk, the recurrence unrolls to
//   S_t = e^{γ_t} S₀ + Σ_{s≤t} e^{γ_t−γ_s} k_s δ_sᵀ,
//   δ_t + β_t Σ_{s<t} e^{γ_t−γ_s}(k_t·k_s) δ_s = β_t (v_t − e^{γ_t} S₀ᵀ k_t),
// i.e. (I + A) Δ = diag(β)(V − diag(e^γ) K S₀) with A strictly lower triangular, A[t,s] = β_t e^{γ_t−γ_s} k_t·k_s, so
//   Δ = U − W S₀,  U = (I + A)⁻¹ diag(β) V,  W = (I + A)⁻¹ diag(β e^γ) K,
//   o_t = e^{γ_t} S₀ᵀ q_t + Σ_{s≤t} e^{γ_t−γ_s} (q_t·k_s) δ_s,
//   S_C = e^{γ_C} S₀ + Σ_s e^{γ_C−γ_s} k_s δ_sᵀ.
// Every exponent is ≤ 0 (γ falls), so nothing overflows. Three kernels: prepare (all chunks in parallel: A, then W and
// U by blocked forward substitution, plus P[t,s] = e^{γ_t−γ_s} q_t·k_s for s ≤ t, the normalised keys K of the key
// head, the factors e^{γ_C−γ} and the row factors of Qd = diag(e^γ) Q), scan (chunk after chunk per head and 64-column
// slice: Δ = U − W S, S ← e^{γ_C} S + Kᵀ diag(e^{γ_C−γ}) Δ, recording each chunk's S₀), outputs and gated norm (all
// chunks in parallel: O = Qd S₀ + P Δ).
//
// Every matrix product runs on tensor cores as 3×TF32: each fp32 operand x is split into a tf32 hi and lo = x − hi
// (split_tf32), and hi·hi + hi·lo + lo·hi is accumulated in fp32. The dropped lo·lo term and the truncation of lo are
// ~2⁻²⁰ relative, so the products keep fp32 accuracy (plain TF32, ~2⁻¹¹, would not meet the tests' 1e-4). In
// one-pass mode (GdnProducts::Tf32, the kernels' kOnePass) each operand is rounded to tf32 once instead and each
// product is one mma (a third of the tensor work, no split instructions); the error bound that gives is derived in
// tests/gpu/test_cuda_gdn.cpp.
// The bf16 mode (GdnProducts::Bf16, the *_bf16 kernels below) rounds each operand to bf16
// once (unit roundoff 2⁻⁹) for mma.sync m16n8k16 bf16 with fp32 accumulators, and keeps every value that is only a
// product operand (W, U and Δ, the keys and queries, P, S₀) as bf16 in the scratch; the state across chunks stays in
// fp32 registers, the gates, decays, norms and exponentials in fp32 (its error bound: tests/gpu/test_cuda_gdn.cpp).
// Tiles are 16 × 16 (k-steps of 8); shared-memory tiles are zero-padded to multiples of 16 and their row strides are
// a multiple of 16 plus 4 floats, so the fragment loads (one 32-bit word a lane, rows 4 banks apart) are free of bank
// conflicts.

constexpr int kTile = 16;
constexpr int kStep = 8;                         // the k extent of one tf32 mma
constexpr int kChunkStride = kC + 4;             // row stride of [C][C] tiles
constexpr int kSliceStride = kSliceColumns + 4;  // row stride of [..][32] slice tiles

// The kernels are compiled twice: for the release's head dimensions (dk = dv = 128) as constants, so that every
// stride and k-loop bound is known to the compiler (immediate offsets, unrolled loops), and for any shape.
constexpr int kReleaseDim = 128;
__host__ __device__ inline bool is_release(const GdnShape& s) { return s.dk == kReleaseDim && s.dv == kReleaseDim; }
template <bool kRelease>
__device__ inline GdnShape fixed(GdnShape s) {
  if constexpr (kRelease) s.dk = s.dv = kReleaseDim;
  return s;
}

__host__ __device__ inline int padded(int width) { return (width + kTile - 1) / kTile * kTile; }
__host__ __device__ inline int stride_of(int width) { return padded(width) + 4; }
// The row stride of a tile read as a row-major B or a column-major A operand: a lane (g, t) reads row t (t + 4) at
// column g there, so rows must be 8 (or 24) banks apart; 16k + 4 would put rows t and t + 1 four banks apart and two
// lanes on every bank.
__host__ __device__ inline int operand_stride_of(int width) { return padded(width) + 8; }

// ---- 16 × 16 tiles on the tensor cores: mma.sync m16n8k8 (tf32 in, fp32 accumulators), two 8-column halves ----
//
// The fragments are loaded with plain shared-memory loads in the PTX ISA's m16n8k8 layouts (lane = 4g + t holds A
// rows g, g + 8 at columns t, t + 4; B rows t, t + 4 at column g; C rows g, g + 8 at columns 2t, 2t + 1). WMMA's
// fragment loads take generic pointers: every one became a generic load with 64-bit address arithmetic, and its
// m16n16k8 tf32 mma two m16n8k4 instructions.
struct RowMajor {};  // element (r, c) at r·ld + c
struct ColMajor {};  // element (r, c) at c·ld + r

struct Accumulator {
  float x[8];  // x[4h + 2i + j]: row g + 8i, column 8h + 2t + j
};

__device__ inline void fill(Accumulator& c, float value) {
#pragma unroll
  for (int e = 0; e < 8; ++e) c.x[e] = value;
}

template <typename... Accumulators>
__device__ inline void zero(Accumulators&... accumulators) {
  (fill(accumulators, 0.0f), ...);
}

// A row-major tile at p (row stride ld) into c / from c.
__device__ inline void load_tile(Accumulator& c, const float* p, int ld) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
#pragma unroll
  for (int e = 0; e < 8; ++e) c.x[e] = p[(g + 8 * (e / 2 % 2)) * ld + 8 * (e / 4) + 2 * t + e % 2];
}
__device__ inline void store_tile(float* p, const Accumulator& c, int ld) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
#pragma unroll
  for (int e = 0; e < 8; ++e) p[(g + 8 * (e / 2 % 2)) * ld + 8 * (e / 4) + 2 * t + e % 2] = c.x[e];
}

// x as a tf32 hi (its low 13 mantissa bits cleared) and lo = x − hi (exact in fp32, |lo| < 2⁻¹⁰|x|). lo goes to the
// tensor cores as it is: they read the top 19 bits of an operand, so lo is truncated to tf32 there (error < 2⁻²⁰|x|).
struct Split {
  uint32_t hi, lo;
};
__device__ inline Split split_tf32(float x) {
  const uint32_t hi = __float_as_uint(x) & 0xffffe000u;
  return {hi, __float_as_uint(x - __uint_as_float(hi))};
}

// x rounded to the nearest tf32 (ties away from zero): relative error ≤ 2⁻¹¹, low 13 mantissa bits zero.
__device__ inline float round_tf32(float x) {
  uint32_t rounded;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(rounded) : "f"(x));
  return __uint_as_float(rounded);
}

// One operand word as the products take it. 3×TF32 (kOnePass false): split into hi and lo. One pass: rounded to tf32
// (lo unused), or passed as it is where its producer stored it rounded (kStored). Rounding a rounded word changes
// nothing, so a stored operand gives the products the same words as rounding at the load, bit for bit; but a
// rounding takes four instructions (cvt.rna.tf32 is an add, a finiteness test, a select and a mask on sm_90), and a
// tile's words are loaded by several warps and for several products: where every reader of a tile only feeds the
// products with it, its producer stores it rounded once (the scan's operands; in one-pass mode also the keys and
// queries of prepare's products, A and the diagonal blocks' inverses of the solve, P and the outputs' queries). S₀ and
// Δ, which only the outputs read, are not: storing them rounded slowed the scan (see docs/CUDA.md).
template <bool kOnePass, bool kStored = false>
__device__ inline Split operand(float x) {
  if constexpr (!kOnePass) return split_tf32(x);
  if constexpr (kStored) return {__float_as_uint(x), 0u};
  return {__float_as_uint(round_tf32(x)), 0u};
}

// What a producer of a kStored operand writes: in one-pass mode x rounded to tf32, else x.
template <bool kOnePass>
__device__ inline float stored_operand(float x) {
  if constexpr (kOnePass) return round_tf32(x);
  return x;
}

// The A operand of one k-step: the 16 × 8 tile at a (element (m, k) as Layout says), as `operand` takes it (kStored:
// the tile's producer stored it rounded, see stored_operand).
template <bool kOnePass, typename Layout, bool kStored = false>
__device__ inline void load_a(Split (&f)[4], const float* a, int lda) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int m = g + 8 * (e % 2), k = t + 4 * (e / 2);
    f[e] = operand<kOnePass, kStored>(std::is_same_v<Layout, RowMajor> ? a[m * lda + k] : a[k * lda + m]);
  }
}

// The B operand of one k-step: the 8 × 16 tile at b (element (k, n) as Layout says); f[h]: columns 8h….
template <bool kOnePass, typename Layout, bool kStored = false>
__device__ inline void load_b(Split (&f)[2][2], const float* b, int ldb) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int k = t + 4 * e, n = 8 * h + g;
      f[h][e] = operand<kOnePass, kStored>(std::is_same_v<Layout, RowMajor> ? b[k * ldb + n] : b[n * ldb + k]);
    }
}

// d[4h … 4h + 3] += A B_h for the A and B operand words given (one m16n8k8 tf32 mma).
__device__ inline void mma(float* d, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The products of one k-step for both column halves. 3×TF32: hi·hi to acc, lo·hi and hi·lo to the cross accumulators
// (their own dependency chains). One pass: hi·hi only, to acc.
template <bool kOnePass>
__device__ inline void mma_step(Accumulator& acc, Accumulator& lo_hi, Accumulator& hi_lo, const Split (&a)[4],
                                const Split (&b)[2][2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if constexpr (!kOnePass) {
      mma(lo_hi.x + 4 * h, a[0].lo, a[1].lo, a[2].lo, a[3].lo, b[h][0].hi, b[h][1].hi);
      mma(hi_lo.x + 4 * h, a[0].hi, a[1].hi, a[2].hi, a[3].hi, b[h][0].lo, b[h][1].lo);
    }
    mma(acc.x + 4 * h, a[0].hi, a[1].hi, a[2].hi, a[3].hi, b[h][0].hi, b[h][1].hi);
  }
}

// acc += the second chain of a product: 3×TF32's cross terms, or (one pass) the odd k-steps' sums (`odd`, passed as
// the first cross accumulator: a second chain of mma beside acc's; hi_lo is then unused).
template <bool kOnePass>
__device__ inline void add_chains(Accumulator& acc, const Accumulator& lo_hi_or_odd, const Accumulator& hi_lo) {
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    if constexpr (kOnePass)
      acc.x[e] += lo_hi_or_odd.x[e];
    else
      acc.x[e] += lo_hi_or_odd.x[e] + hi_lo.x[e];
  }
}

__device__ inline int a_offset(bool rows, int k, int ld) { return rows ? k * kStep : k * kStep * ld; }
__device__ inline int b_offset(bool rows, int k, int ld) { return rows ? k * kStep * ld : k * kStep; }

// acc += A B over `steps` k-steps of 8: A is 16 × 8·steps at a (layout LayoutA, stride lda), B is 8·steps × 16 at b
// (layout LayoutB, stride ldb); one warp. 3×TF32: the hi·hi products and the two kinds of cross terms go to three
// accumulators, so three chains of dependent mma run side by side instead of one three times as long. One pass: the
// even and odd k-steps form two chains (`steps` is even: every k extent here is a multiple of 16). kStoredA / kStoredB:
// that operand's producer stored it rounded (one pass: loaded as it is; stored_operand).
template <bool kOnePass, typename LayoutA, typename LayoutB, bool kStoredA = false, bool kStoredB = false>
__device__ inline void mma_tile(Accumulator& acc, const float* a, int lda, const float* b, int ldb, int steps) {
  constexpr bool a_rows = std::is_same_v<LayoutA, RowMajor>, b_rows = std::is_same_v<LayoutB, RowMajor>;
  Accumulator lo_hi, hi_lo;
  zero(lo_hi, hi_lo);
  if constexpr (kOnePass) {
#pragma unroll 2
    for (int k = 0; k < steps; k += 2)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        Split a_frag[4], b_frag[2][2];
        load_a<true, LayoutA, kStoredA>(a_frag, a + a_offset(a_rows, k + j, lda), lda);
        load_b<true, LayoutB, kStoredB>(b_frag, b + b_offset(b_rows, k + j, ldb), ldb);
        mma_step<true>(j == 0 ? acc : lo_hi, hi_lo, hi_lo, a_frag, b_frag);
      }
  } else {
#pragma unroll 4  // lets the fragment loads of later k-steps run ahead of the mma chains
    for (int k = 0; k < steps; ++k) {
      Split a_frag[4], b_frag[2][2];
      load_a<false, LayoutA>(a_frag, a + a_offset(a_rows, k, lda), lda);
      load_b<false, LayoutB>(b_frag, b + b_offset(b_rows, k, ldb), ldb);
      mma_step<false>(acc, lo_hi, hi_lo, a_frag, b_frag);
    }
  }
  add_chains<kOnePass>(acc, lo_hi, hi_lo);
}

// first += A₀ B and second += A₁ B (as mma_tile; A₀ at a0, A₁ at a1, one B): two independent tiles interleaved, B
// loaded (and split) once.
template <bool kOnePass, typename LayoutA, typename LayoutB, bool kStoredA = false, bool kStoredB = false>
__device__ inline void mma_tile_pair(Accumulator& first, Accumulator& second, const float* a0, const float* a1, int lda,
                                     const float* b, int ldb, int steps) {
  constexpr bool a_rows = std::is_same_v<LayoutA, RowMajor>, b_rows = std::is_same_v<LayoutB, RowMajor>;
  Accumulator lo_hi0, hi_lo0, lo_hi1, hi_lo1;
  zero(lo_hi0, hi_lo0, lo_hi1, hi_lo1);
#pragma unroll 2
  for (int k = 0; k < steps; ++k) {
    Split a0_frag[4], a1_frag[4], b_frag[2][2];
    load_b<kOnePass, LayoutB, kStoredB>(b_frag, b + b_offset(b_rows, k, ldb), ldb);
    load_a<kOnePass, LayoutA, kStoredA>(a0_frag, a0 + a_offset(a_rows, k, lda), lda);
    load_a<kOnePass, LayoutA, kStoredA>(a1_frag, a1 + a_offset(a_rows, k, lda), lda);
    mma_step<kOnePass>(first, lo_hi0, hi_lo0, a0_frag, b_frag);
    mma_step<kOnePass>(second, lo_hi1, hi_lo1, a1_frag, b_frag);
  }
  add_chains<kOnePass>(first, lo_hi0, hi_lo0);
  add_chains<kOnePass>(second, lo_hi1, hi_lo1);
}

// ---- k-paired operands: two k-steps from one 128-bit load a row --------------------------------------------------
//
// A sum over k does not change when A's columns and B's rows are permuted alike. Within each 16-wide block of k,
// lane (g, t) takes k = 4t + 2j and 4t + 2j + 1 as the slots t and t + 4 of k-step j (j = 0, 1): its B words of both
// steps are then B[4t … 4t + 3][column], one float4 when B is column-major (k-contiguous), and its A words are one
// float4 a k-step when A is stored in fragment order (below). Four 128-bit loads a pair of k-steps replace sixteen
// scalar ones. Rows of such tiles are 16 mod 32 floats apart: a quarter warp's eight 16-byte loads (rows g, g + 1,
// t = 0 … 3) then cover the 32 banks once. Only the scan reads such operands, and in one-pass mode their producers
// store them rounded to tf32 (stored_operand), so the loads take them as they are.
__host__ __device__ inline int pair_stride_of(int width) { return padded(width) + 16; }
constexpr int kPairK = 2 * kStep;  // the k extent of one pair of k-steps

// A in fragment order: within each 16-row tile, rows r and r + 8 interleave so that a lane's four A words of a
// k-step are one float4 (each word lands in the register the mma reads it from; a row-major float4 a row would need
// eight register moves a pair of k-steps to regroup). Row r of a tile group is in row pair p = 8·(r / 16) + r % 8
// (rows of the group's storage, stride ld ≡ 16 mod 32); in its k block b (16 wide) element (r, 4t + 2j + i) sits at
// 32b + 16j + 4t + 2i + (r / 8) % 2. a: the tile's first row pair, at its k block.
template <bool kOnePass>
__device__ inline void load_a_pair(Split (&f)[2][4], const float* a, int ld) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const float4 words = *reinterpret_cast<const float4*>(a + g * ld + 16 * j + 4 * t);
    f[j][0] = operand<kOnePass, true>(words.x);
    f[j][1] = operand<kOnePass, true>(words.y);
    f[j][2] = operand<kOnePass, true>(words.z);
    f[j][3] = operand<kOnePass, true>(words.w);
  }
}

// c stored in fragment order (as load_a_pair reads it) at a: its 16 columns are the k block's (stored_operand).
template <bool kOnePass>
__device__ inline void store_a_pair(float* a, const Accumulator& c, int ld) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h)  // column 8h + 2t + i of rows g, g + 8: k = 4(2h + t/2) + 2(t % 2) + i
    *reinterpret_cast<float4*>(a + g * ld + 16 * (t % 2) + 4 * (2 * h + t / 2)) =
        make_float4(stored_operand<kOnePass>(c.x[4 * h]), stored_operand<kOnePass>(c.x[4 * h + 2]),
                    stored_operand<kOnePass>(c.x[4 * h + 1]), stored_operand<kOnePass>(c.x[4 * h + 3]));
}
__host__ __device__ inline int pair_rows_stride_of(int width) { return 2 * padded(width) + 16; }
constexpr int kPairRows = kTile / 2;  // row pairs a tile

// B (16 × 16, column-major at b: element (k, n) at n·ldb + k) of k-steps j = 0, 1: f[j][h] for columns 8h ….
template <bool kOnePass>
__device__ inline void load_b_pair(Split (&f)[2][2][2], const float* b, int ldb) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float4 column = *reinterpret_cast<const float4*>(b + (8 * h + g) * ldb + 4 * t);
    f[0][h][0] = operand<kOnePass, true>(column.x);
    f[0][h][1] = operand<kOnePass, true>(column.y);
    f[1][h][0] = operand<kOnePass, true>(column.z);
    f[1][h][1] = operand<kOnePass, true>(column.w);
  }
}

// acc += A B (as mma_tile) over k = 16·pairs: A in fragment order at a, B column-major at b. One pass: k-step j of
// each pair goes to chain j.
template <bool kOnePass>
__device__ inline void mma_tile_kpaired(Accumulator& acc, const float* a, int lda, const float* b, int ldb, int pairs) {
  Accumulator lo_hi, hi_lo;
  zero(lo_hi, hi_lo);
#pragma unroll 4
  for (int k = 0; k < pairs; ++k) {
    Split a_frag[2][4], b_frag[2][2][2];
    load_a_pair<kOnePass>(a_frag, a + k * 2 * kPairK, lda);
    load_b_pair<kOnePass>(b_frag, b + k * kPairK, ldb);
#pragma unroll
    for (int j = 0; j < 2; ++j)
      mma_step<kOnePass>(kOnePass && j == 1 ? lo_hi : acc, lo_hi, hi_lo, a_frag[j], b_frag[j]);
  }
  add_chains<kOnePass>(acc, lo_hi, hi_lo);
}

// first += A B₀ and second += A B₁ (as mma_tile_kpaired; B₀ at b0, B₁ at b1, A loaded once).
template <bool kOnePass>
__device__ inline void mma_tile_pair_kpaired(Accumulator& first, Accumulator& second, const float* a, int lda,
                                             const float* b0, const float* b1, int ldb, int pairs) {
  Accumulator lo_hi0, hi_lo0, lo_hi1, hi_lo1;
  zero(lo_hi0, hi_lo0, lo_hi1, hi_lo1);
#pragma unroll 2
  for (int k = 0; k < pairs; ++k) {
    Split a_frag[2][4], b0_frag[2][2][2], b1_frag[2][2][2];
    load_a_pair<kOnePass>(a_frag, a + k * 2 * kPairK, lda);
    load_b_pair<kOnePass>(b0_frag, b0 + k * kPairK, ldb);
    load_b_pair<kOnePass>(b1_frag, b1 + k * kPairK, ldb);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      mma_step<kOnePass>(kOnePass && j == 1 ? lo_hi0 : first, lo_hi0, hi_lo0, a_frag[j], b0_frag[j]);
      mma_step<kOnePass>(kOnePass && j == 1 ? lo_hi1 : second, lo_hi1, hi_lo1, a_frag[j], b1_frag[j]);
    }
  }
  add_chains<kOnePass>(first, lo_hi0, hi_lo0);
  add_chains<kOnePass>(second, lo_hi1, hi_lo1);
}

// ---- bf16 operands (GdnProducts::Bf16): mma.sync m16n8k16 bf16, fp32 accumulators ----------------------------
//
// A k-step is 16 wide. Lane (g, t) holds A rows g, g + 8 at k = 2t, 2t + 1 and 2t + 8, 2t + 9 (four 32-bit registers of
// two bf16 each), B rows k = 2t, 2t + 1 and 2t + 8, 2t + 9 at column g, C as in the tf32 mma (Accumulator). Where an
// operand lies in shared memory as bf16 with k contiguous (every operand of the scan and the outputs), a 16 × 16 tile
// is one ldmatrix.x4 (k-major ones: the transposing ldmatrix); rows of such tiles are 16 mod 32 words apart
// (padded(width) + 8 elements), so the eight rows of each 8 × 8 matrix fall on distinct banks.
using bf16 = __nv_bfloat16;
__host__ __device__ inline int bf16_stride_of(int width) { return padded(width) + 8; }

// lo and hi rounded to bf16 (to nearest even) in one word, lo in the low half (the lower k or column).
__device__ inline uint32_t pack_bf16(float lo, float hi) {
  uint32_t word;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(word) : "f"(hi), "f"(lo));
  return word;
}
__device__ inline float low_bf16(uint32_t word) { return __uint_as_float(word << 16); }
__device__ inline float high_bf16(uint32_t word) { return __uint_as_float(word & 0xffff0000u); }

// d[0 … 3] += A B for one m16n8k16 bf16 step.
__device__ inline void mma_bf16(float* d, const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Both column halves of a 16 × 16 tile: acc += A B.
__device__ inline void mma_bf16_tile(Accumulator& acc, const uint32_t (&a)[4], const uint32_t (&b)[2][2]) {
  mma_bf16(acc.x, a, b[0][0], b[0][1]);
  mma_bf16(acc.x + 4, a, b[1][0], b[1][1]);
}

// Four 8 × 8 bf16 matrices from shared memory, as stored or transposed (`.trans`).
template <bool kTransposed = false>
__device__ inline void ldmatrix_x4(uint32_t (&r)[4], const bf16* p) {
  const unsigned address = unsigned(__cvta_generic_to_shared(p));
  if constexpr (kTransposed)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(address));
}

// A B operand's two column halves (f[h] for columns 8h …) from one ldmatrix.x4.
__device__ inline void b_halves(uint32_t (&f)[2][2], const uint32_t (&r)[4]) {
  f[0][0] = r[0];
  f[0][1] = r[1];
  f[1][0] = r[2];
  f[1][1] = r[3];
}

// The A operand of a 16 × 16 tile at a (bf16, rows m with k contiguous, row stride ld): lane i addresses row i % 16
// at k 8·(i / 16), so the four matrices are rows 0–7 / 8–15 at k 0–7, then at k 8–15 (a[0 … 3]).
__device__ inline void load_a_bf16(uint32_t (&f)[4], const bf16* a, int ld) {
  const int lane = threadIdx.x % 32;
  ldmatrix_x4(f, a + (lane % 16) * ld + 8 * (lane / 16));
}

// The B operand of a 16 (k) × 16 (n) tile stored n-major at b (bf16, rows n with k contiguous, row stride ld): f[h]
// for columns 8h …; lane i addresses row n = i % 8 + 8·(i / 16) at k 8·(i / 8 % 2).
__device__ inline void load_b_bf16(uint32_t (&f)[2][2], const bf16* b, int ld) {
  const int lane = threadIdx.x % 32;
  uint32_t r[4];
  ldmatrix_x4(r, b + (lane % 8 + 8 * (lane / 16)) * ld + 8 * (lane / 8 % 2));
  b_halves(f, r);
}

// tile[t][c] (row stride ld) for t < tile_rows, c < tile_width (a multiple of 4): source[t·source_stride + c]
// (asynchronously) where t < rows and c < width, zero elsewhere. Whole float4s when the source rows allow it. Each
// element has one owner thread, so restaging the same tile shape needs no barrier between the zero stores and the
// copies.
__device__ inline void stage_tile(float* tile, int ld, int tile_rows, int tile_width, const float* source,
                                  size_t source_stride, int rows, int width) {
  const bool vectors = width % 4 == 0 && source_stride % 4 == 0 && reinterpret_cast<uintptr_t>(source) % 16 == 0;
  if (vectors) {
    for (int e = 4 * threadIdx.x; e < tile_rows * tile_width; e += 4 * blockDim.x) {
      const int t = e / tile_width, c = e % tile_width;
      float* target = tile + t * ld + c;
      if (t < rows && c < width)
        __pipeline_memcpy_async(target, source + t * source_stride + c, 4 * sizeof(float));
      else
        *reinterpret_cast<float4*>(target) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    return;
  }
  for (int e = threadIdx.x; e < tile_rows * tile_width; e += blockDim.x) {
    const int t = e / tile_width, c = e % tile_width;
    if (t < rows && c < width)
      copy_async(tile + t * ld + c, source + t * source_stride + c);
    else
      tile[t * ld + c] = 0.0f;
  }
}

// Scratch regions, each [chunks][heads][...] but the keys ([chunks][key heads][...]: the key head's value heads share
// them; the scan scales Δ's rows by key_decay = e^{γ_C−γ_t} instead of storing Kd = diag(e^{γ_C−γ}) K for each value
// head, which wrote and read back 3× the bytes); U is overwritten by Δ in the scan. Qd is not stored: the outputs read
// the raw q rows (which the three value heads of a key head share, so mostly from L2) and scale the product Q S₀ by
// q_factor = e^{γ_t} / (‖q_t‖ √dk) row by row; that saves writing and reading back 4 · T · heads · dk bytes.
//
// progress [heads][scan slices]: how many chunks the scan block of (head, slice) has finished (S₀ and Δ stored).
// The prepare kernel zeroes it; the scan publishes it (release) and the outputs, which run beside the scan on the
// multiprocessors it leaves free, wait on it (acquire).
struct ChunkScratch {
  float *w, *u, *q_factor, *keys, *key_decay, *p, *s0, *decay;  // [C, dk], [C, dv], [C], [dk, C] (transposed), [C],
                                                                // [C, C], [dk, dv], [1]
  unsigned* progress;                                           // [heads][scan_slices]
  int scan_slices;
};

// The scan's blocks: a head's value columns in slices of 64 (see the scan kernel).
constexpr int kScanColumns = 64;
__host__ __device__ inline int scan_slices_of(const GdnShape& s) { return (s.dv + kScanColumns - 1) / kScanColumns; }

// In bf16 mode (GdnProducts::Bf16) the operand regions hold bf16 at padded widths (kdp = padded(dk), vdp =
// padded(dv); zero past dk and dv), so that every tile is staged in whole 16-byte copies: W [C][kdp], Uᵀ and then Δᵀ
// [vdp][C] (the scan reads and writes them a value column's tokens at a time), the keys transposed [kdp][C] followed
// by the normalised queries [C][kdp] (a key head's, for the outputs), P [C][C], S₀ᵀ [vdp][kdp]. Each region is sized
// for the larger of the two layouts (at the release both take the same bytes).
ChunkScratch chunk_scratch(const GdnShape& s, int rows, float* base, size_t* total) {
  const size_t chunks = size_t((rows + kC - 1) / kC), blocks = chunks * size_t(s.heads);
  const size_t dk = size_t(s.dk), dv = size_t(s.dv), kdp = size_t(padded(s.dk)), vdp = size_t(padded(s.dv));
  size_t offset = 0;
  auto take = [&](size_t per_block, size_t count) {
    float* at = base ? base + offset : nullptr;
    offset += (count * per_block + 63) / 64 * 64;  // keeps every region 256-byte aligned
    return at;
  };
  ChunkScratch x;
  x.w = take(std::max(kC * dk, kC * kdp / 2), blocks);
  x.u = take(std::max(kC * dv, vdp * kC / 2), blocks);
  x.q_factor = take(kC, blocks);
  x.keys = take(kC * kdp, chunks * size_t(s.key_heads));  // ≥ C·dk floats; bf16 mode: Kᵀ and Q
  x.key_decay = take(kC, blocks);
  x.p = take(kC * kC, blocks);
  x.s0 = take(std::max(dk * dv, vdp * kdp / 2), blocks);
  x.decay = take(1, blocks);
  x.scan_slices = scan_slices_of(s);
  x.progress = reinterpret_cast<unsigned*>(base ? base + offset : nullptr);
  offset += (size_t(s.heads) * x.scan_slices + 63) / 64 * 64;
  if (total) *total = offset;
  return x;
}

// x = column `column` of (I + A_bb)⁻¹ for the unit lower triangular diagonal block b at rows and columns r0 … r0 + 15
// of A (row stride kChunkStride), by forward substitution of (I + A_bb) x = e_column (x[c] = 0 for c < column falls
// out of the sums, so no lane branches).
__device__ inline void solve_diagonal_column(float (&x)[kTile], const float* a, int r0, int column) {
#pragma unroll
  for (int i = 0; i < kTile; ++i) {
    const float4* row = reinterpret_cast<const float4*>(a + (r0 + i) * kChunkStride + r0);
    float sums[4] = {i == column ? 1.0f : 0.0f, 0.0f, 0.0f, 0.0f};  // four partial sums: shorter chains
#pragma unroll
    for (int c4 = 0; c4 < i; c4 += 4) {
      const float4 q = row[c4 / 4];
      const float values[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int c = c4; c < c4 + 4 && c < i; ++c) sums[c % 4] -= values[c - c4] * x[c];
    }
    x[i] = (sums[0] + sums[1]) + (sums[2] + sums[3]);
  }
}
// inverses[r0 + i][r0 + column] = ((I + A_bb)⁻¹)[i][column] (solve_diagonal_column) by lanes 0–15 of a warp (lane =
// column), which call it together; inverses may be A itself (the inverse overwrites the block: every lane has read it
// first). The inverses are stored as the solve's products take them (stored_operand): nothing else reads them.
template <bool kOnePass>
__device__ inline void invert_diagonal_block(float* inverses, const float* a, int r0, int column) {
  float x[kTile];
  solve_diagonal_column(x, a, r0, column);
  __syncwarp(0xffffu);
#pragma unroll
  for (int i = 0; i < kTile; ++i) inverses[(r0 + i) * kChunkStride + r0 + column] = stored_operand<kOnePass>(x[i]);
}

// The inclusive cumulative sum of the 64 log decays at gamma, in place, by one warp (two a lane).
__device__ inline void cumulative_decays(float* gamma, int lane) {
  const float first = gamma[2 * lane], second = gamma[2 * lane + 1];
  float sum = first + second;
  for (int offset = 1; offset < 32; offset <<= 1) {
    const float other = __shfl_up_sync(0xffffffffu, sum, offset);
    if (lane >= offset) sum += other;
  }
  const float before = __shfl_up_sync(0xffffffffu, sum, 1);  // the sum over the lanes below
  gamma[2 * lane] = lane == 0 ? first : before + first;
  gamma[2 * lane + 1] = lane == 0 ? first + second : (before + first) + second;
}

// A prepare block takes a group of value heads of one key head and one chunk: all the key head's value heads (3 at
// the release) share q and k, so the staging of the q and k rows, their norms and the products K Kᵀ and Q Kᵀ are
// done once for the group; only the per-row scalars (β, the decays) and V differ between them. Groups of one value
// head make 3× the blocks of a third of the work: where even those blocks fit on the GPU at once (short passes, e.g.
// one chunk: 48 blocks instead of 16), they finish sooner (prepare_group picks).
__host__ __device__ inline int value_heads_per_key_head(const GdnShape& s) { return s.heads / s.key_heads; }

// Shared memory of the prepare kernel for groups of `group` value heads: γ and β of each value head [G][C]; q and k
// factors [C]; keys [C][ldk]; queries [C][ldk], later values [C][ldv]; K Kᵀ [C][C + 4]; Q Kᵀ, later A with its
// inverted diagonal blocks [C][C + 4]. (At the release 105.5 KB: two blocks an SM, either group.)
size_t prepare_shared_bytes(const GdnShape& s, int group) {
  const size_t ldk = size_t(stride_of(s.dk)), ldx = size_t(std::max(stride_of(s.dk), operand_stride_of(s.dv)));
  return (2 * size_t(group) * kC + 2 * size_t(kC) + kC * ldk + kC * ldx + 2 * size_t(kC) * kChunkStride) * 4;
}

// Block (group of value heads, chunk), 512 threads, two blocks an SM (64 registers a thread): the kernel is bound by
// latencies between its barriers, so more warps each do less.
constexpr int kPrepareThreads = 512;
constexpr int kPrepareWarps = kPrepareThreads / 32;

// target[t·width + e] = convert(tile[t·ld + e]) for the chunk's rows t < C and e < width, by a prepare block: whole
// float4s where the widths and the target allow it (the release: four loads, roundings and stores in one; with one
// float a thread, the index and 64-bit address arithmetic took ~12 instructions an element in an issue-bound kernel).
template <typename Convert>
__device__ inline void write_rows(float* target, const float* tile, int ld, int width, Convert convert) {
  if (width % 4 == 0 && ld % 4 == 0 && reinterpret_cast<uintptr_t>(target) % 16 == 0) {
    for (unsigned e = 4 * threadIdx.x; e < unsigned(kC * width); e += 4 * blockDim.x) {
      const float4 x = *reinterpret_cast<const float4*>(tile + e / width * ld + e % width);
      *reinterpret_cast<float4*>(target + e) = make_float4(convert(x.x), convert(x.y), convert(x.z), convert(x.w));
    }
    return;
  }
  for (unsigned e = threadIdx.x; e < unsigned(kC * width); e += blockDim.x)
    target[e] = convert(tile[e / width * ld + e % width]);
}

// keys_out[i·C + t] = keys[t·ld + i] at the release's dk = 128 (512 threads: one 4 × 4 block of tokens and keys
// each): four float4 loads, a transpose in registers and four float4 stores. A quarter warp's loads (token quads 2m,
// 2m + 1 and four key quads: rows 16 mod 32 banks apart) cover the 32 banks once; a warp's stores are 16 rows of 32
// bytes.
__device__ inline void transpose_keys(float* keys_out, const float* keys, int ld) {
  static_assert(kPrepareThreads == kC / 4 * (kReleaseDim / 4));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int token = 4 * (warp % 8 * 2 + lane % 2), key = 4 * (warp / 8 * 16 + lane / 2);
  float rows[4][4];
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const float4 x = *reinterpret_cast<const float4*>(keys + (token + r) * ld + key);
    rows[r][0] = x.x;
    rows[r][1] = x.y;
    rows[r][2] = x.z;
    rows[r][3] = x.w;
  }
#pragma unroll
  for (int c = 0; c < 4; ++c)
    *reinterpret_cast<float4*>(keys_out + (key + c) * kC + token) =
        make_float4(rows[0][c], rows[1][c], rows[2][c], rows[3][c]);
}

// The bf16 mode's views of the scratch regions (chunk_scratch): block = chunk · heads + value head.
__device__ inline bf16* w_bf16(const ChunkScratch& x, const GdnShape& s, size_t block) {
  return reinterpret_cast<bf16*>(x.w) + block * kC * padded(s.dk);
}
__device__ inline bf16* delta_bf16(const ChunkScratch& x, const GdnShape& s, size_t block) {  // Uᵀ, then Δᵀ
  return reinterpret_cast<bf16*>(x.u) + block * size_t(padded(s.dv)) * kC;
}
__device__ inline bf16* keys_bf16(const ChunkScratch& x, const GdnShape& s, int chunk, int key_head) {
  return reinterpret_cast<bf16*>(x.keys) + (size_t(chunk) * s.key_heads + key_head) * 2 * kC * padded(s.dk);
}
__device__ inline bf16* queries_bf16(const ChunkScratch& x, const GdnShape& s, int chunk, int key_head) {
  return keys_bf16(x, s, chunk, key_head) + kC * padded(s.dk);
}
__device__ inline bf16* p_bf16(const ChunkScratch& x, size_t block) {
  return reinterpret_cast<bf16*>(x.p) + block * kC * kC;
}
__device__ inline bf16* s0_bf16(const ChunkScratch& x, const GdnShape& s, size_t block) {  // S₀ᵀ
  return reinterpret_cast<bf16*>(x.s0) + block * size_t(padded(s.dv)) * padded(s.dk);
}

// The chunk's log decays γ and β = sigmoid(b) of `group` value heads from first_head, [group][C]; rows past the input
// get β = 0 and γ = 0 (they change nothing).
__device__ inline void stage_gates(const GdnInputs& in, const GdnShape& s, int first_head, int group, int t0, int n,
                                   float* gammas, float* betas) {
  for (int e = threadIdx.x; e < group * kC; e += kPrepareThreads) {
    const int h = first_head + e / kC, t = e % kC;
    float gamma = 0.0f, beta = 0.0f;
    if (t < n) {
      const size_t at = size_t(t0 + t) * s.heads + h;
      gamma = log_decay(in, h, at);
      beta = sigmoid(in.b[at]);
    }
    gammas[e] = gamma;
    betas[e] = beta;
  }
}

// Phase 1, once a group: q and k rows staged and l2-normalised, every value head's γ and β, K Kᵀ and Q Kᵀ, the
// normalised keys to the scratch (by one block of the key head); then for each value head its P, key and q factors and
// chunk decay to the scratch. Phase 2, value head after value head: A
// (from K Kᵀ), V and the keys restaged, I + A's diagonal blocks inverted, the blocked solve for W and U, both to the
// scratch. Every value is computed by the same operations in the same order as in the earlier kernel per value head
// (the restaged keys are normalised by the same factor before they are scaled), so the results are unchanged.
template <bool kRelease, bool kOnePass>
__global__ void __launch_bounds__(kPrepareThreads, 2)
    gdn_chunk_prepare_kernel(GdnShape shape, GdnInputs in, ChunkScratch x, int group) {
  const GdnShape s = fixed<kRelease>(shape);
  allow_dependents();
  extern __shared__ __align__(128) float4 shared4[];
  const int kdp = padded(s.dk), vdp = padded(s.dv);
  const int ldk = stride_of(s.dk), ldv = operand_stride_of(s.dv), ldx = max(ldk, ldv);
  float* gammas = reinterpret_cast<float*>(shared4);  // [G][C] inclusive cumulative log decays
  float* betas = gammas + group * kC;                 // [G][C]
  float* q_factor = betas + group * kC;               // [C]: 1 / (‖q_t‖ √dk)
  float* k_factor = q_factor + kC;                    // [C]: 1 / ‖k_t‖, zero past the input
  float* keys = k_factor + kC;                        // [C][ldk]: normalised K, then diag(β e^γ) K, then W
  float* queries = keys + kC * ldk;                   // [C][ldk]: normalised Q scaled by 1/√dk
  float* values = queries;                            // [C][ldv]: diag(β) V, then U (once Q is used up)
  float* kk = queries + kC * ldx;                     // [C][C + 4]: K Kᵀ
  float* qk = kk + kC * kChunkStride;                 // [C][C + 4]: Q Kᵀ
  float* a = qk;  // [C][C + 4]: A (strictly lower; a value head's, once every P is written), its diagonal blocks
                  // then replaced by (I + A_bb)⁻¹
  const int first_head = blockIdx.x * group, key_head = first_head / value_heads_per_key_head(s);
  const int chunk = blockIdx.y, tid = threadIdx.x;
  const int lane = tid % 32, warp = tid / 32;
  const int t0 = chunk * kC, n = min(kC, in.rows - t0);
  if (chunk == 0)  // the scan starts after this grid; the group's counters are adjacent
    for (int e = tid; e < group * x.scan_slices; e += kPrepareThreads) x.progress[first_head * x.scan_slices + e] = 0;

  // Raw q and k rows, zero past the input and past dk.
  const float* q_rows = in.qkv + size_t(t0) * s.conv_dim + key_head * s.dk;
  const float* k_rows = q_rows + s.key_dim;
  stage_tile(queries, ldk, kC, kdp, q_rows, size_t(s.conv_dim), n, s.dk);
  stage_tile(keys, ldk, kC, kdp, k_rows, size_t(s.conv_dim), n, s.dk);
  stage_gates(in, s, first_head, group, t0, n, gammas, betas);
  if (tid >= n && tid < kC) k_factor[tid] = 0.0f;
  wait_copies();
  __syncthreads();
  for (int head = warp; head < group; head += kPrepareWarps) cumulative_decays(gammas + head * kC, lane);
  const float q_scale = 1.0f / sqrtf(float(s.dk));
  for (int t = warp; t < n; t += kPrepareWarps) {  // l2-normalise in place (each lane rescales what it summed)
    float q_sum = 0.0f, k_sum = 0.0f;
    for (int i = lane; i < s.dk; i += 32) {
      q_sum += queries[t * ldk + i] * queries[t * ldk + i];
      k_sum += keys[t * ldk + i] * keys[t * ldk + i];
    }
    const float q_norm = 1.0f / sqrtf(warp_sum(q_sum) + 1e-6f) * q_scale;
    const float k_norm = 1.0f / sqrtf(warp_sum(k_sum) + 1e-6f);
    if (lane == 0) {
      q_factor[t] = q_norm;
      k_factor[t] = k_norm;
    }
    for (int i = lane; i < s.dk; i += 32) {  // (one pass: stored rounded; phase 2 restages the keys in fp32)
      queries[t * ldk + i] = stored_operand<kOnePass>(queries[t * ldk + i] * q_norm);
      keys[t * ldk + i] = stored_operand<kOnePass>(keys[t * ldk + i] * k_norm);
    }
  }
  __syncthreads();

  // K Kᵀ and Q Kᵀ: the 10 tiles of each on or below the diagonal (those above are masked below), ≤ 2 a warp. (A
  // warp computing both products of a tile position at once, sharing the keys operand, was slower: 64 registers.)
  for (int tile = warp; tile < 20; tile += kPrepareWarps) {
    const bool q_rows_tile = tile >= 10;
    const int lower = tile % 10, row = lower >= 6 ? 3 : lower >= 3 ? 2 : lower >= 1 ? 1 : 0;
    const int r0 = row * kTile, c0 = (lower - row * (row + 1) / 2) * kTile;
    Accumulator acc;
    fill(acc, 0.0f);
    mma_tile<kOnePass, RowMajor, ColMajor, true, true>(acc, (q_rows_tile ? queries : keys) + r0 * ldk, ldk,
                                                       keys + c0 * ldk, ldk, kdp / kStep);
    store_tile((q_rows_tile ? qk : kk) + r0 * kChunkStride + c0, acc, kChunkStride);
  }
  __syncthreads();

  // The normalised keys transposed, [dk][C] (the scan reads them k-contiguous), once a key head, as the scan's
  // products take them (in one-pass mode the keys tile holds them rounded already).
  if (first_head % value_heads_per_key_head(s) == 0) {
    float* keys_out = x.keys + (size_t(chunk) * s.key_heads + key_head) * kC * s.dk;
    if constexpr (kRelease)
      transpose_keys(keys_out, keys, ldk);
    else {  // a warp's 32 elements: keys 4q … 4q + 3 of 8 tokens (32 banks; four 32-byte pieces in the scratch)
      static_assert(kPrepareThreads / 4 % kC == 0);
      const int key_quads = (s.dk + 3) / 4, token = tid / 4 % kC;
      for (int e = tid; e < key_quads * 4 * kC; e += kPrepareThreads) {
        const int i = e / (4 * kC) * 4 + e % 4;
        if (i < s.dk) keys_out[i * kC + token] = keys[token * ldk + i];
      }
    }
  }
  // Each value head's P (decayed and masked), the keys' factors e^{γ_C−γ_t}, Qd's row factors and the chunk's decay.
  for (int head = 0; head < group; ++head) {
    const float* gamma = gammas + head * kC;
    const size_t block = size_t(chunk) * s.heads + first_head + head;
    float* p = x.p + block * kC * kC;
    for (unsigned e = tid; e < kC * kC; e += kPrepareThreads) {
      const int t = e / kC, u = e % kC;
      const float decay = u <= t ? expf(gamma[t] - gamma[u]) : 0.0f;
      p[e] = u <= t ? stored_operand<kOnePass>(decay * qk[t * kChunkStride + u]) : 0.0f;
    }
    const float gamma_end = gamma[kC - 1];
    if (tid < kC) {
      x.q_factor[block * kC + tid] = tid < n ? q_factor[tid] * expf(gamma[tid]) : 0.0f;
      x.key_decay[block * kC + tid] = expf(gamma_end - gamma[tid]);
    }
    if (tid == 0) x.decay[block] = expf(gamma_end);
  }
  __syncthreads();  // Q Kᵀ, the queries and (past the first value head) the normalised keys are used up

  for (int head = 0; head < group; ++head) {
    const int h = first_head + head;
    const float *gamma = gammas + head * kC, *beta = betas + head * kC;
    const size_t block = size_t(chunk) * s.heads + h;
    // The right-hand sides [diag(β e^γ) K | diag(β) V] (zero past the input: β = 0 there). V, and past the first
    // value head (in one-pass mode also for it: phase 1 left the keys rounded) the raw k rows again (from L2: this
    // block read them), load by cp.async while A is formed.
    const bool restage_keys = kOnePass || head > 0;
    stage_tile(values, ldv, kC, vdp, in.qkv + size_t(t0) * s.conv_dim + 2 * s.key_dim + h * s.dv, size_t(s.conv_dim), n,
               s.dv);
    if (restage_keys) stage_tile(keys, ldk, kC, kdp, k_rows, size_t(s.conv_dim), n, s.dk);
    __pipeline_commit();
    // A, stored as the solve's products take it outside the diagonal blocks (only they read it there; the inversion
    // reads the diagonal blocks).
    for (unsigned e = tid; e < kC * kC; e += kPrepareThreads) {
      const int t = e / kC, u = e % kC;
      const float value = u < t ? beta[t] * expf(gamma[t] - gamma[u]) * kk[t * kChunkStride + u] : 0.0f;
      a[t * kChunkStride + u] = t / kTile == u / kTile ? value : stored_operand<kOnePass>(value);
    }
    __pipeline_wait_prior(0);
    __syncthreads();
    // Four warps invert the diagonal blocks of I + A in place while the others scale the right-hand sides.
    if (warp >= kPrepareWarps - kC / kTile && lane < kTile)
      invert_diagonal_block<kOnePass>(a, a, (warp - (kPrepareWarps - kC / kTile)) * kTile, lane);
    for (int t = warp; t < kC; t += kPrepareWarps) {
      const float scale = beta[t] * expf(gamma[t]), norm = k_factor[t];
      for (int i = lane; i < kdp; i += 32) {
        const float key = restage_keys ? keys[t * ldk + i] * norm : keys[t * ldk + i];  // normalised as in phase 1
        keys[t * ldk + i] = key * scale;
      }
    }
    for (int t = warp; t < n; t += kPrepareWarps)
      for (int j = lane; j < s.dv; j += 32) values[t * ldv + j] *= beta[t];
    __syncthreads();

    // (I + A) [W | U] = [diag(β e^γ) K | diag(β) V] by blocks of 16 rows, a warp per 16-column tile (the tiles do not
    // depend on each other, so no block barrier): subtract the solved rows' part, then multiply by the diagonal
    // block's inverse, both on the tensor cores.
    const int key_tiles = kdp / kTile, tiles = key_tiles + vdp / kTile;
    for (int tile = warp; tile < tiles; tile += kPrepareWarps) {
      const bool key = tile < key_tiles;
      float* rhs = key ? keys + tile * kTile : values + (tile - key_tiles) * kTile;
      const int ld = key ? ldk : ldv;
      for (int r0 = 0; r0 < kC; r0 += kTile) {
        if (r0 > 0) {
          Accumulator solved, rest;
          fill(solved, 0.0f);
          mma_tile<kOnePass, RowMajor, RowMajor, true>(solved, a + r0 * kChunkStride, kChunkStride, rhs, ld,
                                                       r0 / kStep);
          load_tile(rest, rhs + r0 * ld, ld);
#pragma unroll
          for (int e = 0; e < 8; ++e) rest.x[e] -= solved.x[e];
          store_tile(rhs + r0 * ld, rest, ld);
          __syncwarp();
        }
        Accumulator solution;
        fill(solution, 0.0f);
        mma_tile<kOnePass, RowMajor, RowMajor, true>(solution, a + r0 * kChunkStride + r0, kChunkStride, rhs + r0 * ld,
                                                     ld, kTile / kStep);
        __syncwarp();  // every lane has read the block before it is overwritten
        store_tile(rhs + r0 * ld, solution, ld);
        __syncwarp();
      }
    }
    __syncthreads();

    write_rows(x.w + block * kC * s.dk, keys, ldk, s.dk, [](float w) { return stored_operand<kOnePass>(w); });
    write_rows(x.u + block * kC * s.dv, values, ldv, s.dv, [](float u) { return u; });
    if (head + 1 < group) __syncthreads();  // the next value head restages the keys and values and forms its A
  }
}

// ---- The bf16 mode's prepare: bf16 tiles, (I + A)⁻¹ once, W and U as one product each ------------------------------
//
// The normalised q and k rows are staged as bf16 (converted once, while staging; halves the tiles), the products read
// them with ldmatrix. Per value head, T = (I + A)⁻¹ is built in fp32 in three stages between block barriers: the
// diagonal blocks' inverses D_b by forward substitution, then the off-diagonal blocks by the inverse of a block lower
// triangular matrix,
//   [[L₁₁, 0], [L₂₁, L₂₂]]⁻¹ = [[L₁₁⁻¹, 0], [−L₂₂⁻¹ L₂₁ L₁₁⁻¹, L₂₂⁻¹]],
// at 32 rows (T₁₀ = −D₁ A₁₀ D₀, T₃₂ = −D₃ A₃₂ D₂: two warps, with the D_b, in the first stage) and then at 64 (the
// lower left 32 × 32 block: four warps, two stages), with 3×TF32 products (fp32 accurate), while other warps stage V
// as bf16 and store the diagonal blocks' factors. Then W = T diag(β e^γ) K and U = T diag(β) V are one bf16 product
// each over T's lower tiles (every entry of T is ≤ 1 in magnitude, docs/CUDA.md): the column scales go onto T (64 × 64,
// written as bf16 by the warp that forms each tile) instead of onto K and V (64 × 128 each), the keys are staged once
// for the key head's value heads, and the 4-step blocked substitution with its barriers is gone. U is computed
// transposed, Uᵀ = Vᵀ (T diag(β))ᵀ, so that both results leave the registers as bf16 pairs adjacent in the scratch's
// layout. P, the decays and the column scales of all the group's value heads are written once, before the first.
constexpr int kFactorStride = kC + 8;    // bf16 [C][C + 8]: T diag(β e^γ), T diag(β)
constexpr int kBlockStride = kTile + 8;  // fp32 [16][24]: the inverse's intermediate blocks
constexpr int kInverseWarps = 4;         // the warps that build (I + A)⁻¹ (the first two: its first stage)
constexpr int kInverseThreads = 32 * kInverseWarps;

// Shared memory of the bf16 prepare for groups of `group` value heads: γ, β and the column scales β e^γ [G][C], K Kᵀ
// and A, then T, [C][C + 4] each (fp32), four intermediate blocks [16][24] (fp32), the normalised keys [C][ldk] and
// queries, later V, [C][max(ldk, ldv)] (bf16), the two scaled copies of T [C][C + 8] (bf16). (At the release 96.5 KB:
// two blocks an SM. A second A tile, to form the next value head's A during the inversion, made it 111.25 KB and the
// kernel slower: 360 → 396 µs at T = 8192, docs/CUDA.md.)
size_t prepare_bf16_shared_bytes(const GdnShape& s, int group) {
  const size_t ldk = size_t(bf16_stride_of(s.dk)), ldx = std::max(ldk, size_t(bf16_stride_of(s.dv)));
  const size_t floats = 3 * size_t(group) * kC + 2 * size_t(kC) * kChunkStride + 4 * kTile * kBlockStride;
  return floats * sizeof(float) + (kC * ldk + kC * ldx + 2 * size_t(kC) * kFactorStride) * sizeof(bf16);
}

// The A operand of a 16 (m) × 16 (k) tile stored k-major at a (bf16, rows k with m contiguous, row stride ld), by the
// transposing ldmatrix: lane i addresses row k = i % 8 + 8·(i / 16) at m 8·(i / 8 % 2).
__device__ inline void load_a_bf16_trans(uint32_t (&f)[4], const bf16* a, int ld) {
  const int lane = threadIdx.x % 32;
  ldmatrix_x4<true>(f, a + (lane % 8 + 8 * (lane / 16)) * ld + 8 * (lane / 8 % 2));
}

// The B operand of a 16 (k) × 16 (n) tile stored k-major at b (bf16, rows k with n contiguous, row stride ld): lane i
// addresses row k = i % 8 + 8·(i / 8 % 2) at n 8·(i / 16).
__device__ inline void load_b_bf16_trans(uint32_t (&f)[2][2], const bf16* b, int ld) {
  const int lane = threadIdx.x % 32;
  uint32_t r[4];
  ldmatrix_x4<true>(r, b + (lane % 8 + 8 * (lane / 8 % 2)) * ld + 8 * (lane / 16));
  b_halves(f, r);
}

// acc += A Bᵀ over k = 16·steps, A's rows at a and B's rows (the n side) at b, both bf16 with k contiguous (row stride
// ld); the even and odd k-steps form two chains.
__device__ inline void mma_rows_bf16(Accumulator& acc, const bf16* a, const bf16* b, int ld, int steps) {
  Accumulator odd;
  zero(odd);
#pragma unroll 2
  for (int k = 0; k < steps; ++k) {
    uint32_t a_frag[4], b_frag[2][2];
    load_a_bf16(a_frag, a + kTile * k, ld);
    load_b_bf16(b_frag, b + kTile * k, ld);
    mma_bf16_tile(k % 2 ? odd : acc, a_frag, b_frag);
  }
#pragma unroll
  for (int e = 0; e < 8; ++e) acc.x[e] += odd.x[e];
}

// Elements i … i + 3 of a row of `width` floats (zero past it, and all zero where row is null): one 16-byte load where
// `vectors` says the rows are 16-byte aligned.
__device__ inline float4 row_quad(const float* row, int i, int width, bool vectors) {
  if (!row || i >= width) return make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (vectors && i + 4 <= width) return *reinterpret_cast<const float4*>(row + i);
  return make_float4(row[i], i + 1 < width ? row[i + 1] : 0.0f, i + 2 < width ? row[i + 2] : 0.0f,
                     i + 3 < width ? row[i + 3] : 0.0f);
}
__device__ inline float squares(float4 v) { return v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w; }
__device__ inline void store_quad_bf16(bf16* target, float4 v, float scale) {
  *reinterpret_cast<uint2*>(target) =
      make_uint2(pack_bf16(v.x * scale, v.y * scale), pack_bf16(v.z * scale, v.w * scale));
}

// Row t of the queries and of the keys (null past the input), l2-normalised (the queries also scaled by q_scale) as
// bf16 into the tiles (kdp wide, zero past dk), by one warp. The same factors as the TF32 prepare's.
template <bool kRelease>
__device__ inline void stage_normalised_rows(bf16* queries, bf16* keys, const float* q, const float* k, int dk, int kdp,
                                             float q_scale, bool vectors, int lane) {
  if constexpr (kRelease) {  // dk = 128: one quad a lane, loaded once
    const float4 qv = row_quad(q, 4 * lane, dk, vectors), kv = row_quad(k, 4 * lane, dk, vectors);
    const float q_norm = 1.0f / sqrtf(warp_sum(squares(qv)) + 1e-6f) * q_scale;
    const float k_norm = 1.0f / sqrtf(warp_sum(squares(kv)) + 1e-6f);
    store_quad_bf16(queries + 4 * lane, qv, q_norm);
    store_quad_bf16(keys + 4 * lane, kv, k_norm);
    return;
  }
  float q_sum = 0.0f, k_sum = 0.0f;
  for (int i = 4 * lane; i < kdp; i += 128) {
    q_sum += squares(row_quad(q, i, dk, vectors));
    k_sum += squares(row_quad(k, i, dk, vectors));
  }
  const float q_norm = 1.0f / sqrtf(warp_sum(q_sum) + 1e-6f) * q_scale;
  const float k_norm = 1.0f / sqrtf(warp_sum(k_sum) + 1e-6f);
  for (int i = 4 * lane; i < kdp; i += 128) {
    store_quad_bf16(queries + i, row_quad(q, i, dk, vectors), q_norm);
    store_quad_bf16(keys + i, row_quad(k, i, dk, vectors), k_norm);
  }
}

// Lower tile l (0 … 9, row by row) of a 4 × 4 grid of 16 × 16 tiles: its first row and column.
__host__ __device__ constexpr int lower_tile_row(int l) { return kTile * (l >= 6 ? 3 : l >= 3 ? 2 : l >= 1 ? 1 : 0); }
__host__ __device__ constexpr int lower_tile_column(int l) {
  const int row = lower_tile_row(l) / kTile;
  return kTile * (l - row * (row + 1) / 2);
}

// Where the inverse's producers write T's lower tiles as bf16 with their columns scaled (T diag(β e^γ) for W, T
// diag(β) for U): the factor tiles [C][C + 8] and the value head's column scales.
struct Factors {
  bf16 *w, *u;
  const float *w_scale, *beta;
};

// T's elements (t, u) and (t, u + 1) into both factor tiles, as one bf16 pair each.
__device__ inline void store_factor_pair(const Factors& f, int t, int u, float first, float second) {
  *reinterpret_cast<uint32_t*>(f.w + t * kFactorStride + u) =
      pack_bf16(first * f.w_scale[u], second * f.w_scale[u + 1]);
  *reinterpret_cast<uint32_t*>(f.u + t * kFactorStride + u) = pack_bf16(first * f.beta[u], second * f.beta[u + 1]);
}

// A 16 × 16 tile of T at rows r0 …, columns c0 … (in the accumulator layout) into both factor tiles.
__device__ inline void store_factor_tile(const Factors& f, int r0, int c0, const Accumulator& c) {
  const int g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
#pragma unroll
  for (int e = 0; e < 8; e += 2)
    store_factor_pair(f, r0 + g + 8 * (e / 2 % 2), c0 + 8 * (e / 4) + 2 * t, c.x[e], c.x[e + 1]);
}

// The 3×TF32 product of two 16 × 16 fp32 tiles (row-major), negated where `negate`, plus a second product where a2 is
// given. The caller stores it (every lane has read the operands: a target may be one of them).
__device__ inline Accumulator block_product(const float* a, int lda, const float* b, int ldb, bool negate,
                                            const float* a2 = nullptr, const float* b2 = nullptr, int ldb2 = 0) {
  Accumulator acc;
  zero(acc);
  mma_tile<false, RowMajor, RowMajor>(acc, a, lda, b, ldb, kTile / kStep);
  if (a2) mma_tile<false, RowMajor, RowMajor>(acc, a2, lda, b2, ldb2, kTile / kStep);
  if (negate)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc.x[e] = -acc.x[e];
  __syncwarp();
  return acc;
}

// T = (I + A)⁻¹ in place of A (the strictly lower fp32 [C][C + 4] tile at a; its diagonal blocks' upper parts zero)
// in three stages, each followed by a block barrier; blocks: four [16][kBlockStride] intermediate tiles. Every tile
// of T goes to the factor tiles from the warp that forms it, but the diagonal blocks (store_diagonal_factors, by
// other warps during stage 2: off the critical path). Stage 1, by warps p = 0, 1: the diagonal blocks' inverses D_2p
// (lanes 0–15, a column each) and D_2p+1 (lanes 16–31), then T_2p+1,2p = −D_2p+1 (A_2p+1,2p D_2p).
__device__ inline float* inverse_block(float* a, int row, int column) {
  return a + kTile * row * kChunkStride + kTile * column;
}
__device__ inline void invert_at_32_rows(float* a, float* blocks, const Factors& f, int p, int lane) {
  const int r0 = kTile * (2 * p + lane / kTile), column = lane % kTile;
  float x[kTile];
  solve_diagonal_column(x, a, r0, column);
  __syncwarp();
#pragma unroll
  for (int i = 0; i < kTile; ++i) a[(r0 + i) * kChunkStride + r0 + column] = x[i];
  __syncwarp();
  float* mine = blocks + p * kTile * kBlockStride;
  const int r = 2 * p + 1;
  store_tile(
      mine,
      block_product(inverse_block(a, r, r - 1), kChunkStride, inverse_block(a, r - 1, r - 1), kChunkStride, false),
      kBlockStride);
  __syncwarp();
  const Accumulator t = block_product(inverse_block(a, r, r), kChunkStride, mine, kBlockStride, true);
  store_tile(inverse_block(a, r, r - 1), t, kChunkStride);
  store_factor_tile(f, kTile * r, kTile * (r - 1), t);
}
// D_b (b < 4, fp32 in A's place since stage 1) to both factor tiles by one warp at constant offsets: lane i takes row
// i / 2, columns 8(i % 2) … 8(i % 2) + 7 (two 16-byte stores).
__device__ inline void store_diagonal_factors(const float* a, const Factors& f, int b, int lane) {
  const int t = kTile * b + lane / 2, u = kTile * b + 8 * (lane % 2);
  const float4 left = *reinterpret_cast<const float4*>(a + t * kChunkStride + u);
  const float4 right = *reinterpret_cast<const float4*>(a + t * kChunkStride + u + 4);
  const float x[8] = {left.x, left.y, left.z, left.w, right.x, right.y, right.z, right.w};
  uint32_t w[4], v[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int at = u + 2 * c;
    w[c] = pack_bf16(x[2 * c] * f.w_scale[at], x[2 * c + 1] * f.w_scale[at + 1]);
    v[c] = pack_bf16(x[2 * c] * f.beta[at], x[2 * c + 1] * f.beta[at + 1]);
  }
  *reinterpret_cast<uint4*>(f.w + t * kFactorStride + u) = make_uint4(w[0], w[1], w[2], w[3]);
  *reinterpret_cast<uint4*>(f.u + t * kFactorStride + u) = make_uint4(v[0], v[1], v[2], v[3]);
}

// Stages 2 and 3, the lower left 32 × 32 block by warps q = 0 … 3: X = A_[23][01] T_[01][01] (block (i, j) by warp
// q = 2(i − 2) + j), then −T_[23][23] X in its place (to the factor tiles only: nothing reads it as fp32).
__device__ inline void invert_at_64_rows_first(float* a, float* blocks, int q) {
  float* mine = blocks + q * kTile * kBlockStride;
  const int i = 2 + q / 2, j = q % 2;
  if (j == 0)  // X_i0 = A_i0 D₀ + A_i1 T₁₀
    store_tile(mine,
               block_product(inverse_block(a, i, 0), kChunkStride, inverse_block(a, 0, 0), kChunkStride, false,
                             inverse_block(a, i, 1), inverse_block(a, 1, 0), kChunkStride),
               kBlockStride);
  else  // X_i1 = A_i1 D₁
    store_tile(mine, block_product(inverse_block(a, i, 1), kChunkStride, inverse_block(a, 1, 1), kChunkStride, false),
               kBlockStride);
}
__device__ inline void invert_at_64_rows_second(float* a, const float* blocks, const Factors& f, int q) {
  const int i = 2 + q / 2, j = q % 2;
  const float* x2 = blocks + j * kTile * kBlockStride;  // X_2j
  if (i == 2)                                           // T_2j = −D₂ X_2j
    store_factor_tile(f, kTile * i, kTile * j,
                      block_product(inverse_block(a, 2, 2), kChunkStride, x2, kBlockStride, true));
  else  // T_3j = −(T₃₂ X_2j + D₃ X_3j)
    store_factor_tile(f, kTile * i, kTile * j,
                      block_product(inverse_block(a, 3, 2), kChunkStride, x2, kBlockStride, true,
                                    inverse_block(a, 3, 3), blocks + q * kTile * kBlockStride, kBlockStride));
}

// Elements i … i + 3 (i + 4 ≤ the row's width) of a row, all zero where row is null: row_quad without its checks
// of the width, for the release's rows (they took ~25 instructions a quad).
__device__ inline float4 whole_quad(const float* row, int i, bool vectors) {
  if (!row) return make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (vectors) return *reinterpret_cast<const float4*>(row + i);
  return make_float4(row[i], row[i + 1], row[i + 2], row[i + 3]);
}

// The release's (dk = 128) rows t = warp + 16r (r < 4) of the queries and keys as stage_normalised_rows writes them, by
// one warp: all eight 16-byte loads a lane first (one memory latency, not four).
__device__ inline void stage_normalised_rows_release(bf16* queries, bf16* keys, int ld, const float* q_rows,
                                                     const float* k_rows, size_t stride, int n, float q_scale,
                                                     bool vectors, int warp, int lane) {
  constexpr int kRows = kC / kPrepareWarps;
  float4 qv[kRows], kv[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int t = warp + kPrepareWarps * r;
    qv[r] = whole_quad(t < n ? q_rows + size_t(t) * stride : nullptr, 4 * lane, vectors);
    kv[r] = whole_quad(t < n ? k_rows + size_t(t) * stride : nullptr, 4 * lane, vectors);
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int t = warp + kPrepareWarps * r;
    const float q_norm = 1.0f / sqrtf(warp_sum(squares(qv[r])) + 1e-6f) * q_scale;
    const float k_norm = 1.0f / sqrtf(warp_sum(squares(kv[r])) + 1e-6f);
    store_quad_bf16(queries + t * ld + 4 * lane, qv[r], q_norm);
    store_quad_bf16(keys + t * ld + 4 * lane, kv[r], k_norm);
  }
}

// The release's (dv = 128) V columns 16w … 16w + 15 of the chunk's rows as bf16 (zero past the input), by warp w < 8:
// lane i takes rows i and i + 32, all eight 16-byte loads first (two row addresses a lane: eight rows' addresses
// were kept across the value heads and spilled), and stores each row's 16 columns as two 16-byte words (a quarter
// warp's eight rows are 4 banks apart: the 32 banks once).
constexpr int kValueWarps = kReleaseDim / kTile;
__device__ inline void stage_value_columns_release(bf16* values, int ld, const float* v_rows, size_t stride, int n,
                                                   bool vectors, int warp, int lane) {
  float4 v[2][4];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int t = lane + 32 * j;
    const float* row = t < n ? v_rows + size_t(t) * stride : nullptr;
#pragma unroll
    for (int c = 0; c < 4; ++c) v[j][c] = whole_quad(row, kTile * warp + 4 * c, vectors);
  }
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int c = 0; c < 4; c += 2) {
      const float4 first = v[j][c], second = v[j][c + 1];
      *reinterpret_cast<uint4*>(values + (lane + 32 * j) * ld + kTile * warp + 4 * c) =
          make_uint4(pack_bf16(first.x, first.y), pack_bf16(first.z, first.w), pack_bf16(second.x, second.y),
                     pack_bf16(second.z, second.w));
    }
}

// An L2 prefetch of the chunk's V rows of one value head (the start of each 128-byte line, a thread a line, clamped to
// the row), a value head ahead: its staging (which the inversion's first stage waits for) then waits for L2, not for
// memory.
__device__ inline void prefetch_value_rows(const float* v_rows, size_t stride, int n, int dv) {
  constexpr int kLineFloats = 128 / sizeof(float);
  const int lines = (dv + kLineFloats - 1) / kLineFloats;
  for (int e = threadIdx.x; e < n * lines; e += kPrepareThreads)
    asm volatile(
        "prefetch.global.L2 [%0];" ::"l"(v_rows + size_t(e / lines) * stride + min(e % lines * kLineFloats, dv - 1)));
}

// A = β_t e^{γ_t−γ_u} (K Kᵀ)[t][u] over K Kᵀ's lower tiles (strictly lower: the diagonal tiles' upper parts zero), by
// the block's 512 threads at constant offsets: thread i takes row (i % 256) / 16, column i % 16 of lower tiles
// 2j + i / 256 (j < 5).
__device__ inline void form_a(float* a, const float* kk, const float* gamma, const float* beta) {
  static_assert(kPrepareThreads == 512 && kTile * kTile == 256);
  const int tid = threadIdx.x, half = tid / 256, r = tid % 256 / kTile, c = tid % kTile;
#pragma unroll
  for (int j = 0; j < 5; ++j) {
    const int t = (half ? lower_tile_row(2 * j + 1) : lower_tile_row(2 * j)) + r;
    const int u = (half ? lower_tile_column(2 * j + 1) : lower_tile_column(2 * j)) + c;
    a[t * kChunkStride + u] = u < t ? beta[t] * expf(gamma[t] - gamma[u]) * kk[t * kChunkStride + u] : 0.0f;
  }
}

// Block (group of value heads, chunk) as the TF32 prepare's (value_heads_per_key_head, prepare_group), 512 threads,
// two blocks an SM. Writes chunk_scratch's bf16 layouts: W, Uᵀ, Kᵀ and Q, P (bf16), the
// queries' row factors e^{γ_t}, the keys' factors e^{γ_C−γ_t} and the chunk's decay. A value head costs five block
// barriers (seven before): A formed; T's first stage (and V staged); its second (and D_b's factors); its third; W and
// Uᵀ. H200, T = 8192, the release (ncu): 360 µs, 108 M warp instructions (session 11's form: 402 µs, 147 M;
// docs/CUDA.md).
template <bool kRelease>
__global__ void __launch_bounds__(kPrepareThreads, 2)
    gdn_chunk_prepare_bf16_kernel(GdnShape shape, GdnInputs in, ChunkScratch x, int group) {
  const GdnShape s = fixed<kRelease>(shape);
  allow_dependents();
  extern __shared__ __align__(128) float4 shared4[];
  const int kdp = padded(s.dk), vdp = padded(s.dv);
  const int ldk = bf16_stride_of(s.dk), ldv = bf16_stride_of(s.dv), ldx = max(ldk, ldv);
  float* gammas = reinterpret_cast<float*>(shared4);  // [G][C] inclusive cumulative log decays
  float* betas = gammas + group * kC;                 // [G][C]
  float* w_scales = betas + group * kC;               // [G][C]: β e^γ
  float* kk = w_scales + group * kC;                  // [C][C + 4]: K Kᵀ (lower tiles)
  float* a = kk + kC * kChunkStride;                  // [C][C + 4]: A, then T = (I + A)⁻¹ (lower tiles)
  float* blocks = a + kC * kChunkStride;              // [4][16][kBlockStride]
  bf16* keys = reinterpret_cast<bf16*>(blocks + 4 * kTile * kBlockStride);  // [C][ldk]: normalised K
  bf16* queries = keys + kC * ldk;                                          // [C][ldk]: normalised Q / √dk
  bf16* values = queries;                                                   // [C][ldv]: V (once Q is written)
  bf16* w_factors = queries + kC * ldx;                                     // [C][C + 8]: T diag(β e^γ)
  bf16* u_factors = w_factors + kC * kFactorStride;                         // [C][C + 8]: T diag(β)
  const int first_head = blockIdx.x * group, key_head = first_head / value_heads_per_key_head(s);
  const int chunk = blockIdx.y, tid = threadIdx.x;
  const int lane = tid % 32, warp = tid / 32, g = lane / 4, t4 = lane % 4;
  const int t0 = chunk * kC, n = min(kC, in.rows - t0);
  if (chunk == 0)  // the scan starts after this grid; the group's counters are adjacent
    for (int e = tid; e < group * x.scan_slices; e += kPrepareThreads) x.progress[first_head * x.scan_slices + e] = 0;
  const bool vectors =
      reinterpret_cast<uintptr_t>(in.qkv) % 16 == 0 && s.conv_dim % 4 == 0 && s.dk % 4 == 0 && s.dv % 4 == 0;

  const float* q_rows = in.qkv + size_t(t0) * s.conv_dim + key_head * s.dk;
  const float* k_rows = q_rows + s.key_dim;
  stage_gates(in, s, first_head, group, t0, n, gammas, betas);
  const float* v_base = in.qkv + size_t(t0) * s.conv_dim + 2 * s.key_dim;  // value head h's rows at h · dv
  prefetch_value_rows(v_base + size_t(first_head) * s.dv, size_t(s.conv_dim), n, s.dv);
  const float q_scale = 1.0f / sqrtf(float(s.dk));
  if constexpr (kRelease) {
    stage_normalised_rows_release(queries, keys, ldk, q_rows, k_rows, size_t(s.conv_dim), n, q_scale, vectors, warp,
                                  lane);
  } else {
    for (int t = warp; t < kC; t += kPrepareWarps) {
      const bool row = t < n;
      stage_normalised_rows<kRelease>(
          queries + t * ldk, keys + t * ldk, row ? q_rows + size_t(t) * s.conv_dim : nullptr,
          row ? k_rows + size_t(t) * s.conv_dim : nullptr, s.dk, kdp, q_scale, vectors, lane);
    }
  }
  __syncthreads();
  for (int head = warp; head < group; head += kPrepareWarps) cumulative_decays(gammas + head * kC, lane);

  // Q Kᵀ's lower tile `warp` (warps 0 … 9), kept in registers until γ is summed (each value head's P is formed from
  // it), and K Kᵀ's lower tile warp − 6 (warps 6 … 15), to shared memory (each value head's A).
  Accumulator qk;
  zero(qk);
  if (warp < 10)
    mma_rows_bf16(qk, queries + lower_tile_row(warp) * ldk, keys + lower_tile_column(warp) * ldk, ldk, kdp / kTile);
  if (warp >= 6) {
    const int r0 = lower_tile_row(warp - 6), c0 = lower_tile_column(warp - 6);
    Accumulator product;
    zero(product);
    mma_rows_bf16(product, keys + r0 * ldk, keys + c0 * ldk, ldk, kdp / kTile);
    store_tile(kk + r0 * kChunkStride + c0, product, kChunkStride);
  }
  if (first_head % value_heads_per_key_head(s) == 0) {  // Kᵀ [kdp][C] and Q [C][kdp], once a key head
    bf16* keys_out = keys_bf16(x, s, chunk, key_head);
    for (int e = tid; e < kdp * kC / 8; e += kPrepareThreads) {  // eight tokens of one key a thread
      const int i = e % kdp, token = 8 * (e / kdp);
      uint32_t words[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const bf16 lo = keys[(token + 2 * c) * ldk + i], hi = keys[(token + 2 * c + 1) * ldk + i];
        words[c] = uint32_t(__bfloat16_as_ushort(lo)) | uint32_t(__bfloat16_as_ushort(hi)) << 16;
      }
      *reinterpret_cast<uint4*>(keys_out + i * kC + token) = make_uint4(words[0], words[1], words[2], words[3]);
    }
    bf16* queries_out = queries_bf16(x, s, chunk, key_head);
    for (int e = tid; e < kC * kdp / 8; e += kPrepareThreads) {
      const int t = e / (kdp / 8), i = 8 * (e % (kdp / 8));
      *reinterpret_cast<uint4*>(queries_out + t * kdp + i) = *reinterpret_cast<const uint4*>(queries + t * ldk + i);
    }
  }
  __syncthreads();  // the queries are used up (V takes their place); γ is summed

  // Every value head's P (decayed, masked) from Q Kᵀ's tiles (warps 0 … 9; warps 10 … 15 the zero tiles above the
  // diagonal), its column scales β e^γ, factors and chunk decay.
  for (int head = 0; head < group; ++head) {
    const float* gamma = gammas + head * kC;
    bf16* p = p_bf16(x, size_t(chunk) * s.heads + first_head + head);
    if (warp < 10) {
      const int r0 = lower_tile_row(warp), c0 = lower_tile_column(warp);
#pragma unroll
      for (int e = 0; e < 8; e += 2) {
        const int t = r0 + g + 8 * (e / 2 % 2), u = c0 + 8 * (e / 4) + 2 * t4;
        const float first = u <= t ? expf(gamma[t] - gamma[u]) * qk.x[e] : 0.0f;
        const float second = u + 1 <= t ? expf(gamma[t] - gamma[u + 1]) * qk.x[e + 1] : 0.0f;
        *reinterpret_cast<uint32_t*>(p + t * kC + u) = pack_bf16(first, second);
      }
    } else {  // upper tile warp − 10: (0,1) (0,2) (0,3) (1,2) (1,3) (2,3)
      const int l = warp - 10;
      const int r0 = kTile * (l < 3 ? 0 : l < 5 ? 1 : 2), c0 = kTile * (l < 3 ? l + 1 : l < 5 ? l - 1 : 3);
      *reinterpret_cast<uint4*>(p + (r0 + lane / 2) * kC + c0 + 8 * (lane % 2)) = make_uint4(0, 0, 0, 0);
    }
  }
  for (int e = tid; e < group * kC; e += kPrepareThreads) {
    const int t = e % kC;
    const float* gamma = gammas + e / kC * kC;
    const size_t block = size_t(chunk) * s.heads + first_head + e / kC;
    w_scales[e] = betas[e] * expf(gamma[t]);
    x.q_factor[block * kC + t] = t < n ? expf(gamma[t]) : 0.0f;  // (the stored queries are normalised)
    x.key_decay[block * kC + t] = expf(gamma[kC - 1] - gamma[t]);
    if (t == 0) x.decay[block] = expf(gamma[kC - 1]);
  }

  for (int head = 0; head < group; ++head) {
    const int h = first_head + head;
    const float *gamma = gammas + head * kC, *beta = betas + head * kC;
    const size_t block = size_t(chunk) * s.heads + h;
    const Factors factors{w_factors, u_factors, w_scales + head * kC, beta};
    if (head + 1 < group) prefetch_value_rows(v_base + size_t(h + 1) * s.dv, size_t(s.conv_dim), n, s.dv);
    form_a(a, kk, gamma, beta);
    __syncthreads();

    // T = (I + A)⁻¹ in three stages between block barriers (invert_at_32_rows); meanwhile the other warps load V as
    // bf16 (zero past the input and past dv).
    const bool inverts = warp >= kPrepareWarps - kInverseWarps;
    const int q = warp - (kPrepareWarps - kInverseWarps);
    const float* v_rows = v_base + size_t(h) * s.dv;
    if (inverts) {
      if (q < 2) invert_at_32_rows(a, blocks, factors, q, lane);
    } else if constexpr (kRelease) {
      if (warp < kValueWarps)
        stage_value_columns_release(values, ldv, v_rows, size_t(s.conv_dim), n, vectors, warp, lane);
    } else {
      const int quads = vdp / 4;
      for (int e = tid; e < kC * quads; e += kPrepareThreads - kInverseThreads) {
        const int t = e / quads, i = 4 * (e % quads);
        store_quad_bf16(values + t * ldv + i,
                        row_quad(t < n ? v_rows + size_t(t) * s.conv_dim : nullptr, i, s.dv, vectors), 1.0f);
      }
    }
    __syncthreads();
    if (inverts)
      invert_at_64_rows_first(a, blocks, q);
    else if (warp < kC / kTile)
      store_diagonal_factors(a, factors, warp, lane);
    __syncthreads();
    if (inverts) invert_at_64_rows_second(a, blocks, factors, q);
    __syncthreads();

    // W = T diag(β e^γ) K (a warp per 16 key columns: row block i over k blocks j ≤ i) and Uᵀ = Vᵀ (T diag(β))ᵀ (a
    // warp per 16 value columns: token block i over j ≤ i), straight from the registers to the scratch.
    const int key_tiles = kdp / kTile, tiles = key_tiles + vdp / kTile;
    for (int tile = warp; tile < tiles; tile += kPrepareWarps) {
      if (tile < key_tiles) {
        const int c0 = kTile * tile;
        uint32_t b_frag[kC / kTile][2][2];
#pragma unroll
        for (int j = 0; j < kC / kTile; ++j) load_b_bf16_trans(b_frag[j], keys + kTile * j * ldk + c0, ldk);
        bf16* w_out = w_bf16(x, s, block);
#pragma unroll
        for (int i = 0; i < kC / kTile; ++i) {
          Accumulator acc;
          zero(acc);
#pragma unroll
          for (int j = 0; j <= i; ++j) {
            uint32_t a_frag[4];
            load_a_bf16(a_frag, w_factors + kTile * i * kFactorStride + kTile * j, kFactorStride);
            mma_bf16_tile(acc, a_frag, b_frag[j]);
          }
#pragma unroll
          for (int e = 0; e < 8; e += 2)
            *reinterpret_cast<uint32_t*>(w_out + (kTile * i + g + 8 * (e / 2 % 2)) * kdp + c0 + 8 * (e / 4) + 2 * t4) =
                pack_bf16(acc.x[e], acc.x[e + 1]);
        }
      } else {
        const int c0 = kTile * (tile - key_tiles);
        uint32_t v_frag[kC / kTile][4];
#pragma unroll
        for (int j = 0; j < kC / kTile; ++j) load_a_bf16_trans(v_frag[j], values + kTile * j * ldv + c0, ldv);
        bf16* u_out = delta_bf16(x, s, block);
#pragma unroll
        for (int i = 0; i < kC / kTile; ++i) {
          Accumulator acc;
          zero(acc);
#pragma unroll
          for (int j = 0; j <= i; ++j) {
            uint32_t b_frag[2][2];
            load_b_bf16(b_frag, u_factors + kTile * i * kFactorStride + kTile * j, kFactorStride);
            mma_bf16_tile(acc, v_frag[j], b_frag);
          }
#pragma unroll
          for (int e = 0; e < 8; e += 2)
            *reinterpret_cast<uint32_t*>(u_out + (c0 + g + 8 * (e / 2 % 2)) * kC + kTile * i + 8 * (e / 4) + 2 * t4) =
                pack_bf16(acc.x[e], acc.x[e + 1]);
        }
      }
    }
    if (head + 1 < group) __syncthreads();  // the next value head restages V and forms its A and T
  }
}

// The scan: block (head, slice of 64 value columns), 512 threads, one block an SM (at the release shape 96 blocks,
// each value head's W read twice, not four times as with 32-column slices; the key head's keys by its 3 value heads'
// 6 blocks). It works on the transposed state Sᵀ [64][dk], so that every product has both operands k-contiguous in
// shared memory (k-paired fragments):
//   Δᵀ = Uᵀ − Sᵀ Wᵀ (k = dk: Sᵀ rows, W rows),  Sᵀ ← e^{γ_C} Sᵀ + (Δᵀ diag(e^{γ_C−γ})) K (k = C: Δᵀ rows, Kᵀ rows).
// Its shared memory: two stages of {W [C][dk + 16], Kᵀ [dk][C + 16], e^{γ_C−γ} [C]} (the next chunk's operands load
// during the whole of the current chunk's math), Δᵀ (its columns scaled by e^{γ_C−γ}) and Sᵀ in fragment order (A
// operands; 32 row pairs of 2C + 16 and 2dk + 16 floats): 204 KB at dk = 128. Warp w owns the state
// tiles (value columns 16·(w%4), keys 16·(w/4) and 16·(w/4 + 4)) in registers across the chunks: it writes S₀ to the
// scratch and the final state from there, and Sᵀ to shared memory once a chunk for the Δ products. U comes to each
// warp's Δᵀ tile straight from global memory into registers, a chunk ahead; Δ goes back from registers.
constexpr int kScanThreads = 512;
constexpr int kTokenStride = kC + 16;      // Kᵀ rows: a k-paired B operand over the chunk's tokens
constexpr int kDeltaStride = 2 * kC + 16;  // Δᵀ's row pairs (fragment order)
constexpr int kScanRowPairs = kScanColumns / kTile * kPairRows;  // of Δᵀ and Sᵀ

__host__ __device__ inline size_t scan_stage_floats(const GdnShape& s) {
  return size_t(kC) * pair_stride_of(s.dk) + size_t(padded(s.dk)) * kTokenStride + kC;
}

size_t scan_shared_bytes(const GdnShape& s) {
  return (2 * scan_stage_floats(s) + size_t(kScanRowPairs) * (kDeltaStride + pair_rows_stride_of(s.dk))) * 4;
}

// A whole [kRows][kWidth] tile from source (rows kWidth floats apart, 16-byte aligned) into tile (row stride ld) by
// cp.async, 16 bytes a copy, by the scan's kScanThreads threads: the release's stages need neither stage_tile's zero
// padding nor its loop, whose index arithmetic took ~20 instructions a copy.
template <int kRows, int kWidth>
__device__ inline void stage_whole_tile(float* tile, int ld, const float* source) {
  constexpr int kVectors = kWidth / 4;  // float4s a row
  static_assert(kWidth % 4 == 0 && kRows * kVectors % kScanThreads == 0);
#pragma unroll
  for (int i = 0; i < kRows * kVectors / kScanThreads; ++i) {
    const int e = int(threadIdx.x) + i * kScanThreads, t = e / kVectors, c = e % kVectors * 4;
    __pipeline_memcpy_async(tile + t * ld + c, source + t * kWidth + c, 4 * sizeof(float));
  }
}

// The scan's progress counters: a release store after the block's barrier (thread 0's fence orders every thread's
// stores before the barrier ahead of the counter) and an acquire load.
__device__ inline void publish_progress(unsigned* counter, unsigned chunks_done) {
  __threadfence();
  atomicExch(counter, chunks_done);
}
__device__ inline unsigned load_progress(const unsigned* counter) {
  unsigned value;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(value) : "l"(counter) : "memory");
  return value;
}

// The row and column of accumulator element e within its tile (see Accumulator).
__device__ inline int row_of(int e) { return threadIdx.x % 32 / 4 + 8 * (e / 2 % 2); }
__device__ inline int column_of(int e) { return 8 * (e / 4) + 2 * (threadIdx.x % 4) + e % 2; }

// Per chunk, in order: S₀ to the scratch (from the owners' registers); Δᵀ = Uᵀ − Sᵀ Wᵀ (warp w: the tile at value
// columns 16·(w%4), tokens 16·(w/4)), Δ to the scratch (over U) and Δᵀ diag(e^{γ_C−γ}) to shared memory;
// Sᵀ ← e^{γ_C} Sᵀ + (Δᵀ diag(e^{γ_C−γ})) K (two key tiles a warp sharing the Δᵀ operand), Sᵀ to shared memory. Two
// barriers a chunk: the one at its start also frees the stage that the next chunk's operands then load into (the
// previous chunk's update was its last reader).
template <bool kRelease, bool kOnePass>
__global__ void __launch_bounds__(kScanThreads, 1)
    gdn_chunk_scan_kernel(GdnShape shape, int rows, ChunkScratch x, float* recurrent) {
  const GdnShape s = fixed<kRelease>(shape);
  allow_dependents();
  extern __shared__ __align__(128) float4 shared4[];
  const int kdp = padded(s.dk), ldw = pair_stride_of(s.dk), lds = pair_rows_stride_of(s.dk);
  const size_t stage_floats = scan_stage_floats(s);
  float* stages = reinterpret_cast<float*>(shared4);    // 2 × {W [C][ldw], Kᵀ [kdp][C + 16], e^{γ_C−γ} [C]}
  float* delta = stages + 2 * stage_floats;             // Δᵀ [32 row pairs][2C + 16]
  float* state = delta + kScanRowPairs * kDeltaStride;  // Sᵀ [32 row pairs][lds]
  const int h = blockIdx.x, key_head = h / (s.heads / s.key_heads), tid = threadIdx.x, warp = tid / 32;
  const int j0 = blockIdx.y * kScanColumns, columns = min(kScanColumns, s.dv - j0);
  const int chunks = (rows + kC - 1) / kC;
  const size_t dv = size_t(s.dv);
  float* head_state = recurrent + size_t(h) * s.dk * dv + j0;
  unsigned* progress = x.progress + h * x.scan_slices + blockIdx.y;
  const bool whole_tiles =
      kRelease && reinterpret_cast<uintptr_t>(x.w) % 16 == 0 && reinterpret_cast<uintptr_t>(x.keys) % 16 == 0 &&
      reinterpret_cast<uintptr_t>(x.key_decay) % 16 == 0;  // (the engine's scratch: 256-byte aligned)
  auto stage_chunk = [&](int chunk) {
    float* w = stages + (chunk % 2) * stage_floats;
    float *keys = w + kC * ldw, *key_decay = keys + kdp * kTokenStride;
    const size_t block = size_t(chunk) * s.heads + h;
    const float* w_rows = x.w + block * kC * s.dk;
    const float* key_rows = x.keys + (size_t(chunk) * s.key_heads + key_head) * kC * s.dk;
    const float* decays = x.key_decay + block * kC;
    if (whole_tiles) {
      stage_whole_tile<kC, kReleaseDim>(w, ldw, w_rows);
      stage_whole_tile<kReleaseDim, kC>(keys, kTokenStride, key_rows);
      if (tid < kC / 4) __pipeline_memcpy_async(key_decay + 4 * tid, decays + 4 * tid, 4 * sizeof(float));
      return;
    }
    stage_tile(w, ldw, kC, kdp, w_rows, size_t(s.dk), kC, s.dk);
    stage_tile(keys, kTokenStride, kdp, kC, key_rows, size_t(kC), s.dk, kC);
    stage_tile(key_decay, kC, 1, kC, decays, size_t(kC), 1, kC);
  };
  stage_chunk(0);

  // This warp's tiles: value columns c0 … c0 + 15 (Δᵀ and Sᵀ rows), Δᵀ's tokens d0 …, the state's key tiles.
  const int c0 = warp % 4 * kTile, d0 = warp / 4 * kTile, first_key_tile = warp / 4;
  float* state_rows = state + c0 / 2 * lds;           // this warp's tile of Sᵀ (its first row pair)
  float* delta_rows = delta + c0 / 2 * kDeltaStride;  // and of Δᵀ
  const int key_tiles = kdp / kTile;                  // ≤ 8 (dk ≤ 128): a warp owns at most two
  const bool owns[2] = {first_key_tile < key_tiles, first_key_tile + 4 < key_tiles};
  auto in_slice = [&](int e) { return c0 + row_of(e) < columns; };
  auto key_of = [&](int tile, int e) { return (first_key_tile + 4 * tile) * kTile + column_of(e); };
  Accumulator owned[2];  // Sᵀ at the owned key tiles; zero past dk and past the slice's columns
#pragma unroll
  for (int tile = 0; tile < 2; ++tile)
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int key = key_of(tile, e);
      owned[tile].x[e] = owns[tile] && key < s.dk && in_slice(e) ? head_state[key * dv + c0 + row_of(e)] : 0.0f;
    }
  auto store_owned = [&] {
#pragma unroll
    for (int tile = 0; tile < 2; ++tile)
      if (owns[tile]) store_a_pair<kOnePass>(state_rows + 2 * (first_key_tile + 4 * tile) * kTile, owned[tile], lds);
  };
  store_owned();

  // U of this warp's Δᵀ tile (element e: value column c0 + row_of(e), token d0 + column_of(e)), a chunk ahead.
  auto u_at = [&](int chunk) { return x.u + (size_t(chunk) * s.heads + h) * kC * dv + j0 + c0; };
  auto load_u = [&](float(&u)[8], int chunk) {
    const float* source = u_at(chunk);
#pragma unroll
    for (int e = 0; e < 8; ++e) u[e] = in_slice(e) ? source[(d0 + column_of(e)) * dv + row_of(e)] : 0.0f;
  };
  float u_next[8];
  load_u(u_next, 0);

  for (int chunk = 0; chunk < chunks; ++chunk) {
    const size_t block = size_t(chunk) * s.heads + h;
    const float decay = x.decay[block];  // loaded here, used in the state update
    float u[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) u[e] = u_next[e];
    if (chunk + 1 < chunks) load_u(u_next, chunk + 1);
    float* s0 = x.s0 + block * s.dk * dv + j0 + c0;  // S₀, for the outputs
#pragma unroll
    for (int tile = 0; tile < 2; ++tile)
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int key = key_of(tile, e);
        if (owns[tile] && key < s.dk && in_slice(e)) s0[key * dv + row_of(e)] = owned[tile].x[e];
      }
    wait_copies();    // this chunk's stage
    __syncthreads();  // ... for every thread, and Sᵀ; and the previous chunk is done with the other stage and Δᵀ
    if (chunk + 1 < chunks) stage_chunk(chunk + 1);
    const float* w = stages + (chunk % 2) * stage_floats;
    const float* keys = w + kC * ldw;                    // Kᵀ
    const float* key_decay = keys + kdp * kTokenStride;  // e^{γ_C−γ_t}

    {  // Δᵀ = Uᵀ − Sᵀ Wᵀ
      Accumulator product;
      fill(product, 0.0f);
      mma_tile_kpaired<kOnePass>(product, state_rows, lds, w + d0 * ldw, ldw, kdp / kPairK);
      float* target = u_at(chunk);  // Δ replaces U
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        product.x[e] = u[e] - product.x[e];
        if (in_slice(e)) target[(d0 + column_of(e)) * dv + row_of(e)] = product.x[e];
        product.x[e] *= key_decay[d0 + column_of(e)];  // Δᵀ diag(e^{γ_C−γ}) for the state update
      }
      store_a_pair<kOnePass>(delta_rows + 2 * d0, product, kDeltaStride);
    }
    __syncthreads();
    // Every thread stored the previous chunk's S₀ and Δ before this chunk's first barrier: the outputs may read them.
    // (Published here, half a chunk later, so that thread 0's fence finds those stores drained.)
    if (tid == 0 && chunk > 0) publish_progress(progress, unsigned(chunk));

      // Sᵀ ← e^{γ_C} Sᵀ + (Δᵀ diag(e^{γ_C−γ})) K on the owned tiles (every warp is done reading Sᵀ from shared memory).
#pragma unroll
    for (int tile = 0; tile < 2; ++tile)
#pragma unroll
      for (int e = 0; e < 8; ++e) owned[tile].x[e] *= decay;
    const float* keys_first = keys + first_key_tile * kTile * kTokenStride;
    if (owns[1])
      mma_tile_pair_kpaired<kOnePass>(owned[0], owned[1], delta_rows, kDeltaStride, keys_first,
                                      keys_first + 4 * kTile * kTokenStride, kTokenStride, kC / kPairK);
    else if (owns[0])
      mma_tile_kpaired<kOnePass>(owned[0], delta_rows, kDeltaStride, keys_first, kTokenStride, kC / kPairK);
    store_owned();
  }
  __syncthreads();
  if (tid == 0) publish_progress(progress, unsigned(chunks));
#pragma unroll
  for (int tile = 0; tile < 2; ++tile)
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int key = key_of(tile, e);
      if (owns[tile] && key < s.dk && in_slice(e)) head_state[key * dv + c0 + row_of(e)] = owned[tile].x[e];
    }
}

// The raw q rows of head h's key head in chunk `chunk` (zero past the input) into tile [C][ld] (tile_width ≥ dk
// columns, zero past dk), and their factors e^{γ_t} / (‖q_t‖ √dk) into factors [C]; asynchronously.
__device__ inline void stage_queries(float* tile, int ld, int tile_width, float* factors, const GdnShape& s,
                                     const GdnInputs& in, const ChunkScratch& x, int h, int chunk) {
  const int t0 = chunk * kC, n = min(kC, in.rows - t0), key_head = h / (s.heads / s.key_heads);
  stage_tile(tile, ld, kC, tile_width, in.qkv + size_t(t0) * s.conv_dim + key_head * s.dk, size_t(s.conv_dim), n, s.dk);
  stage_tile(factors, kC, 1, kC, x.q_factor + (size_t(chunk) * s.heads + h) * kC, size_t(kC), 1, kC);
}

// tile[t][c] = round_tf32(tile[t][c]) for t < rows, c < width (a multiple of 4; rows 16-byte aligned), by the block.
__device__ inline void round_in_place(float* tile, int ld, int rows, int width) {
  for (int e = 4 * threadIdx.x; e < rows * width; e += 4 * blockDim.x) {
    float4* words = reinterpret_cast<float4*>(tile + e / width * ld + e % width);
    const float4 x = *words;
    *words = make_float4(round_tf32(x.x), round_tf32(x.y), round_tf32(x.z), round_tf32(x.w));
  }
}

// Rows g and g + 8 of a tile whose rows start at factors: acc (the product with raw q rows) becomes Qd's.
__device__ inline void scale_rows(Accumulator& acc, const float* factors) {
  const int g = threadIdx.x % 32 / 4;
#pragma unroll
  for (int e = 0; e < 8; ++e) acc.x[e] *= factors[g + 8 * (e / 2 % 2)];
}

// Shared memory of the outputs: raw Q [C][ldk] (then the output tile [C][36]), P [C][C + 4], S₀ [kdp][36], Δ [C][36],
// q factors [C].
size_t output_shared_bytes(const GdnShape& s) {
  return (size_t(kC) * stride_of(s.dk) + size_t(kC) * kChunkStride + size_t(padded(s.dk)) * kSliceStride +
          size_t(kC) * kSliceStride + kC) *
         4;
}

// Block (head, chunk, slice of 32 value columns): O = Qd S₀ + P Δ, written to out [rows, heads·dv]. Warp w computes
// the tile (rows 16·(w/2), columns 16·(w%2)).
template <bool kOnePass>
__global__ void __launch_bounds__(kThreads)
    gdn_chunk_output_kernel(GdnShape s, GdnInputs in, ChunkScratch x, float* out) {
  allow_dependents();
  extern __shared__ __align__(128) float4 shared4[];
  const int kdp = padded(s.dk), ldk = stride_of(s.dk);
  float* qd = reinterpret_cast<float*>(shared4);  // [C][ldk]
  float* p = qd + kC * ldk;                       // [C][C + 4]
  float* s0 = p + kC * kChunkStride;              // [kdp][36]
  float* delta = s0 + kdp * kSliceStride;         // [C][36]
  float* factors = delta + kC * kSliceStride;     // [C]
  float* o = qd;  // [C][36] once every warp is done with its tiles (may run into P: at least 64·(20 + 68) floats)
  const int h = blockIdx.x, chunk = blockIdx.y, tid = threadIdx.x, warp = tid / 32;
  const int j0 = blockIdx.z * kSliceColumns, columns = min(kSliceColumns, s.dv - j0);
  const int t0 = chunk * kC, n = min(kC, in.rows - t0);
  const size_t block = size_t(chunk) * s.heads + h, dv = size_t(s.dv);
  stage_queries(qd, ldk, kdp, factors, s, in, x, h, chunk);
  stage_tile(p, kChunkStride, kC, kC, x.p + block * kC * kC, size_t(kC), kC, kC);
  stage_tile(s0, kSliceStride, kdp, kSliceColumns, x.s0 + block * s.dk * dv + j0, dv, s.dk, columns);
  stage_tile(delta, kSliceStride, kC, kSliceColumns, x.u + block * kC * dv + j0, dv, kC, columns);
  wait_copies();
  __syncthreads();

  const int r0 = warp / 2 * kTile, c0 = warp % 2 * kTile;
  Accumulator acc;
  fill(acc, 0.0f);
  mma_tile<kOnePass, RowMajor, RowMajor>(acc, qd + r0 * ldk, ldk, s0 + c0, kSliceStride, kdp / kStep);
  scale_rows(acc, factors + r0);
  mma_tile<kOnePass, RowMajor, RowMajor, true, false>(acc, p + r0 * kChunkStride, kChunkStride, delta + c0,
                                                      kSliceStride, kC / kStep);
  __syncthreads();  // every warp is done with Qd
  store_tile(o + r0 * kSliceStride + c0, acc, kSliceStride);
  __syncthreads();
  for (int e = tid; e < n * columns; e += kThreads) {
    const int t = e / columns, c = e % columns;
    out[(size_t(t0 + t) * s.heads + h) * dv + j0 + c] = o[t * kSliceStride + c];
  }
}

// The outputs and the gated norm in one kernel where dk and dv are multiples of 16, dv ≤ 128 and the operands fit in
// shared memory (the release): block (head, chunk), 256 threads, two blocks an SM, computes all dv columns, so it
// sees whole rows for the norm. Its operands are staged whole by cp.async in two phases over one region: Qd and S₀
// (then O = Qd S₀), then P, Δ and the gate inputs z in their place (O += P Δ, the norm); one block's loads overlap
// the other block's products. (Reading S₀ and Δ as fragments straight from global memory, one fragment ahead, left
// each block waiting on a global latency per k-step: ~45 µs a block.) Warp w computes column tile w of all four row
// tiles (two pairs, each sharing the B fragment), then the gated norm row by row (warp w: rows w, w + 8, …).
constexpr size_t kMaxDynamicShared = 227 * 1024;  // what a block may opt into on Hopper

size_t output_norm_shared_bytes(const GdnShape& s) {
  const size_t ldq = size_t(s.dk) + 4, ldo = size_t(operand_stride_of(s.dv));
  return std::max(kC * ldq + size_t(s.dk) * ldo + kC, size_t(kC) * kChunkStride + 2 * kC * ldo) * 4;
}

bool fused_output_fits(const GdnShape& s) {
  return s.dk % kTile == 0 && s.dv % kTile == 0 && s.dv / kTile <= kWarps &&
         output_norm_shared_bytes(s) <= kMaxDynamicShared;
}

// The outputs run as a dependent launch of the scan: their blocks start on the multiprocessors that the scan leaves
// free (at the release shape 36 of 132: its 96 blocks take a whole multiprocessor's shared memory each) and, chunk
// after chunk, follow it. Block (head, chunk) waits until every scan slice of its head has finished the chunk (its
// S₀ and Δ stored). The last chunk's blocks wait for the whole scan grid instead (griddepcontrol.wait, the launch
// rule's wait), so that this grid's completion implies the scan's, final state included; the other blocks skip that
// wait, which would hold their multiprocessors until the scan ends.
__device__ inline void wait_for_scan(const ChunkScratch& x, int h, int chunk) {
  if (chunk == int(gridDim.y) - 1) {
    wait_for_producers();
    return;
  }
  if (threadIdx.x < unsigned(x.scan_slices)) {
    const unsigned* counter = x.progress + h * x.scan_slices + threadIdx.x;
    while (load_progress(counter) <= unsigned(chunk)) __nanosleep(256);
  }
  __syncthreads();
}

// Block (head, chunk): O = Qd S₀ + P Δ, then out = w ⊙ rmsnorm(O) ⊙ gate(z).
template <bool kRelease, bool kOnePass>
__global__ void __launch_bounds__(kThreads, 2)
    gdn_chunk_output_norm_kernel(GdnShape shape, GdnInputs in, ChunkScratch x, float* out) {
  const GdnShape s = fixed<kRelease>(shape);
  allow_dependents();
  extern __shared__ __align__(128) float4 shared4[];
  const int ldq = s.dk + 4, ldo = operand_stride_of(s.dv);  // S₀ and Δ are row-major B operands

  float* qd = reinterpret_cast<float*>(shared4);  // phase 1: raw Q [C][dk + 4]
  float* s0 = qd + kC * ldq;                      //          S₀ [dk][dv + 8]
  float* factors = s0 + s.dk * ldo;               //          q factors [C]
  float* p = qd;                                  // phase 2: P [C][C + 4]
  float* delta = p + kC * kChunkStride;           //          Δ [C][dv + 8], then O
  float* gate = delta + kC * ldo;                 //          z [C][dv + 8]
  const int h = blockIdx.x, chunk = blockIdx.y, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int t0 = chunk * kC, n = min(kC, in.rows - t0);
  const size_t block = size_t(chunk) * s.heads + h, row_stride = size_t(s.heads) * s.dv;
  stage_queries(qd, ldq, s.dk, factors, s, in, x, h, chunk);  // the prepare kernel's, complete before the scan began
  wait_for_scan(x, h, chunk);
  stage_tile(s0, ldo, s.dk, s.dv, x.s0 + block * s.dk * s.dv, size_t(s.dv), s.dk, s.dv);
  wait_copies();
  __syncthreads();
  if constexpr (kOnePass) {  // Q rounded once here, not by each of the 8 warps that load it
    round_in_place(qd, ldq, kC, s.dk);
    __syncthreads();
  }

  const bool computes = warp < s.dv / kTile;
  const int c0 = warp * kTile;
  Accumulator acc[kC / kTile];
#pragma unroll
  for (int r = 0; r < kC / kTile; ++r) fill(acc[r], 0.0f);
  if (computes)
#pragma unroll
    for (int r = 0; r < kC / kTile; r += 2)
      mma_tile_pair<kOnePass, RowMajor, RowMajor, true, false>(
          acc[r], acc[r + 1], qd + r * kTile * ldq, qd + (r + 1) * kTile * ldq, ldq, s0 + c0, ldo, s.dk / kStep);
#pragma unroll
  for (int r = 0; r < kC / kTile; ++r) scale_rows(acc[r], factors + r * kTile);
  __syncthreads();  // Q, S₀ and the factors are used up

  stage_tile(p, kChunkStride, kC, kC, x.p + block * kC * kC, size_t(kC), kC, kC);
  stage_tile(delta, ldo, kC, s.dv, x.u + block * kC * s.dv, size_t(s.dv), kC, s.dv);
  stage_tile(gate, ldo, kC, s.dv, in.z + size_t(t0) * row_stride + size_t(h) * s.dv, row_stride, n, s.dv);
  wait_copies();
  __syncthreads();
  if (computes)
#pragma unroll
    for (int r = 0; r < kC / kTile; r += 2)
      mma_tile_pair<kOnePass, RowMajor, RowMajor, true, false>(acc[r], acc[r + 1], p + r * kTile * kChunkStride,
                                                               p + (r + 1) * kTile * kChunkStride, kChunkStride,
                                                               delta + c0, ldo, kC / kStep);
  __syncthreads();  // every warp is done with Δ
  if (computes)
#pragma unroll
    for (int r = 0; r < kC / kTile; ++r) store_tile(delta + r * kTile * ldo + c0, acc[r], ldo);
  __syncthreads();

  for (int t = warp; t < n; t += kWarps) {
    const float* row = delta + t * ldo;
    float sum = 0.0f;
    for (int j = lane; j < s.dv; j += 32) sum += row[j] * row[j];
    const float scale = 1.0f / sqrtf(warp_sum(sum) / float(s.dv) + in.eps);
    float* target = out + size_t(t0 + t) * row_stride + size_t(h) * s.dv;
    for (int j = lane; j < s.dv; j += 32)
      target[j] = in.norm[j] * (row[j] * scale) * output_gate(gate[t * ldo + j], in.sigmoid_gate);
  }
}

// ---- The bf16 mode's scan and outputs (GdnProducts::Bf16) ---------------------------------------------------------
//
// The scan: block (head, slice of 64 value columns), 4 compute warps and a stage warp (160 threads). Compute warp w
// owns the slice's value columns c0 = 16w … 16w + 15 of Sᵀ across all keys: kdp / 16 (8 at the release) 16 × 16 fp32
// accumulator tiles in its registers across the chunks, so no warp needs another's state or Δᵀ. Per chunk, with each
// tile's products in the same order as the s11-gdn16c scan's (8 warps that exchanged Sᵀ and Δᵀ through shared memory,
// two barriers a chunk):
//   Δᵀ (16 × 64 tokens) = Uᵀ − S₀ᵀ Wᵀ, the A fragments of S₀ᵀ converted in registers from the state's accumulators
//     (a_fragment_of: the C layout of two adjacent n8 halves is the A layout of a k-step); B = W from the stage
//     (ldmatrix); per Δᵀ tile two chains, even and odd key tiles;
//   Δᵀ diag(e^{γ_C−γ}) as bf16 A fragments, again in registers;
//   Sᵀ ← e^{γ_C} Sᵀ + (Δᵀ diag(e^{γ_C−γ})) K, B = K from the stage's Kᵀ.
// The bf16 words the products take (S₀ᵀ, Δᵀ diag(e^{γ_C−γ})) are the ones the earlier scan stored to shared memory and
// read back, so the results are bit for bit the same. S₀ᵀ and Δᵀ go to the scratch through a tile of the warp's own
// (stmatrix, then 16-byte loads and stores of whole 128-byte lines): stored from the fragments directly, 4 bytes a
// lane, each warp store touched 8 lines for 128 bytes, ~2300 L1 requests a block and chunk with the fragment loads of
// Uᵀ, and the scan ran at 348 µs (T = 8192, ncu), slower than the 8-warp scan. The stage warp makes every copy (W
// [C][kdp + 8], Kᵀ [kdp][C + 8], the slice's Uᵀ [64][C + 8], e^{γ_C−γ} and e^{γ_C} by cp.async, three stages in
// flight) and publishes the progress counter, so its fence (st.release: MEMBAR.ALL.GPU) holds no compute warp; the
// only barrier a chunk is the stage pipeline's. 158.8 KB at dk = 128 (one block an SM). fla's state pass
// (chunk_gated_delta_rule_fwd_kernel_h_blockdim64) has the same blocks, 4 warps of wgmma.
constexpr int kScanBf16ComputeWarps = 4;
constexpr int kScanBf16Threads = 32 * (kScanBf16ComputeWarps + 1);  // + the stage warp
constexpr int kScanBf16KeyTiles = kReleaseDim / kTile;              // Sᵀ tiles a warp (dk ≤ 128)
constexpr int kScanBf16TokenTiles = kC / kTile;                     // Δᵀ tiles a warp

__host__ __device__ inline size_t scan_bf16_stage_bytes(const GdnShape& s) {
  return (size_t(kC) * bf16_stride_of(s.dk) + size_t(padded(s.dk) + kScanColumns) * bf16_stride_of(kC)) * sizeof(bf16) +
         (kC + 4) * sizeof(float);
}

// Stages in flight: chunk c + 2's operands load while chunk c computes.
constexpr int kScanBf16Stages = 3;

// The compute warps' own tiles for the scratch: S₀ᵀ [16][kdp + 8] and Δᵀ [16][C + 8] a warp.
__host__ __device__ inline size_t scan_bf16_transfer_bytes(const GdnShape& s) {
  return size_t(kTile) * (bf16_stride_of(s.dk) + bf16_stride_of(kC)) * sizeof(bf16);
}

size_t scan_bf16_shared_bytes(const GdnShape& s) {
  return kScanBf16Stages * scan_bf16_stage_bytes(s) + kScanBf16ComputeWarps * scan_bf16_transfer_bytes(s);
}

// The A operand of one bf16 k-step from an accumulator tile whose 16 columns are that k-step's: lane (g, t) holds rows
// g, g + 8 at columns 2t, 2t + 1 (x[0 … 3]) and 2t + 8, 2t + 9 (x[4 … 7]), as the A layout of m16n8k16 wants them.
__device__ inline void a_fragment_of(uint32_t (&a)[4], const Accumulator& c) {
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = pack_bf16(c.x[2 * i], c.x[2 * i + 1]);
}

// The 16 × 16 bf16 tile of A fragment f (as load_a_bf16 reads it) to a (k contiguous, row stride ld): one
// stmatrix.x4, the four 8 × 8 matrices addressed as load_a_bf16 addresses them.
__device__ inline void store_a_bf16(bf16* a, int ld, const uint32_t (&f)[4]) {
  const int lane = threadIdx.x % 32;
  const unsigned address = unsigned(__cvta_generic_to_shared(a + (lane % 16) * ld + 8 * (lane / 16)));
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
               :
               : "r"(address), "r"(f[0]), "r"(f[1]), "r"(f[2]), "r"(f[3])
               : "memory");
}

// copy(r, v) for each 16-byte vector v (< vectors) of each row r (< rows) of a tile, by kCount threads (a block, or
// a warp's lanes; `thread` < kCount): where the threads cover whole rows and the rows a whole number of times (the
// release's tiles), each thread keeps one vector and steps kCount / vectors rows a constant number of times, so that
// the unrolled copies differ by constant offsets (a loop over e = thread + i · threads, r = e / vectors took ~20
// instructions a copy in the scan and the outputs).
template <int kCount, typename Copy>
__device__ inline void for_each_vector(int thread, int rows, int vectors, Copy copy) {
  if (kCount % vectors == 0 && rows % (kCount / vectors) == 0) {
    const int step = kCount / vectors, first = thread / vectors, v = thread % vectors;
#pragma unroll
    for (int i = 0; i < rows / step; ++i) copy(first + i * step, v);
    return;
  }
  for (int e = thread; e < rows * vectors; e += kCount) copy(e / vectors, e % vectors);
}

// rows × width bf16 (width a multiple of 8; source rows width apart, 16-byte aligned) into tile (row stride ld) by
// cp.async, 16 bytes a copy, by kCount threads (for_each_vector).
template <int kCount>
__device__ inline void stage_bf16_rows(bf16* tile, int ld, const bf16* source, int rows, int width, int thread) {
  for_each_vector<kCount>(thread, rows, width / 8, [&](int r, int v) {
    __pipeline_memcpy_async(tile + r * ld + 8 * v, source + r * width + 8 * v, 16);
  });
}

// The scan's progress counter as a release store after the block's barrier: the barrier orders every thread's
// stores ahead of thread 0's store, and release is cumulative, so a reader that acquires the counter sees them.
// (publish_progress's fence.sc — MEMBAR.SC.GPU — held warp 0, and with it the block's next barrier, until its
// latest stores had reached the device scope.)
__device__ inline void publish_progress_release(unsigned* counter, unsigned chunks_done) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" : : "l"(counter), "r"(chunks_done) : "memory");
}

// The first `valid` of rows × width bf16 of tile (row stride ld) to target (rows width apart, 16-byte aligned), 16
// bytes a copy, by one warp (for_each_vector over its lanes): each store covers whole 128-byte lines.
__device__ inline void write_bf16_rows_of_warp(bf16* target, const bf16* tile, int ld, int rows, int width, int valid,
                                               int lane) {
  for_each_vector<32>(lane, rows, width / 8, [&](int r, int v) {
    if (r < valid)
      *reinterpret_cast<uint4*>(target + r * width + 8 * v) = *reinterpret_cast<const uint4*>(tile + r * ld + 8 * v);
  });
}

template <bool kRelease>
__global__ void __launch_bounds__(kScanBf16Threads, 1)
    gdn_chunk_scan_bf16_kernel(GdnShape shape, int rows, ChunkScratch x, float* recurrent) {
  const GdnShape s = fixed<kRelease>(shape);
  allow_dependents();
  extern __shared__ __align__(128) float4 shared4[];
  const int kdp = padded(s.dk), vdp = padded(s.dv), ldw = bf16_stride_of(s.dk), ldt = bf16_stride_of(kC);
  const size_t stage_bytes = scan_bf16_stage_bytes(s);
  // kScanBf16Stages × {W [C][ldw], Kᵀ [kdp][ldt], Uᵀ [64][ldt], e^{γ_C−γ} [C] and e^{γ_C}}, then a transfer area a
  // compute warp
  char* stages = reinterpret_cast<char*>(shared4);
  const int h = blockIdx.x, key_head = h / (s.heads / s.key_heads), tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int chunks = (rows + kC - 1) / kC, j0 = blockIdx.y * kScanColumns;
  auto stage_w = [&](int chunk) { return reinterpret_cast<bf16*>(stages + (chunk % kScanBf16Stages) * stage_bytes); };
  auto stage_keys = [&](bf16* w) { return w + kC * ldw; };
  auto stage_u = [&](bf16* w) { return stage_keys(w) + kdp * ldt; };
  auto stage_decays = [&](bf16* w) { return reinterpret_cast<float*>(stage_u(w) + kScanColumns * ldt); };

  if (warp == kScanBf16ComputeWarps) {  // the stage warp: every copy into the stages, and the progress counter
    const int scratch_rows = kRelease ? kScanColumns : min(kScanColumns, vdp - j0);  // of the slice's Uᵀ rows
    auto stage_chunk = [&](int chunk) {
      bf16* w = stage_w(chunk);
      const size_t block = size_t(chunk) * s.heads + h;
      stage_bf16_rows<32>(w, ldw, w_bf16(x, s, block), kC, kdp, lane);
      stage_bf16_rows<32>(stage_keys(w), ldt, keys_bf16(x, s, chunk, key_head), kdp, kC, lane);
      stage_bf16_rows<32>(stage_u(w), ldt, delta_bf16(x, s, block) + size_t(j0) * kC, scratch_rows, kC, lane);
      if (lane < kC / 4)
        __pipeline_memcpy_async(stage_decays(w) + 4 * lane, x.key_decay + block * kC + 4 * lane, 4 * sizeof(float));
      if (lane == kC / 4) __pipeline_memcpy_async(stage_decays(w) + kC, x.decay + block, sizeof(float));
    };
    // One cp.async group a chunk (empty past the last), so that waiting for all but the newest kScanBf16Stages − 2
    // groups waits for exactly the current chunk's stage.
    for (int chunk = 0; chunk < kScanBf16Stages - 1; ++chunk) {
      if (chunk < chunks) stage_chunk(chunk);
      __pipeline_commit();
    }
    unsigned* progress = x.progress + h * x.scan_slices + blockIdx.y;
    for (int chunk = 0; chunk < chunks; ++chunk) {
      __pipeline_wait_prior(kScanBf16Stages - 2);  // this chunk's stage
      __syncthreads();  // ... for every warp; the compute warps are done with the previous chunk's stage
      // Every compute thread's S₀ᵀ and Δᵀ of the chunks before this one are stored.
      if (lane == 0 && chunk > 0) publish_progress_release(progress, unsigned(chunk));
      if (chunk + kScanBf16Stages - 1 < chunks) stage_chunk(chunk + kScanBf16Stages - 1);
      __pipeline_commit();
    }
    __syncthreads();
    if (lane == 0) publish_progress_release(progress, unsigned(chunks));
    return;
  }

  const int g = tid % 32 / 4, t = tid % 4, c0 = warp * kTile;
  const int columns = min(kScanColumns, s.dv - j0), key_tiles = kdp / kTile;
  // The warp's rows of S₀ᵀ and Δᵀ that the scratch holds, and their tiles on the way there.
  const int scratch_rows = kRelease ? kTile : min(kTile, vdp - j0 - c0);
  bf16* s0_tile = reinterpret_cast<bf16*>(stages + kScanBf16Stages * stage_bytes +
                                          warp * scan_bf16_transfer_bytes(s));  // S₀ᵀ [16][ldw]
  bf16* delta_tile = s0_tile + kTile * ldw;                                     // Δᵀ [16][ldt]
  const size_t dv = size_t(s.dv);
  float* head_state = recurrent + size_t(h) * s.dk * dv + j0 + c0;

  // At the release every key tile is owned and every row of every warp is in the slice and the scratch. Row half i of
  // a lane is value column c0 + g + 8i of the slice; word i of a fragment (a_fragment_of) is in row half i % 2 at
  // columns 8·(i / 2) + 2t, + 1.
  auto owns = [&](int tile) { return kRelease || tile < key_tiles; };
  auto in_slice = [&](int half) { return kRelease || c0 + g + 8 * half < columns; };
  auto in_scratch = [&](int half) { return kRelease || j0 + c0 + g + 8 * half < vdp; };  // a row of Uᵀ, Δᵀ and S₀ᵀ
  Accumulator state[kScanBf16KeyTiles];  // Sᵀ at key tile k; zero past dk and past the slice's columns
#pragma unroll
  for (int k = 0; k < kScanBf16KeyTiles; ++k)
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int key = k * kTile + column_of(e);
      state[k].x[e] = owns(k) && key < s.dk && in_slice(e / 2 % 2) ? head_state[key * dv + row_of(e)] : 0.0f;
    }

  for (int chunk = 0; chunk < chunks; ++chunk) {
    const size_t block = size_t(chunk) * s.heads + h;
    __syncthreads();  // this chunk's stage is in (the stage warp waited for its copies)
    const bf16* w = stage_w(chunk);
    const bf16* keys = stage_keys(stage_w(chunk));
    const float* key_decay = stage_decays(stage_w(chunk));
    const float decay = key_decay[kC];

    // Δᵀ = Uᵀ − S₀ᵀ Wᵀ, two token tiles at a time (registers), S₀ᵀ's fragments to the warp's S₀ᵀ tile on the way;
    // Δᵀ to the warp's Δᵀ tile, and Δᵀ diag(e^{γ_C−γ}) as the update's A fragments (k-step j: tokens 16j …).
    uint32_t scaled[kScanBf16TokenTiles][4];
#pragma unroll
    for (int pair = 0; pair < kScanBf16TokenTiles; pair += 2) {
      Accumulator even[2], odd[2];
      zero(even[0], even[1], odd[0], odd[1]);
#pragma unroll
      for (int k = 0; k < kScanBf16KeyTiles; ++k)
        if (owns(k)) {
          uint32_t a[4];
          a_fragment_of(a, state[k]);
          if (pair == 0) store_a_bf16(s0_tile + k * kTile, ldw, a);
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            uint32_t b[2][2];
            load_b_bf16(b, w + (pair + j) * kTile * ldw + k * kTile, ldw);
            mma_bf16_tile(k % 2 ? odd[j] : even[j], a, b);
          }
        }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        uint32_t u[4], delta[4];  // Uᵀ (zero past the scratch's rows) and Δᵀ, in fragment order
        load_a_bf16(u, stage_u(stage_w(chunk)) + c0 * ldt + (pair + j) * kTile, ldt);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int e = 2 * i, column = (pair + j) * kTile + 8 * (i / 2);
          const uint32_t u_word = in_scratch(i % 2) ? u[i] : 0u;
          const float first = low_bf16(u_word) - (even[j].x[e] + odd[j].x[e]);
          const float second = high_bf16(u_word) - (even[j].x[e + 1] + odd[j].x[e + 1]);
          delta[i] = pack_bf16(first, second);
          const float2 factors = *reinterpret_cast<const float2*>(key_decay + column + 2 * t);
          scaled[pair + j][i] = pack_bf16(first * factors.x, second * factors.y);
        }
        store_a_bf16(delta_tile + (pair + j) * kTile, ldt, delta);
      }
    }
    // S₀ᵀ and Δᵀ over Uᵀ to the scratch in whole lines (the tiles are reused after the next chunk's barrier).
    __syncwarp();
    write_bf16_rows_of_warp(s0_bf16(x, s, block) + size_t(j0 + c0) * kdp, s0_tile, ldw, kTile, kdp, scratch_rows, lane);
    write_bf16_rows_of_warp(delta_bf16(x, s, block) + size_t(j0 + c0) * kC, delta_tile, ldt, kTile, kC, scratch_rows,
                            lane);

    // Sᵀ ← e^{γ_C} Sᵀ + (Δᵀ diag(e^{γ_C−γ})) K.
#pragma unroll
    for (int k = 0; k < kScanBf16KeyTiles; ++k)
#pragma unroll
      for (int e = 0; e < 8; ++e) state[k].x[e] *= decay;
#pragma unroll
    for (int j = 0; j < kScanBf16TokenTiles; ++j)
#pragma unroll
      for (int k = 0; k < kScanBf16KeyTiles; ++k)
        if (owns(k)) {
          uint32_t b[2][2];
          load_b_bf16(b, keys + k * kTile * ldt + j * kTile, ldt);
          mma_bf16_tile(state[k], scaled[j], b);
        }
  }
  __syncthreads();  // the stage warp's last barrier
#pragma unroll
  for (int k = 0; k < kScanBf16KeyTiles; ++k)
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int key = k * kTile + column_of(e);
      if (owns(k) && key < s.dk && in_slice(e / 2 % 2)) head_state[key * dv + row_of(e)] = state[k].x[e];
    }
}
// The bf16 mode's outputs: block (head, chunk, slice of 128 value columns), 256 threads, O = diag(e^γ) Q S₀ + P Δ with
// every operand bf16 from the scratch, staged whole by cp.async (Q [C][kdp + 8], S₀ᵀ's slice [128][kdp + 8], P
// [C][C + 8], Δᵀ's slice [128][C + 8]) and, where the slice holds all of dv (dv ≤ 128), the gate inputs z [C][136]
// (112.5 KB at the release: two blocks an SM). Warp w computes column tile w of all four row tiles (the B fragment
// shared) and keeps O in its accumulators. With one slice the gated norm follows from the registers: a row's sum of
// squares over the lane's four values and the quad's lanes by shuffles, over the warps through shared memory (one
// thread a row for its scale), then z read at the accumulators' positions and the outputs stored as pairs; otherwise O
// goes to out and gdn_gated_norm_kernel runs after. The first look at the scan's progress goes out before the copies
// (look_at_scan), and z is staged last, in a cp.async group of its own that the norm waits for, so it arrives while
// the products run. Measured at T = 8192 (ncu, serialised; H200): until s12 O went through shared memory and the norm
// ran a warp a row (four values a lane, a butterfly, IEEE square root and division, a sigmoid with IEEE division an
// element): 2108 instructions a warp, 1368 of them the norm's, 47 % of the stall samples, 290 µs. The norm from the
// registers: 58 M warp instructions (was 104 M), 213–220 µs; the early look: 202; z last: 197 (at 3.9 TB/s of DRAM
// for 778 MB). Δᵀ in a group of its own as well (waited before P Δ, one barrier more) measured 195 µs but no faster in
// the whole pass.
constexpr int kOutputBf16Columns = 128;
// The row stride of z [C][136] (fp32): rows 8 banks apart, so that a half warp's 8-byte reads at its accumulators'
// positions (rows g, columns 2t) meet every bank once; column 128 + w of row t holds warp w's part of the sum of
// squares of O's row t.
constexpr int kGateStride = kOutputBf16Columns + kWarps;

size_t output_bf16_shared_bytes(const GdnShape& s) {
  return (kC + kOutputBf16Columns) * size_t(bf16_stride_of(s.dk) + bf16_stride_of(kC)) * sizeof(bf16) +
         2 * kC * sizeof(float) + size_t(kC) * kGateStride * sizeof(float);  // Q, S₀ᵀ, P, Δᵀ; factors, scales; z
}

// The output gate with the hardware's exponential and reciprocal: e^{−z} as ex2.approx.ftz(−z·log2 e) (relative error
// ~2⁻²²·(2 + 1.2|z|); flushed to 0 below 2⁻¹²⁶, where the gate is 1 to within that) and 1 / (1 + e^{−z}) by rcp.approx
// (0 where e^{−z} overflows), far inside the bf16 products' error; output_gate's expf and IEEE division took ~20
// instructions and a branch an element, __expf without ftz three more for its denormal range.
template <bool kSigmoid>
__device__ inline float fast_output_gate(float z) {
  float exponential;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(exponential) : "f"(z * -1.4426950408889634f));
  const float sigmoid = __fdividef(1.0f, 1.0f + exponential);
  return kSigmoid ? sigmoid : z * sigmoid;
}

// wait_for_scan's protocol (acquire loads of the head's progress counters until every scan slice has finished the
// chunk; the last chunk's blocks wait for the whole scan grid instead) with the first look taken before the block
// issues its copies: look_at_scan, then wait_for_scan_after with what it saw. The acquire load holds its warp until it
// returns (the L1 invalidation after it waits for the value), so it goes first, before that warp's copies and not
// behind the block's (Q, P and then also z: 56 KB); behind them the block waited there in 15 % of its stall samples.
__device__ inline unsigned look_at_scan(const ChunkScratch& x, int h, int chunk) {
  if (chunk == int(gridDim.y) - 1 || threadIdx.x >= unsigned(x.scan_slices)) return 0;
  return load_progress(x.progress + h * x.scan_slices + threadIdx.x);
}
__device__ inline void wait_for_scan_after(const ChunkScratch& x, int h, int chunk, unsigned seen) {
  if (chunk == int(gridDim.y) - 1) {
    wait_for_producers();
    return;
  }
  if (threadIdx.x < unsigned(x.scan_slices)) {
    const unsigned* counter = x.progress + h * x.scan_slices + threadIdx.x;
    while (seen <= unsigned(chunk)) {
      __nanosleep(256);
      seen = load_progress(counter);
    }
  }
  __syncthreads();
}

template <bool kRelease>
__global__ void __launch_bounds__(kThreads, 2)
    gdn_chunk_output_bf16_kernel(GdnShape shape, GdnInputs in, ChunkScratch x, float* out) {
  const GdnShape s = fixed<kRelease>(shape);
  allow_dependents();
  extern __shared__ __align__(128) float4 shared4[];
  const int kdp = padded(s.dk), vdp = padded(s.dv), ldk = bf16_stride_of(s.dk), ldt = bf16_stride_of(kC);
  bf16* queries = reinterpret_cast<bf16*>(shared4);                             // [C][ldk]
  bf16* s0 = queries + kC * ldk;                                                // S₀ᵀ [128][ldk]
  bf16* p = s0 + kOutputBf16Columns * ldk;                                      // [C][ldt]
  bf16* delta = p + kC * ldt;                                                   // Δᵀ [128][ldt]
  float* factors = reinterpret_cast<float*>(delta + kOutputBf16Columns * ldt);  // e^{γ_t} [C]
  float* scales = factors + kC;                                                 // the norm's 1 / rms [C]
  float* gate = scales + kC;                                                    // z [C][136] (one slice)
  const int h = blockIdx.x, chunk = blockIdx.y, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int j0 = blockIdx.z * kOutputBf16Columns;
  const int slice_rows = kRelease ? kOutputBf16Columns : min(kOutputBf16Columns, vdp - j0);  // one slice: the release
  const int t0 = chunk * kC, n = min(kC, in.rows - t0), key_head = h / (s.heads / s.key_heads);
  const size_t block = size_t(chunk) * s.heads + h, row_stride = size_t(s.heads) * s.dv;
  const unsigned seen = look_at_scan(x, h, chunk);
  // Prepare's (complete before the scan began), then the scan's.
  stage_bf16_rows<kThreads>(queries, ldk, queries_bf16(x, s, chunk, key_head), kC, kdp, int(threadIdx.x));
  stage_bf16_rows<kThreads>(p, ldt, p_bf16(x, block), kC, kC, int(threadIdx.x));
  if (tid < kC / 4) __pipeline_memcpy_async(factors + 4 * tid, x.q_factor + block * kC + 4 * tid, 4 * sizeof(float));
  // Lane (g, t) of warp w holds O's rows 16r + 8i + g at columns column + 8hh + j (acc[r].x[4hh + 2i + j]).
  const bool computes = warp * kTile < slice_rows;
  const int c0 = warp * kTile, g = lane / 4, t = lane % 4, column = j0 + c0 + 2 * t;
  auto valid = [&](int e) { return kRelease || (computes && column + 8 * (e / 4) + e % 2 < s.dv); };
  float weight[2][2];  // the norm's, at the lane's columns
#pragma unroll
  for (int hh = 0; hh < 2; ++hh)
#pragma unroll
    for (int j = 0; j < 2; ++j) weight[hh][j] = valid(4 * hh + j) ? in.norm[column + 8 * hh + j] : 0.0f;
  wait_for_scan_after(x, h, chunk, seen);
  stage_bf16_rows<kThreads>(s0, ldk, s0_bf16(x, s, block) + size_t(j0) * kdp, slice_rows, kdp, int(threadIdx.x));
  stage_bf16_rows<kThreads>(delta, ldt, delta_bf16(x, s, block) + size_t(j0) * kC, slice_rows, kC, int(threadIdx.x));
  __pipeline_commit();   // the products' operands
  if (gridDim.z == 1) {  // the norm's gate inputs, last: they arrive while the products run
    const float* z = in.z + size_t(t0) * row_stride + size_t(h) * s.dv;
    if (kRelease && reinterpret_cast<uintptr_t>(z) % 16 == 0)  // stage_tile's result, at constant offsets
      for_each_vector<kThreads>(int(threadIdx.x), kC, kReleaseDim / 4, [&](int t, int v) {
        float* target = gate + t * kGateStride + 4 * v;
        if (t < n)
          __pipeline_memcpy_async(target, z + t * row_stride + 4 * v, 4 * sizeof(float));
        else
          *reinterpret_cast<float4*>(target) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      });
    else
      stage_tile(gate, kGateStride, kC, vdp, z, row_stride, n, s.dv);
  }
  __pipeline_commit();
  __pipeline_wait_prior(1);
  __syncthreads();

  Accumulator acc[kC / kTile];
#pragma unroll
  for (int r = 0; r < kC / kTile; ++r) fill(acc[r], 0.0f);
  if (computes) {
#pragma unroll 2
    for (int k = 0; k < kdp / kTile; ++k) {
      uint32_t b_frag[2][2];
      load_b_bf16(b_frag, s0 + c0 * ldk + k * kTile, ldk);
#pragma unroll
      for (int r = 0; r < kC / kTile; ++r) {
        uint32_t a_frag[4];
        load_a_bf16(a_frag, queries + r * kTile * ldk + k * kTile, ldk);
        mma_bf16_tile(acc[r], a_frag, b_frag);
      }
    }
#pragma unroll
    for (int r = 0; r < kC / kTile; ++r) scale_rows(acc[r], factors + r * kTile);
#pragma unroll
    for (int k = 0; k < kC / kTile; ++k) {
      uint32_t b_frag[2][2];
      load_b_bf16(b_frag, delta + c0 * ldt + k * kTile, ldt);
#pragma unroll
      for (int r = 0; r < kC / kTile; ++r) {
        uint32_t a_frag[4];
        load_a_bf16(a_frag, p + r * kTile * ldt + k * kTile, ldt);
        mma_bf16_tile(acc[r], a_frag, b_frag);
      }
    }
  }

  float* target = out + size_t(t0) * row_stride + size_t(h) * s.dv + column;  // row 0 of the lane's first column
  if (!kRelease && gridDim.z > 1) {                                           // O alone; the norm runs after
#pragma unroll
    for (int r = 0; r < kC / kTile; ++r)
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int row = kTile * r + 8 * (e / 2 % 2) + g;
        if (row < n && valid(e)) target[row * row_stride + 8 * (e / 4) + e % 2] = acc[r].x[e];
      }
    return;
  }
  // The norm. Each row's sum of squares: the lane's four values, the quad's, then the warps' parts (in z's column 128 +
  // warp) summed by one thread a row.
#pragma unroll
  for (int r = 0; r < kC / kTile; ++r)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float sum = 0.0f;
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int e = 4 * hh + 2 * i + j;
          if (valid(e)) sum += acc[r].x[e] * acc[r].x[e];
        }
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      if (t == 0) gate[(kTile * r + 8 * i + g) * kGateStride + kOutputBf16Columns + warp] = sum;
    }
  __pipeline_wait_prior(0);  // z
  __syncthreads();
  if (tid < kC) {
    const float4* part = reinterpret_cast<const float4*>(gate + tid * kGateStride + kOutputBf16Columns);
    const float4 a = part[0], b = part[1];
    scales[tid] = rms_scale(((a.x + a.y) + (a.z + a.w)) + ((b.x + b.y) + (b.z + b.w)), 1.0f / float(s.dv), in.eps);
  }
  __syncthreads();
  const bool pairs = kRelease && reinterpret_cast<uintptr_t>(out) % 8 == 0;
  auto gated_rows = [&](auto sigmoid) {  // std::bool_constant: the gate's kind
#pragma unroll
    for (int r = 0; r < kC / kTile; ++r)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int row = kTile * r + 8 * i + g;
        if (row >= n) continue;
        const float scale = scales[row];
        const float* z = gate + row * kGateStride + c0 + 2 * t;
        float* row_target = target + row * row_stride;
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int e = 4 * hh + 2 * i;
          const float2 zz = *reinterpret_cast<const float2*>(z + 8 * hh);
          const float v0 = acc[r].x[e] * scale * weight[hh][0] * fast_output_gate<decltype(sigmoid)::value>(zz.x);
          const float v1 = acc[r].x[e + 1] * scale * weight[hh][1] * fast_output_gate<decltype(sigmoid)::value>(zz.y);
          if (pairs) {
            *reinterpret_cast<float2*>(row_target + 8 * hh) = make_float2(v0, v1);
          } else {
            if (valid(e)) row_target[8 * hh] = v0;
            if (valid(e + 1)) row_target[8 * hh + 1] = v1;
          }
        }
      }
  };
  if (in.sigmoid_gate)
    gated_rows(std::true_type{});
  else
    gated_rows(std::false_type{});
}

// o = w ⊙ rmsnorm(o) ⊙ gate(z) per head of dv values, in place; one warp per (row, head), kWarps a block.
__global__ void __launch_bounds__(kThreads) gdn_gated_norm_kernel(float* core, const float* z, const float* weight,
                                                                  int groups, int dv, float eps, bool sigmoid_gate) {
  allow_dependents();
  const int group = blockIdx.x * kWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (group >= groups) return;
  float* o = core + size_t(group) * dv;
  const float* gate = z + size_t(group) * dv;
  float sum = 0.0f;
  for (int j = lane; j < dv; j += 32) sum += o[j] * o[j];
  const float scale = 1.0f / sqrtf(warp_sum(sum) / float(dv) + eps);
  for (int j = lane; j < dv; j += 32) o[j] = weight[j] * (o[j] * scale) * output_gate(gate[j], sigmoid_gate);
}

}  // namespace

size_t gdn_chunk_scratch_floats(const GdnShape& s, int rows) {
  size_t total = 0;
  chunk_scratch(s, rows, nullptr, &total);
  return total;
}

GdnProducts gdn_prefill_products() {
  switch (gemm_precision()) {
    case GemmPrecision::Fp32:
      return GdnProducts::Tf32x3;
    case GemmPrecision::Tf32:
      return GdnProducts::Tf32;
    case GemmPrecision::Bf16:
      return GdnProducts::Bf16;
  }
  return GdnProducts::Tf32x3;
}

namespace {

// Value heads a prepare block takes (see value_heads_per_key_head): one where the blocks of one value head all fit on
// the GPU at once (then the pass takes about one block's time, and a block of one value head is the shorter), else
// the key head's. Measured on the H200 (release shape, 132 SMs, 2 blocks an SM; whole prefill, 3×TF32): at T = 64
// 48 blocks of one value head 64 µs against 85 for 16 key-head blocks, at T = 256 (192 against 64 blocks) 98 against
// 108; at T = 512 (384 against 128) the key head's are the faster, 148 against 154 µs.
int prepare_group(const GdnShape& s, int chunks, GdnPrepareBlocks blocks, const void* kernel, size_t bytes_of_one) {
  const int key_group = value_heads_per_key_head(s);
  if (blocks != GdnPrepareBlocks::Auto) return blocks == GdnPrepareBlocks::PerValueHead ? 1 : key_group;
  int device = 0, multiprocessors = 0, per_multiprocessor = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_multiprocessor, kernel, kPrepareThreads, bytes_of_one);
  return long(s.heads) * chunks <= long(multiprocessors) * per_multiprocessor ? 1 : key_group;
}

// The three (or four) launches at one arithmetic; gdn_prefill picks the instantiation.
template <bool kOnePass>
void launch_prefill(const GdnShape& s, const GdnInputs& in, const ChunkScratch& x, float* recurrent, float* out,
                    cudaStream_t stream, GdnPrepareBlocks blocks) {
  const unsigned chunks = unsigned((in.rows + kC - 1) / kC), heads = unsigned(s.heads);
  const unsigned slices = unsigned((s.dv + kSliceColumns - 1) / kSliceColumns);
  const bool release = is_release(s);
  const auto prepare = release ? gdn_chunk_prepare_kernel<true, kOnePass> : gdn_chunk_prepare_kernel<false, kOnePass>;
  cudaFuncSetAttribute(prepare, cudaFuncAttributeMaxDynamicSharedMemorySize,
                       int(prepare_shared_bytes(s, value_heads_per_key_head(s))));  // the larger
  const int group =
      prepare_group(s, int(chunks), blocks, reinterpret_cast<const void*>(prepare), prepare_shared_bytes(s, 1));
  prepare<<<dim3(heads / unsigned(group), chunks), kPrepareThreads, prepare_shared_bytes(s, group), stream>>>(s, in, x,
                                                                                                              group);
  const size_t scan_bytes = scan_shared_bytes(s);
  const unsigned scan_slices = unsigned(x.scan_slices);
  const auto scan = release ? gdn_chunk_scan_kernel<true, kOnePass> : gdn_chunk_scan_kernel<false, kOnePass>;
  cudaFuncSetAttribute(scan, cudaFuncAttributeMaxDynamicSharedMemorySize, int(scan_bytes));
  scan<<<dim3(heads, scan_slices), kScanThreads, scan_bytes, stream>>>(s, in.rows, x, recurrent);
  if (fused_output_fits(s)) {
    const size_t bytes = output_norm_shared_bytes(s);
    const auto output =
        release ? gdn_chunk_output_norm_kernel<true, kOnePass> : gdn_chunk_output_norm_kernel<false, kOnePass>;
    cudaFuncSetAttribute(output, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
    launch_dependent(output, dim3(heads, chunks), dim3(kThreads), bytes, stream, s, in, x, out);
    return;
  }
  const size_t output_bytes = output_shared_bytes(s);
  const auto output = gdn_chunk_output_kernel<kOnePass>;
  cudaFuncSetAttribute(output, cudaFuncAttributeMaxDynamicSharedMemorySize, int(output_bytes));
  output<<<dim3(heads, chunks, slices), kThreads, output_bytes, stream>>>(s, in, x, out);
  const int groups = in.rows * s.heads;
  gdn_gated_norm_kernel<<<blocks_for(groups, kWarps), kThreads, 0, stream>>>(out, in.z, in.norm, groups, s.dv, in.eps,
                                                                             in.sigmoid_gate);
}

// The bf16 mode's launches: prepare (its bf16 instantiation), the bf16 scan, its outputs as a dependent launch in
// slices of 128 value columns (the gated norm fused where one slice holds dv, else a separate norm launch).
void launch_prefill_bf16(const GdnShape& s, const GdnInputs& in, const ChunkScratch& x, float* recurrent, float* out,
                         cudaStream_t stream, GdnPrepareBlocks blocks) {
  const unsigned chunks = unsigned((in.rows + kC - 1) / kC), heads = unsigned(s.heads);
  const bool release = is_release(s);
  const auto prepare = release ? gdn_chunk_prepare_bf16_kernel<true> : gdn_chunk_prepare_bf16_kernel<false>;
  cudaFuncSetAttribute(prepare, cudaFuncAttributeMaxDynamicSharedMemorySize,
                       int(prepare_bf16_shared_bytes(s, value_heads_per_key_head(s))));
  const int group =
      prepare_group(s, int(chunks), blocks, reinterpret_cast<const void*>(prepare), prepare_bf16_shared_bytes(s, 1));
  prepare<<<dim3(heads / unsigned(group), chunks), kPrepareThreads, prepare_bf16_shared_bytes(s, group), stream>>>(
      s, in, x, group);
  const size_t scan_bytes = scan_bf16_shared_bytes(s);
  const auto scan = release ? gdn_chunk_scan_bf16_kernel<true> : gdn_chunk_scan_bf16_kernel<false>;
  cudaFuncSetAttribute(scan, cudaFuncAttributeMaxDynamicSharedMemorySize, int(scan_bytes));
  scan<<<dim3(heads, unsigned(x.scan_slices)), kScanBf16Threads, scan_bytes, stream>>>(s, in.rows, x, recurrent);
  const unsigned slices = unsigned((padded(s.dv) + kOutputBf16Columns - 1) / kOutputBf16Columns);
  const size_t bytes = output_bf16_shared_bytes(s);
  const auto output = release ? gdn_chunk_output_bf16_kernel<true> : gdn_chunk_output_bf16_kernel<false>;
  cudaFuncSetAttribute(output, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  launch_dependent(output, dim3(heads, chunks, slices), dim3(kThreads), bytes, stream, s, in, x, out);
  if (slices == 1) return;
  const int groups = in.rows * s.heads;
  gdn_gated_norm_kernel<<<blocks_for(groups, kWarps), kThreads, 0, stream>>>(out, in.z, in.norm, groups, s.dv, in.eps,
                                                                             in.sigmoid_gate);
}

}  // namespace

void gdn_prefill(const GdnShape& s, const GdnInputs& in, float* recurrent, float* scratch, float* out,
                 cudaStream_t stream, GdnProducts products, GdnPrepareBlocks prepare_blocks) {
  if (in.rows <= 0) return;
  const ChunkScratch x = chunk_scratch(s, in.rows, scratch, nullptr);
  if (products == GdnProducts::Bf16)
    launch_prefill_bf16(s, in, x, recurrent, out, stream, prepare_blocks);
  else if (products == GdnProducts::Tf32)
    launch_prefill<true>(s, in, x, recurrent, out, stream, prepare_blocks);
  else
    launch_prefill<false>(s, in, x, recurrent, out, stream, prepare_blocks);
}

}  // namespace vavilov::cuda
