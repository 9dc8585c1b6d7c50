#include <cublas_v2.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cuda/gemm.cuh"
#include "cuda/launch.cuh"

namespace vavilov::cuda {

namespace {

__device__ inline float bf16_value(uint16_t bits) { return __uint_as_float(uint32_t(bits) << 16); }

template <typename T>
__device__ inline T stored_as(float v) {
  if constexpr (sizeof(T) == 2)
    return __float2bfloat16_rn(v);
  else
    return v;
}

// out[i] = W[first_row + i / cols, i % cols] for i < count, by the threads of a grid-stride loop: Q4 a code word
// (eight values, one scale and bias; scale·q + bias in fp32 as the CPU dequantises) per thread, 32-byte stores;
// dense formats a value per thread.
template <WeightFormat F, typename T>
__device__ inline void widen(const DeviceMatrix& w, int64_t first_row, int64_t count, T* out) {
  const int64_t start = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, stride = int64_t(gridDim.x) * blockDim.x;
  if constexpr (F == WeightFormat::Q4) {
    const auto* codes = static_cast<const uint32_t*>(w.data) + first_row * (w.cols / 8);
    const uint16_t* scales = w.scales + first_row * (w.cols / 64);
    const uint16_t* biases = w.biases + first_row * (w.cols / 64);
    for (int64_t word = start; word < count / 8; word += stride) {
      const uint32_t bits = codes[word];
      const float scale = bf16_value(scales[word / 8]), bias = bf16_value(biases[word / 8]);
      T values[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) values[i] = stored_as<T>(scale * float((bits >> (4 * i)) & 0xfu) + bias);
      T* to = out + word * 8;
      if constexpr (sizeof(T) == 4) {
        reinterpret_cast<float4*>(to)[0] = make_float4(values[0], values[1], values[2], values[3]);
        reinterpret_cast<float4*>(to)[1] = make_float4(values[4], values[5], values[6], values[7]);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) to[i] = values[i];
      }
    }
  } else if constexpr (F == WeightFormat::BF16) {  // dense rows are contiguous: an element-wise conversion
    const uint16_t* from = static_cast<const uint16_t*>(w.data) + first_row * w.cols;
    for (int64_t i = start; i < count; i += stride) out[i] = stored_as<T>(bf16_value(from[i]));
  } else {
    const float* from = static_cast<const float*>(w.data) + first_row * w.cols;
    for (int64_t i = start; i < count; i += stride) out[i] = stored_as<T>(from[i]);
  }
}

// Rows [first_row, first_row + count / cols) of W into out.
template <WeightFormat F, typename T>
__global__ void widen_rows_kernel(DeviceMatrix w, int first_row, int64_t count, T* out) {
  allow_dependents();
  widen<F>(w, first_row, count, out);
}

// Expert batch: out[b] (rows × cols each) = E[ids[b]] widened, for b < gridDim.y.
template <WeightFormat F, typename T>
__global__ void widen_experts_kernel(const DeviceMatrix* experts, const int* ids, int64_t count, T* out) {
  allow_dependents();
  widen<F>(experts[ids[blockIdx.y]], 0, count, out + int64_t(blockIdx.y) * count);
}

__global__ void to_bf16_kernel(const float* x, int64_t n, __nv_bfloat16* out) {
  allow_dependents();
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16_rn(x[i]);
}

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 4096;

unsigned blocks_for(int64_t n) { return unsigned(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, kMaxBlocks)); }

template <typename T>
void widen_rows(const DeviceMatrix& w, int first_row, int rows, T* out, cudaStream_t stream) {
  const int64_t count = int64_t(rows) * w.cols;
  switch (w.format) {
    case WeightFormat::F32:
      widen_rows_kernel<WeightFormat::F32><<<blocks_for(count), kThreads, 0, stream>>>(w, first_row, count, out);
      break;
    case WeightFormat::BF16:
      widen_rows_kernel<WeightFormat::BF16><<<blocks_for(count), kThreads, 0, stream>>>(w, first_row, count, out);
      break;
    case WeightFormat::Q4:
      widen_rows_kernel<WeightFormat::Q4><<<blocks_for(count), kThreads, 0, stream>>>(w, first_row, count, out);
      break;
    default:  // gemm_widens() keeps every other format away
      break;
  }
}

