#include "cpu/linear.h"

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/threads.h"
#include "cpu/simd.h"
#include "model/quantize.h"

namespace vavilov::cpu {

float dot(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  __m256 acc2 = _mm256_setzero_ps(), acc3 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), acc2);
    acc3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), acc3);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  __m256 acc = _mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3));
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  half = _mm_add_ps(half, _mm_movehl_ps(half, half));
  half = _mm_add_ss(half, _mm_movehdup_ps(half));
  float sum = _mm_cvtss_f32(half);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

namespace {

// Codes chunk·8 … chunk·8 + 7 of a group of 64 (packed in 2·Bits whole words), widened to eight int32 lanes. Only
// whole aligned words are read: a 3-bit chunk that straddles two words takes both (a 3-byte load stalls on store
// forwarding). With `chunk` a constant after unrolling, the word indices and shifts are constants too.
template <int Bits>
inline __m256i codes8(const uint8_t* group_codes, int chunk) {
  const int bit = chunk * 8 * Bits;
  uint32_t low;
  std::memcpy(&low, group_codes + bit / 32 * 4, 4);
  uint64_t window = low;
  if (bit % 32 + 8 * Bits > 32) {
    uint32_t high;
    std::memcpy(&high, group_codes + bit / 32 * 4 + 4, 4);
    window |= uint64_t(high) << 32;
  }
  const auto packed = uint32_t(window >> (bit % 32));
  const __m256i shifts = _mm256_setr_epi32(0, Bits, 2 * Bits, 3 * Bits, 4 * Bits, 5 * Bits, 6 * Bits, 7 * Bits);
  return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(packed)), shifts),
                          _mm256_set1_epi32((1 << Bits) - 1));
}

// Eight weights w = scale·q + bias in registers.
template <int Bits>
inline __m256 weights8(const uint8_t* group_codes, int chunk, __m256 scale, __m256 bias) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(codes8<Bits>(group_codes, chunk)), scale, bias);
}

constexpr int kChunksPerGroup = int(kQuantGroup / 8);

template <int Bits>
void dequantize_row_group64(const Matrix& w, int64_t row, float* out) {
  const auto* codes = reinterpret_cast<const uint8_t*>(w.row(row));
  const int64_t groups = w.cols / kQuantGroup;
  for (int64_t g = 0; g < groups; ++g) {
    __m256 scale = _mm256_set1_ps(bf16_to_f32(w.scales[row * groups + g]));
    __m256 bias = _mm256_set1_ps(bf16_to_f32(w.biases[row * groups + g]));
    const uint8_t* group_codes = codes + g * kQuantGroup * Bits / 8;
    for (int chunk = 0; chunk < kChunksPerGroup; ++chunk)
      _mm256_storeu_ps(out + g * kQuantGroup + chunk * 8, weights8<Bits>(group_codes, chunk, scale, bias));
  }
}

// NVFP4: eight e2m1 codes of one little-endian word (column k in bits 4k..4k+3) as signed values.
inline __m256 nvfp4_values8(uint32_t word) {
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i codes =
      _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(word)), shifts), _mm256_set1_epi32(15));
  const __m256 magnitudes = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  const __m256 magnitude = _mm256_permutevar8x32_ps(magnitudes, codes);  // uses the low three bits of each code
  const __m256i sign = _mm256_slli_epi32(_mm256_srli_epi32(codes, 3), 31);
  return _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(magnitude), sign));
}

// e4m3 block scales through a table: one lookup per 16 weights.
const float* e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> values{};
    for (int i = 0; i < 256; ++i) values[size_t(i)] = f8_e4m3_to_f32(uint8_t(i));
    return values;
  }();
  return table.data();
}

void dequantize_nvfp4_row(const Matrix& w, int64_t row, float* out) {
  const auto* words = reinterpret_cast<const uint32_t*>(w.row(row));
  const uint8_t* block_scales = w.block_scales + row * (w.cols / 16);
  const float* e4m3 = e4m3_table();
  for (int64_t b = 0; b < w.cols / 16; ++b) {
    const __m256 scale = _mm256_set1_ps(e4m3[block_scales[b]] * w.tensor_scale);
    _mm256_storeu_ps(out + b * 16, _mm256_mul_ps(nvfp4_values8(words[2 * b]), scale));
    _mm256_storeu_ps(out + b * 16 + 8, _mm256_mul_ps(nvfp4_values8(words[2 * b + 1]), scale));
  }
}

}  // namespace

