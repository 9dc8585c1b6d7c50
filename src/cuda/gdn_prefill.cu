#include <mma.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/gdn_common.cuh"

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
// Kd = diag(e^{γ_C−γ}) K), scan (chunk after chunk per head and 32-column slice: Δ = U − W S, S ← e^{γ_C} S + Kdᵀ Δ,
// recording each chunk's S₀), outputs (all chunks in parallel: O = Qd S₀ + P Δ), then the gated norm.
//
// Every matrix product runs on tensor cores as 3×TF32: each fp32 operand x is split into hi = tf32(x) and
// lo = tf32(x − hi), and hi·hi + hi·lo + lo·hi is accumulated in fp32. The dropped lo·lo term and the rounding of lo
// are ~2⁻²² relative, so the products keep fp32 accuracy (plain TF32, ~2⁻¹¹, would not meet the tests' 1e-4).
// Tiles are 16 × 16 (k-steps of 8); shared-memory tiles are zero-padded to multiples of 16 and their row strides are
// a multiple of 16 plus 4 floats, so the fragment loads spread over the banks.

namespace wmma = nvcuda::wmma;
using Accumulator = wmma::fragment<wmma::accumulator, 16, 16, 8, float>;
constexpr int kTile = 16;
constexpr int kStep = 8;                         // the k extent of one tf32 mma
constexpr int kChunkStride = kC + 4;             // row stride of [C][C] tiles
constexpr int kSliceStride = kSliceColumns + 4;  // row stride of [..][32] slice tiles

__host__ __device__ inline int padded(int width) { return (width + kTile - 1) / kTile * kTile; }
__host__ __device__ inline int stride_of(int width) { return padded(width) + 4; }

// Splits the fp32 values of a loaded fragment into its tf32 part (in place) and the tf32 part of the remainder.
template <typename Fragment>
__device__ inline void split_tf32(Fragment& hi, Fragment& lo) {
#pragma unroll
  for (int e = 0; e < hi.num_elements; ++e) {
    const float x = hi.x[e];
    hi.x[e] = wmma::__float_to_tf32(x);
    lo.x[e] = wmma::__float_to_tf32(x - hi.x[e]);
  }
}

