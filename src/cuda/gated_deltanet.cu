#include <cooperative_groups.h>
#include <cuda_pipeline.h>

#include <algorithm>
#include <cmath>

#include "cuda/device_math.cuh"
#include "cuda/gated_deltanet.cuh"

namespace vavilov::cuda {

namespace {

namespace cg = cooperative_groups;

constexpr int kMaxConvKernel = 8;
constexpr int kThreads = 256;  // every GDN kernel but the conv and the norm
constexpr int kWarps = kThreads / 32;
constexpr int kSliceColumns = 32;                                  // value columns per block (decode, scan, outputs)
constexpr int kC = kGdnChunk;                                      // tokens per chunk
constexpr int kMaxDecodeSlices = kGdnMaxValueDim / kSliceColumns;  // the cluster of one head: ≤ 8 (portable)

// The log-space decay g = −e^{a_log}·softplus(a + dt_bias) of value head h at index `at` of [rows, heads].
__device__ inline float log_decay(const GdnInputs& in, int h, size_t at) {
  return -expf(in.a_log[h]) * softplus(in.a[at] + in.dt_bias[h]);
}

__device__ inline float output_gate(float z, bool sigmoid_gate) { return sigmoid_gate ? sigmoid(z) : silu(z); }

// Shared-memory loads go through cp.async: a thread issues all of its copies before waiting for any, so a tile
// costs one memory latency, not one per element.
__device__ inline void copy_async(float* shared, const float* global) {
  __pipeline_memcpy_async(shared, global, sizeof(float));
}
__device__ inline void wait_copies() {
  __pipeline_commit();
  __pipeline_wait_prior(0);
}

__host__ __device__ inline int padded_key_dim(int dk) { return (dk + 3) & ~3; }  // rows of float4 in shared memory

__global__ void gdn_conv_kernel(const float* taps, int channels, int kernel, float* state, float* x, int rows,
                                float* row_states) {
  const int ch = blockIdx.x * blockDim.x + threadIdx.x;
  if (ch >= channels) return;
  const int history = kernel - 1;
  float window[kMaxConvKernel];
  for (int k = 0; k < history; ++k) window[k] = state[size_t(k) * channels + ch];
  for (int t = 0; t < rows; ++t) {
    window[history] = x[size_t(t) * channels + ch];
    float sum = 0.0f;
    for (int k = 0; k < kernel; ++k) sum += taps[ch * kernel + k] * window[k];
    x[size_t(t) * channels + ch] = silu(sum);
    for (int k = 0; k < history; ++k) window[k] = window[k + 1];
    if (row_states)
      for (int k = 0; k < history; ++k) row_states[(size_t(t) * history + k) * channels + ch] = window[k];
  }
  for (int k = 0; k < history; ++k) state[size_t(k) * channels + ch] = window[k];
}

// ---- Decode ----------------------------------------------------------------------------------------------------
//
// Block (head, slice) owns value columns [32·slice, 32·slice + 32) of the head's dk × dv state: 256 threads, each
// holding 16 state values in registers (kVec adjacent columns × 16/kVec rows, read and written as float4 when
// kVec = 4). Sums over dk go through shuffles and shared memory. The blocks of one head form a cluster, which
// shares the squared sums the gated RMS norm needs over all dv columns.

template <int kVec>
struct DecodeLayout {
  static constexpr int kColumnThreads = kSliceColumns / kVec;        // threads across the slice
  static constexpr int kRowGroups = kThreads / kColumnThreads;       // threads down dk
  static constexpr int kRowsPerThread = kGdnMaxKeyDim / kRowGroups;  // state rows per thread
};

template <int kVec>
__device__ inline void load_columns(const float* p, float (&v)[kVec]) {
  if constexpr (kVec == 4) {
    const float4 x = *reinterpret_cast<const float4*>(p);
    v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
  } else {
    v[0] = *p;
  }
}

template <int kVec>
__device__ inline void store_columns(float* p, const float (&v)[kVec]) {
  if constexpr (kVec == 4)
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  else
    *p = v[0];
}

// Sums each thread's per-column partials over the block's row groups into result[32] (visible to all on return).
template <int kVec>
__device__ inline void column_sums(float (&v)[kVec], float (*partial)[kSliceColumns], float* result) {
  constexpr int kColumnThreads = DecodeLayout<kVec>::kColumnThreads;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
  for (int c = 0; c < kVec; ++c)
    for (int offset = kColumnThreads; offset < 32; offset <<= 1) v[c] += __shfl_xor_sync(0xffffffffu, v[c], offset);
  if (lane < kColumnThreads)
#pragma unroll
    for (int c = 0; c < kVec; ++c) partial[warp][lane * kVec + c] = v[c];
  __syncthreads();
  if (threadIdx.x < kSliceColumns) {
    float sum = 0.0f;
    for (int w = 0; w < kWarps; ++w) sum += partial[w][threadIdx.x];
    result[threadIdx.x] = sum;
  }
  __syncthreads();
}

template <int kVec>
__global__ void __launch_bounds__(kThreads)
    gdn_decode_kernel(GdnShape s, GdnInputs in, float* recurrent, float* row_states, float* out) {
  using L = DecodeLayout<kVec>;
  __shared__ float q[kGdnMaxKeyDim], k[kGdnMaxKeyDim], gates[2];
  __shared__ float partial[kWarps][kSliceColumns], kv[kSliceColumns];
  __shared__ float outputs[kGdnDecodeMaxRows][kSliceColumns], squares[kGdnDecodeMaxRows];
  const int head = blockIdx.x, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int column_thread = tid % L::kColumnThreads, row_group = tid / L::kColumnThreads;
  const int j0 = blockIdx.y * kSliceColumns + column_thread * kVec;  // this thread's first column
  const bool active = j0 < s.dv;  // kVec = 4 only when dv % 4 == 0: all four columns or none
  const int key_head = head / (s.heads / s.key_heads);
  const size_t head_size = size_t(s.dk) * s.dv;
  float* head_state = recurrent + head * head_size;
  const int j = blockIdx.y * kSliceColumns + lane;  // the output norm's column (warp r: row r)
  const bool norm_thread = warp < in.rows && j < s.dv;
  const size_t out_at = (size_t(warp) * s.heads + head) * s.dv + j;
  const float gate = norm_thread ? output_gate(in.z[out_at], in.sigmoid_gate) : 0.0f;
  const float weight = norm_thread ? in.norm[j] : 0.0f;

  float state[L::kRowsPerThread][kVec] = {};
#pragma unroll
  for (int m = 0; m < L::kRowsPerThread; ++m) {
    const int i = row_group + m * L::kRowGroups;
    if (active && i < s.dk) load_columns<kVec>(head_state + size_t(i) * s.dv + j0, state[m]);
  }

  const float q_scale = 1.0f / sqrtf(float(s.dk));
  for (int t = 0; t < in.rows; ++t) {
    const float* row = in.qkv + size_t(t) * s.conv_dim;
    float v[kVec];  // loaded now, used after the first sum
#pragma unroll
    for (int c = 0; c < kVec; ++c) v[c] = active ? row[2 * s.key_dim + head * s.dv + j0 + c] : 0.0f;
    if (warp < 2) {  // warp 0: q, warp 1: k, l2-normalised
      const float* source = row + warp * s.key_dim + key_head * s.dk;
      float sum = 0.0f;
      for (int i = lane; i < s.dk; i += 32) sum += source[i] * source[i];
      const float scale = 1.0f / sqrtf(warp_sum(sum) + 1e-6f) * (warp == 0 ? q_scale : 1.0f);
      float* target = warp == 0 ? q : k;
      for (int i = lane; i < s.dk; i += 32) target[i] = source[i] * scale;
    } else if (tid == 64) {
      const size_t at = size_t(t) * s.heads + head;
      gates[0] = expf(log_decay(in, head, at));
      gates[1] = sigmoid(in.b[at]);
    }
    __syncthreads();
    const float decay = gates[0], beta = gates[1];
    float sums[kVec] = {};
#pragma unroll
    for (int m = 0; m < L::kRowsPerThread; ++m) {
      const int i = row_group + m * L::kRowGroups;
      if (i < s.dk)
#pragma unroll
        for (int c = 0; c < kVec; ++c) {
          state[m][c] *= decay;
          sums[c] += state[m][c] * k[i];
        }
    }
    column_sums<kVec>(sums, partial, kv);  // kv = Sᵀk
    float delta[kVec];
#pragma unroll
    for (int c = 0; c < kVec; ++c) {
      delta[c] = beta * (v[c] - kv[column_thread * kVec + c]);
      sums[c] = 0.0f;
    }
#pragma unroll
    for (int m = 0; m < L::kRowsPerThread; ++m) {
      const int i = row_group + m * L::kRowGroups;
      if (i < s.dk)
#pragma unroll
        for (int c = 0; c < kVec; ++c) {
          state[m][c] += k[i] * delta[c];
          sums[c] += state[m][c] * q[i];
        }
    }
    if (row_states && active) {
      float* snapshot = row_states + (size_t(t) * s.heads + head) * head_size;
#pragma unroll
      for (int m = 0; m < L::kRowsPerThread; ++m) {
        const int i = row_group + m * L::kRowGroups;
        if (i < s.dk) store_columns<kVec>(snapshot + size_t(i) * s.dv + j0, state[m]);
      }
    }
    column_sums<kVec>(sums, partial, outputs[t]);  // o = Sᵀq
  }
#pragma unroll
  for (int m = 0; m < L::kRowsPerThread; ++m) {
    const int i = row_group + m * L::kRowGroups;
    if (active && i < s.dk) store_columns<kVec>(head_state + size_t(i) * s.dv + j0, state[m]);
  }

  // Gated RMS norm over the head's dv outputs of each row (warp t: row t); the cluster adds up the slices' squares.
  const float o = norm_thread ? outputs[warp][lane] : 0.0f;
  if (warp < in.rows) {
    const float sum = warp_sum(o * o);
    if (lane == 0) squares[warp] = sum;
  }
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();
  if (warp < in.rows) {
    float total = 0.0f;
    for (unsigned r = 0; r < cluster.num_blocks(); ++r) total += cluster.map_shared_rank(squares, r)[warp];
    if (norm_thread) out[out_at] = weight * (o * (1.0f / sqrtf(total / float(s.dv) + in.eps))) * gate;
  }
  cluster.sync();  // no block leaves while another still reads its `squares`
}

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
// Every exponent is ≤ 0 (γ falls), so nothing overflows. Three kernels: prepare (all chunks in parallel: A by
// forward substitution into W and U, plus P[t,s] = e^{γ_t−γ_s} q_t·k_s for s ≤ t, Qd = diag(e^γ) Q and
// Kdᵀ = (diag(e^{γ_C−γ}) K)ᵀ), scan (chunk after chunk per head and 32-column slice: Δ = U − W S, S ← e^{γ_C} S + Kdᵀ
// Δ, recording each chunk's S₀), outputs (all chunks in parallel: O = Qd S₀ + P Δ), then the gated norm.

// Scratch regions, each [chunks][heads][...]; U is overwritten by Δ in the scan.
struct ChunkScratch {
  float *w, *u, *qd, *kdt, *p, *s0, *decay;  // [C, dk], [C, dv], [C, dk], [dk, C], [C, C], [dk, dv], [1]
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
  x.kdt = take(dk * kC);
  x.p = take(kC * kC);
  x.s0 = take(dk * dv);
  x.decay = take(1);
  if (total) *total = offset;
  return x;
}

size_t prepare_shared_bytes(const GdnShape& s) { return (size_t(kC) * kC + 2 * kC + 2 * size_t(kC) * (s.dk + 1)) * 4; }

// Block (head, chunk), 256 threads.
__global__ void __launch_bounds__(kThreads) gdn_chunk_prepare_kernel(GdnShape s, GdnInputs in, ChunkScratch x) {
  extern __shared__ float4 shared4[];
  const int stride = s.dk + 1;  // odd: the A/P products read rows of K and Q at stride 16 rows without conflicts
  float* a = reinterpret_cast<float*>(shared4);  // [C][C], strictly lower
  float* gamma = a + kC * kC;                    // [C] inclusive cumulative log decay
  float* beta = gamma + kC;                      // [C]
  float* keys = beta + kC;                       // [C][stride], normalised
  float* queries = keys + kC * stride;           // [C][stride], normalised and scaled by 1/√dk
  const int h = blockIdx.x, chunk = blockIdx.y, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int t0 = chunk * kC, n = min(kC, in.rows - t0);
  const int key_head = h / (s.heads / s.key_heads);
  const size_t block = size_t(chunk) * s.heads + h;

  for (int e = tid; e < kC * s.dk; e += kThreads) {  // raw q and k rows; zero past the input
    const int t = e / s.dk, i = e % s.dk;
    if (t < n) {
      const float* q_row = in.qkv + size_t(t0 + t) * s.conv_dim + key_head * s.dk;
      copy_async(queries + t * stride + i, q_row + i);
      copy_async(keys + t * stride + i, q_row + s.key_dim + i);
    } else {
      queries[t * stride + i] = 0.0f;
      keys[t * stride + i] = 0.0f;
    }
  }
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
      q_sum += queries[t * stride + i] * queries[t * stride + i];
      k_sum += keys[t * stride + i] * keys[t * stride + i];
    }
    const float q_norm = 1.0f / sqrtf(warp_sum(q_sum) + 1e-6f) * q_scale;
    const float k_norm = 1.0f / sqrtf(warp_sum(k_sum) + 1e-6f);
    for (int i = lane; i < s.dk; i += 32) {
      queries[t * stride + i] *= q_norm;
      keys[t * stride + i] *= k_norm;
    }
  }
  __syncthreads();

