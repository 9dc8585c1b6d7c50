#include "cuda/gemv.cuh"

namespace vavilov::cuda {

namespace {

constexpr int kWarps = 8;  // output rows per block: one warp per row

__device__ inline float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Σ q_i·x_i and Σ x_i over the 8 codes of one word against 8 consecutive activations.
__device__ inline void accumulate_word(uint32_t word, const float4& lo, const float4& hi, float& qx, float& sx) {
  const float xs[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    qx += float((word >> (4 * i)) & 0xfu) * xs[i];
    sx += xs[i];
  }
}

// One warp per output row; each lane takes 32 columns (16 bytes of codes) at a time. For a group of 64 columns,
// Σ (s·q + b)·x = s·Σ q·x + b·Σ x, so the scale and bias are applied once per half group.
template <int B>
__global__ void __launch_bounds__(kWarps * 32) gemv_q4_kernel(const GemvMatrix* matrices) {
  const GemvMatrix m = matrices[blockIdx.y];
  const int row = blockIdx.x * kWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= m.rows) return;
  const int chunks = m.cols / 32;
  const uint4* codes = reinterpret_cast<const uint4*>(m.codes + size_t(row) * (m.cols / 8));
  const __nv_bfloat16* scales = m.scales + size_t(row) * (m.cols / kQuantGroup);
  const __nv_bfloat16* biases = m.biases + size_t(row) * (m.cols / kQuantGroup);
  float acc[B] = {};
  for (int c = lane; c < chunks; c += 32) {
    const uint4 packed = __ldg(codes + c);
    const float scale = __bfloat162float(scales[c / 2]), bias = __bfloat162float(biases[c / 2]);
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const float4* x = reinterpret_cast<const float4*>(m.x + size_t(b) * m.cols + c * 32);
      float qx = 0.0f, sx = 0.0f;
      accumulate_word(packed.x, __ldg(x + 0), __ldg(x + 1), qx, sx);
      accumulate_word(packed.y, __ldg(x + 2), __ldg(x + 3), qx, sx);
      accumulate_word(packed.z, __ldg(x + 4), __ldg(x + 5), qx, sx);
      accumulate_word(packed.w, __ldg(x + 6), __ldg(x + 7), qx, sx);
      acc[b] += scale * qx + bias * sx;
    }
  }
#pragma unroll
  for (int b = 0; b < B; ++b) {
    const float sum = warp_sum(acc[b]);
    if (lane == 0) m.y[size_t(b) * m.rows + row] = sum;
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
cudaError_t launch_q4(const GemvMatrix* matrices, int count, int max_rows, cudaStream_t stream) {
  dim3 grid((max_rows + kWarps - 1) / kWarps, count);
  gemv_q4_kernel<B><<<grid, kWarps * 32, 0, stream>>>(matrices);
  return cudaGetLastError();
}

template <int B>
cudaError_t launch_bf16(const GemvMatrix* matrices, int count, int max_rows, cudaStream_t stream) {
  dim3 grid((max_rows + kWarps - 1) / kWarps, count);
  gemv_bf16_kernel<B><<<grid, kWarps * 32, 0, stream>>>(matrices);
  return cudaGetLastError();
}

}  // namespace

cudaError_t gemv_q4(const GemvMatrix* matrices, int count, int max_rows, int batch, cudaStream_t stream) {
  switch (batch) {
    case 1: return launch_q4<1>(matrices, count, max_rows, stream);
    case 2: return launch_q4<2>(matrices, count, max_rows, stream);
    case 3: return launch_q4<3>(matrices, count, max_rows, stream);
    case 4: return launch_q4<4>(matrices, count, max_rows, stream);
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
