#include "model/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "core/threads.h"

namespace vavilov {

namespace {

// Code q of element i in a packed row: bits·i … bits·i + bits − 1 counted from the least-significant bit of the row's
// first little-endian word (codes may straddle words for 3-bit).
uint32_t read_code(const std::byte* row, int64_t i, int bits) {
  const int64_t bit = i * bits;
  uint64_t window = 0;
  std::memcpy(&window, row + bit / 8, size_t((bit % 8 + bits + 7) / 8));
  return uint32_t(window >> (bit % 8)) & ((1u << bits) - 1);
}

void write_code(uint32_t* row, int64_t i, int bits, uint32_t code) {
  const int64_t bit = i * bits;
  auto* bytes = reinterpret_cast<uint8_t*>(row);
  for (int b = 0; b < bits; ++b)
    if (code >> b & 1u) bytes[(bit + b) / 8] |= uint8_t(1u << ((bit + b) % 8));
}

}  // namespace

QuantizedRows quantize_rows(const float* weights, int64_t rows, int64_t cols, int bits) {
  check(bits == 2 || bits == 3 || bits == 4, "quantization to {} bits is not supported (4, 3 or 2)", bits);
  check(cols % kQuantGroup == 0, "quantization needs a multiple of {} columns, got {}", kQuantGroup, cols);
  const int64_t groups = cols / kQuantGroup, words = cols * bits / 32;
  const float levels = float((1 << bits) - 1);
  QuantizedRows out;
  out.codes.assign(size_t(rows * words), 0);
  out.scales.resize(size_t(rows * groups));
  out.biases.resize(size_t(rows * groups));
  parallel_for(size_t(rows), 16, [&](size_t begin, size_t end) {
    for (size_t r = begin; r < end; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        const float* w = weights + int64_t(r) * cols + g * kQuantGroup;
        auto [lo, hi] = std::minmax_element(w, w + kQuantGroup);
        // Scale and bias are stored in bf16; codes are chosen against the stored (rounded) values.
        uint16_t scale_bits = f32_to_bf16(std::max((*hi - *lo) / levels, 1e-8f));
        uint16_t bias_bits = f32_to_bf16(*lo);
        float scale = bf16_to_f32(scale_bits), bias = bf16_to_f32(bias_bits);
        out.scales[r * size_t(groups) + size_t(g)] = scale_bits;
        out.biases[r * size_t(groups) + size_t(g)] = bias_bits;
        for (int64_t i = 0; i < kQuantGroup; ++i) {
          float q = std::clamp(std::nearbyint((w[i] - bias) / scale), 0.0f, levels);
          write_code(out.codes.data() + int64_t(r) * words, g * kQuantGroup + i, bits, uint32_t(q));
        }
      }
  });
  return out;
}

void dequantize_row(const Matrix& w, int64_t row, float* out) {
  const std::byte* codes = w.row(row);
  const int64_t groups = w.cols / kQuantGroup;
  if (w.bits == 4) {  // the common case: eight whole codes per word
    const auto* words = reinterpret_cast<const uint32_t*>(codes);
    for (int64_t g = 0; g < groups; ++g) {
      float scale = bf16_to_f32(w.scales[row * groups + g]), bias = bf16_to_f32(w.biases[row * groups + g]);
      for (int64_t k = 0; k < kQuantGroup / 8; ++k) {
        uint32_t word = words[g * (kQuantGroup / 8) + k];
        float* dst = out + g * kQuantGroup + k * 8;
        for (int i = 0; i < 8; ++i) dst[i] = scale * float((word >> (4 * i)) & 0xfu) + bias;
      }
    }
    return;
  }
  for (int64_t g = 0; g < groups; ++g) {
    float scale = bf16_to_f32(w.scales[row * groups + g]), bias = bf16_to_f32(w.biases[row * groups + g]);
    for (int64_t i = 0; i < kQuantGroup; ++i) {
      int64_t col = g * kQuantGroup + i;
      out[col] = scale * float(read_code(codes, col, w.bits)) + bias;
    }
  }
}

int quantize_model(Model& model, int bits) {
  int count = 0;
  std::vector<float> dense;
  for_each_matrix(model, [&](Matrix& m) {
    if (m.quantized() || m.cols % kQuantGroup != 0) return;
    dense.resize(size_t(m.rows * m.cols));
    for (int64_t r = 0; r < m.rows; ++r) to_f32(m.dtype, m.row(r), dense.data() + r * m.cols, size_t(m.cols));
    QuantizedRows q = quantize_rows(dense.data(), m.rows, m.cols, bits);
    auto keep = [&](const auto& values) {
      const auto* bytes = reinterpret_cast<const std::byte*>(values.data());
      model.owned.emplace_back(bytes, bytes + values.size() * sizeof(values[0]));
      return model.owned.back().data();
    };
    m.data = keep(q.codes);
    m.scales = reinterpret_cast<const uint16_t*>(keep(q.scales));
    m.biases = reinterpret_cast<const uint16_t*>(keep(q.biases));
    m.dtype = DType::BF16;
    m.bits = bits;
    ++count;
  });
  return count;
}

}  // namespace vavilov
