#include <cooperative_groups.h>

#include <cstdint>

#include "cuda/gdn_common.cuh"
#include "cuda/launch.cuh"

namespace vavilov::cuda {

namespace {

using namespace gdn;
namespace cg = cooperative_groups;

constexpr int kMaxConvKernel = kGdnMaxConvKernel;
constexpr int kMaxConvHistory = kMaxConvKernel - 1;
constexpr int kMaxDecodeSlices = kGdnMaxValueDim / kSliceColumns;  // the cluster of one head: ≤ 8 (portable)
constexpr int kMaxClusterBlocks = 16;  // sm_90 with non-portable cluster sizes; ≤ 32: a lane per block in the norm

// ---- Decode ----------------------------------------------------------------------------------------------------
//
// Block (head, slice) owns value columns [32·slice, 32·slice + 32) of the head's dk × dv state: 256 threads, each
// holding 16 state values in registers (kVec adjacent columns × 16/kVec rows, read and written as float4 when
// kVec = 4). The state loads are issued first; while they are in flight the block prepares every row's inputs in
// shared memory (phase 1): threads [0, 128) one q and one k channel each (the causal conv when kConv, the l2 norms'
// partial sums), the next 32 the slice's v columns, the next `rows` the gates. Then one block reduction a row
// (phase 2): with S' = e^g S, both Sᵀk = S'ᵀk and o = Sᵀq = S'ᵀq + δ (k·q) come from one pass over the state.
//
// The blocks of one head share the squared outputs the gated RMS norm needs over all dv columns through a
// thread-block cluster: each block pushes its rows' sums into every block's shared memory, then one barrier (its
// arrive before the state stores, so that it does not wait for them to complete). With the conv folded in (kConv) the
// cluster holds all blocks of one key head (heads per key head × slices): each of them convolves the key head's q and k
// channels itself from the old conv state, and only after the cluster barrier, when every block has read that state,
// does the key head's first block write it back. Each block owns the conv state of its own v columns.

template <int kVec>
struct DecodeLayout {
  static constexpr int kColumnThreads = kSliceColumns / kVec;        // threads across the slice
  static constexpr int kRowGroups = kThreads / kColumnThreads;       // threads down dk
  static constexpr int kRowsPerThread = kGdnMaxKeyDim / kRowGroups;  // state rows per thread
};

// Phase 1's thread roles.
constexpr int kKeyWarps = kGdnMaxKeyDim / 32;                // threads [0, 128): a q and a k channel
constexpr int kValueThread0 = kGdnMaxKeyDim;                 // [128, 160): the slice's v columns
constexpr int kGateThread0 = kValueThread0 + kSliceColumns;  // [160, 160 + rows): one row's gates
static_assert(kGateThread0 + kGdnDecodeMaxRows <= kThreads, "phase 1 needs a thread per channel and per row");
static_assert(kGdnDecodeMaxRows <= kWarps, "the gated norm takes a warp per row");

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

// The cluster barrier in two halves (sm_90): arrive, do other work, wait. A relaxed arrive publishes nothing; a
// release arrive makes this block's earlier writes (its shared-memory pushes) visible to the blocks that then wait,
// and costs the time its outstanding stores take to complete, so the big state stores are issued after it.
__device__ inline void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ inline void cluster_arrive_release() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ inline void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

// One channel's causal conv in registers: its taps and its last kernel−1 inputs (window[0] the oldest), indexed by
// compile-time constants only; entries past `history` are zero.
struct ConvChannel {
  float taps[kMaxConvHistory], newest_tap, window[kMaxConvHistory];
  int history;