  // A and P: thread (ti, si) computes rows ti + 16·r against columns si + 16·c.
  {
    const int ti = tid / 16, si = tid % 16;
    float kk[4][4] = {}, qk[4][4] = {};
    for (int i = 0; i < s.dk; ++i) {
      float kt[4], qt[4], kc[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        kt[r] = keys[(ti + 16 * r) * stride + i];
        qt[r] = queries[(ti + 16 * r) * stride + i];
        kc[r] = keys[(si + 16 * r) * stride + i];
      }
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          kk[r][c] += kt[r] * kc[c];
          qk[r][c] += qt[r] * kc[c];
        }
    }
    float* p = x.p + block * kC * kC;
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int t = ti + 16 * r, u = si + 16 * c;
        const float decay = u <= t ? expf(gamma[t] - gamma[u]) : 0.0f;
        a[t * kC + u] = u < t ? beta[t] * decay * kk[r][c] : 0.0f;
        p[t * kC + u] = decay * qk[r][c];
      }
  }
  __syncthreads();

  // W and U by forward substitution, one column of [diag(β e^γ) K | diag(β) V] per thread, held in registers.
  for (int column = tid; column < s.dk + s.dv; column += kThreads) {
    float w[kC];
    const bool key = column < s.dk;
    if (key) {
#pragma unroll
      for (int t = 0; t < kC; ++t) w[t] = beta[t] * expf(gamma[t]) * keys[t * stride + column];
    } else {
      const float* v = in.qkv + size_t(t0) * s.conv_dim + 2 * s.key_dim + h * s.dv + (column - s.dk);
#pragma unroll
      for (int t = 0; t < kC; ++t) w[t] = t < n ? beta[t] * v[size_t(t) * s.conv_dim] : 0.0f;
    }
#pragma unroll
    for (int t = 1; t < kC; ++t) {
      const float4* a_row = reinterpret_cast<const float4*>(a + t * kC);
      float sum = w[t];
#pragma unroll
      for (int u = 0; u < t; u += 4) {  // A[t, u] = 0 for u ≥ t: the last group's extra terms add nothing
        const float4 a4 = a_row[u / 4];
        sum -= a4.x * w[u] + a4.y * w[u + 1] + a4.z * w[u + 2] + a4.w * w[u + 3];
      }
      w[t] = sum;
    }
    float* target = key ? x.w + block * kC * s.dk + column : x.u + block * kC * s.dv + (column - s.dk);
    const int row_stride = key ? s.dk : s.dv;
#pragma unroll
    for (int t = 0; t < kC; ++t) target[t * row_stride] = w[t];
  }

  const float gamma_end = gamma[kC - 1];
  float* qd = x.qd + block * kC * s.dk;
  float* kdt = x.kdt + block * s.dk * kC;
  for (int e = tid; e < kC * s.dk; e += kThreads) {
    const int t = e / s.dk, i = e % s.dk;
    qd[e] = queries[t * stride + i] * expf(gamma[t]);
    const int i2 = e / kC, t2 = e % kC;
    kdt[e] = keys[t2 * stride + i2] * expf(gamma_end - gamma[t2]);
  }
  if (tid == 0) x.decay[block] = expf(gamma_end);
}

