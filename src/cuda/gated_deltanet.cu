#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cuda/gdn_common.cuh"
#include "cuda/launch.cuh"

namespace vavilov::cuda {

namespace {

using namespace gdn;

constexpr int kMaxConvKernel = kGdnMaxConvKernel;
constexpr int kMaxConvHistory = kMaxConvKernel - 1;
constexpr int kMaxPortableCluster = 8;  // the value heads of one key head form a cluster
// The decode kernel folds in convs of kernel ≤ 4 (the release's; wider ones would spill the registers that hold the
// state): the conv state of 3 inputs a channel.
constexpr int kDecodeConvHistory = 3;
constexpr int kReplayThreads = 256;

// ---- Decode ----------------------------------------------------------------------------------------------------
//
// One block per value head holds the head's whole dk × dv state in registers: kColumns ≥ dv columns (128 or 256),
// 512 threads, each 4 adjacent columns × 128·kColumns/16384 rows (8 rows, 32 values at 128 columns; read and written
// as float4 when dv % 4 == 0). A warp holds kColumns/16 columns over all 128 rows (column threads × row groups), so
// the sums over dk (Sᵀk, Sᵀq) finish with shuffles inside the warp, and the gated RMS norm over the head's dv outputs
// inside the block: no shared-memory reduction and no barrier per row, and no cluster for the norm. (At 128 columns
// 256 threads of 64 values each took ~480 instructions a warp per row, issued one after another by 8 warps a
// multiprocessor; 512 threads halve each warp's chain.) The state loads are issued first; while they are in
// flight the block prepares every row's inputs in shared memory (phase 1): threads [0, 128) one q and one k channel
// each (the causal conv when kConv, the l2 norms' partial sums), the next kColumns one v column each (its conv, its
// output gates, and row c's gates for thread c < rows). Then the rows one after the other (phase 2).
//
// With the conv folded in (kConv) the value heads of one key head form a thread-block cluster (3 blocks at
// Flash-Next's shape: small and portable, so a cluster finds room on the SMs while the kernel before still runs):
// each block convolves the key head's q and k channels itself from the old conv state, arrives at the cluster barrier
// after phase 1, and only after its wait, when every block has read that state, does the key head's first block
// write it back. Each block owns the conv state of its own v columns.

template <int kColumns>
struct DecodeLayout {
  static constexpr int kThreads = 512;
  static constexpr int kColumnThreads = kColumns / 64;  // a warp: column threads × row groups
  static constexpr int kRowGroups = 32 / kColumnThreads;
  static constexpr int kWarpColumns = 4 * kColumnThreads;
  static constexpr int kRowsPerThread = kGdnMaxKeyDim / kRowGroups;  // state rows (row_group + kRowGroups·m)
  static_assert(kThreads / 32 * kWarpColumns == kColumns, "the warps cover the columns");
};
constexpr int kNarrowColumns = 128;  // dv ≤ 128; else kGdnMaxValueDim columns
static_assert(kGdnMaxValueDim == 2 * kNarrowColumns, "two decode widths");

// Phase 1's thread roles.
constexpr int kKeyWarps = kGdnMaxKeyDim / 32;  // threads [0, 128): a q and a k channel
constexpr int kValueThread0 = kGdnMaxKeyDim;   // [128, 128 + kColumns): the head's v columns
static_assert(kGdnDecodeMaxRows <= kNarrowColumns, "value thread c computes row c's gates");
static_assert(kGdnDecodeMaxRows <= DecodeLayout<kNarrowColumns>::kThreads / 32, "the gated norm takes a warp per row");

// Row i, columns j0 .. j0 + 3 of a head's [dk, dv] state (zero outside it); vector when dv % 4 == 0.
__device__ inline void load_state(const float* head, const GdnShape& s, int i, int j0, bool vector, float (&v)[4]) {
  const float* p = head + size_t(i) * s.dv + j0;
  if (vector && i < s.dk && j0 < s.dv) {
    const float4 x = *reinterpret_cast<const float4*>(p);
    v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
  } else {
#pragma unroll
    for (int n = 0; n < 4; ++n) v[n] = !vector && i < s.dk && j0 + n < s.dv ? p[n] : 0.0f;
  }
}
// The thread's state rows row_group + kRowGroups·m (< dk), columns j0 .. j0 + 3 into a head's [dk, dv] state at
// `head` (vector when dv % 4 == 0). Its addresses are computed here, at each call, from an offset the compiler cannot
// see through: hoisted out of the row loop, 16 pointers would take the registers that hold the state. The vector
// stores are streaming (st.global.cs, evict-first): nothing in the pass reads these lines again, and they leave 48 SMs
// 64 KB a head at a time. When recorded passes still wrote a snapshot per row, each extra row cost ~6.5 us at
// Flash-Next's shape with plain stores, ~2 streamed (and staging the snapshots in shared memory for bulk copies, ~3:
// see bench/results/2026-11-30-h200-gdn-decode-rows-s6.json); they now record the state before the pass once.
template <int kRowGroups, int kRows>
__device__ inline void store_state(float* head, const GdnShape& s, int row_group, int j0, bool vector,
                                   const float (&state)[kRows][4]) {
  int first = row_group * s.dv + j0;
  asm volatile("" : "+r"(first));
  float* p = head + first;
  const int stride = kRowGroups * s.dv;
#pragma unroll
  for (int m = 0; m < kRows; ++m) {
    if (row_group + m * kRowGroups >= s.dk) break;
    float* row = p + m * stride;
    if (vector) {
      if (j0 < s.dv)
        __stcs(reinterpret_cast<float4*>(row), make_float4(state[m][0], state[m][1], state[m][2], state[m][3]));
    } else {
#pragma unroll
      for (int n = 0; n < 4; ++n)
        if (j0 + n < s.dv) row[n] = state[m][n];
    }
  }
}

// A row's l2 norm scales from phase 1's per-warp sums: q̂ = q·(1/‖q‖/√dk), k̂ = k·(1/‖k‖) with ‖x‖ = sqrt(Σx² + 1e-6),
// and k̂·q̂.
struct RowScales {
  float q, k, kq;
};
__device__ inline RowScales row_scales(const float (&norms)[kKeyWarps][3], int dk) {
  float sums[3] = {};
  for (int w = 0; w < kKeyWarps; ++w)
    for (int n = 0; n < 3; ++n) sums[n] += norms[w][n];
  // rsqrtf rather than IEEE 1/sqrt: these are on every row's serial path (device_math.cuh's rms_scale says why).
  const float rq = rsqrtf(sums[0] + 1e-6f) * rsqrtf(float(dk)), rk = rsqrtf(sums[1] + 1e-6f);
  return {rq, rk, sums[2] * rq * rk};
}

// The cluster barrier in two halves (sm_90): arrive, do other work, wait. A release arrive orders this thread's
// earlier memory accesses (its reads of the old conv state) before the acquiring wait of the block that then writes.
__device__ inline void cluster_arrive_release() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ inline void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

// One channel's causal conv in registers: its taps and its last kernel−1 ≤ kHistory inputs (window[0] the oldest),
// indexed by compile-time constants only; entries past `history` are zero.
template <int kHistory = kMaxConvHistory>
struct ConvChannel {
  float taps[kHistory], newest_tap, window[kHistory];
  int history;

