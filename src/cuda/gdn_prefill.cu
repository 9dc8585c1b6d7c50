#include <mma.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/gdn_common.cuh"
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
// U by blocked forward substitution, plus P[t,s] = e^{γ_t−γ_s} q_t·k_s for s ≤ t, Qd = diag(e^γ) Q and
// Kd = diag(e^{γ_C−γ}) K), scan (chunk after chunk per head and 64-column slice: Δ = U − W S, S ← e^{γ_C} S + Kdᵀ Δ,
// recording each chunk's S₀), outputs (all chunks in parallel: O = Qd S₀ + P Δ), then the gated norm.
//
// Every matrix product runs on tensor cores as 3×TF32: each fp32 operand x is split into a tf32 hi and lo = x − hi
// (split_tf32), and hi·hi + hi·lo + lo·hi is accumulated in fp32. The dropped lo·lo term and the truncation of lo are
// ~2⁻²⁰ relative, so the products keep fp32 accuracy (plain TF32, ~2⁻¹¹, would not meet the tests' 1e-4).
// Tiles are 16 × 16 (k-steps of 8); shared-memory tiles are zero-padded to multiples of 16 and their row strides are
// a multiple of 16 plus 4 floats, so the fragment loads spread over the banks.

namespace wmma = nvcuda::wmma;
using Accumulator = wmma::fragment<wmma::accumulator, 16, 16, 8, float>;
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

// Splits the fp32 values of a loaded fragment into hi, x with its low 13 mantissa bits cleared (a tf32 value), and
// lo = x − hi (exact in fp32, |lo| < 2⁻¹⁰|x|). lo goes to the tensor cores as it is: they read the top 19 bits of
// an operand, so lo is truncated to tf32 there (error < 2⁻²⁰|x|). Two instructions a value, where rounding both
// parts with __float_to_tf32 (and its inf/nan guard) took about nine.
template <typename Fragment>
__device__ inline void split_tf32(Fragment& hi, Fragment& lo) {
#pragma unroll
  for (int e = 0; e < hi.num_elements; ++e) {
    const float x = hi.x[e];
    hi.x[e] = __uint_as_float(__float_as_uint(x) & 0xffffe000u);
    lo.x[e] = x - hi.x[e];
  }
}

// acc += A B over `steps` k-steps of 8: A is 16 × 8·steps at a (layout LayoutA, stride lda), B is 8·steps × 16 at b
// (layout LayoutB, stride ldb); one warp, 3×TF32. The hi·hi products and the two kinds of cross terms go to three
// accumulators, so three chains of dependent mma run side by side instead of one three times as long.
template <typename LayoutA, typename LayoutB>
__device__ inline void mma_3xtf32(Accumulator& acc, const float* a, int lda, const float* b, int ldb, int steps) {
  constexpr bool a_rows = std::is_same_v<LayoutA, wmma::row_major>;
  constexpr bool b_rows = std::is_same_v<LayoutB, wmma::row_major>;
  Accumulator lo_hi, hi_lo;
  wmma::fill_fragment(lo_hi, 0.0f);
  wmma::fill_fragment(hi_lo, 0.0f);
#pragma unroll 4  // lets the fragment loads of later k-steps run ahead of the mma chains
  for (int k = 0; k < steps; ++k) {
    wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, LayoutA> a_hi, a_lo;
    wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, LayoutB> b_hi, b_lo;
    wmma::load_matrix_sync(a_hi, a + (a_rows ? k * kStep : k * kStep * lda), unsigned(lda));
    wmma::load_matrix_sync(b_hi, b + (b_rows ? k * kStep * ldb : k * kStep), unsigned(ldb));
    split_tf32(a_hi, a_lo);
    split_tf32(b_hi, b_lo);
    wmma::mma_sync(lo_hi, a_lo, b_hi, lo_hi);
    wmma::mma_sync(hi_lo, a_hi, b_lo, hi_lo);
    wmma::mma_sync(acc, a_hi, b_hi, acc);
  }
#pragma unroll
  for (int e = 0; e < acc.num_elements; ++e) acc.x[e] += lo_hi.x[e] + hi_lo.x[e];
}

