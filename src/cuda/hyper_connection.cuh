#pragma once
// Hyper-connection read and write on the GPU (the CPU's gated residual, src/cpu/layers.h): the S residual streams of
// a row are read through a low-rank mix into one layer input, and the layer's output is written back into every
// stream with a per-stream gate. The write also normalises the updated streams for the next read, so that a step
// does not launch a separate RMSNorm for it.
#include <cuda_runtime.h>

#include <cstdint>

namespace vavilov::cuda {

// low = silu(low / S) in place.
void hc_low_activation(float* low, int64_t n, int streams, cudaStream_t stream);

// input[r, d] = Σ_s σ(mix[r, s, d])·normed[r, s, d] / S.
void hc_combine(const float* mix, const float* normed, int rows, int streams, int hidden, float* input,
                cudaStream_t stream);

// stack[r, s, :] += 2σ(inject[r, s] / S)·y[r, :] (inject: the raw projection). With norm_weight, also
// normed[r, s, :] = zero-centred RMSNorm of the updated stack[r, s, :] with weight norm_weight + s·hidden (the next
// read's first step, with the same arithmetic as rms_norm).
void hc_write(const float* inject, const float* y, int rows, int streams, int hidden, float* stack,
              const float* norm_weight, float eps, float* normed, cudaStream_t stream);

}  // namespace vavilov::cuda
