#pragma once
// A weight matrix resident on the GPU, as the kernels read it. Plain data, shared by host code and kernels.
#include <cstddef>
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

// Byte sizes of a matrix's parts as the kernels read them: data (dense values or codes), affine scales and biases,
// NVFP4 block scales.
struct MatrixParts {
  size_t data = 0, scales = 0, biases = 0, block_scales = 0;
};

inline MatrixParts matrix_parts(const DeviceMatrix& m) {
  const size_t n = size_t(m.rows) * size_t(m.cols);
  MatrixParts p;
  switch (m.format) {
    case WeightFormat::F32:
      p.data = n * 4;
      break;
    case WeightFormat::BF16:
      p.data = n * 2;
      break;
    case WeightFormat::F8:
      p.data = n;
      break;
    case WeightFormat::NVFP4:
      p.data = n / 2;
      p.block_scales = n / 16;
      break;
    case WeightFormat::Q4:
    case WeightFormat::Q3:
    case WeightFormat::Q2:
    case WeightFormat::Affine: {
      const int bits = m.format == WeightFormat::Q4   ? 4
                       : m.format == WeightFormat::Q3 ? 3
                       : m.format == WeightFormat::Q2 ? 2
                                                      : m.bits;
      p.data = n * size_t(bits) / 8;
      p.scales = p.biases = size_t(m.rows) * (size_t(m.cols) / size_t(m.group)) * 2;  // bf16 per group
      break;
    }
    case WeightFormat::Mixed:
      break;
  }
  return p;
}

// Bytes the kernels read for the whole matrix (codes or values plus scales).
inline double matrix_bytes(const DeviceMatrix& m) {
  const MatrixParts p = matrix_parts(m);
  return double(p.data + p.scales + p.biases + p.block_scales);
}

}  // namespace vavilov::cuda
