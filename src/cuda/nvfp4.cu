#include <cstdint>

#include "cuda/launch.cuh"
#include "cuda/nvfp4.cuh"

namespace vavilov::cuda {

namespace {

constexpr int kWarps = 4;           // a block's warps
constexpr int kRowsPerWarp = 2;     // output rows a warp computes together (two independent 16-byte loads a lane)
constexpr int kChunkColumns = 32;   // columns of one 16-byte load of codes: two 16-column scale blocks
constexpr int kChunksInFlight = 2;  // chunks each lane loads before using them

__device__ inline float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ inline uint32_t word_of(const uint4& v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

struct Chunk {
  uint4 codes[kRowsPerWarp];
  uint32_t scales[kRowsPerWarp];  // the chunk's two e4m3 block scales, low byte first
};

// Each warp: kRowsPerWarp rows; each lane: 16-byte chunks lane, lane + 32, ... of those rows, every code decoded once
// in registers and multiplied by B activation rows read as float4; per 16-column block the e4m3 scale (times the
// tensor scale) multiplies the block's sum.
//
// A dependent launch (launch.cuh): it may start while the previous kernel runs, and waits for it before anything else.
template <int B>
__global__ void __launch_bounds__(kWarps * 32) nvfp4_gemv_kernel(DeviceMatrix w, const float* x, float* y) {
  const int lane = threadIdx.x % 32;
  wait_for_producers();  // before the trigger: launch.cuh's two-deep rule (the MoE block's next launches rely on it)
  allow_dependents();
  const int first_row = (blockIdx.x * kWarps + threadIdx.x / 32) * kRowsPerWarp;
  if (first_row >= w.rows) return;
  const int chunks = w.cols / kChunkColumns, blocks_per_row = w.cols / 16;
  const uint4* codes[kRowsPerWarp];
  const uint16_t* scales[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int row = min(first_row + r, w.rows - 1);  // past the end: re-read the last row, never stored
    codes[r] = static_cast<const uint4*>(w.data) + size_t(row) * chunks;
    scales[r] = reinterpret_cast<const uint16_t*>(w.block_scales + size_t(row) * blocks_per_row);
  }
  float acc[kRowsPerWarp][B] = {};
  for (int base = lane; base < chunks; base += 32 * kChunksInFlight) {
    Chunk loaded[kChunksInFlight];
#pragma unroll
    for (int u = 0; u < kChunksInFlight; ++u) {
      const int chunk = base + 32 * u;
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        loaded[u].codes[r] = chunk < chunks ? __ldg(codes[r] + chunk) : make_uint4(0u, 0u, 0u, 0u);
        loaded[u].scales[r] = chunk < chunks ? __ldg(scales[r] + chunk) : 0u;
      }
    }
#pragma unroll
    for (int u = 0; u < kChunksInFlight; ++u) {
      const int chunk = base + 32 * u;
      if (chunk >= chunks) break;
      const float* xs = x + size_t(chunk) * kChunkColumns;
      float block_sum[kRowsPerWarp][B][2] = {};
#pragma unroll
      for (int word = 0; word < 4; ++word) {  // eight columns a word; words 0-1 and 2-3 are the two scale blocks
        float weights[kRowsPerWarp][8];
#pragma unroll
        for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
          for (int i = 0; i < 8; ++i) weights[r][i] = e2m1_value(word_of(loaded[u].codes[r], word) >> (4 * i));
#pragma unroll
        for (int b = 0; b < B; ++b) {
          const float4* p = reinterpret_cast<const float4*>(xs + size_t(b) * w.cols) + 2 * word;
          const float4 lo = __ldg(p), hi = __ldg(p + 1);
          const float values[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
          for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
            for (int i = 0; i < 8; ++i)
              block_sum[r][b][word / 2] = fmaf(weights[r][i], values[i], block_sum[r][b][word / 2]);
        }
      }
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
        const float scale0 = e4m3_value(loaded[u].scales[r] & 0xffu) * w.tensor_scale;
        const float scale1 = e4m3_value(loaded[u].scales[r] >> 8) * w.tensor_scale;
#pragma unroll
        for (int b = 0; b < B; ++b)
          acc[r][b] = fmaf(block_sum[r][b][1], scale1, fmaf(block_sum[r][b][0], scale0, acc[r][b]));
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const float sum = warp_sum(acc[r][b]);
      if (lane == 0 && first_row + r < w.rows) y[size_t(b) * w.rows + first_row + r] = sum;
    }
}

template <int B>
void launch(const DeviceMatrix& w, const float* x, float* y, cudaStream_t stream) {
  constexpr int kBlockRows = kWarps * kRowsPerWarp;
  launch_dependent(nvfp4_gemv_kernel<B>, dim3((w.rows + kBlockRows - 1) / kBlockRows), dim3(kWarps * 32), 0, stream, w,
                   x, y);
}

}  // namespace

bool nvfp4_gemv(const DeviceMatrix& w, const float* x, int x_rows, float* y, cudaStream_t stream) {
  const auto codes = reinterpret_cast<uintptr_t>(w.data), activations = reinterpret_cast<uintptr_t>(x);
  const auto scales = reinterpret_cast<uintptr_t>(w.block_scales);
  if (w.format != WeightFormat::NVFP4 || x_rows < 1 || x_rows > 4 || w.cols % kChunkColumns != 0 || codes % 16 != 0 ||
      activations % 16 != 0 || scales % 2 != 0)
    return false;
  switch (x_rows) {
    case 1:
      launch<1>(w, x, y, stream);
      break;
    case 2:
      launch<2>(w, x, y, stream);
      break;
    case 3:
      launch<3>(w, x, y, stream);
      break;
    default:
      launch<4>(w, x, y, stream);
      break;
  }
  return true;
}

}  // namespace vavilov::cuda
