// Known kernels for tests/gpu/test_cuda_kernel_trace.cpp, launched in a known order.
#include <cuda_runtime.h>

#include "cuda/launch.cuh"

namespace vavilov {
namespace {

// Each kernel spins for a while after its wait, so that its span is measurable.
__device__ void spin_ns(unsigned long long ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  while (now - start < ns);
}
__global__ void first_traced(int* out) {
  cuda::wait_for_producers();
  cuda::allow_dependents();
  spin_ns(20000);
  if (threadIdx.x == 0) atomicAdd(out, 1);
}
__global__ void second_traced(int* out) {
  cuda::wait_for_producers();
  cuda::allow_dependents();
  spin_ns(40000);
  if (threadIdx.x == 0) atomicAdd(out, 1);
}
__global__ void waits_twice(int* out) {
  cuda::wait_for_producers();
  cuda::wait_for_producers();
  cuda::allow_dependents();
  if (threadIdx.x == 0) atomicAdd(out, 1);
}

}  // namespace

// The first failure of the launches, if any.
cudaError_t launch_known(int* counter, cudaStream_t stream, bool around_launch_helper) {
  cudaError_t status = cuda::launch_dependent(first_traced, dim3(3), dim3(64), 0, stream, counter);
  if (around_launch_helper && status == cudaSuccess) {
    second_traced<<<7, 96, 0, stream>>>(counter);
    status = cudaGetLastError();
  }
  if (status == cudaSuccess) status = cuda::launch_dependent(second_traced, dim3(5), dim3(128), 0, stream, counter);
  if (status == cudaSuccess) status = cuda::launch_dependent(waits_twice, dim3(2, 2), dim3(32), 0, stream, counter);
  return status;
}

}  // namespace vavilov