  __device__ void load(const GdnConvState& conv, int channels, int ch) {
    history = conv.kernel - 1;
    const float* tap = conv.taps + size_t(ch) * conv.kernel;
#pragma unroll
    for (int k = 0; k < kHistory; ++k) window[k] = k < history ? conv.state[size_t(k) * channels + ch] : 0.0f;
    if constexpr (kHistory == 3) {
      // A channel's 4 taps are one float4 (a warp's loads one contiguous 512-byte run; read a float at a time they
      // touched each sector four times: ncu counted 24 % of the decode kernel's global sectors as excess).
      if (conv.kernel == 4 && reinterpret_cast<uintptr_t>(conv.taps) % 16 == 0) {
        const float4 t = *reinterpret_cast<const float4*>(tap);
        taps[0] = t.x, taps[1] = t.y, taps[2] = t.z, newest_tap = t.w;
        return;
      }
    }
#pragma unroll
    for (int k = 0; k < kHistory; ++k) taps[k] = k < history ? tap[k] : 0.0f;
    newest_tap = tap[history];
  }
  // silu of the conv with x as the newest input (the sum in gdn_conv_kernel's order); x joins the window.
  __device__ float step(float x) {
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < kHistory; ++k) sum += taps[k] * window[k];
    sum += newest_tap * x;
#pragma unroll
    for (int k = 0; k < kHistory; ++k) {
      const float next = window[k + 1 < kHistory ? k + 1 : k];
      window[k] = k + 1 < history ? next : k + 1 == history ? x : 0.0f;
    }
    return silu(sum);
  }
  // Writes the window into a [kernel−1, channels] state.
  __device__ void store(float* state, int channels, int ch) const {
#pragma unroll
    for (int k = 0; k < kHistory; ++k)
      if (k < history) state[size_t(k) * channels + ch] = window[k];
  }
};

// ---- Causal conv of longer passes (prefill) -------------------------------------------------------------------
//
// In place over x [rows, channels]. A block holds kConvChannels channels × kConvGroups groups of kConvRowBatch rows (a
// 256-row stretch at a time): each thread reads its rows and the raw inputs before them (from x, or for the first
// group the window carried from the previous stretch or the state) before the block's barrier and writes after it, so
// no thread overwrites an input another still needs, and every thread has 16 loads in flight (one thread walking
// all rows of a channel left a 512-row chunk latency-bound: 347 us at Flash-Next's 10240 channels). The sums are
// ConvChannel's, as in decode.
constexpr int kConvChannels = 32, kConvGroups = 16, kConvRowBatch = 16;
constexpr int kConvStretch = kConvGroups * kConvRowBatch;

__global__ void __launch_bounds__(kConvChannels* kConvGroups)
    gdn_conv_kernel(GdnConvState conv, int channels, float* x, int rows) {
  wait_for_producers();
  allow_dependents();
  const int ch = int(blockIdx.x) * kConvChannels + int(threadIdx.x) % kConvChannels;
  const int group = int(threadIdx.x) / kConvChannels;
  const bool active = ch < channels;  // inactive threads still reach the barriers
  ConvChannel<> c{};
  if (active) c.load(conv, channels, ch);
  const auto at = [&](int row) -> float& { return x[size_t(row) * channels + ch]; };
  for (int base = 0; base < rows; base += kConvStretch) {
    const int first = base + group * kConvRowBatch, end = min(base + kConvStretch, rows);
    float inputs[kConvRowBatch], carry[kMaxConvHistory] = {};
    if (active && first < rows) {
      if (group > 0)  // the raw inputs before `first`, all inside this stretch
#pragma unroll
        for (int k = 0; k < kMaxConvHistory; ++k) c.window[k] = k < c.history ? at(first - c.history + k) : 0.0f;
#pragma unroll
      for (int i = 0; i < kConvRowBatch; ++i) inputs[i] = first + i < rows ? at(first + i) : 0.0f;
    }
    if (active && group == 0)  // the window after the stretch: raw inputs end − history .. end − 1
#pragma unroll
      for (int k = 0; k < kMaxConvHistory; ++k) {
        const int row = end - c.history + k;
        if (k >= c.history) continue;
        if (row >= base) {
          carry[k] = at(row);
        } else {  // a stretch shorter than the history: the rest comes from the current window
#pragma unroll
          for (int j = 0; j < kMaxConvHistory; ++j)
            if (j == row - base + c.history) carry[k] = c.window[j];
        }
      }
    __syncthreads();
    if (active && first < rows) {
#pragma unroll
      for (int i = 0; i < kConvRowBatch; ++i) {
        const int t = first + i;
        if (t >= rows) break;
        at(t) = c.step(inputs[i]);
        if (conv.row_states) c.store(conv.row_states + size_t(t) * c.history * channels, channels, ch);
      }
    }
    if (group == 0)
#pragma unroll
      for (int k = 0; k < kMaxConvHistory; ++k) c.window[k] = carry[k];
  }
  if (active && group == 0) c.store(conv.state, channels, ch);
}

// kMaxRows: the rows a launch may take, kGdnDecodeMaxRows (any shape) or 1. The 1-row instantiation (a decode step
// without drafts) is for the release's head dims, dk = dv = 128, and conv width 4, and has those and its row count
// as constants: no row loops, the shared arrays a row deep, no bounds checks, no scalar paths for dv % 4 != 0 and
// no loops over the conv's history, so a smaller body
// (ncu found 7.2 of ~19.9 cycles between a warp's instructions waiting for instruction fetch in the general kernel at
// 1 row). Same arithmetic in the same order: bit-identical results. One block a multiprocessor at most (up to 128
// registers a thread; two would spill the 256-column state).
template <int kColumns, bool kConv, int kMaxRows>
__global__ void __launch_bounds__(DecodeLayout<kColumns>::kThreads, 1)
    gdn_decode_kernel(GdnShape shape, GdnInputs in, GdnConvState conv, float* recurrent, float* row_states,
                      float* out) {
  using L = DecodeLayout<kColumns>;
  static_assert(kMaxRows == kGdnDecodeMaxRows || (kMaxRows == 1 && kColumns == kGdnMaxKeyDim),
                "a general instantiation and one of 1 row at dk = dv = 128");
  GdnShape s = shape;
  if constexpr (kMaxRows == 1) s.dk = s.dv = kGdnMaxKeyDim, conv.kernel = kDecodeConvHistory + 1;
  __shared__ float q[kMaxRows][kGdnMaxKeyDim], k[kMaxRows][kGdnMaxKeyDim];  // raw (conv output)
  __shared__ __align__(16) float v[kMaxRows][kColumns];
  __shared__ __align__(16) float outputs[kMaxRows][kColumns];
  __shared__ float output_gates[kMaxRows][kColumns];  // σ(z) or silu(z)
  __shared__ float norm_weight[kColumns];
  __shared__ float norms[kMaxRows][kKeyWarps][3];                                   // per warp: Σq², Σk², Σqk
  __shared__ float gates[kMaxRows][2];                                              // e^g, β
  __shared__ float key_windows[kConv ? kDecodeConvHistory : 1][2 * kGdnMaxKeyDim];  // the owner's new q | k conv state
  const int head = blockIdx.x, tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int rows = kMaxRows == 1 ? 1 : in.rows;
  const int row_group = lane / L::kColumnThreads;
  const int j0 = warp * L::kWarpColumns + lane % L::kColumnThreads * 4;  // this thread's first column
  const bool vector = s.dv % 4 == 0;  // then a thread's four columns are all inside dv or all outside
  const int key_head = head / (s.heads / s.key_heads);
  const size_t head_size = size_t(s.dk) * s.dv;
  float* head_state = recurrent + head * head_size;

  float state[L::kRowsPerThread][4];
#pragma unroll
  for (int m = 0; m < L::kRowsPerThread; ++m) {
    const int i = row_group + m * L::kRowGroups;
    load_state(head_state, s, i, j0, vector, state[m]);
  }
  // Phase 1's channels: threads [0, 128) a q (first) and a k (second) channel, [128, 128 + kColumns) a v channel
  // (first). Their conv taps and state are loaded with the recurrent state: the layer's own, which only this kernel
  // writes; and the norm weight.
  const bool key_thread = tid < kGdnMaxKeyDim, value_thread = !key_thread && tid < kValueThread0 + kColumns;
  const int c = tid - kValueThread0;  // a value thread's column
  const bool key_valid = tid < s.dk, value_valid = value_thread && c < s.dv;
  const int q_channel = key_head * s.dk + (key_valid ? tid : 0), k_channel = s.key_dim + q_channel;
  const int v_channel = 2 * s.key_dim + head * s.dv + (value_valid ? c : 0);
  const int first_channel = key_thread ? q_channel : v_channel;
  // The key head's first block (rank 0 of its cluster) owns its q and k channels' conv state.
  const bool key_owner = kConv && head % (s.heads / s.key_heads) == 0;
  ConvChannel<kDecodeConvHistory> first_conv, second_conv;
  if constexpr (kConv) {
    if (key_thread || value_thread) first_conv.load(conv, s.conv_dim, first_channel);
    if (key_thread) second_conv.load(conv, s.conv_dim, k_channel);
  }
  const float weight = value_valid ? in.norm[c] : 0.0f;
  // Value thread c < rows computes row c's gates: the head's decay rate −e^{a_log} and dt_bias are weights, so they
  // are read (and the rate's exponential taken) here, off the path after the wait.
  const bool gate_thread = value_thread && c < kMaxRows;
  const float decay_rate = gate_thread ? -expf(in.a_log[head]) : 0.0f, dt_bias = gate_thread ? in.dt_bias[head] : 0.0f;
  // A dependent launch got here while the kernel before it (the layer's input products) may still run: the state is
  // this layer's own, the pass's inputs are read only after that kernel has finished (a no-op in a plain launch).
  wait_for_producers();
  allow_dependents();
  // A recorded pass of several rows keeps what a rollback needs (gdn_row_state_floats): first the state before it,
  // stored while phase 1 runs.
  const bool record = kMaxRows > 1 && row_states && rows > 1;
  if (record) store_state<L::kRowGroups>(row_states + head * head_size, s, row_group, j0, vector, state);

  // Phase 1: every input of every row into shared memory (copied asynchronously, so that all of a thread's loads are
  // in flight at once without registers, which hold the state), each thread's channels convolved in place there, and
  // the l2 norms' partial sums.
  if (key_thread) {
#pragma unroll 1
    for (int t = 0; t < rows; ++t) {
      if (key_valid) {
        copy_async(&q[t][tid], in.qkv + size_t(t) * s.conv_dim + q_channel);
        copy_async(&k[t][tid], in.qkv + size_t(t) * s.conv_dim + k_channel);
      } else {
        q[t][tid] = k[t][tid] = 0.0f;
      }
    }
  } else if (value_thread) {
#pragma unroll 1
    for (int t = 0; t < rows; ++t) {
      if (value_valid) {
        copy_async(&v[t][c], in.qkv + size_t(t) * s.conv_dim + v_channel);
        copy_async(&output_gates[t][c], in.z + (size_t(t) * s.heads + head) * s.dv + c);
      } else {
        v[t][c] = output_gates[t][c] = 0.0f;
      }
    }
  }
  float row_decay = 0.0f, row_beta = 0.0f;
  if (value_thread && c < rows) {  // value thread c also computes row c's gates
    const size_t at = size_t(c) * s.heads + head;
    const float a = in.a[at], b = in.b[at];                // both loads in flight before either is used
    row_decay = expf(decay_rate * softplus(a + dt_bias));  // log_decay's arithmetic
    row_beta = sigmoid(b);
  }
  wait_copies();  // this thread's own copies
  if (key_thread) {
    float* recorded = key_owner && key_valid ? conv.row_states : nullptr;
#pragma unroll 1
    for (int t = 0; t < rows; ++t) {
      float qt = q[t][tid], kt = k[t][tid];
      if constexpr (kConv)
        if (key_valid) {
          qt = first_conv.step(qt);
          kt = second_conv.step(kt);
          if (recorded) {
            float* row_state = recorded + size_t(t) * first_conv.history * s.conv_dim;
            first_conv.store(row_state, s.conv_dim, q_channel);
            second_conv.store(row_state, s.conv_dim, k_channel);
          }
          q[t][tid] = qt;
          k[t][tid] = kt;
        }
      const float qq = warp_sum(qt * qt), kk = warp_sum(kt * kt), qk = warp_sum(qt * kt);
      if (lane == 0) norms[t][warp][0] = qq, norms[t][warp][1] = kk, norms[t][warp][2] = qk;
    }
    if constexpr (kConv)
      if (key_owner) {  // written back after the cluster wait; kept here, not in registers over phase 2
        first_conv.store(&key_windows[0][0], 2 * kGdnMaxKeyDim, tid);
        second_conv.store(&key_windows[0][0], 2 * kGdnMaxKeyDim, kGdnMaxKeyDim + tid);
      }
  } else if (value_thread) {
#pragma unroll 1
    for (int t = 0; t < rows; ++t) {
      if constexpr (kConv)
        if (value_valid) {
          v[t][c] = first_conv.step(v[t][c]);
          if (conv.row_states)
            first_conv.store(conv.row_states + size_t(t) * first_conv.history * s.conv_dim, s.conv_dim, v_channel);
        }
      if (value_valid) output_gates[t][c] = output_gate(output_gates[t][c], in.sigmoid_gate);
    }
    norm_weight[c] = weight;
    if (c < rows) gates[c][0] = row_decay, gates[c][1] = row_beta;
  }
  // Every block of the key head reads the old conv state in phase 1; the owner writes it back after the wait below.
  // The release arrive is a GPU-scope fence (MEMBAR.ALL.GPU) that waits for the thread's outstanding stores: a value
  // thread's new conv state (its own, which this thread alone reads) is stored after it.
  if constexpr (kConv) {
    cluster_arrive_release();
    if (value_valid) first_conv.store(conv.state, s.conv_dim, v_channel);
  }
  __syncthreads();

  // Phase 2: the rows one after the other. With S' = e^g S, both Sᵀk̂ = S'ᵀk̂ and o = Sᵀq̂ = S'ᵀq̂ + δ (k̂·q̂) come from
  // one pass over the state; each warp holds whole columns, so its shuffles complete the sums over dk.
  for (int t = 0; t < rows; ++t) {
    // The parameter's dk, not the 1-row body's constant: rsqrtf(128) folded at compile time is not the bits of the
    // general body's MUFU.RSQ.
    const RowScales r = row_scales(norms[t], shape.dk);
    const float decay = gates[t][0], beta = gates[t][1];
    float sk[4] = {}, sq[4] = {};
#pragma unroll
    for (int m = 0; m < L::kRowsPerThread; ++m) {
      const int i = row_group + m * L::kRowGroups;
      const float ki = k[t][i] * r.k, qi = q[t][i] * r.q;
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        state[m][n] *= decay;
        sk[n] += state[m][n] * ki;
        sq[n] += state[m][n] * qi;
      }
    }
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int offset = L::kColumnThreads; offset < 32; offset <<= 1) {
        sk[n] += __shfl_xor_sync(0xffffffffu, sk[n], offset);
        sq[n] += __shfl_xor_sync(0xffffffffu, sq[n], offset);
      }
    const float4 vt = *reinterpret_cast<const float4*>(&v[t][j0]);
    const float vs[4] = {vt.x, vt.y, vt.z, vt.w};
    float delta[4], o[4];
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      delta[n] = beta * (vs[n] - sk[n]);
      o[n] = sq[n] + delta[n] * r.kq;
    }
    // The row's update of every state entry is S ← decay·S (above), then S ← k̂ δᵀ + S: recorded, a rollback redoes
    // those very operations (gdn_replay).