size_t scan_shared_bytes(const GdnShape& s) {
  const size_t dkp = size_t(padded_key_dim(s.dk));
  return (2 * size_t(kC) * dkp + dkp * kSliceColumns + 2 * size_t(kC) * kSliceColumns) * 4;
}

// Block (head, slice of 32 value columns), 256 threads; the chunks in order. Thread (warp, lane) owns column lane and
// rows warp + 8m.
__global__ void __launch_bounds__(kThreads)
    gdn_chunk_scan_kernel(GdnShape s, int rows, ChunkScratch x, float* recurrent) {
  extern __shared__ float4 shared4[];
  const int dkp = padded_key_dim(s.dk);
  float* w = reinterpret_cast<float*>(shared4);  // [C][dkp]
  float* kdt = w + kC * dkp;                     // [dkp][C]
  float* state = kdt + dkp * kC;                 // [dkp][32]
  float* delta = state + dkp * kSliceColumns;    // [C][32]
  float* u_slice = delta + kC * kSliceColumns;   // [C][32]
  const int h = blockIdx.x, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int j0 = blockIdx.y * kSliceColumns, j = j0 + lane;
  const bool valid = j < s.dv;
  const int chunks = (rows + kC - 1) / kC;
  float* head_state = recurrent + size_t(h) * s.dk * s.dv;
  for (int i = warp; i < dkp; i += kWarps)
    state[i * kSliceColumns + lane] = valid && i < s.dk ? head_state[size_t(i) * s.dv + j] : 0.0f;

  for (int chunk = 0; chunk < chunks; ++chunk) {
    const size_t block = size_t(chunk) * s.heads + h;
    const float* w_chunk = x.w + block * kC * s.dk;
    const float* kdt_chunk = x.kdt + block * s.dk * kC;
    float* u = x.u + block * kC * s.dv;
    for (int e = tid; e < kC * dkp; e += kThreads) {
      const int t = e / dkp, i = e % dkp;
      if (i < s.dk)
        copy_async(w + e, w_chunk + t * s.dk + i);
      else
        w[e] = 0.0f;
      if (e < s.dk * kC)
        copy_async(kdt + e, kdt_chunk + e);
      else
        kdt[e] = 0.0f;
    }
    for (int e = tid; e < kC * kSliceColumns; e += kThreads) {
      const int t = e / kSliceColumns, c = j0 + e % kSliceColumns;
      if (c < s.dv)
        copy_async(u_slice + e, u + t * s.dv + c);
      else
        u_slice[e] = 0.0f;
    }
    const float decay = x.decay[block];
    float* s0 = x.s0 + block * s.dk * s.dv;
    if (valid)
      for (int i = warp; i < s.dk; i += kWarps) s0[size_t(i) * s.dv + j] = state[i * kSliceColumns + lane];
    wait_copies();
    __syncthreads();

    // Δ = U − W S
    float sums[kC / kWarps];
#pragma unroll
    for (int m = 0; m < kC / kWarps; ++m) sums[m] = u_slice[(warp + kWarps * m) * kSliceColumns + lane];
    for (int i = 0; i < dkp; i += 4) {
      const float s0_ = state[i * kSliceColumns + lane], s1 = state[(i + 1) * kSliceColumns + lane];
      const float s2 = state[(i + 2) * kSliceColumns + lane], s3 = state[(i + 3) * kSliceColumns + lane];
#pragma unroll
      for (int m = 0; m < kC / kWarps; ++m) {
        const float4 w4 = *reinterpret_cast<const float4*>(w + (warp + kWarps * m) * dkp + i);
        sums[m] -= w4.x * s0_ + w4.y * s1 + w4.z * s2 + w4.w * s3;
      }
    }
#pragma unroll
    for (int m = 0; m < kC / kWarps; ++m) {
      const int t = warp + kWarps * m;
      delta[t * kSliceColumns + lane] = sums[m];
      if (valid) u[t * s.dv + j] = sums[m];
    }
    __syncthreads();

    // S ← e^{γ_C} S + Kdᵀ Δ (each thread rewrites only the rows it reads)
    float next[kGdnMaxKeyDim / kWarps];
#pragma unroll
    for (int m = 0; m < kGdnMaxKeyDim / kWarps; ++m) {
      const int i = warp + kWarps * m;
      next[m] = i < dkp ? decay * state[i * kSliceColumns + lane] : 0.0f;
    }
    for (int t = 0; t < kC; t += 4) {
      const float d0 = delta[t * kSliceColumns + lane], d1 = delta[(t + 1) * kSliceColumns + lane];
      const float d2 = delta[(t + 2) * kSliceColumns + lane], d3 = delta[(t + 3) * kSliceColumns + lane];
#pragma unroll
      for (int m = 0; m < kGdnMaxKeyDim / kWarps; ++m) {
        const int i = warp + kWarps * m;
        if (i < dkp) {
          const float4 k4 = *reinterpret_cast<const float4*>(kdt + i * kC + t);
          next[m] += k4.x * d0 + k4.y * d1 + k4.z * d2 + k4.w * d3;
        }
      }
    }
#pragma unroll
    for (int m = 0; m < kGdnMaxKeyDim / kWarps; ++m) {
      const int i = warp + kWarps * m;
      if (i < dkp) state[i * kSliceColumns + lane] = next[m];
    }
    __syncthreads();
  }
  if (valid)
    for (int i = warp; i < s.dk; i += kWarps) head_state[size_t(i) * s.dv + j] = state[i * kSliceColumns + lane];
}