  __device__ void load(const GdnConvState& conv, int channels, int ch) {
    history = conv.kernel - 1;
    const float* tap = conv.taps + size_t(ch) * conv.kernel;
#pragma unroll
    for (int k = 0; k < kMaxConvHistory; ++k) {
      window[k] = k < history ? conv.state[size_t(k) * channels + ch] : 0.0f;
      taps[k] = k < history ? tap[k] : 0.0f;
    }
    newest_tap = tap[history];
  }
  // silu of the conv with x as the newest input (the sum in gdn_conv_kernel's order); x joins the window.
  __device__ float step(float x) {
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < kMaxConvHistory; ++k) sum += taps[k] * window[k];
    sum += newest_tap * x;
#pragma unroll
    for (int k = 0; k < kMaxConvHistory; ++k) {
      const float next = window[k + 1 < kMaxConvHistory ? k + 1 : k];
      window[k] = k + 1 < history ? next : k + 1 == history ? x : 0.0f;
    }
    return silu(sum);
  }
  // Writes the window into a [kernel−1, channels] state.
  __device__ void store(float* state, int channels, int ch) const {
#pragma unroll
    for (int k = 0; k < kMaxConvHistory; ++k)
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
  ConvChannel c{};
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

// Every row's input of channel ch of x [rows, conv_dim] (zero past `rows`).
__device__ inline void load_rows(const float* x, int conv_dim, int ch, int rows, float (&values)[kGdnDecodeMaxRows]) {
#pragma unroll
  for (int t = 0; t < kGdnDecodeMaxRows; ++t) values[t] = t < rows ? x[size_t(t) * conv_dim + ch] : 0.0f;
}

// The conv of channel ch over the rows' inputs in place: `conv` ends holding the window after the last row and
// row_states, when given ([rows, kernel−1, conv_dim]), each row's. A thread loads all its inputs before it calls
// this: a load after these stores could not be issued before them.
__device__ inline void convolve_rows(ConvChannel& conv, int conv_dim, int ch, int rows, float* row_states,
                                     float (&values)[kGdnDecodeMaxRows]) {
#pragma unroll
  for (int t = 0; t < kGdnDecodeMaxRows; ++t)
    if (t < rows) {
      values[t] = conv.step(values[t]);
      if (row_states) conv.store(row_states + size_t(t) * conv.history * conv_dim, conv_dim, ch);
    }
}

template <int kVec, bool kConv>
__global__ void __launch_bounds__(kThreads)
    gdn_decode_kernel(GdnShape s, GdnInputs in, GdnConvState conv, float* recurrent, float* row_states, float* out) {
  using L = DecodeLayout<kVec>;
  __shared__ __align__(16) float q[kGdnDecodeMaxRows][kGdnMaxKeyDim], k[kGdnDecodeMaxRows][kGdnMaxKeyDim];
  __shared__ __align__(16) float v[kGdnDecodeMaxRows][kSliceColumns];
  __shared__ __align__(16) float partial[2][kWarps][2][kSliceColumns];  // by row parity: Sᵀk, Sᵀq per warp
  __shared__ float norms[kGdnDecodeMaxRows][kKeyWarps][3];              // per warp: Σq², Σk², Σqk
  __shared__ float gates[kGdnDecodeMaxRows][3];                         // e^g, β, k̂·q̂
  __shared__ float outputs[kGdnDecodeMaxRows][kSliceColumns];
  __shared__ float pushed[kMaxClusterBlocks][kGdnDecodeMaxRows];  // by the sender's rank: its rows' Σo²
  __shared__ int pushed_head[kMaxClusterBlocks];                  // the sender's head
  cg::cluster_group cluster = cg::this_cluster();
  cluster_arrive_relaxed();  // waited for before the first push into another block's shared memory: all have started
  const int head = blockIdx.x, tid = threadIdx.x, lane = tid % 32, warp = tid / 32, rows = in.rows;
  const int column_thread = tid % L::kColumnThreads, row_group = tid / L::kColumnThreads;
  const int j0 = blockIdx.y * kSliceColumns + column_thread * kVec;  // this thread's first column
  const bool active = j0 < s.dv;  // kVec = 4 only when dv % 4 == 0: all four columns or none
  const int key_head = head / (s.heads / s.key_heads);
  const size_t head_size = size_t(s.dk) * s.dv;
  float* head_state = recurrent + head * head_size;

  float state[L::kRowsPerThread][kVec] = {};
#pragma unroll
  for (int m = 0; m < L::kRowsPerThread; ++m) {
    const int i = row_group + m * L::kRowGroups;
    if (active && i < s.dk) load_columns<kVec>(head_state + size_t(i) * s.dv + j0, state[m]);
  }
  const int j = blockIdx.y * kSliceColumns + lane;  // the output norm's column (warp r: row r)
  const bool norm_thread = warp < rows && j < s.dv;
  const float weight = norm_thread ? in.norm[j] : 0.0f;
  // Phase 1's channels: threads [0, 128) a q (first) and a k (second) channel, [128, 160) a v channel (first). Their
  // conv taps and state are loaded with the recurrent state: the layer's own, which only this kernel writes.
  const bool key_thread = tid < kGdnMaxKeyDim, value_thread = !key_thread && tid < kGateThread0;
  const bool key_valid = tid < s.dk,
             value_valid = value_thread && blockIdx.y * kSliceColumns + tid - kValueThread0 < s.dv;
  const int q_channel = key_head * s.dk + (key_valid ? tid : 0), k_channel = s.key_dim + q_channel;
  const int v_channel =
      2 * s.key_dim + head * s.dv + (value_valid ? blockIdx.y * kSliceColumns + tid - kValueThread0 : 0);
  const int first_channel = key_thread ? q_channel : v_channel;
  // The key head's first block (of the cluster) owns its q and k channels' conv state.
  const bool key_owner = kConv && blockIdx.x % cluster.dim_blocks().x == 0 && blockIdx.y == 0;
  ConvChannel first_conv, second_conv;
  if constexpr (kConv) {
    if (key_thread || value_thread) first_conv.load(conv, s.conv_dim, first_channel);
    if (key_thread) second_conv.load(conv, s.conv_dim, k_channel);
  }
  // A dependent launch got here while the kernel before it (the layer's input products) may still run: the state is
  // this layer's own, the pass's inputs are read only after that kernel has finished (a no-op in a plain launch).
  wait_for_producers();
  allow_dependents();
  const size_t out_at = (size_t(warp) * s.heads + head) * s.dv + j;
  const float gate = norm_thread ? output_gate(in.z[out_at], in.sigmoid_gate) : 0.0f;

  // Phase 1.
  if (key_thread) {
    float q_rows[kGdnDecodeMaxRows], k_rows[kGdnDecodeMaxRows];
    float* recorded = key_owner && key_valid ? conv.row_states : nullptr;
    load_rows(in.qkv, s.conv_dim, q_channel, rows, q_rows);
    load_rows(in.qkv, s.conv_dim, k_channel, rows, k_rows);
    if constexpr (kConv) {
      convolve_rows(first_conv, s.conv_dim, q_channel, rows, recorded, q_rows);
      convolve_rows(second_conv, s.conv_dim, k_channel, rows, recorded, k_rows);
    }
#pragma unroll
    for (int t = 0; t < kGdnDecodeMaxRows; ++t) {
      if (!key_valid) q_rows[t] = k_rows[t] = 0.0f;
      if (t < rows) {
        q[t][tid] = q_rows[t];
        k[t][tid] = k_rows[t];
        const float qq = warp_sum(q_rows[t] * q_rows[t]), kk = warp_sum(k_rows[t] * k_rows[t]),
                    qk = warp_sum(q_rows[t] * k_rows[t]);
        if (lane == 0) norms[t][warp][0] = qq, norms[t][warp][1] = kk, norms[t][warp][2] = qk;
      }
    }
  } else if (value_thread) {
    const int c = tid - kValueThread0;
    float v_rows[kGdnDecodeMaxRows];
    load_rows(in.qkv, s.conv_dim, v_channel, rows, v_rows);
    if constexpr (kConv) {
      convolve_rows(first_conv, s.conv_dim, v_channel, rows, value_valid ? conv.row_states : nullptr, v_rows);
      if (value_valid) first_conv.store(conv.state, s.conv_dim, v_channel);  // this thread alone reads it
    }
#pragma unroll
    for (int t = 0; t < kGdnDecodeMaxRows; ++t)
      if (t < rows) v[t][c] = value_valid ? v_rows[t] : 0.0f;
  } else if (tid < kGateThread0 + rows) {
    const int t = tid - kGateThread0;
    const size_t at = size_t(t) * s.heads + head;
    gates[t][0] = expf(log_decay(in, head, at));
    gates[t][1] = sigmoid(in.b[at]);
  }
  __syncthreads();
  // l2 norms: q̂ = q/‖q‖/√dk, k̂ = k/‖k‖ (‖x‖ = sqrt(Σx² + 1e-6)), and k̂·q̂.
  const float q_scale = 1.0f / sqrtf(float(s.dk));
  if (tid < kGdnMaxKeyDim) {
    for (int t = 0; t < rows; ++t) {
      float sums[3] = {};
      for (int w = 0; w < kKeyWarps; ++w)
        for (int n = 0; n < 3; ++n) sums[n] += norms[t][w][n];
      const float rq = 1.0f / sqrtf(sums[0] + 1e-6f) * q_scale, rk = 1.0f / sqrtf(sums[1] + 1e-6f);
      q[t][tid] *= rq;
      k[t][tid] *= rk;
      if (tid == 0) gates[t][2] = sums[2] * rq * rk;
    }
  }
  __syncthreads();

  // Phase 2: the rows one after the other.
  for (int t = 0; t < rows; ++t) {
    const float decay = gates[t][0], beta = gates[t][1], kq = gates[t][2];
    float sk[kVec] = {}, sq[kVec] = {};
#pragma unroll
    for (int m = 0; m < L::kRowsPerThread; ++m) {
      const int i = row_group + m * L::kRowGroups;
      if (i < s.dk) {
        const float ki = k[t][i], qi = q[t][i];
#pragma unroll
        for (int c = 0; c < kVec; ++c) {
          state[m][c] *= decay;
          sk[c] += state[m][c] * ki;
          sq[c] += state[m][c] * qi;
        }
      }
    }
#pragma unroll
    for (int c = 0; c < kVec; ++c)
      for (int offset = L::kColumnThreads; offset < 32; offset <<= 1) {
        sk[c] += __shfl_xor_sync(0xffffffffu, sk[c], offset);
        sq[c] += __shfl_xor_sync(0xffffffffu, sq[c], offset);
      }
    float(*sums)[2][kSliceColumns] = partial[t & 1];  // row t+1 writes the other half while row t's is still read
    const int column = column_thread * kVec;
    if (lane < L::kColumnThreads) {
      store_columns<kVec>(&sums[warp][0][column], sk);
      store_columns<kVec>(&sums[warp][1][column], sq);
    }
    __syncthreads();
    float delta[kVec], o[kVec];
#pragma unroll
    for (int c = 0; c < kVec; ++c) sk[c] = sq[c] = 0.0f;
    for (int w = 0; w < kWarps; ++w) {
      float wk[kVec], wq[kVec];
      load_columns<kVec>(&sums[w][0][column], wk);
      load_columns<kVec>(&sums[w][1][column], wq);
#pragma unroll
      for (int c = 0; c < kVec; ++c) sk[c] += wk[c], sq[c] += wq[c];
    }
#pragma unroll
    for (int c = 0; c < kVec; ++c) {
      delta[c] = beta * (v[t][column + c] - sk[c]);
      o[c] = sq[c] + delta[c] * kq;
    }
#pragma unroll
    for (int m = 0; m < L::kRowsPerThread; ++m) {
      const int i = row_group + m * L::kRowGroups;
      if (i < s.dk) {
        const float ki = k[t][i];
#pragma unroll
        for (int c = 0; c < kVec; ++c) state[m][c] += ki * delta[c];
      }
    }
    if (row_group == 0) store_columns<kVec>(&outputs[t][column], o);
    if (row_states && active && t + 1 < rows) {  // the last row's with the state, after the cluster arrive
      float* snapshot = row_states + (size_t(t) * s.heads + head) * head_size;
#pragma unroll
      for (int m = 0; m < L::kRowsPerThread; ++m) {
        const int i = row_group + m * L::kRowGroups;
        if (i < s.dk) store_columns<kVec>(snapshot + size_t(i) * s.dv + j0, state[m]);
      }
    }
  }
  __syncthreads();  // outputs complete

  // Gated RMS norm over the head's dv outputs of each row (warp t: row t). Every block pushes its rows' squares and its
  // head into the shared memory of each block of the cluster (distributed shared memory) and adds up, after the
  // barrier, those of its own head: one barrier, and no block reads another's memory after it (so none waits to exit).
  const float o = norm_thread ? outputs[warp][lane] : 0.0f;
  const int blocks = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  cluster_wait();  // every block of the cluster has started
  if (warp < rows) {
    const float sum = warp_sum(o * o);
    if (lane < blocks) {
      cluster.map_shared_rank(&pushed[0][0], unsigned(lane))[rank * kGdnDecodeMaxRows + warp] = sum;
      if (warp == 0) cluster.map_shared_rank(pushed_head, unsigned(lane))[rank] = head;
    }
  }
  cluster_arrive_release();
  // The new state (and the last row's snapshot) while the other blocks arrive.
  float* last_snapshot = row_states ? row_states + (size_t(rows - 1) * s.heads + head) * head_size : nullptr;
#pragma unroll
  for (int m = 0; m < L::kRowsPerThread; ++m) {
    const int i = row_group + m * L::kRowGroups;
    if (active && i < s.dk) {
      store_columns<kVec>(head_state + size_t(i) * s.dv + j0, state[m]);
      if (last_snapshot) store_columns<kVec>(last_snapshot + size_t(i) * s.dv + j0, state[m]);
    }
  }
  cluster_wait();
  if (warp < rows) {
    const float mine = lane < blocks && pushed_head[lane] == head ? pushed[lane][warp] : 0.0f;
    const float total = warp_sum(mine);
    if (norm_thread) out[out_at] = weight * (o * (1.0f / sqrtf(total / float(s.dv) + in.eps))) * gate;
  }
  // Every block of the key head has read the old conv state (phase 1 came before its arrive).
  if (key_owner && key_valid) {
    first_conv.store(conv.state, s.conv_dim, q_channel);
    second_conv.store(conv.state, s.conv_dim, k_channel);
  }
}

// The largest cluster (≤ 16 blocks) the fused kernel can be launched with; non-portable sizes (> 8) allowed once.
template <int kVec>
int fused_cluster_limit() {
  static const int limit = [] {
    const auto kernel = gdn_decode_kernel<kVec, true>;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
      cudaGetLastError();
      return 8;
    }
    for (int blocks = kMaxClusterBlocks; blocks > 8; --blocks) {
      cudaLaunchConfig_t config = {};
      config.gridDim = dim3(unsigned(blocks));
      config.blockDim = dim3(kThreads);
      cudaLaunchAttribute cluster[1];
      cluster[0].id = cudaLaunchAttributeClusterDimension;
      cluster[0].val.clusterDim.x = unsigned(blocks);
      cluster[0].val.clusterDim.y = cluster[0].val.clusterDim.z = 1;
      config.attrs = cluster;
      config.numAttrs = 1;
      int clusters = 0;
      if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) cudaGetLastError();
      if (clusters > 0) return blocks;
    }
    return 8;
  }();
  return limit;
}

template <int kVec, bool kConv>
void launch_decode(const GdnShape& s, const GdnInputs& in, const GdnConvState& conv, float* recurrent,
                   float* row_states, float* out, bool dependent, cudaStream_t stream) {
  const unsigned slices = unsigned((s.dv + kSliceColumns - 1) / kSliceColumns);
  const dim3 cluster(kConv ? unsigned(s.heads / s.key_heads) : 1u, slices, 1);
  launch_clustered(gdn_decode_kernel<kVec, kConv>, dim3(unsigned(s.heads), slices), dim3(kThreads), 0, stream, cluster,
                   dependent, s, in, conv, recurrent, row_states, out);
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
                cudaStream_t stream) {
  if (in.rows <= 0) return;
  static_assert(kMaxDecodeSlices <= 8, "a head's blocks must fit one portable cluster");
  const GdnConvState no_conv{};
  if (s.dv % 4 == 0)
    launch_decode<4, false>(s, in, no_conv, recurrent, row_states, out, false, stream);
  else
    launch_decode<1, false>(s, in, no_conv, recurrent, row_states, out, false, stream);
}

bool gdn_conv_decode_fused(const GdnShape& s) {
  const int blocks = s.heads / s.key_heads * ((s.dv + kSliceColumns - 1) / kSliceColumns);
  return blocks <= (s.dv % 4 == 0 ? fused_cluster_limit<4>() : fused_cluster_limit<1>());
}

void gdn_conv_decode(const GdnShape& s, const GdnConvState& conv, float* qkv, GdnInputs in, float* recurrent,
                     float* row_states, float* out, bool dependent, cudaStream_t stream) {
  if (in.rows <= 0) return;
  in.qkv = qkv;
  if (!gdn_conv_decode_fused(s)) {
    gdn_conv(conv.taps, s.conv_dim, conv.kernel, conv.state, qkv, in.rows, conv.row_states, stream);
    gdn_decode(s, in, recurrent, row_states, out, stream);
  } else if (s.dv % 4 == 0) {
    launch_decode<4, true>(s, in, conv, recurrent, row_states, out, dependent, stream);
  } else {
    launch_decode<1, true>(s, in, conv, recurrent, row_states, out, dependent, stream);
  }
}
}  // namespace vavilov::cuda
