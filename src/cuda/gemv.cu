#include "cuda/gemv.cuh"

namespace vavilov::cuda {

namespace {

constexpr int kWarps = 8;  // output rows per block: one warp per row

__device__ inline float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The 8 codes of a word as floats: OR-ing a code into the mantissa of 2^23 and subtracting 2^23 is exact and uses
// full-rate logic and add instructions instead of the quarter-rate integer-to-float conversion.
__device__ inline void decode_word(uint32_t word, float* q) {
#pragma unroll
  for (int i = 0; i < 8; ++i) q[i] = __uint_as_float(((word >> (4 * i)) & 0xfu) | 0x4B000000u) - 8388608.0f;
}

// Stages the activations [B, cols] in shared memory, followed by their sums over every 8-column word (the bias term
// of a word is bias·Σx): computed once per block instead of once per weight.
template <int B>
__device__ inline void stage_activations(const GemvMatrix& m, float* x, float* sums) {
  const int words = m.cols / 8;
  for (int i = threadIdx.x; i < B * words; i += blockDim.x) {
    const float4* source = reinterpret_cast<const float4*>(m.x + size_t(i / words) * m.cols + (i % words) * 8);
    const float4 lo = __ldg(source), hi = __ldg(source + 1);
    reinterpret_cast<float4*>(x)[2 * i] = lo;
    reinterpret_cast<float4*>(x)[2 * i + 1] = hi;
    sums[i] = ((lo.x + lo.y) + (lo.z + lo.w)) + ((hi.x + hi.y) + (hi.z + hi.w));
  }
  __syncthreads();
}

constexpr int kRowsPerWarp = 2;  // each activation read from shared memory serves two weight rows

// Each warp takes kRowsPerWarp output rows. Lane l takes word l of every 256-column stretch, so the codes (4 bytes a
// lane) are read contiguously across the warp; each word is decoded once and applied to every activation row. For a
// word, Σ (s·q + b)·x = s·Σ q·x + b·Σ x.
template <int B>
__global__ void __launch_bounds__(kWarps * 32) gemv_q4_kernel(const GemvMatrix* matrices) {
  extern __shared__ float shared[];  // activations [B, cols], then word sums [B, cols / 8]
  const GemvMatrix m = matrices[blockIdx.y];
  constexpr int kBlockRows = kWarps * kRowsPerWarp;
  if (blockIdx.x * kBlockRows >= m.rows) return;  // the whole block is past this matrix's rows
  float* x = shared;
  float* sums = shared + size_t(B) * m.cols;
  stage_activations<B>(m, x, sums);
  const int first_row = blockIdx.x * kBlockRows + (threadIdx.x / 32) * kRowsPerWarp, lane = threadIdx.x % 32;
  if (first_row >= m.rows) return;
  const int words = m.cols / 8, groups = m.cols / kQuantGroup;
  const uint32_t* codes[kRowsPerWarp];
  const __nv_bfloat16 *scales[kRowsPerWarp], *biases[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int row = min(first_row + r, m.rows - 1);  // a missing second row recomputes the first, never stored
    codes[r] = m.codes + size_t(row) * words;
    scales[r] = m.scales + size_t(row) * groups;
    biases[r] = m.biases + size_t(row) * groups;
  }
  float acc[kRowsPerWarp][B] = {};
  constexpr int kUnroll = 2;  // loads in flight per lane and row
  for (int base = 0; base < words; base += 32 * kUnroll) {
    uint32_t packed[kRowsPerWarp][kUnroll];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int w = base + u * 32 + lane;
        packed[r][u] = w < words ? __ldg(codes[r] + w) : 0u;
      }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int w = base + u * 32 + lane;
      if (w >= words) break;
      float xs[B][8];
#pragma unroll
      for (int b = 0; b < B; ++b) {
        const float4 lo = reinterpret_cast<const float4*>(x + size_t(b) * m.cols)[2 * w];
        const float4 hi = reinterpret_cast<const float4*>(x + size_t(b) * m.cols)[2 * w + 1];
        xs[b][0] = lo.x, xs[b][1] = lo.y, xs[b][2] = lo.z, xs[b][3] = lo.w;
        xs[b][4] = hi.x, xs[b][5] = hi.y, xs[b][6] = hi.z, xs[b][7] = hi.w;
      }
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const float scale = __bfloat162float(scales[r][w / 8]), bias = __bfloat162float(biases[r][w / 8]);
        float q[8];
        decode_word(packed[r][u], q);
#pragma unroll
        for (int b = 0; b < B; ++b) {
          float qx = 0.0f;
#pragma unroll
          for (int i = 0; i < 8; ++i) qx += q[i] * xs[b][i];
          acc[r][b] += scale * qx + bias * sums[b * words + w];
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const float sum = warp_sum(acc[r][b]);
      if (lane == 0 && first_row + r < m.rows) m.y[size_t(b) * m.rows + first_row + r] = sum;
    }
}

template <int B>
__global__ void __launch_bounds__(kWarps * 32) gemv_bf16_kernel(const GemvMatrix* matrices) {
  const GemvMatrix m = matrices[blockIdx.y];
  const int row = blockIdx.x * kWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= m.rows) return;
  const uint4* weights = reinterpret_cast<const uint4*>(m.dense + size_t(row) * m.cols);
  float acc[B] = {};
  for (int c = lane; c < m.cols / 8; c += 32) {
    const uint4 packed = __ldg(weights + c);
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
    float w[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(pairs[i]);
      w[2 * i] = f.x;
      w[2 * i + 1] = f.y;
    }
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const float4* x = reinterpret_cast<const float4*>(m.x + size_t(b) * m.cols + c * 8);
      const float4 lo = __ldg(x), hi = __ldg(x + 1);
      acc[b] += w[0] * lo.x + w[1] * lo.y + w[2] * lo.z + w[3] * lo.w + w[4] * hi.x + w[5] * hi.y + w[6] * hi.z +
                w[7] * hi.w;
    }
  }
#pragma unroll
  for (int b = 0; b < B; ++b) {
    const float sum = warp_sum(acc[b]);
    if (lane == 0) m.y[size_t(b) * m.rows + row] = sum;
  }
}