void matrix_row(const Matrix& w, int64_t row, float* out) {
  if (!w.quantized()) {
    to_f32(w.dtype, w.row(row), out, size_t(w.cols));
    if (w.tensor_scale != 1.0f)  // ModelOpt FP8: e4m3 values times a per-tensor scale
      for (int64_t i = 0; i < w.cols; ++i) out[i] *= w.tensor_scale;
  } else if (w.nvfp4()) {
    dequantize_nvfp4_row(w, row, out);
  } else if (w.group != kQuantGroup || w.bits > 4) {  // MLX's other widths and groups: correct, not fast
    dequantize_row(w, row, out);
  } else if (w.bits == 4) {
    dequantize_row_group64<4>(w, row, out);
  } else if (w.bits == 3) {
    dequantize_row_group64<3>(w, row, out);
  } else {
    dequantize_row_group64<2>(w, row, out);
  }
}

namespace {

using simd::horizontal_sum;
using simd::load8;

inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) { return bf16_to_f32(*p); }

// y[r·out_dim + o] = Σ_k w[o·w_stride + k]·x[r·n + k] for O weight rows and R input rows at once (register
// blocking): each weight vector is widened once and feeds R rows, each input vector feeds O weight rows, and the O·R
// independent FMA chains hide the FMA latency. Every (o, r) pair has one accumulator over k in steps of 8, then the
// same horizontal sum and scalar tail, so an output does not depend on O, R or how the rows are split into blocks
// and tasks: a verify row's products equal the one-row decode step's bit for bit.
constexpr int64_t kPrefetchDistance = 8192;

template <int O, int R, typename T>
void dot_block(const T* w, int64_t w_stride, const float* x, int64_t n, float* y, int64_t out_dim) {
  __m256 acc[O][R];
#pragma GCC unroll 8
  for (int o = 0; o < O; ++o)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[o][r] = _mm256_setzero_ps();
  // The block's O rows are one contiguous run of memory, consumed O·8 weights a step; the hardware prefetchers do not
  // follow O interleaved rows, so each step prefetches the same share of the run kPrefetchDistance bytes ahead.
  constexpr int64_t kStepBytes = O * 8 * int64_t(sizeof(T));
  const char* ahead = reinterpret_cast<const char*>(w) + kPrefetchDistance;
  int64_t k = 0;
  for (; k + 8 <= n; k += 8, ahead += kStepBytes) {
#pragma GCC unroll 4
    for (int64_t line = 0; line < kStepBytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    __m256 xv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + r * n + k);
#pragma GCC unroll 8
    for (int o = 0; o < O; ++o) {
      const __m256 wv = load8(w + o * w_stride + k);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[o][r] = _mm256_fmadd_ps(wv, xv[r], acc[o][r]);
    }
  }
  for (int o = 0; o < O; ++o)
    for (int r = 0; r < R; ++r) {
      float sum = horizontal_sum(acc[o][r]);
      // An explicit fma: whether the compiler would contract a*b + c must not differ between weight dtypes.
      for (int64_t tail = k; tail < n; ++tail) sum = std::fma(load1(w + o * w_stride + tail), x[r * n + tail], sum);
      y[r * out_dim + o] = sum;
    }
}

// Weight rows per block for R (1–3) input rows: O·R accumulators (8–9 chains cover the FMA latency at two FMAs a cycle)
// plus the R input vectors stay within the 16 vector registers.
template <int R>
constexpr int kWeightRowsPerBlock = R == 1   ? 8
                                    : R == 2 ? 4
                                             : 3;

// Weight rows [o_begin, o_end) against R input rows, in blocks of kWeightRowsPerBlock<R> weight rows.
template <int R, typename T>
void weight_rows_times(const T* w, int64_t w_stride, int64_t o_begin, int64_t o_end, const float* x, int64_t n,
                       float* y, int64_t out_dim) {
  constexpr int O = kWeightRowsPerBlock<R>;
  int64_t o = o_begin;
  for (; o + O <= o_end; o += O) dot_block<O, R>(w + o * w_stride, w_stride, x, n, y + o, out_dim);
  // The rest in halving blocks: a single weight row against one input row is one latency-bound chain.
  if constexpr (O > 4)
    for (; o + 4 <= o_end; o += 4) dot_block<4, R>(w + o * w_stride, w_stride, x, n, y + o, out_dim);
  if constexpr (O > 2)
    for (; o + 2 <= o_end; o += 2) dot_block<2, R>(w + o * w_stride, w_stride, x, n, y + o, out_dim);
  for (; o < o_end; ++o) dot_block<1, R>(w + o * w_stride, w_stride, x, n, y + o, out_dim);
}

