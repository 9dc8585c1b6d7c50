#include "cuda/random_fill.cuh"

namespace vavilov::cuda {

namespace {

__device__ inline uint64_t mix(uint64_t x) {  // splitmix64's finaliser
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

__device__ inline uint64_t hash(uint64_t seed, uint64_t stream_id, uint64_t i) {
  return mix(mix(seed ^ mix(stream_id)) + i);
}

__device__ inline float unit(uint64_t bits) { return float(bits >> 40) * (1.0f / 16777216.0f); }

__device__ inline uint16_t to_bf16(float v) {  // round to nearest even (finite values only)
  const uint32_t bits = __float_as_uint(v);
  return uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

__global__ void uniform_kernel(float* out, size_t n, uint64_t seed, uint64_t stream_id, float lo, float hi) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = lo + (hi - lo) * unit(hash(seed, stream_id, i));
}

__global__ void uniform_bf16_kernel(uint16_t* out, size_t n, uint64_t seed, uint64_t stream_id, float lo, float hi) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = to_bf16(lo + (hi - lo) * unit(hash(seed, stream_id, i)));
}

__global__ void words_kernel(uint32_t* out, size_t n, uint64_t seed, uint64_t stream_id) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = uint32_t(hash(seed, stream_id, i) >> 16);
}

__global__ void constant_bf16_kernel(uint16_t* out, size_t n, uint16_t bits) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = bits;
}

__global__ void constant_kernel(float* out, size_t n, float value) {
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    out[i] = value;
}

constexpr int kThreads = 256, kBlocks = 4096;

}  // namespace

void fill_uniform(float* out, size_t n, uint64_t seed, uint64_t stream_id, float lo, float hi, cudaStream_t stream) {
  if (n) uniform_kernel<<<kBlocks, kThreads, 0, stream>>>(out, n, seed, stream_id, lo, hi);
}

void fill_uniform_bf16(uint16_t* out, size_t n, uint64_t seed, uint64_t stream_id, float lo, float hi,
                       cudaStream_t stream) {
  if (n) uniform_bf16_kernel<<<kBlocks, kThreads, 0, stream>>>(out, n, seed, stream_id, lo, hi);
}

void fill_words(uint32_t* out, size_t n, uint64_t seed, uint64_t stream_id, cudaStream_t stream) {
  if (n) words_kernel<<<kBlocks, kThreads, 0, stream>>>(out, n, seed, stream_id);
}

void fill_constant_bf16(uint16_t* out, size_t n, uint16_t bits, cudaStream_t stream) {
  if (n) constant_bf16_kernel<<<kBlocks, kThreads, 0, stream>>>(out, n, bits);
}

void fill_constant(float* out, size_t n, float value, cudaStream_t stream) {
  if (n) constant_kernel<<<kBlocks, kThreads, 0, stream>>>(out, n, value);
}

}  // namespace vavilov::cuda
