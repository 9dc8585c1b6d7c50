#pragma once
// A producer kernel that lets the next (dependent) launch start at once and writes its output only ~100 µs later
// (test_cuda_dependent_launch.cu), for tests of kernels that start before their producers finish.
#include <cuda_runtime.h>

#include <cstddef>
#include <functional>

namespace vavilov::test {

// Copies `bytes` from source to target late, then runs `product` on the same stream: eagerly, or captured into a
// graph and replayed (graph). Returns after the stream finished.
void run_after_late_producer(const void* source, void* target, size_t bytes, bool graph,
                             const std::function<void(cudaStream_t)>& product);

}  // namespace vavilov::test