// Weight rows [o_begin, o_end) (w points at row 0) against `rows` input rows, three at a time (the block shape with
// the most work per load: 4 input rows would leave room for only 2 weight rows). Slices of 24 weight rows (a
// multiple of every block size) meet all input rows while they are in cache.
template <typename T>
void rows_times_inputs(const T* w, int64_t w_stride, int64_t o_begin, int64_t o_end, const float* x, int64_t rows,
                       int64_t n, float* y, int64_t out_dim) {
  constexpr int64_t kSlice = 24;
  for (int64_t slice = o_begin; slice < o_end; slice += kSlice) {
    const int64_t slice_end = std::min(slice + kSlice, o_end);
    for (int64_t r = 0; r < rows; r += 3) {
      const float* xr = x + r * n;
      float* yr = y + r * out_dim;
      switch (std::min<int64_t>(3, rows - r)) {
        case 3:
          weight_rows_times<3>(w, w_stride, slice, slice_end, xr, n, yr, out_dim);
          break;
        case 2:
          weight_rows_times<2>(w, w_stride, slice, slice_end, xr, n, yr, out_dim);
          break;
        default:
          weight_rows_times<1>(w, w_stride, slice, slice_end, xr, n, yr, out_dim);
          break;
      }
    }
  }
}

// Quantized weight row o (group kQuantGroup) against R input rows: codes are widened and scaled in registers and
// each group of eight weights feeds R accumulators, so a decode step reads every packed weight exactly once.
template <int R, int Bits>
void quantized_dot_rows(const Matrix& w, int64_t o, const float* x, int64_t stride, float* out) {
  const auto* codes = reinterpret_cast<const uint8_t*>(w.row(o));
  const int64_t groups = w.cols / kQuantGroup;
  __m256 acc[R], acc2[R];
  for (int r = 0; r < R; ++r) acc[r] = acc2[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 scale = _mm256_set1_ps(bf16_to_f32(w.scales[o * groups + g]));
    __m256 bias = _mm256_set1_ps(bf16_to_f32(w.biases[o * groups + g]));
    const uint8_t* group_codes = codes + g * kQuantGroup * Bits / 8;
    const float* group_x = x + g * kQuantGroup;
    for (int chunk = 0; chunk < kChunksPerGroup; chunk += 2) {
      __m256 w0 = weights8<Bits>(group_codes, chunk, scale, bias);
      __m256 w1 = weights8<Bits>(group_codes, chunk + 1, scale, bias);
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(group_x + r * stride + chunk * 8), acc[r]);
        acc2[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(group_x + r * stride + chunk * 8 + 8), acc2[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) out[r] = horizontal_sum(_mm256_add_ps(acc[r], acc2[r]));
}

// NVFP4 weight row o against R input rows, decoded in registers like the affine rows (block scale × tensor scale).
template <int R>
void nvfp4_dot_rows(const Matrix& w, int64_t o, const float* x, int64_t stride, float* out) {
  const auto* words = reinterpret_cast<const uint32_t*>(w.row(o));
  const uint8_t* block_scales = w.block_scales + o * (w.cols / 16);
  const float* e4m3 = e4m3_table();
  const float tensor_scale = w.tensor_scale;
  __m256 acc[R], acc2[R];
  for (int r = 0; r < R; ++r) acc[r] = acc2[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < w.cols / 16; ++b) {
    const __m256 scale = _mm256_set1_ps(e4m3[block_scales[b]] * tensor_scale);
    const __m256 w0 = _mm256_mul_ps(nvfp4_values8(words[2 * b]), scale);
    const __m256 w1 = _mm256_mul_ps(nvfp4_values8(words[2 * b + 1]), scale);
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * stride + b * 16), acc[r]);
      acc2[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * stride + b * 16 + 8), acc2[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = horizontal_sum(_mm256_add_ps(acc[r], acc2[r]));
}

constexpr int kNvfp4 = 1;  // "Bits" of the NVFP4 kernels below

template <int R, int Bits>
void packed_dot_rows(const Matrix& w, int64_t o, const float* x, int64_t stride, float* out) {
  if constexpr (Bits == kNvfp4)
    nvfp4_dot_rows<R>(w, o, x, stride, out);
  else
    quantized_dot_rows<R, Bits>(w, o, x, stride, out);
}

template <int Bits>
void quantized_row_times_inputs(const Matrix& w, const float* x, int64_t rows, int64_t o, float* y) {
  const int64_t n = w.cols, out_dim = w.rows;
  float out[4];
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4) {
    packed_dot_rows<4, Bits>(w, o, x + r * n, n, out);
    for (int i = 0; i < 4; ++i) y[(r + i) * out_dim + o] = out[i];
  }
  switch (rows - r) {
    case 3:
      packed_dot_rows<3, Bits>(w, o, x + r * n, n, out);
      break;
    case 2:
      packed_dot_rows<2, Bits>(w, o, x + r * n, n, out);
      break;
    case 1:
      packed_dot_rows<1, Bits>(w, o, x + r * n, n, out);
      break;
    default:
      return;
  }
  for (int64_t i = 0; i < rows - r; ++i) y[(r + i) * out_dim + o] = out[i];
}

void quantized_row_times_inputs(const Matrix& w, const float* x, int64_t rows, int64_t o, float* y) {
  if (w.nvfp4())
    quantized_row_times_inputs<kNvfp4>(w, x, rows, o, y);
  else if (w.bits == 4)
    quantized_row_times_inputs<4>(w, x, rows, o, y);
  else if (w.bits == 3)
    quantized_row_times_inputs<3>(w, x, rows, o, y);
  else
    quantized_row_times_inputs<2>(w, x, rows, o, y);
}

}  // namespace