size_t output_shared_bytes(const GdnShape& s) {
  const size_t dkp = size_t(padded_key_dim(s.dk));
  return (size_t(kC) * dkp + dkp * kSliceColumns + size_t(kC) * kC + size_t(kC) * kSliceColumns) * 4;
}

// Block (head, chunk, slice of 32 value columns): O = Qd S₀ + P Δ, written to out [rows, heads·dv].
__global__ void __launch_bounds__(kThreads) gdn_chunk_output_kernel(GdnShape s, int rows, ChunkScratch x, float* out) {
  extern __shared__ float4 shared4[];
  const int dkp = padded_key_dim(s.dk);
  float* qd = reinterpret_cast<float*>(shared4);  // [C][dkp]
  float* p = qd + kC * dkp;                       // [C][C]
  float* s0 = p + kC * kC;                        // [dkp][32]
  float* delta = s0 + dkp * kSliceColumns;        // [C][32]
  const int h = blockIdx.x, chunk = blockIdx.y, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int j0 = blockIdx.z * kSliceColumns, j = j0 + lane;
  const int t0 = chunk * kC, n = min(kC, rows - t0);
  const size_t block = size_t(chunk) * s.heads + h;
  const float* qd_chunk = x.qd + block * kC * s.dk;
  const float* p_chunk = x.p + block * kC * kC;
  const float* s0_chunk = x.s0 + block * s.dk * s.dv;
  const float* delta_chunk = x.u + block * kC * s.dv;
  for (int e = tid; e < kC * dkp; e += kThreads) {
    const int t = e / dkp, i = e % dkp;
    if (i < s.dk)
      copy_async(qd + e, qd_chunk + t * s.dk + i);
    else
      qd[e] = 0.0f;
  }
  for (int e = tid; e < kC * kC; e += kThreads) copy_async(p + e, p_chunk + e);
  for (int e = tid; e < dkp * kSliceColumns; e += kThreads) {
    const int i = e / kSliceColumns, c = j0 + e % kSliceColumns;
    if (i < s.dk && c < s.dv)
      copy_async(s0 + e, s0_chunk + size_t(i) * s.dv + c);
    else
      s0[e] = 0.0f;
  }
  for (int e = tid; e < kC * kSliceColumns; e += kThreads) {
    const int t = e / kSliceColumns, c = j0 + e % kSliceColumns;
    if (c < s.dv)
      copy_async(delta + e, delta_chunk + t * s.dv + c);
    else
      delta[e] = 0.0f;
  }
  wait_copies();
  __syncthreads();

  float sums[kC / kWarps] = {};
  for (int i = 0; i < dkp; i += 4) {
    const float a0 = s0[i * kSliceColumns + lane], a1 = s0[(i + 1) * kSliceColumns + lane];
    const float a2 = s0[(i + 2) * kSliceColumns + lane], a3 = s0[(i + 3) * kSliceColumns + lane];
#pragma unroll
    for (int m = 0; m < kC / kWarps; ++m) {
      const float4 q4 = *reinterpret_cast<const float4*>(qd + (warp + kWarps * m) * dkp + i);
      sums[m] += q4.x * a0 + q4.y * a1 + q4.z * a2 + q4.w * a3;
    }
  }
  for (int u = 0; u < kC; u += 4) {
    const float d0 = delta[u * kSliceColumns + lane], d1 = delta[(u + 1) * kSliceColumns + lane];
    const float d2 = delta[(u + 2) * kSliceColumns + lane], d3 = delta[(u + 3) * kSliceColumns + lane];
#pragma unroll
    for (int m = 0; m < kC / kWarps; ++m) {
      const float4 p4 = *reinterpret_cast<const float4*>(p + (warp + kWarps * m) * kC + u);
      sums[m] += p4.x * d0 + p4.y * d1 + p4.z * d2 + p4.w * d3;
    }
  }
  if (j < s.dv)
#pragma unroll
    for (int m = 0; m < kC / kWarps; ++m) {
      const int t = warp + kWarps * m;
      if (t < n) out[(size_t(t0 + t) * s.heads + h) * s.dv + j] = sums[m];
    }
}

