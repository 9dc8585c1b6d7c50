#pragma once
// A producer for the dependent-launch tests (src/cuda/launch.cuh): a kernel that lets the next (dependent) launch start
// at once and writes that one's input only ~100 µs later, so that a kernel that read its input before its wait would
// see what was there before. The kernel lives in test_cuda_dependent_launch.cu.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstddef>

namespace vavilov::test {

constexpr long long kLateDelayNs = 100000;

// An ordinary launch of that kernel: it triggers its dependents, waits kLateDelayNs, then copies `bytes` from source to
// target.
void launch_late_copy(const void* source, void* target, size_t bytes, cudaStream_t stream);

// Runs `product` after that producer; eagerly or through a captured graph.
template <typename Product>
void after_late_producer(const void* source, void* target, size_t bytes, bool graph, Product&& product) {
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const auto launch = [&] {
    launch_late_copy(source, target, bytes, stream);
    product(stream);
  };
  if (graph) {
    cudaGraph_t captured;
    cudaGraphExec_t exec;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed), cudaSuccess);
    launch();
    ASSERT_EQ(cudaStreamEndCapture(stream, &captured), cudaSuccess);
    ASSERT_EQ(cudaGraphInstantiate(&exec, captured, 0), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(captured);
  } else {
    launch();
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  }
  cudaStreamDestroy(stream);
}

}  // namespace vavilov::test