void matmul(const Matrix& w, const float* x, int64_t rows, float* y) {
  const int64_t out_dim = w.rows, in_dim = w.cols;
  // Enough output rows per task that a task does the work of streaming ~256 KiB of weights against one input row:
  // waking a worker costs tens of microseconds, more than a small matrix takes on one core. A verify step's 2–4 input
  // rows make each weight row that much more work, so its matrices split into that many times more tasks.
  const size_t work_per_row = std::max<size_t>(1, w.row_bytes()) * size_t(std::clamp<int64_t>(rows, 1, 4));
  const size_t grain = std::max<size_t>(1, (256 << 10) / work_per_row);
  // F32 and BF16 weights are read in place for any number of rows (a bf16 vector is widened in two operations).
  // Quantized weights (group 64) are decoded in registers for decode and verify steps; other dtypes, and quantized
  // weights for many rows (prefill), have a row widened once.
  const bool quantized_in_registers =
      w.quantized() && rows <= 4 && (w.nvfp4() || (w.bits <= 4 && w.group == kQuantGroup));
  const bool in_registers = !w.quantized() && (w.dtype == DType::F32 || w.dtype == DType::BF16);
  parallel_for(size_t(out_dim), grain, [&](size_t begin, size_t end) {
    if (quantized_in_registers) {
      for (size_t o = begin; o < end; ++o) quantized_row_times_inputs(w, x, rows, int64_t(o), y);
      return;
    }
    if (in_registers && w.dtype == DType::BF16) {
      rows_times_inputs(reinterpret_cast<const uint16_t*>(w.data), in_dim, int64_t(begin), int64_t(end), x, rows,
                        in_dim, y, out_dim);
      return;
    }
    if (in_registers) {
      rows_times_inputs(reinterpret_cast<const float*>(w.data), in_dim, int64_t(begin), int64_t(end), x, rows, in_dim,
                        y, out_dim);
      return;
    }
    // Eight rows widened at a time, so the blocked kernel has weight rows to block over.
    constexpr size_t kWidened = 8;
    std::vector<float> converted(kWidened * size_t(in_dim));
    for (size_t o = begin; o < end; o += kWidened) {
      const size_t count = std::min(kWidened, end - o);
      for (size_t i = 0; i < count; ++i) matrix_row(w, int64_t(o + i), converted.data() + i * size_t(in_dim));
      rows_times_inputs(converted.data(), in_dim, 0, int64_t(count), x, rows, in_dim, y + o, out_dim);
    }
  });
}

}  // namespace vavilov::cpu
