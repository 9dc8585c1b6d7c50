#include "cuda/expert_cache_kernels.cuh"
#include "cuda/launch.cuh"
#include "cuda/moe.cuh"

namespace vavilov::cuda {

namespace {

constexpr int kCountThreads = 256;

__global__ void count_expert_use_kernel(const int* ids, int count, int experts, uint32_t* uses,
                                        unsigned long long* reads, const DeviceMatrix* gate, const char* slots_begin,
                                        const char* slots_end) {
  wait_for_producers();
  allow_dependents();
  __shared__ unsigned seen[kMaxMoeExperts / 32];
  __shared__ unsigned distinct, hits;
  for (int i = int(threadIdx.x); i < kMaxMoeExperts / 32; i += blockDim.x) seen[i] = 0;
  if (threadIdx.x == 0) distinct = hits = 0;
  __syncthreads();
  for (int i = int(threadIdx.x); i < count; i += blockDim.x) {
    const int id = ids[i];
    if (id < 0 || id >= experts) continue;
    atomicAdd(&uses[id], 1u);
    const unsigned bit = 1u << (id % 32);
    if (atomicOr(&seen[id / 32], bit) & bit) continue;
    atomicAdd(&distinct, 1u);
    const char* data = static_cast<const char*>(*reinterpret_cast<const void* const volatile*>(&gate[id].data));
    if (data >= slots_begin && data < slots_end) atomicAdd(&hits, 1u);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    atomicAdd(&reads[0], (unsigned long long)distinct);
    atomicAdd(&reads[1], (unsigned long long)hits);
  }
}

static_assert(sizeof(DeviceMatrix) % 8 == 0 && alignof(DeviceMatrix) == 8, "entries are written in 8-byte words");

__global__ void write_entries_kernel(const ExpertEntryUpdate* updates, int count) {
  constexpr int kWords = int(sizeof(DeviceMatrix) / 8);
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x), update = i / kWords, word = i % kWords;
  if (update >= count) return;
  const auto* from = reinterpret_cast<const unsigned long long*>(&updates[update].value);
  auto* to = reinterpret_cast<volatile unsigned long long*>(updates[update].target);
  to[word] = from[word];
}

}  // namespace

cudaError_t count_expert_use(const int* ids, int count, int experts, uint32_t* uses, unsigned long long* reads,
                             const DeviceMatrix* gate, const void* slots_begin, const void* slots_end,
                             cudaStream_t stream) {
  return launch_dependent(count_expert_use_kernel, 1, kCountThreads, 0, stream, ids, count, experts, uses, reads, gate,
                          static_cast<const char*>(slots_begin), static_cast<const char*>(slots_end));
}

cudaError_t write_expert_entries(const ExpertEntryUpdate* updates, int count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const int threads = count * int(sizeof(DeviceMatrix) / 8);
  write_entries_kernel<<<(threads + 127) / 128, 128, 0, stream>>>(updates, count);
  return cudaGetLastError();
}

}  // namespace vavilov::cuda
