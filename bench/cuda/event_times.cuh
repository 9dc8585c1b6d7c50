#pragma once
// GPU time of repeated runs between two CUDA events, for the benchmarks under bench/cuda.
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "check.cuh"

// The time in ms of each of `runs` runs of enqueue(run), each between two events recorded on `stream`.
template <typename Enqueue>
std::vector<float> event_times_ms(cudaStream_t stream, int runs, const Enqueue& enqueue) {
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  std::vector<float> times;
  for (int run = 0; run < runs; ++run) {
    CHECK(cudaEventRecord(start, stream));
    enqueue(run);
    CHECK(cudaEventRecord(stop, stream));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0.0f;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(stop));
  return times;
}

inline float fastest(const std::vector<float>& times) { return *std::min_element(times.begin(), times.end()); }

inline float median(std::vector<float> times) {
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}
