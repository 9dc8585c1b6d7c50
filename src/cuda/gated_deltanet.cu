#include <cooperative_groups.h>

#include <cstdint>

#include "cuda/gdn_common.cuh"

namespace vavilov::cuda {

namespace {

using namespace gdn;
namespace cg = cooperative_groups;

constexpr int kMaxConvKernel = 8;
constexpr int kMaxDecodeSlices = kGdnMaxValueDim / kSliceColumns;  // the cluster of one head: ≤ 8 (portable)

__global__ void gdn_conv_kernel(const float* taps, int channels, int kernel, float* state, float* x, int rows,
                                float* row_states) {
  cudaTriggerProgrammaticLaunchCompletion();
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
  cudaTriggerProgrammaticLaunchCompletion();
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
}  // namespace vavilov::cuda