// acc += A B over `steps` k-steps of 8: A is 16 × 8·steps at a (layout LayoutA, stride lda), B is 8·steps × 16 at b
// (layout LayoutB, stride ldb); one warp, 3×TF32.
template <typename LayoutA, typename LayoutB>
__device__ inline void mma_3xtf32(Accumulator& acc, const float* a, int lda, const float* b, int ldb, int steps) {
  constexpr bool a_rows = std::is_same_v<LayoutA, wmma::row_major>;
  constexpr bool b_rows = std::is_same_v<LayoutB, wmma::row_major>;
  for (int k = 0; k < steps; ++k) {
    wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, LayoutA> a_hi, a_lo;
    wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, LayoutB> b_hi, b_lo;
    wmma::load_matrix_sync(a_hi, a + (a_rows ? k * kStep : k * kStep * lda), unsigned(lda));
    wmma::load_matrix_sync(b_hi, b + (b_rows ? k * kStep * ldb : k * kStep), unsigned(ldb));
    split_tf32(a_hi, a_lo);
    split_tf32(b_hi, b_lo);
    wmma::mma_sync(acc, a_lo, b_hi, acc);
    wmma::mma_sync(acc, a_hi, b_lo, acc);
    wmma::mma_sync(acc, a_hi, b_hi, acc);
  }
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
__global__ void __launch_bounds__(kThreads) gdn_chunk_prepare_kernel(GdnShape s, GdnInputs in, ChunkScratch x) {
  cudaTriggerProgrammaticLaunchCompletion();
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

  // K Kᵀ and Q Kᵀ, 16 tiles each; the tiles above the diagonal are masked below and not computed.
  for (int tile = warp; tile < 32; tile += kWarps) {
    const bool q_rows_tile = tile >= 16;
    const int r0 = tile % 16 / 4 * kTile, c0 = tile % 4 * kTile;
    if (c0 > r0) continue;
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
  for (int e = tid; e < kC * s.dk; e += kThreads) {
    const int t = e / s.dk, i = e % s.dk;
    qd[e] = queries[t * ldx + i] * expf(gamma[t]);
    kd[e] = keys[t * ldk + i] * expf(gamma_end - gamma[t]);
  }
  if (tid == 0) x.decay[block] = expf(gamma_end);
  __syncthreads();

  // The right-hand sides [diag(β e^γ) K | diag(β) V] (zero past the input: β = 0 there).
  for (int e = tid; e < kC * kdp; e += kThreads) {
    const int t = e / kdp, i = e % kdp;
    keys[t * ldk + i] *= beta[t] * expf(gamma[t]);
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

// Shared memory of the scan: W and Kd [C][ldk], U and Δ [C][36], the state slice [kdp][36].
size_t scan_shared_bytes(const GdnShape& s) {
  return (2 * size_t(kC) * stride_of(s.dk) + 2 * size_t(kC) * kSliceStride + size_t(padded(s.dk)) * kSliceStride) * 4;
}

// Block (head, slice of 32 value columns), 256 threads; the chunks in order. The next chunk's W and U load while the
// state is updated, its Kd while Δ is computed. Warp w computes the Δ tile (rows 16·(w/2), columns 16·(w%2)) and
// the state tiles w, w + 8, … (2 tiles a row of 16).
__global__ void __launch_bounds__(kThreads)
    gdn_chunk_scan_kernel(GdnShape s, int rows, ChunkScratch x, float* recurrent) {
  cudaTriggerProgrammaticLaunchCompletion();
  extern __shared__ __align__(128) float4 shared4[];
  const int kdp = padded(s.dk), ldk = stride_of(s.dk);
  float* w = reinterpret_cast<float*>(shared4);  // [C][ldk]
  float* kd = w + kC * ldk;                      // [C][ldk]
  float* u = kd + kC * ldk;                      // [C][36]
  float* delta = u + kC * kSliceStride;          // [C][36]
  float* state = delta + kC * kSliceStride;      // [kdp][36]
  const int h = blockIdx.x, tid = threadIdx.x, warp = tid / 32;
  const int j0 = blockIdx.y * kSliceColumns, columns = min(kSliceColumns, s.dv - j0);
  const int chunks = (rows + kC - 1) / kC;
  const size_t dv = size_t(s.dv);
  float* head_state = recurrent + size_t(h) * s.dk * dv + j0;
  auto stage_w_u = [&](int chunk) {
    const size_t block = size_t(chunk) * s.heads + h;
    stage_tile(w, ldk, kC, kdp, x.w + block * kC * s.dk, size_t(s.dk), kC, s.dk);
    stage_tile(u, kSliceStride, kC, kSliceColumns, x.u + block * kC * dv + j0, dv, kC, columns);
  };
  auto stage_kd = [&](int chunk) {
    const size_t block = size_t(chunk) * s.heads + h;
    stage_tile(kd, ldk, kC, kdp, x.kd + block * kC * s.dk, size_t(s.dk), kC, s.dk);
  };
  stage_tile(state, kSliceStride, kdp, kSliceColumns, head_state, dv, s.dk, columns);
  stage_w_u(0);
  __pipeline_commit();
  stage_kd(0);
  __pipeline_commit();

  const int delta_row = warp / 2 * kTile, delta_column = warp % 2 * kTile;
  for (int chunk = 0; chunk < chunks; ++chunk) {
    const size_t block = size_t(chunk) * s.heads + h;
    const float decay = x.decay[block];  // loaded here, used in the state update
    __pipeline_wait_prior(1);            // W, U (and before the first chunk the state); Kd may still be in flight
    __syncthreads();
    float* s0 = x.s0 + block * s.dk * dv + j0;  // the state before this chunk, for the outputs
    for (int e = tid; e < s.dk * columns; e += kThreads)
      s0[e / columns * dv + e % columns] = state[e / columns * kSliceStride + e % columns];

    {  // Δ = U − W S
      Accumulator product, result;
      wmma::fill_fragment(product, 0.0f);
      mma_3xtf32<wmma::row_major, wmma::row_major>(product, w + delta_row * ldk, ldk, state + delta_column,
                                                   kSliceStride, kdp / kStep);
      wmma::load_matrix_sync(result, u + delta_row * kSliceStride + delta_column, kSliceStride, wmma::mem_row_major);
#pragma unroll
      for (int e = 0; e < result.num_elements; ++e) result.x[e] -= product.x[e];
      wmma::store_matrix_sync(delta + delta_row * kSliceStride + delta_column, result, kSliceStride,
                              wmma::mem_row_major);
    }
    __syncthreads();
    if (chunk + 1 < chunks) stage_w_u(chunk + 1);
    __pipeline_commit();
    float* delta_out = x.u + block * kC * dv + j0;  // Δ replaces U
    for (int e = tid; e < kC * columns; e += kThreads)
      delta_out[e / columns * dv + e % columns] = delta[e / columns * kSliceStride + e % columns];
    __pipeline_wait_prior(1);  // Kd
    __syncthreads();

    // S ← e^{γ_C} S + Kdᵀ Δ
    for (int tile = warp; tile < kdp / kTile * 2; tile += kWarps) {
      const int r0 = tile / 2 * kTile, c0 = tile % 2 * kTile;
      Accumulator next;
      wmma::load_matrix_sync(next, state + r0 * kSliceStride + c0, kSliceStride, wmma::mem_row_major);
#pragma unroll
      for (int e = 0; e < next.num_elements; ++e) next.x[e] *= decay;
      mma_3xtf32<wmma::col_major, wmma::row_major>(next, kd + r0, ldk, delta + c0, kSliceStride, kC / kStep);
      wmma::store_matrix_sync(state + r0 * kSliceStride + c0, next, kSliceStride, wmma::mem_row_major);
    }
    __syncthreads();
    if (chunk + 1 < chunks) stage_kd(chunk + 1);
    __pipeline_commit();
  }
  for (int e = tid; e < s.dk * columns; e += kThreads)
    head_state[e / columns * dv + e % columns] = state[e / columns * kSliceStride + e % columns];
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
  cudaTriggerProgrammaticLaunchCompletion();
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
__global__ void __launch_bounds__(kThreads)
    gdn_chunk_output_norm_kernel(GdnShape s, GdnInputs in, ChunkScratch x, float* out) {
  cudaTriggerProgrammaticLaunchCompletion();
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
  cudaTriggerProgrammaticLaunchCompletion();
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
  const size_t prepare_bytes = prepare_shared_bytes(s);
  cudaFuncSetAttribute(gdn_chunk_prepare_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(prepare_bytes));
  gdn_chunk_prepare_kernel<<<dim3(heads, chunks), kThreads, prepare_bytes, stream>>>(s, in, x);
  launch_with_shared(gdn_chunk_scan_kernel, dim3(heads, slices), scan_shared_bytes(s), stream, s, in.rows, x,
                     recurrent);
  if (fused_output_fits(s)) {
    const size_t bytes = output_norm_shared_bytes(s);
    cudaFuncSetAttribute(gdn_chunk_output_norm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
    gdn_chunk_output_norm_kernel<<<dim3(heads, chunks), kThreads, bytes, stream>>>(s, in, x, out);
    return;
  }
  launch_with_shared(gdn_chunk_output_kernel, dim3(heads, chunks, slices), output_shared_bytes(s), stream, s, in.rows,
                     x, out);
  const int groups = in.rows * s.heads;
  gdn_gated_norm_kernel<<<blocks_for(groups, kWarps), kThreads, 0, stream>>>(out, in.z, in.norm, groups, s.dv, in.eps,
                                                                             in.sigmoid_gate);
}

}  // namespace vavilov::cuda