// o = w ⊙ rmsnorm(o) ⊙ gate(z) per head of dv values, in place; one block of 128 threads per (row, head).
__global__ void gdn_gated_norm_kernel(float* core, const float* z, const float* weight, int dv, float eps,
                                      bool sigmoid_gate) {
  __shared__ float partial[4];
  float* o = core + size_t(blockIdx.x) * dv;
  const float* gate = z + size_t(blockIdx.x) * dv;
  float sum = 0.0f;
  for (int j = threadIdx.x; j < dv; j += blockDim.x) sum += o[j] * o[j];
  sum = warp_sum(sum);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = sum;
  __syncthreads();
  const float total = partial[0] + partial[1] + partial[2] + partial[3];
  const float scale = 1.0f / sqrtf(total / float(dv) + eps);
  for (int j = threadIdx.x; j < dv; j += blockDim.x)
    o[j] = weight[j] * (o[j] * scale) * output_gate(gate[j], sigmoid_gate);
}

template <typename Kernel>
void launch_with_shared(Kernel kernel, dim3 grid, size_t shared_bytes, cudaStream_t stream, const GdnShape& s, int rows,
                        const ChunkScratch& x, float* target) {
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared_bytes));
  kernel<<<grid, kThreads, shared_bytes, stream>>>(s, rows, x, target);
}

}  // namespace