#pragma unroll
    for (int m = 0; m < L::kRowsPerThread; ++m) {
      const float ki = k[t][row_group + m * L::kRowGroups] * r.k;
#pragma unroll
      for (int n = 0; n < 4; ++n) state[m][n] = fmaf(ki, delta[n], state[m][n]);
    }
    if (row_group == 0) *reinterpret_cast<float4*>(&outputs[t][j0]) = make_float4(o[0], o[1], o[2], o[3]);
    if (record) {
      float* update = row_states + s.heads * head_size + (size_t(t) * s.heads + head) * gdn_row_update_floats(s);
      if (tid == 0) update[0] = decay;
      if (tid < s.dk) update[kGdnUpdateKeys + tid] = k[t][tid] * r.k;
      if (row_group == 0)
        for (int n = 0; n < 4 && j0 + n < s.dv; ++n) update[kGdnUpdateKeys + s.dk + j0 + n] = delta[n];
    }
  }
  // The new state, issued before the output norm.
  store_state<L::kRowGroups>(head_state, s, row_group, j0, vector, state);
  __syncthreads();  // outputs complete

  // Gated RMS norm over the head's dv outputs of each row: warp t, row t.
  if (warp < rows) {
    float sum = 0.0f;
#pragma unroll
    for (int n = 0; n < kColumns / 32; ++n) {
      const float o = outputs[warp][lane + 32 * n];  // zero past dv
      sum += o * o;
    }
    const float scale = rms_scale(warp_sum(sum), 1.0f / float(s.dv), in.eps);
    float* row_out = out + (size_t(warp) * s.heads + head) * s.dv;
#pragma unroll
    for (int n = 0; n < kColumns / 32; ++n) {
      const int j = lane + 32 * n;
      if (j < s.dv) row_out[j] = norm_weight[j] * (outputs[warp][j] * scale) * output_gates[warp][j];
    }
  }
  if constexpr (kConv) {
    cluster_wait();  // every block of the key head has read the old conv state
    if (key_owner && key_valid)
      for (int h = 0; h < conv.kernel - 1; ++h) {
        conv.state[size_t(h) * s.conv_dim + q_channel] = key_windows[h][tid];
        conv.state[size_t(h) * s.conv_dim + k_channel] = key_windows[h][kGdnMaxKeyDim + tid];
      }
  }
}