// first += A₀ B and second += A₁ B (as mma_3xtf32; A₀ at a0, A₁ at a1, one B): two independent tiles interleaved, B
// loaded and split once.
template <typename LayoutA, typename LayoutB>
__device__ inline void mma_pair_3xtf32(Accumulator& first, Accumulator& second, const float* a0, const float* a1,
                                       int lda, const float* b, int ldb, int steps) {
  constexpr bool a_rows = std::is_same_v<LayoutA, wmma::row_major>;
  constexpr bool b_rows = std::is_same_v<LayoutB, wmma::row_major>;
  Accumulator cross0, cross1;  // both cross terms of each tile
  wmma::fill_fragment(cross0, 0.0f);
  wmma::fill_fragment(cross1, 0.0f);
#pragma unroll 2
  for (int k = 0; k < steps; ++k) {
    wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, LayoutA> a0_hi, a0_lo, a1_hi, a1_lo;
    wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, LayoutB> b_hi, b_lo;
    const int a_offset = a_rows ? k * kStep : k * kStep * lda;
    wmma::load_matrix_sync(b_hi, b + (b_rows ? k * kStep * ldb : k * kStep), unsigned(ldb));
    wmma::load_matrix_sync(a0_hi, a0 + a_offset, unsigned(lda));
    wmma::load_matrix_sync(a1_hi, a1 + a_offset, unsigned(lda));
    split_tf32(b_hi, b_lo);
    split_tf32(a0_hi, a0_lo);
    split_tf32(a1_hi, a1_lo);
    wmma::mma_sync(cross0, a0_lo, b_hi, cross0);
    wmma::mma_sync(cross1, a1_lo, b_hi, cross1);
    wmma::mma_sync(first, a0_hi, b_hi, first);
    wmma::mma_sync(second, a1_hi, b_hi, second);
    wmma::mma_sync(cross0, a0_hi, b_lo, cross0);
    wmma::mma_sync(cross1, a1_hi, b_lo, cross1);
  }
#pragma unroll
  for (int e = 0; e < first.num_elements; ++e) first.x[e] += cross0.x[e], second.x[e] += cross1.x[e];
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

// Scratch regions, each [chunks][heads][...]; U is overwritten by Δ in the scan.
struct ChunkScratch {
  float *w, *u, *qd, *kd, *p, *s0, *decay;  // [C, dk], [C, dv], [C, dk], [C, dk], [C, C], [dk, dv], [1]
};

ChunkScratch chunk_scratch(const GdnShape& s, int rows, float* base, size_t* total) {
  const size_t blocks = size_t((rows + kC - 1) / kC) * size_t(s.heads);
  const size_t dk = size_t(s.dk), dv = size_t(s.dv);
  size_t offset = 0;
  auto take = [&](size_t per_block) {
    float* at = base ? base + offset : nullptr;
    offset += (blocks * per_block + 63) / 64 * 64;  // keeps every region 256-byte aligned
    return at;
  };
  ChunkScratch x;
  x.w = take(kC * dk);
  x.u = take(kC * dv);
  x.qd = take(kC * dk);
  x.kd = take(kC * dk);
  x.p = take(kC * kC);
  x.s0 = take(dk * dv);
  x.decay = take(1);
  if (total) *total = offset;
  return x;
}

// Shared memory of the prepare kernel: γ, β; keys [C][ldk]; queries, later values [C][ldx]; A and Q Kᵀ [C][C + 4].
size_t prepare_shared_bytes(const GdnShape& s) {
  const size_t ldk = size_t(stride_of(s.dk)), ldx = size_t(std::max(stride_of(s.dk), stride_of(s.dv)));
  return (2 * size_t(kC) + kC * ldk + kC * ldx + 2 * size_t(kC) * kChunkStride) * 4;
}

// Block (head, chunk), 256 threads.
template <bool kRelease>
__global__ void __launch_bounds__(kThreads) gdn_chunk_prepare_kernel(GdnShape shape, GdnInputs in, ChunkScratch x) {
  const GdnShape s = fixed<kRelease>(shape);
  allow_dependents();
  extern __shared__ __align__(128) float4 shared4[];
  const int kdp = padded(s.dk), vdp = padded(s.dv);
  const int ldk = stride_of(s.dk), ldx = max(stride_of(s.dk), stride_of(s.dv));
  float* gamma = reinterpret_cast<float*>(shared4);  // [C] inclusive cumulative log decay
  float* beta = gamma + kC;                          // [C]
  float* keys = beta + kC;                           // [C][ldk]: normalised K, then diag(β e^γ) K, then W
  float* queries = keys + kC * ldk;                  // [C][ldx]: normalised Q scaled by 1/√dk
  float* values = queries;                           // [C][ldx]: diag(β) V, then U (once Q is used up)
  float* a = queries + kC * ldx;                     // [C][C + 4]: K Kᵀ, then A (strictly lower)
  float* qk = a + kC * kChunkStride;                 // [C][C + 4]: Q Kᵀ
  const int h = blockIdx.x, chunk = blockIdx.y, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int t0 = chunk * kC, n = min(kC, in.rows - t0);
  const int key_head = h / (s.heads / s.key_heads);
  const size_t block = size_t(chunk) * s.heads + h;

  // Raw q and k rows, zero past the input and past dk.
  const float* q_rows = in.qkv + size_t(t0) * s.conv_dim + key_head * s.dk;
  stage_tile(queries, ldx, kC, kdp, q_rows, size_t(s.conv_dim), n, s.dk);
  stage_tile(keys, ldk, kC, kdp, q_rows + s.key_dim, size_t(s.conv_dim), n, s.dk);
  if (tid < kC) {  // rows past the input: β = 0, g = 0 (they change nothing)
    float g = 0.0f, b = 0.0f;
    if (tid < n) {
      const size_t at = size_t(t0 + tid) * s.heads + h;
      g = log_decay(in, h, at);
      b = sigmoid(in.b[at]);
    }
    gamma[tid] = g;
    beta[tid] = b;
  }
  wait_copies();
  __syncthreads();
  if (warp == 0) {  // inclusive scan of the 64 decays, two per lane
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
  const float q_scale = 1.0f / sqrtf(float(s.dk));
  for (int t = warp; t < n; t += kWarps) {  // l2-normalise in place (each lane rescales what it summed)
    float q_sum = 0.0f, k_sum = 0.0f;
    for (int i = lane; i < s.dk; i += 32) {
      q_sum += queries[t * ldx + i] * queries[t * ldx + i];
      k_sum += keys[t * ldk + i] * keys[t * ldk + i];
    }
    const float q_norm = 1.0f / sqrtf(warp_sum(q_sum) + 1e-6f) * q_scale;
    const float k_norm = 1.0f / sqrtf(warp_sum(k_sum) + 1e-6f);
    for (int i = lane; i < s.dk; i += 32) {
      queries[t * ldx + i] *= q_norm;
      keys[t * ldk + i] *= k_norm;
    }
  }
  __syncthreads();

  // K Kᵀ and Q Kᵀ: the 10 tiles of each on or below the diagonal (those above are masked below), ≤ 3 a warp.
  for (int tile = warp; tile < 20; tile += kWarps) {
    const bool q_rows_tile = tile >= 10;
    const int lower = tile % 10, row = lower >= 6 ? 3 : lower >= 3 ? 2 : lower >= 1 ? 1 : 0;
    const int r0 = row * kTile, c0 = (lower - row * (row + 1) / 2) * kTile;
    Accumulator acc;
    wmma::fill_fragment(acc, 0.0f);
    const float* left = q_rows_tile ? queries + r0 * ldx : keys + r0 * ldk;
    mma_3xtf32<wmma::row_major, wmma::col_major>(acc, left, q_rows_tile ? ldx : ldk, keys + c0 * ldk, ldk, kdp / kStep);
    wmma::store_matrix_sync((q_rows_tile ? qk : a) + r0 * kChunkStride + c0, acc, kChunkStride, wmma::mem_row_major);
  }
  __syncthreads();

  // A and P with their decays and masks; Qd, Kd and the chunk's decay to the scratch.
  float* p = x.p + block * kC * kC;
  for (int e = tid; e < kC * kC; e += kThreads) {
    const int t = e / kC, u = e % kC;
    const float decay = u <= t ? expf(gamma[t] - gamma[u]) : 0.0f;
    a[t * kChunkStride + u] = u < t ? beta[t] * decay * a[t * kChunkStride + u] : 0.0f;
    p[e] = u <= t ? decay * qk[t * kChunkStride + u] : 0.0f;
  }
  const float gamma_end = gamma[kC - 1];
  float* qd = x.qd + block * kC * s.dk;
  float* kd = x.kd + block * kC * s.dk;
  for (int t = warp; t < kC; t += kWarps) {  // a warp a row: e^{γ_t} and e^{γ_C−γ_t} once per row
    const float to_row = expf(gamma[t]), to_end = expf(gamma_end - gamma[t]);
    for (int i = lane; i < s.dk; i += 32) {
      qd[t * s.dk + i] = queries[t * ldx + i] * to_row;
      kd[t * s.dk + i] = keys[t * ldk + i] * to_end;
    }
  }
  if (tid == 0) x.decay[block] = expf(gamma_end);
  __syncthreads();

  // The right-hand sides [diag(β e^γ) K | diag(β) V] (zero past the input: β = 0 there).
  for (int t = warp; t < kC; t += kWarps) {
    const float scale = beta[t] * expf(gamma[t]);
    for (int i = lane; i < kdp; i += 32) keys[t * ldk + i] *= scale;
  }
  const float* v_rows = in.qkv + size_t(t0) * s.conv_dim + 2 * s.key_dim + h * s.dv;
  for (int e = tid; e < kC * vdp; e += kThreads) {
    const int t = e / vdp, j = e % vdp;
    values[t * ldx + j] = t < n && j < s.dv ? beta[t] * v_rows[size_t(t) * s.conv_dim + j] : 0.0f;
  }
  __syncthreads();

  // (I + A) [W | U] = [diag(β e^γ) K | diag(β) V] by blocks of 16 rows: subtract the solved rows' part (tensor cores),
  // then substitute inside the 16 × 16 diagonal block (one column a thread).
  const int key_tiles = kdp / kTile, tiles = key_tiles + vdp / kTile;
  for (int r0 = 0; r0 < kC; r0 += kTile) {
    if (r0 > 0) {
      for (int tile = warp; tile < tiles; tile += kWarps) {
        const bool key = tile < key_tiles;
        float* rhs = key ? keys + tile * kTile : values + (tile - key_tiles) * kTile;
        const int ld = key ? ldk : ldx;
        Accumulator solved, rest;
        wmma::fill_fragment(solved, 0.0f);
        mma_3xtf32<wmma::row_major, wmma::row_major>(solved, a + r0 * kChunkStride, kChunkStride, rhs, ld, r0 / kStep);
        wmma::load_matrix_sync(rest, rhs + r0 * ld, unsigned(ld), wmma::mem_row_major);
#pragma unroll
        for (int e = 0; e < rest.num_elements; ++e) rest.x[e] -= solved.x[e];
        wmma::store_matrix_sync(rhs + r0 * ld, rest, unsigned(ld), wmma::mem_row_major);
      }
      __syncthreads();
    }
    for (int column = tid; column < kdp + vdp; column += kThreads) {
      const bool key = column < kdp;
      float* rhs = key ? keys + column : values + (column - kdp);
      const int ld = key ? ldk : ldx;
      float w[kTile];
#pragma unroll
      for (int r = 0; r < kTile; ++r) w[r] = rhs[(r0 + r) * ld];
#pragma unroll
      for (int r = 1; r < kTile; ++r) {
        const float* a_row = a + (r0 + r) * kChunkStride + r0;
        float sum = w[r];
#pragma unroll
        for (int c = 0; c < r; ++c) sum -= a_row[c] * w[c];
        w[r] = sum;
      }
#pragma unroll
      for (int r = 0; r < kTile; ++r) rhs[(r0 + r) * ld] = w[r];
    }
    __syncthreads();
  }

  float* w_out = x.w + block * kC * s.dk;
  for (int e = tid; e < kC * s.dk; e += kThreads) w_out[e] = keys[e / s.dk * ldk + e % s.dk];
  float* u_out = x.u + block * kC * s.dv;
  for (int e = tid; e < kC * s.dv; e += kThreads) u_out[e] = values[e / s.dv * ldx + e % s.dv];
}

// The scan: block (head, slice of 64 value columns), 512 threads, one block an SM (at the release shape 96 blocks,
// each value head's W and Kd read twice, not four times as with 32-column slices). Its shared memory: two stages of
// {W, Kd [C][ldk], U [C][68]} (the next chunk's operands load during the whole of the current chunk's math), Δ [C][68]
// and the state slice [kdp][68]: 217 KB at dk = 128.
constexpr int kScanColumns = 64;
constexpr int kScanThreads = 512;
constexpr int kScanStride = kScanColumns + 4;

__host__ __device__ inline size_t scan_stage_floats(const GdnShape& s) {
  return 2 * size_t(kC) * stride_of(s.dk) + size_t(kC) * kScanStride;
}

size_t scan_shared_bytes(const GdnShape& s) {
  return (2 * scan_stage_floats(s) + size_t(kC) * kScanStride + size_t(padded(s.dk)) * kScanStride) * 4;
}

// target[t·ld + c] = tile[t][c] (row stride kScanStride) for t < rows, c < columns; whole float4s for full slices.
__device__ inline void store_slice(float* target, size_t ld, const float* tile, int rows, int columns) {
  constexpr int kVectors = kScanColumns / 4;  // float4s a full row
  if (columns == kScanColumns && ld % 4 == 0 && reinterpret_cast<uintptr_t>(target) % 16 == 0) {
    for (int e = threadIdx.x; e < rows * kVectors; e += kScanThreads) {
      const int t = e / kVectors, c = e % kVectors * 4;
      *reinterpret_cast<float4*>(target + t * ld + c) = *reinterpret_cast<const float4*>(tile + t * kScanStride + c);
    }
    return;
  }
  for (int e = threadIdx.x; e < rows * columns; e += kScanThreads)
    target[e / columns * ld + e % columns] = tile[e / columns * kScanStride + e % columns];
}

// Per chunk, in order: S₀ to the scratch; Δ = U − W S (warp w: the tile at rows 16·(w/4), columns 16·(w%4)), Δ to
// the scratch (over U); S ← e^{γ_C} S + Kdᵀ Δ.
template <bool kRelease>
__global__ void __launch_bounds__(kScanThreads, 1)
    gdn_chunk_scan_kernel(GdnShape shape, int rows, ChunkScratch x, float* recurrent) {
  const GdnShape s = fixed<kRelease>(shape);
  allow_dependents();
  extern __shared__ __align__(128) float4 shared4[];
  const int kdp = padded(s.dk), ldk = stride_of(s.dk);
  const size_t stage_floats = scan_stage_floats(s);
  float* stages = reinterpret_cast<float*>(shared4);  // 2 × {W [C][ldk], Kd [C][ldk], U [C][68]}
  float* delta = stages + 2 * stage_floats;           // [C][68]
  float* state = delta + kC * kScanStride;            // [kdp][68]
  const int h = blockIdx.x, tid = threadIdx.x, warp = tid / 32;
  const int j0 = blockIdx.y * kScanColumns, columns = min(kScanColumns, s.dv - j0);
  const int chunks = (rows + kC - 1) / kC;
  const size_t dv = size_t(s.dv);
  float* head_state = recurrent + size_t(h) * s.dk * dv + j0;
  auto stage_chunk = [&](int chunk) {
    float* w = stages + (chunk % 2) * stage_floats;
    const size_t block = size_t(chunk) * s.heads + h;
    stage_tile(w, ldk, kC, kdp, x.w + block * kC * s.dk, size_t(s.dk), kC, s.dk);
    stage_tile(w + kC * ldk, ldk, kC, kdp, x.kd + block * kC * s.dk, size_t(s.dk), kC, s.dk);
    stage_tile(w + 2 * kC * ldk, kScanStride, kC, kScanColumns, x.u + block * kC * dv + j0, dv, kC, columns);
  };
  stage_tile(state, kScanStride, kdp, kScanColumns, head_state, dv, s.dk, columns);
  stage_chunk(0);
  __pipeline_commit();

  const int delta_row = warp / 4 * kTile, delta_column = warp % 4 * kTile;
  const int row_tiles = kdp / kTile, c0 = warp % 4 * kTile;  // the state update's
  for (int chunk = 0; chunk < chunks; ++chunk) {
    const size_t block = size_t(chunk) * s.heads + h;
    const float decay = x.decay[block];  // loaded here, used in the state update
    // The previous chunk's last barrier freed the other stage.
    if (chunk + 1 < chunks) stage_chunk(chunk + 1);
    __pipeline_commit();
    __pipeline_wait_prior(1);  // this chunk's stage (and before the first chunk the state)
    __syncthreads();
    const float* w = stages + (chunk % 2) * stage_floats;
    const float* kd = w + kC * ldk;
    const float* u = kd + kC * ldk;
    store_slice(x.s0 + block * s.dk * dv + j0, dv, state, s.dk, columns);  // S₀, for the outputs

    {  // Δ = U − W S
      Accumulator product, result;
      wmma::fill_fragment(product, 0.0f);
      mma_3xtf32<wmma::row_major, wmma::row_major>(product, w + delta_row * ldk, ldk, state + delta_column, kScanStride,
                                                   kdp / kStep);
      wmma::load_matrix_sync(result, u + delta_row * kScanStride + delta_column, kScanStride, wmma::mem_row_major);
#pragma unroll
      for (int e = 0; e < result.num_elements; ++e) result.x[e] -= product.x[e];
      wmma::store_matrix_sync(delta + delta_row * kScanStride + delta_column, result, kScanStride, wmma::mem_row_major);
    }
    __syncthreads();
    store_slice(x.u + block * kC * dv + j0, dv, delta, kC, columns);  // Δ replaces U

    // S ← e^{γ_C} S + Kdᵀ Δ: warp w updates column tile w % 4 of the row tiles w / 4, w / 4 + 4, … two at a time.
    auto decayed = [&](Accumulator& tile, int row_tile) {
      wmma::load_matrix_sync(tile, state + row_tile * kTile * kScanStride + c0, kScanStride, wmma::mem_row_major);
#pragma unroll
      for (int e = 0; e < tile.num_elements; ++e) tile.x[e] *= decay;
    };
    auto store = [&](const Accumulator& tile, int row_tile) {
      wmma::store_matrix_sync(state + row_tile * kTile * kScanStride + c0, tile, kScanStride, wmma::mem_row_major);
    };
    int row_tile = warp / 4;
    for (; row_tile + 4 < row_tiles; row_tile += 8) {
      Accumulator first, second;
      decayed(first, row_tile);
      decayed(second, row_tile + 4);
      mma_pair_3xtf32<wmma::col_major, wmma::row_major>(
          first, second, kd + row_tile * kTile, kd + (row_tile + 4) * kTile, ldk, delta + c0, kScanStride, kC / kStep);
      store(first, row_tile);
      store(second, row_tile + 4);
    }
    if (row_tile < row_tiles) {
      Accumulator next;
      decayed(next, row_tile);
      mma_3xtf32<wmma::col_major, wmma::row_major>(next, kd + row_tile * kTile, ldk, delta + c0, kScanStride,
                                                   kC / kStep);
      store(next, row_tile);
    }
    __syncthreads();
  }
  store_slice(head_state, dv, state, s.dk, columns);
}

// Shared memory of the outputs: Qd [C][ldk] (then the output tile [C][36]), P [C][C + 4], S₀ [kdp][36], Δ [C][36].
size_t output_shared_bytes(const GdnShape& s) {
  return (size_t(kC) * stride_of(s.dk) + size_t(kC) * kChunkStride + size_t(padded(s.dk)) * kSliceStride +
          size_t(kC) * kSliceStride) *
         4;
}

// Block (head, chunk, slice of 32 value columns): O = Qd S₀ + P Δ, written to out [rows, heads·dv]. Warp w computes
// the tile (rows 16·(w/2), columns 16·(w%2)).
__global__ void __launch_bounds__(kThreads) gdn_chunk_output_kernel(GdnShape s, int rows, ChunkScratch x, float* out) {
  allow_dependents();
  extern __shared__ __align__(128) float4 shared4[];
  const int kdp = padded(s.dk), ldk = stride_of(s.dk);
  float* qd = reinterpret_cast<float*>(shared4);  // [C][ldk]
  float* p = qd + kC * ldk;                       // [C][C + 4]
  float* s0 = p + kC * kChunkStride;              // [kdp][36]
  float* delta = s0 + kdp * kSliceStride;         // [C][36]
  float* o = qd;  // [C][36] once every warp is done with its tiles (may run into P: at least 64·(20 + 68) floats)
  const int h = blockIdx.x, chunk = blockIdx.y, tid = threadIdx.x, warp = tid / 32;
  const int j0 = blockIdx.z * kSliceColumns, columns = min(kSliceColumns, s.dv - j0);
  const int t0 = chunk * kC, n = min(kC, rows - t0);
  const size_t block = size_t(chunk) * s.heads + h, dv = size_t(s.dv);
  stage_tile(qd, ldk, kC, kdp, x.qd + block * kC * s.dk, size_t(s.dk), kC, s.dk);
  stage_tile(p, kChunkStride, kC, kC, x.p + block * kC * kC, size_t(kC), kC, kC);
  stage_tile(s0, kSliceStride, kdp, kSliceColumns, x.s0 + block * s.dk * dv + j0, dv, s.dk, columns);
  stage_tile(delta, kSliceStride, kC, kSliceColumns, x.u + block * kC * dv + j0, dv, kC, columns);
  wait_copies();
  __syncthreads();

  const int r0 = warp / 2 * kTile, c0 = warp % 2 * kTile;
  Accumulator acc;
  wmma::fill_fragment(acc, 0.0f);
  mma_3xtf32<wmma::row_major, wmma::row_major>(acc, qd + r0 * ldk, ldk, s0 + c0, kSliceStride, kdp / kStep);
  mma_3xtf32<wmma::row_major, wmma::row_major>(acc, p + r0 * kChunkStride, kChunkStride, delta + c0, kSliceStride,
                                               kC / kStep);
  __syncthreads();  // every warp is done with Qd
  wmma::store_matrix_sync(o + r0 * kSliceStride + c0, acc, kSliceStride, wmma::mem_row_major);
  __syncthreads();
  for (int e = tid; e < n * columns; e += kThreads) {
    const int t = e / columns, c = e % columns;
    out[(size_t(t0 + t) * s.heads + h) * dv + j0 + c] = o[t * kSliceStride + c];
  }
}

// The outputs and the gated norm in one kernel where dk and dv are multiples of 16 (the release): block (head,
// chunk) computes all dv columns, so it sees whole rows for the norm. Warp w owns the 16-column strips w, w + 8, …
// of all 64 rows: it reads its strip of S₀ and Δ straight from the scratch as tensor-core fragments, each once (the
// next one is loaded while the current one is used four times), against Qd and P in shared memory.
bool fused_output_fits(const GdnShape& s) { return s.dk % kTile == 0 && s.dv % kTile == 0; }

size_t output_norm_shared_bytes(const GdnShape& s) {
  return (size_t(kC) * (s.dk + 4) + size_t(kC) * kChunkStride + size_t(kC) * (s.dv + 4)) * 4;
}

// acc[r] += A_r B for the four 16-row tiles A_r of a [C][lda] (row-major, shared) against the 16-column strip B of b
// (row-major, global, stride ldb), over `steps` k-steps of 8; 3×TF32.
__device__ inline void strip_mma_3xtf32(Accumulator (&acc)[kC / kTile], const float* a, int lda, const float* b,
                                        int ldb, int steps) {
  using FragmentB = wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major>;
  FragmentB next;
  wmma::load_matrix_sync(next, b, unsigned(ldb));
#pragma unroll 4
  for (int k = 0; k < steps; ++k) {
    FragmentB b_hi = next, b_lo;
    if (k + 1 < steps) wmma::load_matrix_sync(next, b + (k + 1) * kStep * ldb, unsigned(ldb));
    split_tf32(b_hi, b_lo);
#pragma unroll
    for (int r = 0; r < kC / kTile; ++r) {
      wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> a_hi, a_lo;
      wmma::load_matrix_sync(a_hi, a + r * kTile * lda + k * kStep, unsigned(lda));
      split_tf32(a_hi, a_lo);
      wmma::mma_sync(acc[r], a_lo, b_hi, acc[r]);
      wmma::mma_sync(acc[r], a_hi, b_lo, acc[r]);
      wmma::mma_sync(acc[r], a_hi, b_hi, acc[r]);
    }
  }
}

// Block (head, chunk): O = Qd S₀ + P Δ, then out = w ⊙ rmsnorm(O) ⊙ gate(z) row by row (warp t: rows t, t + 8, …).
template <bool kRelease>
__global__ void __launch_bounds__(kThreads)
    gdn_chunk_output_norm_kernel(GdnShape shape, GdnInputs in, ChunkScratch x, float* out) {
  const GdnShape s = fixed<kRelease>(shape);
  allow_dependents();
  extern __shared__ __align__(128) float4 shared4[];
  const int ldq = s.dk + 4, ldo = s.dv + 4;
  float* qd = reinterpret_cast<float*>(shared4);  // [C][dk + 4]
  float* p = qd + kC * ldq;                       // [C][C + 4]
  float* o = p + kC * kChunkStride;               // [C][dv + 4]
  const int h = blockIdx.x, chunk = blockIdx.y, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int t0 = chunk * kC, n = min(kC, in.rows - t0);
  const size_t block = size_t(chunk) * s.heads + h;
  stage_tile(qd, ldq, kC, s.dk, x.qd + block * kC * s.dk, size_t(s.dk), kC, s.dk);
  stage_tile(p, kChunkStride, kC, kC, x.p + block * kC * kC, size_t(kC), kC, kC);
  wait_copies();
  __syncthreads();

  const float* s0 = x.s0 + block * s.dk * s.dv;
  const float* delta = x.u + block * kC * s.dv;
  for (int c0 = warp * kTile; c0 < s.dv; c0 += kWarps * kTile) {
    Accumulator acc[kC / kTile];
#pragma unroll
    for (int r = 0; r < kC / kTile; ++r) wmma::fill_fragment(acc[r], 0.0f);
    strip_mma_3xtf32(acc, qd, ldq, s0 + c0, s.dv, s.dk / kStep);
    strip_mma_3xtf32(acc, p, kChunkStride, delta + c0, s.dv, kC / kStep);
#pragma unroll
    for (int r = 0; r < kC / kTile; ++r)
      wmma::store_matrix_sync(o + r * kTile * ldo + c0, acc[r], unsigned(ldo), wmma::mem_row_major);
  }
  __syncthreads();

  for (int t = warp; t < n; t += kWarps) {
    const float* row = o + t * ldo;
    float sum = 0.0f;
    for (int j = lane; j < s.dv; j += 32) sum += row[j] * row[j];
    const float scale = 1.0f / sqrtf(warp_sum(sum) / float(s.dv) + in.eps);
    const size_t at = (size_t(t0 + t) * s.heads + h) * s.dv;
    for (int j = lane; j < s.dv; j += 32)
      out[at + j] = in.norm[j] * (row[j] * scale) * output_gate(in.z[at + j], in.sigmoid_gate);
  }
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

template <typename Kernel>
void launch_with_shared(Kernel kernel, dim3 grid, size_t shared_bytes, cudaStream_t stream, const GdnShape& s, int rows,
                        const ChunkScratch& x, float* target) {
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes));
  kernel<<<grid, kThreads, shared_bytes, stream>>>(s, rows, x, target);
}

}  // namespace

