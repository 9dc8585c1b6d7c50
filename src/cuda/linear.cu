#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include "cuda/gemm.cuh"
#include "cuda/gemv.cuh"
#include "cuda/launch.cuh"
#include "cuda/linear.cuh"
#include "cuda/nvfp4.cuh"
#include "cuda/quant_gemm.cuh"

namespace vavilov::cuda {

namespace {

constexpr int kWarps = 8;        // output rows per block
constexpr int kRowsPerPass = 4;  // activation rows sharing each weight read

__device__ inline float bf16_value(uint16_t bits) { return __uint_as_float(uint32_t(bits) << 16); }

__device__ inline float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The code width of an affine format: fixed for Q3/Q2, the matrix's own for Affine.
template <WeightFormat F>
__device__ inline int affine_bits(const DeviceMatrix& w) {
  if constexpr (F == WeightFormat::Q3) return 3;
  if constexpr (F == WeightFormat::Q2) return 2;
  return w.bits;
}

// `count` ≤ 8 codes of `bits` ≤ 8 bits from bit `first_bit` of a row's least-significant-first bit stream, in the low
// bits of the result (at most 64 bits from two neighbouring words; the second is read only when the codes reach it).
__device__ inline uint64_t affine_codes(const uint32_t* row_words, int first_bit, int count, int bits) {
  const int word = first_bit / 32, shift = first_bit % 32;
  uint64_t stream = __ldg(row_words + word);
  if (shift + count * bits > 32) stream |= uint64_t(__ldg(row_words + word + 1)) << 32;
  return stream >> shift;
}

// A row's first code word (cols·bits is a multiple of 32: MLX's layout, checked at upload).
__device__ inline const uint32_t* affine_row(const DeviceMatrix& w, int row, int bits) {
  return static_cast<const uint32_t*>(w.data) + size_t(row) * (size_t(w.cols) * size_t(bits) / 32);
}

// The eight weights of columns [8·chunk, 8·chunk + 8) of one row, as fp32.
template <WeightFormat F>
__device__ inline void load_chunk(const DeviceMatrix& w, int row, int chunk, float* out) {
  if constexpr (F == WeightFormat::Q3 || F == WeightFormat::Q2 || F == WeightFormat::Affine) {
    const int bits = affine_bits<F>(w);
    const uint64_t codes = affine_codes(affine_row(w, row, bits), 8 * chunk * bits, 8, bits);
    const size_t group = size_t(row) * (w.cols / w.group) + 8 * chunk / w.group;  // groups are multiples of 8
    const float scale = bf16_value(w.scales[group]), bias = bf16_value(w.biases[group]);
    const uint32_t mask = (1u << bits) - 1u;
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = scale * float(uint32_t(codes >> (bits * i)) & mask) + bias;
  } else if constexpr (F == WeightFormat::NVFP4) {
    const uint32_t word = __ldg(static_cast<const uint32_t*>(w.data) + size_t(row) * (w.cols / 8) + chunk);
    const float scale = e4m3_value(__ldg(w.block_scales + size_t(row) * (w.cols / 16) + chunk / 2)) * w.tensor_scale;
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = e2m1_value(word >> (4 * i)) * scale;
  } else if constexpr (F == WeightFormat::F8) {
    const uint2 packed =
        __ldg(reinterpret_cast<const uint2*>(static_cast<const uint8_t*>(w.data) + size_t(row) * w.cols) + chunk);
#pragma unroll
    for (int i = 0; i < 8; ++i)
      out[i] = e4m3_value(((i < 4 ? packed.x : packed.y) >> (8 * (i % 4))) & 0xffu) * w.tensor_scale;
  } else if constexpr (F == WeightFormat::Q4) {
    const uint32_t word = __ldg(static_cast<const uint32_t*>(w.data) + size_t(row) * (w.cols / 8) + chunk);
    const size_t group = size_t(row) * (w.cols / 64) + chunk / 8;
    const float scale = bf16_value(w.scales[group]), bias = bf16_value(w.biases[group]);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = scale * float((word >> (4 * i)) & 0xfu) + bias;
  } else if constexpr (F == WeightFormat::BF16) {
    const uint4 packed =
        __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(w.data) + size_t(row) * w.cols) + chunk);
    const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = __uint_as_float(words[i] << 16);
      out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
  } else {
    const float4* p =
        reinterpret_cast<const float4*>(static_cast<const float*>(w.data) + size_t(row) * w.cols) + 2 * chunk;
    const float4 lo = __ldg(p), hi = __ldg(p + 1);
    out[0] = lo.x, out[1] = lo.y, out[2] = lo.z, out[3] = lo.w, out[4] = hi.x, out[5] = hi.y, out[6] = hi.z,
    out[7] = hi.w;
  }
}