template <int kColumns, bool kConv>
void launch_decode(const GdnShape& s, const GdnInputs& in, const GdnConvState& conv, float* recurrent,
                   float* row_states, float* out, bool dependent, bool one_row_body, cudaStream_t stream) {
  const dim3 cluster = kConv ? dim3(unsigned(s.heads / s.key_heads), 1, 1) : kNoCluster;
  auto* kernel = gdn_decode_kernel<kColumns, kConv, kGdnDecodeMaxRows>;
  if constexpr (kColumns == kGdnMaxKeyDim)
    if (one_row_body && in.rows == 1 && s.dk == kGdnMaxKeyDim && s.dv == kGdnMaxKeyDim &&
        (!kConv || conv.kernel == kDecodeConvHistory + 1))
      kernel = gdn_decode_kernel<kColumns, kConv, 1>;
  launch_clustered(kernel, dim3(unsigned(s.heads)), dim3(DecodeLayout<kColumns>::kThreads), 0, stream, cluster,
                   dependent, s, in, conv, recurrent, row_states, out);
}

template <bool kConv>
void launch_decode(const GdnShape& s, const GdnInputs& in, const GdnConvState& conv, float* recurrent,
                   float* row_states, float* out, bool dependent, bool one_row_body, cudaStream_t stream) {
  if (s.dv <= kNarrowColumns)
    launch_decode<kNarrowColumns, kConv>(s, in, conv, recurrent, row_states, out, dependent, one_row_body, stream);
  else
    launch_decode<kGdnMaxValueDim, kConv>(s, in, conv, recurrent, row_states, out, dependent, one_row_body, stream);
}

