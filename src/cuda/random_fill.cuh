#pragma once
// Seeded pseudo-random fills of device memory (synthetic weights): every value is a hash of (seed, stream, index), so
// the same seed gives the same weights on any GPU and launch shape.
#include <cuda_runtime.h>

#include <cstdint>

namespace vavilov::cuda {

// Uniform in [lo, hi).
void fill_uniform(float* out, size_t n, uint64_t seed, uint64_t stream_id, float lo, float hi, cudaStream_t stream);
void fill_uniform_bf16(uint16_t* out, size_t n, uint64_t seed, uint64_t stream_id, float lo, float hi,
                       cudaStream_t stream);
// Random 32-bit words (4-bit codes, all 16 values equally likely).
void fill_words(uint32_t* out, size_t n, uint64_t seed, uint64_t stream_id, cudaStream_t stream);
void fill_constant_bf16(uint16_t* out, size_t n, uint16_t bits, cudaStream_t stream);
void fill_constant(float* out, size_t n, float value, cudaStream_t stream);

}  // namespace vavilov::cuda
