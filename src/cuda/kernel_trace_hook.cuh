#pragma once
// The device half of the kernel trace (built only with -DVAVILOV_KERNEL_TRACE=ON; launch.cuh includes it): thread 0
// of block 0 of every kernel that calls wait_for_producers() reads %globaltimer before and after the wait and writes
// one entry to a ring in device memory. The wait returns once the previous kernel of the stream has completed, so
// successive entries' release times bound each kernel's share of the critical path as it runs in a replayed graph.
// launch_clustered() notes each launch's kernel on the host in the same order (kernel_trace.h maps the two).
#include <cuda_runtime.h>

#include <cstdint>

namespace vavilov::cuda::kernel_trace {

struct DeviceEntry {
  uint64_t grid_id = 0;      // %gridid: one value per launch (a kernel may wait more than once)
  uint64_t arrived_ns = 0;   // %globaltimer before the wait
  uint64_t released_ns = 0;  // after it
  uint32_t sm = 0, blocks = 0, threads = 0;
  uint32_t pass_end = 0;  // 1: a pass's end marker (kernel_trace.cu)
};

struct DeviceRing {
  unsigned long long count = 0;  // entries written so far (the ring keeps the last `capacity`)
  unsigned long long capacity = 0;
  DeviceEntry* entries = nullptr;
};

// Host side (kernel_trace.cpp): the launch about to be made, in stream order; each CUDA translation unit's copy of the
// ring pointer (a __device__ variable is per module without relocatable device code) registers its setter.
void note_launch(const void* kernel, dim3 grid, dim3 block, cudaStream_t stream);
cudaError_t launch_pass_end_marker(cudaStream_t stream);  // kernel_trace.cu: a 1-block dependent launch that waits
using RingSetter = cudaError_t (*)(DeviceRing*);
bool register_ring(RingSetter setter);

#ifdef __CUDACC__
static __device__ DeviceRing* ring = nullptr;  // null: not tracing
static cudaError_t set_ring(DeviceRing* r) { return cudaMemcpyToSymbol(ring, &r, sizeof r); }
[[maybe_unused]] static const bool ring_registered = register_ring(&set_ring);

static __device__ __forceinline__ bool is_recorder() {
  return (threadIdx.x | threadIdx.y | threadIdx.z | blockIdx.x | blockIdx.y | blockIdx.z) == 0 && ring != nullptr;
}

static __device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The slot is taken before the wait, where its atomic's latency hides behind the wait, and is in launch order all the
// same for kernels that wait before they trigger (every decode kernel): the next kernel starts only after this block's
// allow_dependents(), which follows the store that needs the slot.
struct Arrival {
  unsigned long long slot = 0, ns = 0;
};

static __device__ __forceinline__ Arrival arrival() {
  Arrival a;
  if (is_recorder()) {
    a.ns = global_ns();
    a.slot = atomicAdd(&ring->count, 1ull);
  }
  return a;
}

static __device__ __forceinline__ void record(const Arrival& a, uint32_t pass_end = 0) {
  if (!is_recorder()) return;
  DeviceEntry e;
  e.released_ns = global_ns();
  e.arrived_ns = a.ns;
  asm volatile("mov.u64 %0, %%gridid;" : "=l"(e.grid_id));
  asm volatile("mov.u32 %0, %%smid;" : "=r"(e.sm));
  e.blocks = gridDim.x * gridDim.y * gridDim.z;
  e.threads = blockDim.x * blockDim.y * blockDim.z;
  e.pass_end = pass_end;
  ring->entries[a.slot % ring->capacity] = e;
}
#endif

}  // namespace vavilov::cuda::kernel_trace
