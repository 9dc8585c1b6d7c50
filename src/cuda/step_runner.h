#pragma once
// How one sequence's work reaches the GPU: a non-blocking stream of its own, the kernel launches of each step shape
// captured once into a CUDA graph and replayed, and host inputs and outputs staged through pinned memory with one
// synchronisation at the end of a backend call. VAVILOV_CUDA_GRAPH=0 runs the same launches eagerly.
#include <cuda_runtime.h>

#include <compare>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "cuda/device_model.h"

namespace vavilov::cuda {

// The shape of one captured pass: the caller's pass kind, its rows, whether it records rollback states, which
// logits it computes, whether it takes their argmax (greedy ids).
struct PassShape {
  int kind = 0;
  int rows = 0;
  bool record = false;
  int logits = 0;
  bool greedy = false;
  auto operator<=>(const PassShape&) const = default;
};

// False when the environment sets VAVILOV_CUDA_GRAPH=0.
bool graphs_enabled_by_environment();

class StepRunner {
 public:
  // input_bytes / output_bytes: pinned staging for one call's host inputs and outputs.
  StepRunner(size_t input_bytes, size_t output_bytes, bool graphs);
  ~StepRunner();
  StepRunner(const StepRunner&) = delete;
  StepRunner& operator=(const StepRunner&) = delete;

  cudaStream_t stream() const { return stream_; }

  // Runs `launch` (launches on stream() only, no host synchronisation): replays the graph captured for `shape` while
  // `generation` — the caller's count of reallocations of anything the launches address — is unchanged, else
  // captures it anew. Eager when graphs are off.
  void run(const PassShape& shape, uint64_t generation, const std::function<void()>& launch);

  // A host → device copy on the stream, through pinned memory when it fits (the host buffer may change right after).
  void upload(void* device, const void* host, size_t bytes);
  // A device → host copy on the stream; the host buffer holds the data once finish() returns.
  void download(void* host, const void* device, size_t bytes);
  // Waits for the stream and delivers the downloads; the staging memory is free again.
  void finish();

 private:
  struct ExecDestroy {
    void operator()(cudaGraphExec_t exec) const { cudaGraphExecDestroy(exec); }
  };
  using GraphExec = std::unique_ptr<std::remove_pointer_t<cudaGraphExec_t>, ExecDestroy>;
  struct Captured {
    GraphExec exec;
    uint64_t generation = 0;
  };
  struct PinnedFree {
    void operator()(void* p) const { cudaFreeHost(p); }
  };
  struct Delivery {
    void* host;
    size_t offset, bytes;
  };

  void capture(Captured& captured, const std::function<void()>& launch);

  bool graphs_;
  cudaStream_t stream_ = nullptr;
  std::map<PassShape, Captured> captured_;
  std::unique_ptr<void, PinnedFree> pinned_;
  size_t input_capacity_, output_capacity_, input_used_ = 0, output_used_ = 0;
  std::vector<Delivery> deliveries_;
};

}  // namespace vavilov::cuda