// Block per (value head, buffer); a thread per state entry in turn: the state before the pass, then each kept row's
// S ← decay·S, S ← k̂ δᵀ + S, the decode kernel's own operations in its order (bit-identical states).
__global__ void gdn_replay_kernel(GdnShape s, const GdnReplay* buffers, const int* kept_rows, int kept, int rows) {
  wait_for_producers();
  allow_dependents();
  if (kept_rows) kept = *kept_rows;
  if (kept >= rows) return;  // every row kept: the state is the pass's
  const GdnReplay b = buffers[blockIdx.y];
  const int head = int(blockIdx.x);
  const size_t head_size = size_t(s.dk) * s.dv, update_floats = gdn_row_update_floats(s);
  const float* before = b.row_states + head * head_size;
  const float* updates = b.row_states + s.heads * head_size + size_t(head) * update_floats;
  float* state = b.recurrent + head * head_size;
  for (int e = int(threadIdx.x); e < int(head_size); e += int(blockDim.x)) {
    const int i = e / s.dv, j = e % s.dv;
    float value = before[e];
    for (int t = 0; t < kept; ++t) {
      const float* u = updates + size_t(t) * s.heads * update_floats;
      value = fmaf(u[kGdnUpdateKeys + i], u[kGdnUpdateKeys + s.dk + j], value * u[0]);
    }
    state[e] = value;
  }
}

}  // namespace

