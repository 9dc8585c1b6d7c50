#include "model/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/error.h"
#include "core/threads.h"

namespace vavilov {

namespace {

// Code of element i in a packed row: bits bits·i … bits·i + bits − 1 counted from the least-significant bit of the
// row's first little-endian word (3-bit codes may straddle words).
uint32_t read_code(const std::byte* row, int64_t i, int bits) {
  const int64_t bit = i * bits;
  uint64_t window = 0;
  std::memcpy(&window, row + bit / 8, size_t((bit % 8 + bits + 7) / 8));
  return uint32_t(window >> (bit % 8)) & ((1u << bits) - 1);
}

struct GroupParams {
  float scale, bias;
};

// MLX's choice of grid for one group (mlx/backend/cpu/quantized.cpp, `quantize`), in the same fp32 operations.
GroupParams mlx_group_params(const float* w, int64_t group, float levels) {
  float lo = std::numeric_limits<float>::infinity(), hi = -lo;
  for (int64_t i = 0; i < group; ++i) {
    hi = std::max(hi, w[i]);
    lo = std::min(lo, w[i]);
  }
  const bool low_edge = std::fabs(lo) > std::fabs(hi);
  float scale = std::max((hi - lo) / levels, 1e-7f);
  scale = low_edge ? scale : -scale;
  const float edge = low_edge ? lo : hi;
  const float q0 = std::rint(edge / scale);
  if (q0 == 0.0f) return {scale, 0.0f};
  return {edge / q0, edge};
}

// Appends `bits`-wide codes least-significant first into a byte stream.
class CodeWriter {
 public:
  CodeWriter(uint8_t* out, int bits) : out_(out), bits_(bits) {}
  void push(uint32_t code) {
    pending_ |= uint64_t(code) << count_;
    count_ += bits_;
    while (count_ >= 8) {
      *out_++ = uint8_t(pending_);
      pending_ >>= 8;
      count_ -= 8;
    }
  }

