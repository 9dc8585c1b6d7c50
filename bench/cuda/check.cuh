#pragma once
// CHECK(call): a benchmark's CUDA runtime call, exiting with the failing call and its error when it fails.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK(call)                                                                                   \
  do {                                                                                                \
    cudaError_t error_ = (call);                                                                      \
    if (error_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(error_)); \
      std::exit(1);                                                                                   \
    }                                                                                                 \
  } while (0)
