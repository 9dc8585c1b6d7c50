#include "cuda/argmax.cuh"
#include "cuda/launch.cuh"

namespace vavilov::cuda {

namespace {

constexpr int kChunkThreads = 256;
constexpr int64_t kValuesPerChunk = 4096;  // 16 a thread: enough blocks for a 4-row step, few partials to combine
constexpr int kWarps = kChunkThreads / 32;

// The better of two candidates: a real index over none, a larger value, an equal value at a lower index.
__device__ __forceinline__ ArgmaxPartial better(ArgmaxPartial a, ArgmaxPartial b) {
  if (a.index < 0) return b;
  if (b.index < 0) return a;
  return b.value > a.value || (b.value == a.value && b.index < a.index) ? b : a;
}

// A thread's values come in rising index order: it keeps the first non-NaN one and then only strictly larger ones.
__device__ __forceinline__ void consider(ArgmaxPartial& best, float value, int32_t index) {
  if (value == value && (best.index < 0 || value > best.value)) best = {value, index};
}

// The block's best, in thread 0 (`warps` shared slots).
__device__ ArgmaxPartial block_best(ArgmaxPartial best, ArgmaxPartial* warps) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const ArgmaxPartial other{__shfl_down_sync(0xffffffffu, best.value, offset),
                              __shfl_down_sync(0xffffffffu, best.index, offset)};
    best = better(best, other);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warps[warp] = best;
  __syncthreads();
  if (threadIdx.x == 0)
    for (int w = 1; w < int(blockDim.x / 32); ++w) best = better(best, warps[w]);
  return best;
}

// grid (chunks, rows): partials[row][chunk] = the best of the chunk's values. chunk_size is a multiple of 4; with
// `vectorised` (vocab a multiple of 4, rows 16-byte aligned) each thread reads four consecutive values at a time.
template <bool vectorised>
__global__ void chunk_argmax_kernel(const float* logits, int64_t vocab, int64_t chunk_size, ArgmaxPartial* partials) {
  wait_for_producers();
  allow_dependents();
  __shared__ ArgmaxPartial warps[kWarps];
  const float* row = logits + int64_t(blockIdx.y) * vocab;
  const int64_t begin = int64_t(blockIdx.x) * chunk_size, end = min(vocab, begin + chunk_size);
  ArgmaxPartial best{0.0f, -1};
  if constexpr (vectorised) {
    for (int64_t i = begin + 4 * int64_t(threadIdx.x); i < end; i += 4 * kChunkThreads) {
      const float4 v = *reinterpret_cast<const float4*>(row + i);
      consider(best, v.x, int32_t(i));
      consider(best, v.y, int32_t(i + 1));
      consider(best, v.z, int32_t(i + 2));
      consider(best, v.w, int32_t(i + 3));
    }
  } else {
    for (int64_t i = begin + threadIdx.x; i < end; i += kChunkThreads) consider(best, row[i], int32_t(i));
  }
  best = block_best(best, warps);
  if (threadIdx.x == 0) partials[size_t(blockIdx.y) * kArgmaxMaxChunks + blockIdx.x] = best;
}

// One block (kArgmaxMaxChunks threads) a row: combines the row's partials; a NaN first value wins, as in
// std::max_element.
__global__ void combine_argmax_kernel(const float* logits, int64_t vocab, int chunks, const ArgmaxPartial* partials,
                                      int32_t* ids) {
  wait_for_producers();
  allow_dependents();
  __shared__ ArgmaxPartial warps[kArgmaxMaxChunks / 32];
  const ArgmaxPartial* row = partials + size_t(blockIdx.x) * kArgmaxMaxChunks;
  const ArgmaxPartial best = block_best(int(threadIdx.x) < chunks ? row[threadIdx.x] : ArgmaxPartial{0.0f, -1}, warps);
  if (threadIdx.x != 0) return;
  const float first = logits[int64_t(blockIdx.x) * vocab];
  ids[blockIdx.x] = first != first || best.index < 0 ? 0 : best.index;
}

}  // namespace

cudaError_t argmax_rows(const float* logits, int rows, int64_t vocab, ArgmaxPartial* scratch, int32_t* ids,
                        cudaStream_t stream) {
  if (rows <= 0 || vocab <= 0) return cudaSuccess;
  const int64_t wanted = (vocab + kValuesPerChunk - 1) / kValuesPerChunk;
  const int chunks = int(wanted < kArgmaxMaxChunks ? wanted : kArgmaxMaxChunks);
  const int64_t chunk_size = ((vocab + chunks - 1) / chunks + 3) / 4 * 4;
  const bool vectorised = vocab % 4 == 0 && reinterpret_cast<uintptr_t>(logits) % 16 == 0;
  void (*chunk_kernel)(const float*, int64_t, int64_t, ArgmaxPartial*) =
      vectorised ? chunk_argmax_kernel<true> : chunk_argmax_kernel<false>;
  const cudaError_t status = launch_dependent(chunk_kernel, dim3(unsigned(chunks), unsigned(rows)), kChunkThreads, 0,
                                              stream, logits, vocab, chunk_size, scratch);
  if (status != cudaSuccess) return status;
  return launch_dependent(combine_argmax_kernel, rows, kArgmaxMaxChunks, 0, stream, logits, vocab, chunks,
                          static_cast<const ArgmaxPartial*>(scratch), ids);
}

}  // namespace vavilov::cuda