void gdn_conv(const float* taps, int channels, int kernel, float* state, float* x, int rows, float* row_states,
              cudaStream_t stream) {
  if (rows > 0)
    gdn_conv_kernel<<<blocks_for(channels, 128), 128, 0, stream>>>(taps, channels, kernel, state, x, rows, row_states);
}

void gdn_decode(const GdnShape& s, const GdnInputs& in, float* recurrent, float* row_states, float* out,
                cudaStream_t stream) {
  if (in.rows <= 0) return;
  const int slices = (s.dv + kSliceColumns - 1) / kSliceColumns;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(s.heads), unsigned(slices));
  config.blockDim = dim3(kThreads);
  config.stream = stream;
  cudaLaunchAttribute cluster[1];
  cluster[0].id = cudaLaunchAttributeClusterDimension;
  cluster[0].val.clusterDim.x = 1;
  cluster[0].val.clusterDim.y = unsigned(slices);
  cluster[0].val.clusterDim.z = 1;
  config.attrs = cluster;
  config.numAttrs = 1;
  static_assert(kMaxDecodeSlices <= 8, "a head's blocks must fit one portable cluster");
  if (s.dv % 4 == 0)
    cudaLaunchKernelEx(&config, gdn_decode_kernel<4>, s, in, recurrent, row_states, out);
  else
    cudaLaunchKernelEx(&config, gdn_decode_kernel<1>, s, in, recurrent, row_states, out);
}

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
  launch_with_shared(gdn_chunk_output_kernel, dim3(heads, chunks, slices), output_shared_bytes(s), stream, s, in.rows,
                     x, out);
  gdn_gated_norm_kernel<<<in.rows * s.heads, 128, 0, stream>>>(out, in.z, in.norm, s.dv, in.eps, in.sigmoid_gate);
}

}  // namespace vavilov::cuda