 private:
  uint8_t* out_;
  int bits_;
  uint64_t pending_ = 0;
  int count_ = 0;
};

void quantize_row(const float* w, int64_t cols, int bits, int64_t group, uint8_t* codes, uint16_t* scales,
                  uint16_t* biases) {
  const float levels = float((1 << bits) - 1);
  CodeWriter writer(codes, bits);
  for (int64_t g = 0; g < cols / group; ++g) {
    const float* values = w + g * group;
    const GroupParams p = mlx_group_params(values, group, levels);
    for (int64_t i = 0; i < group; ++i)
      writer.push(uint32_t(std::clamp(std::rint((values[i] - p.bias) / p.scale), 0.0f, levels)));
    scales[g] = f32_to_bf16(p.scale);
    biases[g] = f32_to_bf16(p.bias);
  }
}

const std::byte* keep(Model& model, const void* data, size_t bytes) {
  const auto* begin = static_cast<const std::byte*>(data);
  model.owned.emplace_back(begin, begin + bytes);
  return model.owned.back().data();
}

}  // namespace

QuantizedRows quantize_rows(const float* weights, int64_t rows, int64_t cols, int bits, int64_t group) {
  check(bits >= 2 && bits <= 8 && bits != 7, "quantization to {} bits is not supported (2-6 or 8)", bits);
  check(group == 32 || group == 64 || group == 128, "quantization group {} is not supported (32, 64 or 128)", group);
  check(cols % group == 0 && cols * bits % 32 == 0,
        "quantization in groups of {} needs a multiple of {} columns, got {}", group, group, cols);
  const int64_t groups = cols / group, words = cols * bits / 32;
  QuantizedRows out;
  out.codes.assign(size_t(rows * words), 0);
  out.scales.resize(size_t(rows * groups));
  out.biases.resize(size_t(rows * groups));
  parallel_for(size_t(rows), 16, [&](size_t begin, size_t end) {
    for (size_t r = begin; r < end; ++r)
      quantize_row(weights + int64_t(r) * cols, cols, bits, group,
                   reinterpret_cast<uint8_t*>(out.codes.data() + int64_t(r) * words), out.scales.data() + r * groups,
                   out.biases.data() + r * groups);
  });
  return out;
}

namespace {

// The eight non-negative e2m1 magnitudes; bit 3 of a code is the sign.
constexpr float kE2m1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

void dequantize_nvfp4_row(const Matrix& w, int64_t row, float* out) {
  const auto* codes = reinterpret_cast<const uint8_t*>(w.row(row));
  const uint8_t* scales = w.block_scales + row * (w.cols / w.group);
  for (int64_t g = 0; g < w.cols / w.group; ++g) {
    const float scale = f8_e4m3_to_f32(scales[g]) * w.tensor_scale;
    for (int64_t i = g * w.group; i < (g + 1) * w.group; ++i) {
      const uint32_t code = (codes[i / 2] >> (4 * (i % 2))) & 0xfu;
      out[i] = (code & 8u ? -kE2m1[code & 7u] : kE2m1[code & 7u]) * scale;
    }
  }
}

}  // namespace

void dequantize_row(const Matrix& w, int64_t row, float* out) {
  if (w.nvfp4()) return dequantize_nvfp4_row(w, row, out);
  const std::byte* codes = w.row(row);
  const int64_t groups = w.cols / w.group;
  const uint16_t* scales = w.scales + row * groups;
  const uint16_t* biases = w.biases + row * groups;
  if (w.bits == 4 && w.group % 8 == 0) {  // the common case: eight whole codes per word
    const auto* words = reinterpret_cast<const uint32_t*>(codes);
    for (int64_t g = 0; g < groups; ++g) {
      float scale = bf16_to_f32(scales[g]), bias = bf16_to_f32(biases[g]);
      for (int64_t k = 0; k < w.group / 8; ++k) {
        uint32_t word = words[g * (w.group / 8) + k];
        float* dst = out + g * w.group + k * 8;
        for (int i = 0; i < 8; ++i) dst[i] = scale * float((word >> (4 * i)) & 0xfu) + bias;
      }
    }
    return;
  }
  for (int64_t g = 0; g < groups; ++g) {
    float scale = bf16_to_f32(scales[g]), bias = bf16_to_f32(biases[g]);
    for (int64_t i = 0; i < w.group; ++i) {
      int64_t col = g * w.group + i;
      out[col] = scale * float(read_code(codes, col, w.bits)) + bias;
    }
  }
}

Matrix quantize_matrix(Model& model, const Matrix& m, int bits) {
  std::vector<float> dense(size_t(m.rows * m.cols));
  for (int64_t r = 0; r < m.rows; ++r) {
    float* values = dense.data() + r * m.cols;
    if (m.quantized()) {
      dequantize_row(m, r, values);
    } else {
      to_f32(m.dtype, m.row(r), values, size_t(m.cols));
      for (int64_t i = 0; m.tensor_scale != 1.0f && i < m.cols; ++i) values[i] *= m.tensor_scale;
    }
  }
  QuantizedRows q = quantize_rows(dense.data(), m.rows, m.cols, bits);
  Matrix out = m;
  out.data = keep(model, q.codes.data(), q.codes.size() * 4);
  out.scales = reinterpret_cast<const uint16_t*>(keep(model, q.scales.data(), q.scales.size() * 2));
  out.biases = reinterpret_cast<const uint16_t*>(keep(model, q.biases.data(), q.biases.size() * 2));
  out.dtype = DType::BF16;
  out.bits = bits;
  out.group = kQuantGroup;
  out.block_scales = nullptr;
  out.tensor_scale = 1.0f;
  return out;
}

int quantize_model(Model& model, int bits) {
  int count = 0;
  for_each_matrix(model, [&](Matrix& m) {
    if (m.quantized() || m.cols % kQuantGroup != 0) return;
    m = quantize_matrix(model, m, bits);
    ++count;
  });
  return count;
}

int quantize_experts(Model& model, int bits) {
  check(bits == 2 || bits == 3 || bits == 4, "--experts {}: expert precision must be 4, 3 or 2 bits", bits);
  std::vector<LayerWeights*> layers;
  for (auto& layer : model.layers) layers.push_back(&layer);
  if (model.mtp) layers.push_back(&model.mtp->layer);
  int count = 0;
  for (LayerWeights* layer : layers)
    for (FeedForwardWeights& expert : layer->moe.experts)
      for (Matrix* m : {&expert.gate, &expert.up, &expert.down}) {
        if (m->bits == bits && m->group == kQuantGroup) continue;
        check(m->cols % kQuantGroup == 0, "{}: --experts {} needs a multiple of {} input columns, the expert has {}",
              m->name, bits, kQuantGroup, m->cols);
        *m = quantize_matrix(model, *m, bits);
        ++count;
      }
  return count;
}

}  // namespace vavilov