template <int B>
cudaError_t launch_q4(const GemvMatrix* matrices, int count, int max_rows, int max_cols, cudaStream_t stream) {
  const size_t shared = size_t(B) * (max_cols + max_cols / 8) * sizeof(float);
  if (shared > 48 * 1024) {
    cudaError_t error = cudaFuncSetAttribute(gemv_q4_kernel<B>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared));
    if (error != cudaSuccess) return error;
  }
  const int block_rows = kWarps * kRowsPerWarp;
  dim3 grid((max_rows + block_rows - 1) / block_rows, count);
  gemv_q4_kernel<B><<<grid, kWarps * 32, shared, stream>>>(matrices);
  return cudaGetLastError();
}

template <int B>
cudaError_t launch_bf16(const GemvMatrix* matrices, int count, int max_rows, cudaStream_t stream) {
  dim3 grid((max_rows + kWarps - 1) / kWarps, count);
  gemv_bf16_kernel<B><<<grid, kWarps * 32, 0, stream>>>(matrices);
  return cudaGetLastError();
}

}  // namespace

cudaError_t gemv_q4(const GemvMatrix* matrices, int count, int max_rows, int max_cols, int batch,
                    cudaStream_t stream) {
  switch (batch) {
    case 1: return launch_q4<1>(matrices, count, max_rows, max_cols, stream);
    case 2: return launch_q4<2>(matrices, count, max_rows, max_cols, stream);
    case 3: return launch_q4<3>(matrices, count, max_rows, max_cols, stream);
    case 4: return launch_q4<4>(matrices, count, max_rows, max_cols, stream);
    default: return cudaErrorInvalidValue;
  }
}

cudaError_t gemv_bf16(const GemvMatrix* matrices, int count, int max_rows, int batch, cudaStream_t stream) {
  switch (batch) {
    case 1: return launch_bf16<1>(matrices, count, max_rows, stream);
    case 2: return launch_bf16<2>(matrices, count, max_rows, stream);
    case 3: return launch_bf16<3>(matrices, count, max_rows, stream);
    case 4: return launch_bf16<4>(matrices, count, max_rows, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace vavilov::cuda
