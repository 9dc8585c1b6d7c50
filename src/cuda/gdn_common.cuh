#pragma once
// What the GDN decode (gated_deltanet.cu) and chunked prefill (gdn_prefill.cu) kernels share: their block size, the
// gates' arithmetic and the cp.async copies into shared memory.
#include <cuda_pipeline.h>

#include "cuda/device_math.cuh"
#include "cuda/gated_deltanet.cuh"

namespace vavilov::cuda::gdn {

constexpr int kThreads = 256;  // every GDN kernel but the conv and the norm
constexpr int kWarps = kThreads / 32;
constexpr int kSliceColumns = 32;  // value columns per block (decode, scan, outputs)

// The log-space decay g = −e^{a_log}·softplus(a + dt_bias) of value head h at index `at` of [rows, heads].
__device__ inline float log_decay(const GdnInputs& in, int h, size_t at) {
  return -expf(in.a_log[h]) * softplus(in.a[at] + in.dt_bias[h]);
}

__device__ inline float output_gate(float z, bool sigmoid_gate) { return sigmoid_gate ? sigmoid(z) : silu(z); }

// Shared-memory loads go through cp.async: a thread issues all of its copies before waiting for any, so a tile
// costs one memory latency, not one per element.
__device__ inline void copy_async(float* shared, const float* global) {
  __pipeline_memcpy_async(shared, global, sizeof(float));
}
__device__ inline void wait_copies() {
  __pipeline_commit();
  __pipeline_wait_prior(0);
}

}  // namespace vavilov::cuda::gdn