void gdn_conv(const float* taps, int channels, int kernel, float* state, float* x, int rows, float* row_states,
              cudaStream_t stream) {
  if (rows > 0)
    launch_dependent(gdn_conv_kernel, dim3(unsigned((channels + kConvChannels - 1) / kConvChannels)),
                     dim3(kConvChannels * kConvGroups), 0, stream, GdnConvState{taps, kernel, state, row_states},
                     channels, x, rows);
}

void gdn_decode(const GdnShape& s, const GdnInputs& in, float* recurrent, float* row_states, float* out,
                cudaStream_t stream, bool one_row_body) {
  if (in.rows > 0) launch_decode<false>(s, in, GdnConvState{}, recurrent, row_states, out, false, one_row_body, stream);
}

void gdn_replay(const GdnShape& s, const GdnReplay* buffers, int count, const int* kept_rows, int kept, int rows,
                cudaStream_t stream) {
  if (count > 0)
    launch_dependent(gdn_replay_kernel, dim3(unsigned(s.heads), unsigned(count)), dim3(kReplayThreads), 0, stream, s,
                     buffers, kept_rows, kept, rows);
}

bool gdn_decode_one_row_body() {
  static const bool enabled = [] {
    const char* value = std::getenv("VAVILOV_GDN_ONE_ROW");
    return !(value && std::strcmp(value, "0") == 0);
  }();
  return enabled;
}

