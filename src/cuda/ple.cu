#include "cuda/device_math.cuh"
#include "cuda/launch.cuh"
#include "cuda/ple.cuh"

namespace vavilov::cuda {

namespace {

constexpr int kMaxPleWindow = 64;  // check_supported (device_model.cpp) holds configs to these
constexpr int kMaxNgram = 16;

__global__ void ple_rows_kernel(PleShape s, const int64_t* multipliers, const int64_t* head_sizes,
                                const int64_t* head_offsets, int64_t* previous, const int32_t* ids, int rows,
                                int64_t* table_rows, int64_t* row_previous) {
  wait_for_producers();
  allow_dependents();
  auto history = [&](int64_t i) { return i < s.context ? previous[i] : int64_t(ids[i - s.context]); };
  const int heads = s.context * s.heads_per_ngram;
  for (int t = threadIdx.x; t < rows; t += blockDim.x) {
    const int64_t index = t + s.context;
    int64_t context[kMaxNgram];
    bool cut = false;
    for (int back = 0; back < s.ngram; ++back) {
      if (back >= 2 && history(index - back + 1) == s.eos) cut = true;
      context[back] = (back == 0 || !cut) ? history(index - back) : s.eos;
    }
    uint64_t mixed = uint64_t(context[0]) * uint64_t(multipliers[0]);
    for (int n = 2; n <= s.ngram; ++n) {
      mixed ^= uint64_t(context[n - 1]) * uint64_t(multipliers[n - 1]);
      for (int head = (n - 2) * s.heads_per_ngram; head < (n - 1) * s.heads_per_ngram; ++head) {
        int64_t remainder = int64_t(mixed) % head_sizes[head];
        if (remainder < 0) remainder += head_sizes[head];
        table_rows[size_t(t) * heads + head] = remainder + head_offsets[head];
      }
    }
    if (row_previous)
      for (int i = 0; i < s.context; ++i) row_previous[size_t(t) * s.context + i] = history(t + 1 + i);
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (int i = 0; i < s.context; ++i) previous[i] = history(rows + i);  // reads ahead of the writes
}

// A block owns kConvChannels channels over every row: thread (lane, channel) takes rows lane, lane + kConvRowLanes, ….
// An output needs only its own input and the (kernel − 1)·dilation before it (rows of normed, or the state before the
// pass), never an earlier output, so the rows run side by side; each channel's sum runs over the taps in order, as
// one thread walking the rows would. The state and the recorded windows are read before the block's barrier and the
// state written after it (no other block touches these channels).
constexpr int kConvChannels = 32, kConvRowLanes = 8;
constexpr int kConvStatePerLane = (kMaxPleWindow + kConvRowLanes - 1) / kConvRowLanes;

__global__ void __launch_bounds__(kConvChannels* kConvRowLanes)
    ple_conv_kernel(const float* taps, int channels, int kernel, int dilation, float* state, const float* normed,
                    int rows, const float* gated, float* stack, float* row_states) {
  wait_for_producers();
  allow_dependents();
  const int ch = int(blockIdx.x) * kConvChannels + int(threadIdx.x) % kConvChannels;
  const int lane = int(threadIdx.x) / kConvChannels, history = (kernel - 1) * dilation;
  const bool valid = ch < channels;
  // The conv's input at pass position p: normed row p, or before the pass the state (its oldest row first).
  auto input = [&](int p) {
    return p >= 0 ? normed[size_t(p) * channels + ch] : state[size_t(history + p) * channels + ch];
  };
  float next_state[kConvStatePerLane];
  if (valid) {
    for (int t = lane; t < rows; t += kConvRowLanes) {
      float sum = 0.0f;
      for (int k = 0; k < kernel; ++k) sum += taps[ch * kernel + k] * input(t - dilation * (kernel - 1 - k));
      stack[size_t(t) * channels + ch] += gated[size_t(t) * channels + ch] + silu(sum);
      if (row_states)  // the window after row t: inputs t − history + 1 … t
        for (int i = 0; i < history; ++i)
          row_states[(size_t(t) * history + i) * channels + ch] = input(t + 1 - history + i);
    }
#pragma unroll
    for (int n = 0; n < kConvStatePerLane; ++n)
      if (const int i = lane + n * kConvRowLanes; i < history) next_state[n] = input(rows - history + i);
  }
  __syncthreads();  // every read of the state of these channels precedes its writes
  if (!valid) return;
#pragma unroll
  for (int n = 0; n < kConvStatePerLane; ++n)
    if (const int i = lane + n * kConvRowLanes; i < history) state[size_t(i) * channels + ch] = next_state[n];
}

// One block per (row, stream). Each thread reads back only the gated values it wrote.
__global__ void ple_mix_kernel(const float* keys, const float* stack, const float* value, PleNorms norms, int streams,
                               int hidden, float* gated, float* normed) {
  wait_for_producers();
  allow_dependents();
  const int rs = blockIdx.x, r = rs / streams, s = rs % streams;
  const float* key = keys + size_t(rs) * hidden;
  const float* query = stack + size_t(rs) * hidden;
  const float *key_weight = norms.key + size_t(s) * hidden, *query_weight = norms.query + size_t(s) * hidden;
  float key_sum = 0.0f, query_sum = 0.0f;
  for (int d = threadIdx.x; d < hidden; d += blockDim.x) key_sum += key[d] * key[d], query_sum += query[d] * query[d];
  const float key_scale = rms_scale(block_sum(key_sum), hidden, norms.eps);
  const float query_scale = rms_scale(block_sum(query_sum), hidden, norms.eps);
  float dot = 0.0f;
  for (int d = threadIdx.x; d < hidden; d += blockDim.x)
    dot += (key[d] * key_scale * (1.0f + key_weight[d])) * (query[d] * query_scale * (1.0f + query_weight[d]));
  const float score = block_sum(dot) / sqrtf(float(hidden));
  const float shaped = sqrtf(fmaxf(fabsf(score), 1e-6f)) * float((score > 0) - (score < 0));
  const float gate = sigmoid(shaped);
  float* out = gated + size_t(rs) * hidden;
  float gated_sum = 0.0f;
  for (int d = threadIdx.x; d < hidden; d += blockDim.x) {
    const float v = gate * value[size_t(r) * hidden + d];
    out[d] = v;
    gated_sum += v * v;
  }
  const float conv_scale = rms_scale(block_sum(gated_sum), hidden, norms.eps);
  const float* conv_weight = norms.conv + size_t(s) * hidden;
  for (int d = threadIdx.x; d < hidden; d += blockDim.x)
    normed[size_t(rs) * hidden + d] = out[d] * conv_scale * (1.0f + conv_weight[d]);
}

}  // namespace

void ple_table_rows(const PleShape& s, const int64_t* multipliers, const int64_t* head_sizes,
                    const int64_t* head_offsets, int64_t* previous, const int32_t* ids, int rows, int64_t* table_rows,
                    int64_t* row_previous, cudaStream_t stream) {
  launch_dependent(ple_rows_kernel, 1, 256, 0, stream, s, multipliers, head_sizes, head_offsets, previous, ids, rows,
                   table_rows, row_previous);
}

void ple_mix(const float* keys, const float* stack, const float* value, const PleNorms& norms, int rows, int streams,
             int hidden, float* gated, float* normed, cudaStream_t stream) {
  if (rows * streams == 0) return;
  launch_dependent(ple_mix_kernel, rows * streams, norm_threads(hidden), 0, stream, keys, stack, value, norms, streams,
                   hidden, gated, normed);
}

void ple_conv(const float* taps, int channels, int kernel, int dilation, float* state, const float* normed, int rows,
              const float* gated, float* stack, float* row_states, cudaStream_t stream) {
  launch_dependent(ple_conv_kernel, blocks_for(channels, kConvChannels), kConvChannels * kConvRowLanes, 0, stream, taps,
                   channels, kernel, dilation, state, normed, rows, gated, stack, row_states);
}

}  // namespace vavilov::cuda
