// The kernel trace's pass-end marker (kernel_trace.h); empty unless built with -DVAVILOV_KERNEL_TRACE=ON.
#ifdef VAVILOV_KERNEL_TRACE
#include "cuda/launch.cuh"

namespace vavilov::cuda::kernel_trace {

namespace {

// Its wait returns once the pass's last kernel has completed: the pass's end. Its entry says so (a graph's kernels
// may have the same %gridid at every replay: the report tells repeated waits from replays by the passes).
__global__ void pass_end_marker() {
  const Arrival arrived = arrival();
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize();
#endif
  record(arrived, 1);
  allow_dependents();
}

}  // namespace

cudaError_t launch_pass_end_marker(cudaStream_t stream) {
  return launch_dependent(pass_end_marker, dim3(1), dim3(32), 0, stream);
}

}  // namespace vavilov::cuda::kernel_trace
#endif
