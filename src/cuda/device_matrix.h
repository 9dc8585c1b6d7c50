#pragma once
// A weight matrix resident on the GPU, as the kernels read it. Plain data, shared by host code and kernels.
#include <cstdint>

namespace vavilov::cuda {

enum class WeightFormat : int {
  F32,   // dense fp32 rows
  BF16,  // dense bf16 rows
  Q4,    // 4-bit affine: codes least-significant first in uint32 words, bf16 scale and bias per 64 columns
};

struct DeviceMatrix {
  WeightFormat format = WeightFormat::F32;
  int rows = 0, cols = 0;
  const void* data = nullptr;        // dense rows or Q4 codes [rows, cols / 8] words
  const uint16_t* scales = nullptr;  // Q4: bf16 [rows, cols / 64]
  const uint16_t* biases = nullptr;
};

}  // namespace vavilov::cuda
