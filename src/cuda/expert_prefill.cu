#include <cub/block/block_scan.cuh>
#include <stdexcept>

#include "cuda/expert_prefill.cuh"
#include "cuda/launch.cuh"

namespace vavilov::cuda {

namespace {

constexpr int kGroupThreads = 1024;
constexpr int kMaxExperts = 2048;  // device_model.cpp refuses more
constexpr int kCountsPerThread = kMaxExperts / kGroupThreads;

// One block: count per expert (shared atomics, order-free), exclusive scan, then place the slots 1024 at a time,
// warp after warp, so that slots of one expert keep their order (deterministic grouping).
__global__ void __launch_bounds__(kGroupThreads)
    group_kernel(const int* ids, int slots, int experts, int* counts, int* offsets, int* order, int* position) {
  allow_dependents();
  __shared__ int cursor[kMaxExperts];
  using Scan = cub::BlockScan<int, kGroupThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  const int t = int(threadIdx.x), lane = t % 32, warp = t / 32;
  for (int e = t; e < kMaxExperts; e += kGroupThreads) cursor[e] = 0;
  __syncthreads();
  for (int s = t; s < slots; s += kGroupThreads) atomicAdd(&cursor[ids[s]], 1);
  __syncthreads();
  int count[kCountsPerThread], start[kCountsPerThread];
  for (int i = 0; i < kCountsPerThread; ++i) count[i] = cursor[t * kCountsPerThread + i];
  Scan(scan_storage).ExclusiveSum(count, start);
  __syncthreads();
  for (int i = 0; i < kCountsPerThread; ++i) {
    const int e = t * kCountsPerThread + i;
    cursor[e] = start[i];
    if (e < experts) {
      counts[e] = count[i];
      offsets[e] = start[i];
    }
  }
  __syncthreads();
  for (int base = 0; base < slots; base += kGroupThreads) {
    const int s = base + t;
    const bool valid = s < slots;
    const int e = valid ? ids[s] : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    const int rank = __popc(peers & ((1u << lane) - 1u));
    for (int w = 0; w < kGroupThreads / 32; ++w) {
      if (warp == w) {
        const int first = valid ? cursor[e] : 0;
        __syncwarp();
        if (valid) {
          order[first + rank] = s;
          position[s] = first + rank;
          if (rank == 0) cursor[e] = first + __popc(peers);
        }
      }
      __syncthreads();
    }
  }
}

__global__ void gather_grouped_kernel(const float* x, const int* order, int x_divisor, int cols, float* out) {
  allow_dependents();
  const int p = int(blockIdx.y);
  const float* from = x + size_t(order[p] / x_divisor) * size_t(cols);
  float* to = out + size_t(p) * size_t(cols);
  for (int c = int(blockIdx.x * blockDim.x + threadIdx.x); c < cols; c += int(gridDim.x * blockDim.x)) to[c] = from[c];
}

__global__ void scatter_grouped_kernel(const float* grouped, const int* position, int cols, float* out) {
  allow_dependents();
  const int s = int(blockIdx.y);
  const float* from = grouped + size_t(position[s]) * size_t(cols);
  float* to = out + size_t(s) * size_t(cols);
  for (int c = int(blockIdx.x * blockDim.x + threadIdx.x); c < cols; c += int(gridDim.x * blockDim.x)) to[c] = from[c];
}

dim3 row_grid(int rows, int cols) { return dim3(unsigned((cols + 255) / 256), unsigned(rows)); }

}  // namespace

void group_by_expert(const int* ids, int slots, int experts, int* counts, int* offsets, int* order, int* position,
                     cudaStream_t stream) {
  if (experts > kMaxExperts) throw std::invalid_argument("group_by_expert: more than 2048 experts");
  group_kernel<<<1, kGroupThreads, 0, stream>>>(ids, slots, experts, counts, offsets, order, position);
}

cudaError_t active_experts(const int* counts, int experts, std::vector<ExpertGroup>& groups, cudaStream_t stream) {
  std::vector<int> host(size_t(experts), 0);
  cudaError_t status = cudaMemcpyAsync(host.data(), counts, host.size() * sizeof(int), cudaMemcpyDeviceToHost, stream);
  if (status == cudaSuccess) status = cudaStreamSynchronize(stream);
  if (status != cudaSuccess) return status;
  groups.clear();
  int offset = 0;
  for (int e = 0; e < experts; ++e) {
    if (host[size_t(e)]) groups.push_back({e, offset, host[size_t(e)]});
    offset += host[size_t(e)];
  }
  return cudaSuccess;
}

void gather_grouped_rows(const float* x, const int* order, int slots, int x_divisor, int cols, float* out,
                         cudaStream_t stream) {
  if (slots) gather_grouped_kernel<<<row_grid(slots, cols), 256, 0, stream>>>(x, order, x_divisor, cols, out);
}

void scatter_grouped_rows(const float* grouped, const int* position, int slots, int cols, float* out,
                          cudaStream_t stream) {
  if (slots) scatter_grouped_kernel<<<row_grid(slots, cols), 256, 0, stream>>>(grouped, position, cols, out);
}

}  // namespace vavilov::cuda