template <WeightFormat F>
__device__ inline float load_one(const DeviceMatrix& w, int row, int col) {
  if constexpr (F == WeightFormat::Q3 || F == WeightFormat::Q2 || F == WeightFormat::Affine) {
    const int bits = affine_bits<F>(w);
    const uint32_t code = uint32_t(affine_codes(affine_row(w, row, bits), col * bits, 1, bits)) & ((1u << bits) - 1u);
    const size_t group = size_t(row) * (w.cols / w.group) + col / w.group;
    return bf16_value(w.scales[group]) * float(code) + bf16_value(w.biases[group]);
  } else if constexpr (F == WeightFormat::NVFP4) {
    const uint8_t pair = static_cast<const uint8_t*>(w.data)[size_t(row) * (w.cols / 2) + col / 2];
    const float scale = e4m3_value(w.block_scales[size_t(row) * (w.cols / 16) + col / 16]) * w.tensor_scale;
    return e2m1_value(pair >> (4 * (col % 2))) * scale;
  } else if constexpr (F == WeightFormat::F8) {
    return e4m3_value(static_cast<const uint8_t*>(w.data)[size_t(row) * w.cols + col]) * w.tensor_scale;
  } else if constexpr (F == WeightFormat::Q4) {
    const uint32_t word = static_cast<const uint32_t*>(w.data)[size_t(row) * (w.cols / 8) + col / 8];
    const size_t group = size_t(row) * (w.cols / 64) + col / 64;
    return bf16_value(w.scales[group]) * float((word >> (4 * (col % 8))) & 0xfu) + bf16_value(w.biases[group]);
  } else if constexpr (F == WeightFormat::BF16) {
    return bf16_value(static_cast<const uint16_t*>(w.data)[size_t(row) * w.cols + col]);
  } else {
    return static_cast<const float*>(w.data)[size_t(row) * w.cols + col];
  }
}

// acc[b] += Σ_i weights[i]·x[b, 8·chunk + i] for b < batch.
__device__ inline void accumulate_chunk(const float (&weights)[8], const float* x, int cols, int chunk, int batch,
                                        float (&acc)[kRowsPerPass]) {
#pragma unroll
  for (int b = 0; b < kRowsPerPass; ++b) {
    if (b >= batch) break;
    const float* xs = x + size_t(b) * cols + chunk * 8;
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) sum += weights[i] * xs[i];
    acc[b] += sum;
  }
}

constexpr int kChunksInFlight = 4;  // weight loads each lane issues before using them (memory-level parallelism)

// Σ_k W[row, k]·x[b, k] for b < batch, summed over the warp; lane 0 holds the results.
template <WeightFormat F>
__device__ inline void row_products(const DeviceMatrix& w, int row, const float* x, int batch,
                                    float (&acc)[kRowsPerPass]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int b = 0; b < kRowsPerPass; ++b) acc[b] = 0.0f;
  if (w.cols % 8 == 0) {
    const int chunks = w.cols / 8;
    int chunk = lane;
    for (; chunk + 32 * (kChunksInFlight - 1) < chunks; chunk += 32 * kChunksInFlight) {
      float weights[kChunksInFlight][8];
#pragma unroll
      for (int u = 0; u < kChunksInFlight; ++u) load_chunk<F>(w, row, chunk + 32 * u, weights[u]);
#pragma unroll
      for (int u = 0; u < kChunksInFlight; ++u) accumulate_chunk(weights[u], x, w.cols, chunk + 32 * u, batch, acc);
    }
    for (; chunk < chunks; chunk += 32) {
      float weights[8];
      load_chunk<F>(w, row, chunk, weights);
      accumulate_chunk(weights, x, w.cols, chunk, batch, acc);
    }
  } else {
    for (int col = lane; col < w.cols; col += 32) {
      const float weight = load_one<F>(w, row, col);
#pragma unroll
      for (int b = 0; b < kRowsPerPass; ++b)
        if (b < batch) acc[b] += weight * x[size_t(b) * w.cols + col];
    }
  }
#pragma unroll
  for (int b = 0; b < kRowsPerPass; ++b) acc[b] = warp_sum(acc[b]);
}

template <WeightFormat F>
__global__ void __launch_bounds__(kWarps * 32) linear_kernel(DeviceMatrix w, const float* x, int x_rows, float* y) {
  wait_for_producers();
  allow_dependents();
  const int row = blockIdx.x * kWarps + threadIdx.x / 32;
  const int first = blockIdx.y * kRowsPerPass, batch = min(kRowsPerPass, x_rows - first);
  if (row >= w.rows) return;
  float acc[kRowsPerPass];
  row_products<F>(w, row, x + size_t(first) * w.cols, batch, acc);
  if (threadIdx.x % 32 == 0)
    for (int b = 0; b < batch; ++b) y[size_t(first + b) * w.rows + row] = acc[b];
}