template <typename T>
void widen_experts(const DeviceMatrix* experts, WeightFormat format, const int* ids, int batch, int64_t count, T* out,
                   cudaStream_t stream) {
  const dim3 grid(std::max(1u, blocks_for(count) / unsigned(std::max(1, batch / 8))), unsigned(batch));
  switch (format) {
    case WeightFormat::F32:
      widen_experts_kernel<WeightFormat::F32><<<grid, kThreads, 0, stream>>>(experts, ids, count, out);
      break;
    case WeightFormat::BF16:
      widen_experts_kernel<WeightFormat::BF16><<<grid, kThreads, 0, stream>>>(experts, ids, count, out);
      break;
    case WeightFormat::Q4:
      widen_experts_kernel<WeightFormat::Q4><<<grid, kThreads, 0, stream>>>(experts, ids, count, out);
      break;
    default:  // gemm_widens() keeps every other format away
      break;
  }
}

size_t g_scratch_limit = kWeightScratchBytes;

// Device memory that grows on demand and is kept for the thread's later calls (like linear.cu's split-K partials).
struct Scratch {
  void* data = nullptr;
  size_t capacity = 0;
  void* get(size_t bytes) {
    if (bytes <= capacity) return data;
    if (data) cudaFree(data);
    data = nullptr;
    capacity = 0;
    if (cudaMalloc(&data, bytes) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    capacity = bytes;
    return data;
  }
};

struct Blas {
  cublasHandle_t handle = nullptr;
  Scratch weights, activations, pointers;
  Blas() {
    if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) handle = nullptr;
  }
};

Blas& blas() {
  thread_local Blas b;
  return b;
}

cublasComputeType_t compute_type(GemmPrecision p) {
  return p == GemmPrecision::Tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
}

// y[:, first .. first + m) (row stride ldy) = x[n, k] · A[m, k]ᵀ, in cuBLAS's column-major terms C[m, n] = Aᵀ·B.
bool gemm(cublasHandle_t handle, const void* a, cudaDataType_t type, int m, int n, int k, const void* x, float* y,
          int ldy, GemmPrecision p) {
  const float one = 1.0f, zero = 0.0f;
  return cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &one, a, type, k, x, type, k, &zero, y, CUDA_R_32F,
                      ldy, compute_type(p), CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS;
}

}  // namespace

void set_weight_scratch_limit(size_t bytes) { g_scratch_limit = bytes; }

bool gemm_widens(WeightFormat format) {
  return format == WeightFormat::F32 || format == WeightFormat::BF16 || format == WeightFormat::Q4;
}

bool gemm_linear(const DeviceMatrix& w, const float* x, int x_rows, float* y, cudaStream_t stream) {
  if (!gemm_widens(w.format)) return false;
  Blas& b = blas();
  if (!b.handle || cublasSetStream(b.handle, stream) != CUBLAS_STATUS_SUCCESS) return false;
  const GemmPrecision p = gemm_precision();
  const bool bf16 = p == GemmPrecision::Bf16;
  const cudaDataType_t type = bf16 ? CUDA_R_16BF : CUDA_R_32F;
  const void* activations = x;
  if (bf16) {
    const int64_t n = int64_t(x_rows) * w.cols;
    auto* converted = static_cast<__nv_bfloat16*>(b.activations.get(size_t(n) * 2));
    if (!converted) return false;
    to_bf16_kernel<<<blocks_for(n), kThreads, 0, stream>>>(x, n, converted);
    activations = converted;
  }
  // Weights already in the GEMM's input type are read where they are.
  if ((w.format == WeightFormat::F32 && !bf16) || (w.format == WeightFormat::BF16 && bf16))
    return gemm(b.handle, w.data, type, w.rows, x_rows, w.cols, activations, y, w.rows, p);
  const size_t value_bytes = bf16 ? 2 : 4;
  const size_t fitting_rows = g_scratch_limit / (size_t(w.cols) * value_bytes) / 16 * 16;  // 64-byte aligned blocks
  const int block_rows = int(std::min(std::max<size_t>(fitting_rows, 16), size_t(w.rows)));
  void* scratch = b.weights.get(size_t(block_rows) * size_t(w.cols) * value_bytes);
  if (!scratch) return false;
  for (int first = 0; first < w.rows; first += block_rows) {
    const int rows = std::min(block_rows, w.rows - first);
    if (bf16)
      widen_rows(w, first, rows, static_cast<__nv_bfloat16*>(scratch), stream);
    else
      widen_rows(w, first, rows, static_cast<float*>(scratch), stream);
    if (!gemm(b.handle, scratch, type, rows, x_rows, w.cols, activations, y + first, w.rows, p)) return false;
  }
  return true;
}

