// The kernel trace's pass-end marker (kernel_trace.h); empty unless built with -DVAVILOV_KERNEL_TRACE=ON.
#ifdef VAVILOV_KERNEL_TRACE
#include "cuda/launch.cuh"

namespace vavilov::cuda::kernel_trace {

namespace {

// Its wait returns once the pass's last kernel has completed: the pass's end.
__global__ void pass_end_marker() {
  wait_for_producers();
  allow_dependents();
}

}  // namespace

cudaError_t launch_pass_end_marker(cudaStream_t stream) {
  return launch_dependent(pass_end_marker, dim3(1), dim3(32), 0, stream);
}

}  // namespace vavilov::cuda::kernel_trace
#endif
