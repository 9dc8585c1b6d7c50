#pragma once
// The kernel trace (docs/CUDA.md, "Kernel trace"): with -DVAVILOV_KERNEL_TRACE=ON every kernel that calls
// wait_for_producers() times its block 0's wait into a device ring, launch_clustered() notes each launch's kernel, and
// each pass run by a StepRunner ends with a marker kernel; a graph's launches are noted when it is captured and
// counted again at each replay (a replay runs its kernels in capture order). Without the option the hooks below are
// empty and the kernels are unchanged. One traced sequence at a time, from one host thread.
#include <cuda_runtime.h>

#include <vector>

#include "cuda/kernel_trace_report.h"

namespace vavilov::cuda::kernel_trace {

#ifdef VAVILOV_KERNEL_TRACE
inline constexpr bool kBuilt = true;

// The layer type the launches made during its life belong to (each scope is the next layer of the pass).
class LayerScope {
 public:
  explicit LayerScope(const char* type);
  ~LayerScope();
  LayerScope(const LayerScope&) = delete;
  LayerScope& operator=(const LayerScope&) = delete;
};

// The start of a pass (its layers count from 0).
void pass_begin();
// The end of a pass: a marker kernel on `stream` (inside the capture when graphs are on). No-op while not tracing.
void pass_end(cudaStream_t stream, int kind, int rows);
// `graph` was just launched on `stream`: its launches, noted when it was captured, run now.
void replayed(cudaGraphExec_t graph, cudaStream_t stream);

struct Trace {
  std::vector<Entry> entries;
  std::vector<LaunchRecord> launches;
};
// Starts tracing: a ring of `capacity` entries, every module's kernels pointed at it. Passes captured before start()
// must not be replayed while tracing (their launches are unknown): stop() then fails.
void start(size_t capacity);
// Forgets what was traced so far (after warm-up steps), keeping the graphs' launches. Synchronises the device.
void clear();
// Synchronises the device, reads the ring back and stops tracing.
Trace stop();
#else
inline constexpr bool kBuilt = false;
struct LayerScope {
  explicit LayerScope(const char*) {}
};
inline void pass_begin() {}
inline void pass_end(cudaStream_t, int, int) {}
inline void replayed(cudaGraphExec_t, cudaStream_t) {}
#endif

}  // namespace vavilov::cuda::kernel_trace