bool grouped_expert_gemm(const DeviceMatrix* experts, WeightFormat format, int rows_out, int cols,
                         const std::vector<ExpertGroup>& groups, const float* x, float* y, cudaStream_t stream) {
  if (!gemm_widens(format)) return false;
  if (groups.empty()) return true;
  Blas& b = blas();
  if (!b.handle || cublasSetStream(b.handle, stream) != CUBLAS_STATUS_SUCCESS) return false;
  // cuBLAS's grouped GEMM refused bf16 inputs with fp32 outputs on the H200 (CUDA 13): experts stay fp32 then.
  const GemmPrecision p = gemm_precision() == GemmPrecision::Tf32 ? GemmPrecision::Tf32 : GemmPrecision::Fp32;
  const size_t value_bytes = 4;
  const int64_t expert_values = int64_t(rows_out) * cols;
  const int batch_size =
      int(std::clamp<size_t>(g_scratch_limit / (size_t(expert_values) * value_bytes), 1, groups.size()));
  char* weights = static_cast<char*>(b.weights.get(size_t(batch_size) * size_t(expert_values) * value_bytes));
  if (!weights) return false;
  // Device arrays for every group at once: A, B and C pointers, then the expert ids the widening kernel reads.
  const size_t g = groups.size();
  std::vector<const void*> pointers(3 * g);
  std::vector<int> ids(g), m(g, rows_out), n(g), k(g, cols), group_size(g, 1);
  for (size_t i = 0; i < g; ++i) {
    const ExpertGroup& e = groups[i];
    pointers[i] = weights + (i % size_t(batch_size)) * size_t(expert_values) * value_bytes;
    pointers[g + i] = x + size_t(e.offset) * size_t(cols);
    pointers[2 * g + i] = y + size_t(e.offset) * size_t(rows_out);
    ids[i] = e.expert;
    n[i] = e.count;
  }
  const size_t pointer_bytes = pointers.size() * sizeof(void*);
  char* device = static_cast<char*>(b.pointers.get(pointer_bytes + g * sizeof(int)));
  if (!device) return false;
  if (cudaMemcpyAsync(device, pointers.data(), pointer_bytes, cudaMemcpyHostToDevice, stream) != cudaSuccess ||
      cudaMemcpyAsync(device + pointer_bytes, ids.data(), g * sizeof(int), cudaMemcpyHostToDevice, stream) !=
          cudaSuccess)
    return false;
  auto* a_array = reinterpret_cast<const void* const*>(device);
  auto* c_array = reinterpret_cast<void* const*>(device + 2 * g * sizeof(void*));
  const int* device_ids = reinterpret_cast<const int*>(device + pointer_bytes);
  const std::vector<float> ones(g, 1.0f), zeros(g, 0.0f);
  const std::vector<cublasOperation_t> transpose(g, CUBLAS_OP_T), keep(g, CUBLAS_OP_N);
  for (size_t first = 0; first < g; first += size_t(batch_size)) {
    const int count = int(std::min(g - first, size_t(batch_size)));
    widen_experts(experts, format, device_ids + first, count, expert_values, reinterpret_cast<float*>(weights), stream);
    const cublasStatus_t status = cublasGemmGroupedBatchedEx(
        b.handle, transpose.data(), keep.data(), m.data() + first, n.data() + first, k.data(), ones.data(),
        a_array + first, CUDA_R_32F, k.data(), a_array + g + first, CUDA_R_32F, k.data(), zeros.data(), c_array + first,
        CUDA_R_32F, m.data(), count, group_size.data(), compute_type(p));
    if (status != CUBLAS_STATUS_SUCCESS) return false;
  }
  return true;
}

}  // namespace vavilov::cuda
