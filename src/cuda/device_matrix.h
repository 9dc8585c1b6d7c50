#pragma once
// A weight matrix resident on the GPU, as the kernels read it. Plain data, shared by host code and kernels.
#include <cstdint>

namespace vavilov::cuda {

enum class WeightFormat : int {
  F32,     // dense fp32 rows
  BF16,    // dense bf16 rows
  Q4,      // 4-bit affine at group 64: codes least-significant first in uint32 words, bf16 scale and bias per group
  Q3,      // 3-bit affine at group 64, MLX's layout: one dense least-significant-first bit stream a row
  Q2,      // 2-bit affine at group 64, likewise
  Affine,  // any other MLX affine width (`bits` 2-8) or group (32, 128): the generic kernels only (8-bit routers,
           // the group-32 n-gram table)
  NVFP4,   // ModelOpt NVFP4: e2m1 codes (two a byte, even column low), e4m3 scale per 16 columns, fp32 tensor scale
  F8,      // dense e4m3 bytes times tensor_scale (ModelOpt FP8)
  // Only in DeviceMoe's per-layer summaries: the experts of a layer (or gate beside up) differ in format, and each
  // DeviceMatrix of the expert arrays carries its own.
  Mixed,
};

struct DeviceMatrix {
  WeightFormat format = WeightFormat::F32;
  int rows = 0, cols = 0;
  const void* data = nullptr;  // dense rows, affine codes [rows, cols·bits / 32] words, NVFP4 codes [rows, cols / 2]
  const uint16_t* scales = nullptr;  // affine: bf16 [rows, cols / group]
  const uint16_t* biases = nullptr;
  int bits = 0;                           // affine code width (Q4/Q3/Q2: 4/3/2)
  int group = 64;                         // affine: columns per scale and bias (32, 64 or 128)
  const uint8_t* block_scales = nullptr;  // NVFP4: e4m3 [rows, cols / 16]
  float tensor_scale = 1.0f;              // NVFP4's weight_scale_2, F8's weight_scale
};

// Bytes the kernels read for the whole matrix (codes or values plus scales).
inline double matrix_bytes(const DeviceMatrix& m) {
  const double n = double(m.rows) * double(m.cols);
  switch (m.format) {
    case WeightFormat::F32:
      return n * 4;
    case WeightFormat::BF16:
      return n * 2;
    case WeightFormat::F8:
      return n;
    case WeightFormat::Q4:
    case WeightFormat::Q3:
    case WeightFormat::Q2:
    case WeightFormat::Affine: {
      const int bits = m.format == WeightFormat::Q4   ? 4
                       : m.format == WeightFormat::Q3 ? 3
                       : m.format == WeightFormat::Q2 ? 2
                                                      : m.bits;
      return n * bits / 8 + n / m.group * 4;  // codes, bf16 scale and bias per group
    }
    case WeightFormat::NVFP4:
      return n / 2 + n / 16;
    case WeightFormat::Mixed:
      break;
  }
  return 0;
}

}  // namespace vavilov::cuda