bool gdn_conv_decode_fused(const GdnShape& s, int conv_kernel) {
  return conv_kernel - 1 <= kDecodeConvHistory && s.heads % s.key_heads == 0 &&
         s.heads / s.key_heads <= kMaxPortableCluster;
}

int gdn_conv_decode_resident_clusters(const GdnShape& s) {
  if (!gdn_conv_decode_fused(s, kDecodeConvHistory + 1)) return 0;
  const bool narrow = s.dv <= kNarrowColumns;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(s.heads));
  config.blockDim =
      dim3(unsigned(narrow ? DecodeLayout<kNarrowColumns>::kThreads : DecodeLayout<kGdnMaxValueDim>::kThreads));
  cudaLaunchAttribute cluster[1];
  cluster[0].id = cudaLaunchAttributeClusterDimension;
  cluster[0].val.clusterDim = {unsigned(s.heads / s.key_heads), 1, 1};
  config.attrs = cluster;
  config.numAttrs = 1;
  int clusters = 0;
  const cudaError_t status = narrow
                                 ? cudaOccupancyMaxActiveClusters(
                                       &clusters, gdn_decode_kernel<kNarrowColumns, true, kGdnDecodeMaxRows>, &config)
                                 : cudaOccupancyMaxActiveClusters(
                                       &clusters, gdn_decode_kernel<kGdnMaxValueDim, true, kGdnDecodeMaxRows>, &config);
  return status == cudaSuccess ? clusters : -1;
}

void gdn_conv_decode(const GdnShape& s, const GdnConvState& conv, float* qkv, GdnInputs in, float* recurrent,
                     float* row_states, float* out, bool dependent, cudaStream_t stream, bool one_row_body) {
  if (in.rows <= 0) return;
  in.qkv = qkv;
  if (gdn_conv_decode_fused(s, conv.kernel)) {
    launch_decode<true>(s, in, conv, recurrent, row_states, out, dependent, one_row_body, stream);
  } else {
    gdn_conv(conv.taps, s.conv_dim, conv.kernel, conv.state, qkv, in.rows, conv.row_states, stream);
    gdn_decode(s, in, recurrent, row_states, out, stream, one_row_body);
  }
}
}  // namespace vavilov::cuda