size_t gdn_chunk_scratch_floats(const GdnShape& s, int rows) {
  size_t total = 0;
  chunk_scratch(s, rows, nullptr, &total);
  return total;
}

void gdn_prefill(const GdnShape& s, const GdnInputs& in, float* recurrent, float* scratch, float* out,
                 cudaStream_t stream) {
  if (in.rows <= 0) return;
  const ChunkScratch x = chunk_scratch(s, in.rows, scratch, nullptr);
  const unsigned chunks = unsigned((in.rows + kC - 1) / kC), heads = unsigned(s.heads);
  const unsigned slices = unsigned((s.dv + kSliceColumns - 1) / kSliceColumns);
  const bool release = is_release(s);
  const auto prepare = release ? gdn_chunk_prepare_kernel<true> : gdn_chunk_prepare_kernel<false>;
  const size_t prepare_bytes = prepare_shared_bytes(s);
  cudaFuncSetAttribute(prepare, cudaFuncAttributeMaxDynamicSharedMemorySize, int(prepare_bytes));
  prepare<<<dim3(heads, chunks), kThreads, prepare_bytes, stream>>>(s, in, x);
  const size_t scan_bytes = scan_shared_bytes(s);
  const unsigned scan_slices = unsigned((s.dv + kScanColumns - 1) / kScanColumns);
  const auto scan = release ? gdn_chunk_scan_kernel<true> : gdn_chunk_scan_kernel<false>;
  cudaFuncSetAttribute(scan, cudaFuncAttributeMaxDynamicSharedMemorySize, int(scan_bytes));
  scan<<<dim3(heads, scan_slices), kScanThreads, scan_bytes, stream>>>(s, in.rows, x, recurrent);
  if (fused_output_fits(s)) {
    const size_t bytes = output_norm_shared_bytes(s);
    const auto output = release ? gdn_chunk_output_norm_kernel<true> : gdn_chunk_output_norm_kernel<false>;
    cudaFuncSetAttribute(output, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
    output<<<dim3(heads, chunks), kThreads, bytes, stream>>>(s, in, x, out);
    return;
  }
  launch_with_shared(gdn_chunk_output_kernel, dim3(heads, chunks, slices), output_shared_bytes(s), stream, s, in.rows,
                     x, out);
  const int groups = in.rows * s.heads;
  gdn_gated_norm_kernel<<<blocks_for(groups, kWarps), kThreads, 0, stream>>>(out, in.z, in.norm, groups, s.dv, in.eps,
                                                                             in.sigmoid_gate);
}

}  // namespace vavilov::cuda
