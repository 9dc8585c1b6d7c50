#pragma once
// Dependent launches (Hopper's programmatic dependent launch): a kernel launched with launch_dependent() may start
// while the kernel before it in the stream is still running, as soon as every block of that one has called
// allow_dependents() (or exited). Its blocks can then do the work that does not depend on the previous kernel — a
// GEMV streams its weights — and call wait_for_producers() before the rest.
//
// The rule for a kernel launched with launch_dependent():
//   - before wait_for_producers() it reads only what no kernel of the pass writes (weights, descriptors fixed for the
//     sequence's life) and writes nothing at all (not even scratch that an earlier kernel may still read);
//   - every block calls wait_for_producers() before it exits, early exits included: the wait is what makes this
//     grid's completion imply its producer's, so that the kernels after it (dependent or not) see everything the
//     earlier kernels wrote;
//   - it calls allow_dependents() (best after its own wait, so that launches run at most one kernel ahead).
// The two-deep rule: before its wait a kernel may also read what any kernel two or more launches back wrote, when the
// kernel directly before it is a dependent launch that calls allow_dependents() only after its own
// wait_for_producers() in every block (early exits included: an exit counts as the trigger). This kernel then starts
// only once that kernel's wait has returned in every block, i.e. once the kernel before that one has completed (and,
// since every kernel waits before it exits, every earlier one) with its memory visible. Such reads go through L2
// (__ldcg, ld.global.cg), never __ldg / ld.global.nc (non-coherent: session 6 saw one hoisted across a wait), and the
// kernel in between must say where it waits that its wait has to stay first. Used by the MoE block (2–4 rows: the
// expert down launch's descriptors, gate/up's activations; 1 row: the fused products' activations: docs/CUDA.md).
// Any kernel may call allow_dependents() (or cudaTriggerProgrammaticLaunchCompletion(), the same instruction, where
// this header is not included) as its first statement: it only lets the next dependent launch start early
// and never makes that one see unfinished data (its wait still waits for this whole grid and its memory).
//
// The launch works eagerly and inside stream capture (the graph keeps the programmatic edge). VAVILOV_PDL=0 in the
// environment launches these kernels as ordinary ones (the device calls then return at once), for measurement and
// debugging.
#include <cuda_runtime.h>

#include <cstdlib>
#include <cstring>
#include <utility>
#ifdef VAVILOV_KERNEL_TRACE
#include "cuda/kernel_trace_hook.cuh"
#endif

namespace vavilov::cuda {

// Blocks until the previous kernel in the stream has completed and its memory is visible (no-op in an ordinary launch).
// Trace builds (VAVILOV_KERNEL_TRACE) also time block 0's wait for the kernel trace (kernel_trace_hook.cuh).
__device__ __forceinline__ void wait_for_producers() {
#ifdef VAVILOV_KERNEL_TRACE
  const kernel_trace::Arrival arrived = kernel_trace::arrival();
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize();  // griddepcontrol.wait
#endif
#ifdef VAVILOV_KERNEL_TRACE
  kernel_trace::record(arrived);
#endif
}

// Lets the next kernel in the stream, if it is a dependent launch, start once every block of this grid got here.
__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaTriggerProgrammaticLaunchCompletion();  // griddepcontrol.launch_dependents
#endif
}

inline bool dependent_launches_enabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("VAVILOV_PDL");
    return !(value && std::strcmp(value, "0") == 0);
  }();
  return enabled;
}

// kernel<<<grid, block, shared, stream>>>(args...) in thread-block clusters of `cluster` blocks (kNoCluster: launched
// without the attribute), as a dependent launch (see the rule above) when `dependent`.
inline constexpr dim3 kNoCluster{0, 0, 0};

template <typename... Params, typename... Args>
cudaError_t launch_clustered(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared, cudaStream_t stream,
                             dim3 cluster, bool dependent, Args&&... args) {
  cudaLaunchAttribute attributes[2]{};
  unsigned count = 0;
  if (cluster.x != 0) {
    attributes[count].id = cudaLaunchAttributeClusterDimension;
    attributes[count].val.clusterDim.x = cluster.x;
    attributes[count].val.clusterDim.y = cluster.y;
    attributes[count].val.clusterDim.z = cluster.z;
    ++count;
  }
  if (dependent && dependent_launches_enabled()) {
    attributes[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attributes[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared;
  config.stream = stream;
  config.attrs = attributes;
  config.numAttrs = count;
#ifdef VAVILOV_KERNEL_TRACE
  kernel_trace::note_launch(reinterpret_cast<const void*>(kernel), grid, block, stream);
#endif
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

// kernel<<<grid, block, shared, stream>>>(args...) as a dependent launch (see the rule above).
template <typename... Params, typename... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared, cudaStream_t stream,
                             Args&&... args) {
  return launch_clustered(kernel, grid, block, shared, stream, kNoCluster, true, std::forward<Args>(args)...);
}

}  // namespace vavilov::cuda