// row_products for a matrix of format F, or, for Mixed, of the format the matrix itself names (uniform across a
// block, which reads one expert).
template <WeightFormat F>
__device__ inline void expert_row_products(const DeviceMatrix& w, int row, const float* x, float (&acc)[kRowsPerPass]) {
  if constexpr (F != WeightFormat::Mixed) {
    row_products<F>(w, row, x, 1, acc);
  } else {
    switch (w.format) {
      case WeightFormat::F32:
        return row_products<WeightFormat::F32>(w, row, x, 1, acc);
      case WeightFormat::BF16:
        return row_products<WeightFormat::BF16>(w, row, x, 1, acc);
      case WeightFormat::Q4:
        return row_products<WeightFormat::Q4>(w, row, x, 1, acc);
      case WeightFormat::Q3:
        return row_products<WeightFormat::Q3>(w, row, x, 1, acc);
      case WeightFormat::Q2:
        return row_products<WeightFormat::Q2>(w, row, x, 1, acc);
      case WeightFormat::Affine:
        return row_products<WeightFormat::Affine>(w, row, x, 1, acc);
      case WeightFormat::NVFP4:
        return row_products<WeightFormat::NVFP4>(w, row, x, 1, acc);
      case WeightFormat::F8:
        return row_products<WeightFormat::F8>(w, row, x, 1, acc);
      case WeightFormat::Mixed:
        break;
    }
  }
}

template <WeightFormat F>
__global__ void __launch_bounds__(kWarps * 32)
    expert_kernel(const DeviceMatrix* experts, const int* ids, const float* x, int x_divisor, float* y) {
  wait_for_producers();
  allow_dependents();
  const int slot = blockIdx.y;
  const DeviceMatrix w = experts[ids[slot]];
  const int row = blockIdx.x * kWarps + threadIdx.x / 32;
  if (row >= w.rows) return;
  float acc[kRowsPerPass];
  expert_row_products<F>(w, row, x + size_t(slot / x_divisor) * w.cols, acc);
  if (threadIdx.x % 32 == 0) y[size_t(slot) * w.rows + row] = acc[0];
}

template <WeightFormat F, typename Index>
__global__ void gather_kernel(DeviceMatrix table, const Index* ids, int rows, int copies, float* out) {
  wait_for_producers();
  allow_dependents();
  const int r = blockIdx.y;
  const int64_t id = int64_t(ids[r]);
  for (int col = blockIdx.x * blockDim.x + threadIdx.x; col < table.cols; col += gridDim.x * blockDim.x) {
    const float value = load_one<F>(table, int(id), col);
    for (int c = 0; c < copies; ++c) out[(size_t(r) * copies + c) * table.cols + col] = value;
  }
}

// launch(std::integral_constant<WeightFormat, F>{}) for the format F of one matrix (the kernels take it as a template
// argument); nothing for Mixed, a summary of several experts that no single matrix has.
template <typename Launch>
void with_matrix_format(WeightFormat format, const Launch& launch) {
  using F = WeightFormat;
  switch (format) {
    case F::F32:
      return launch(std::integral_constant<F, F::F32>{});
    case F::BF16:
      return launch(std::integral_constant<F, F::BF16>{});
    case F::Q4:
      return launch(std::integral_constant<F, F::Q4>{});
    case F::Q3:
      return launch(std::integral_constant<F, F::Q3>{});
    case F::Q2:
      return launch(std::integral_constant<F, F::Q2>{});
    case F::Affine:
      return launch(std::integral_constant<F, F::Affine>{});
    case F::NVFP4:
      return launch(std::integral_constant<F, F::NVFP4>{});
    case F::F8:
      return launch(std::integral_constant<F, F::F8>{});
    case F::Mixed:
      return;
  }
}

template <typename Index>
void gather(const DeviceMatrix& table, const Index* ids, int rows, int copies, float* out, cudaStream_t stream) {
  if (rows == 0) return;
  const dim3 grid((table.cols + 255) / 256, rows);
  with_matrix_format(table.format, [&](auto format) {
    launch_dependent(gather_kernel<decltype(format)::value, Index>, grid, 256, 0, stream, table, ids, rows, copies,
                     out);
  });
}

// Decode-sized products (1–4 rows) go to the bandwidth-bound GEMV kernels of gemv.cuh when the matrix meets their
// layout needs (quantized: whole groups, codes 8-byte (Q4) or 4-byte (Q3, Q2) aligned; dense: 16-byte aligned rows;
// activations 16-byte aligned).
// They choose their own split of rows and columns from the shape, so short, wide matrices get as many blocks as tall
// ones. The descriptor travels by value as a kernel parameter: one launch, nothing allocated, nothing synchronised.
bool gemv_fast_path(const DeviceMatrix& w, const float* x, int x_rows, float* y, cudaStream_t stream) {
  const auto address = reinterpret_cast<uintptr_t>(w.data);
  if (x_rows > kMaxGemvRows || reinterpret_cast<uintptr_t>(x) % 16 != 0) return false;
  GemvMatrix m;
  m.rows = w.rows;
  m.cols = w.cols;
  m.x = x;
  m.y = y;
  cudaError_t error = cudaErrorInvalidValue;
  switch (w.format) {
    case WeightFormat::Q4:
      if (w.cols % kQuantGroup != 0 || address % 8 != 0) return false;
      m.codes = static_cast<const uint32_t*>(w.data);
      m.scales = reinterpret_cast<const __nv_bfloat16*>(w.scales);
      m.biases = reinterpret_cast<const __nv_bfloat16*>(w.biases);
      error = gemv_q4(m, x_rows, stream);
      break;
    case WeightFormat::Q3:
    case WeightFormat::Q2:
      if (w.cols % kQuantGroup != 0 || address % 4 != 0) return false;
      m.codes = static_cast<const uint32_t*>(w.data);
      m.scales = reinterpret_cast<const __nv_bfloat16*>(w.scales);
      m.biases = reinterpret_cast<const __nv_bfloat16*>(w.biases);
      error = w.format == WeightFormat::Q3 ? gemv_q3(m, x_rows, stream) : gemv_q2(m, x_rows, stream);
      break;
    case WeightFormat::BF16:
      if (w.cols % 8 != 0 || address % 16 != 0) return false;
      m.dense = static_cast<const __nv_bfloat16*>(w.data);
      error = gemv_bf16(m, x_rows, stream);
      break;
    case WeightFormat::F32:
      if (w.cols % 4 != 0 || address % 16 != 0) return false;
      m.dense_f32 = static_cast<const float*>(w.data);
      error = gemv_f32(m, x_rows, stream);
      break;
    case WeightFormat::Affine:  // other widths or groups, NVFP4 (nvfp4.cuh), FP8 and expert summaries: not here
    case WeightFormat::NVFP4:
    case WeightFormat::F8:
    case WeightFormat::Mixed:
      return false;
  }
  if (error == cudaSuccess) return true;
  cudaGetLastError();  // a refused launch is not sticky; clear it so the fallback's checks do not see it
  return false;
}

}  // namespace

void linear(const DeviceMatrix& w, const float* x, int x_rows, float* y, cudaStream_t stream) {
  if (x_rows == 0 || w.rows == 0) return;
  // Prefill chunks: quantized matrices on their codes (quant_gemm.cuh), the dense formats on cuBLAS (gemm.cuh).
  if (x_rows > kRowsPerPass && quant_gemm_takes(w.format) && quant_gemm(w, x, x_rows, y, stream) == cudaSuccess) return;
  if (x_rows > kRowsPerPass && gemm_linear(w, x, x_rows, y, stream)) return;
  if (gemv_fast_path(w, x, x_rows, y, stream) || (x_rows <= kMaxGemvRows && nvfp4_gemv(w, x, x_rows, y, stream)))
    return;
  const dim3 grid((w.rows + kWarps - 1) / kWarps, (x_rows + kRowsPerPass - 1) / kRowsPerPass);
  with_matrix_format(w.format, [&](auto format) {
    launch_dependent(linear_kernel<decltype(format)::value>, grid, kWarps * 32, 0, stream, w, x, x_rows, y);
  });
}

void expert_linear(const DeviceMatrix* experts, WeightFormat format, int rows_out, int cols, const int* ids, int slots,
                   const float* x, int x_divisor, float* y, cudaStream_t stream) {
  if (slots == 0) return;
  const dim3 grid((rows_out + kWarps - 1) / kWarps, slots);
  const auto launch = [&](auto format) {
    launch_dependent(expert_kernel<decltype(format)::value>, grid, kWarps * 32, 0, stream, experts, ids, x, x_divisor,
                     y);
  };
  if (format == WeightFormat::Mixed)  // experts of several formats: each block reads the one its expert names
    launch(std::integral_constant<WeightFormat, WeightFormat::Mixed>{});
  else
    with_matrix_format(format, launch);
}

void gather_rows(const DeviceMatrix& table, const int32_t* ids, int rows, int copies, float* out, cudaStream_t stream) {
  gather(table, ids, rows, copies, out, stream);
}

void gather_rows(const DeviceMatrix& table, const int64_t* ids, int rows, int copies, float* out, cudaStream_t stream) {
  gather(table, ids, rows, copies, out, stream);
}

}  // namespace vavilov::cuda
