#include <cuda_fp16.h>

#include <algorithm>
#include <type_traits>

#include "cuda/gemv.cuh"

namespace vavilov::cuda {

namespace {

// Tuning knob of the quantized kernels (set with -D in a variant build, compared by bench/cuda/run.sh); the default is
// the measured best.
#ifndef VAVILOV_GEMV_UNROLL
#define VAVILOV_GEMV_UNROLL 4
#endif
constexpr int kUnroll = VAVILOV_GEMV_UNROLL;  // groups of 64 columns whose loads a warp issues together
constexpr int kTileRows = 16;                 // rows of one tensor-core tile (mma m16n8k16)
constexpr int kMaxWarps = 16;                 // warps of one block
static_assert(kUnroll % 4 == 0, "scales and biases are loaded four groups at a time");

// How the work is split (choose_split): one wave of blocks where the shape allows, since a second, partial wave
// doubles a kernel's time. Constants rather than the device's numbers, so that a shape is summed the same way
// everywhere.
constexpr int kSms = 132;             // an H200's multiprocessors
constexpr int kQuantWarpsPerSm = 16;  // resident warps of the quantized kernel on one (its registers allow 18)
constexpr int kDenseWarpsPerSm = 32;  // and of the dense kernel
constexpr int kMaxSplits = 16;        // warps of one block on one tile
constexpr int kMaxTiles = 8;          // tiles of one block
constexpr int kMaxBlocksPerSm = 32;   // Hopper's limit
// Shared memory: Hopper's per multiprocessor, its per-block opt-in limit, what the runtime reserves per block, and the
// quantized kernel's static partial sums.
constexpr size_t kSharedPerSm = 228 * 1024, kReservedShared = 1024;
constexpr size_t kStaticShared = kMaxWarps * 64 * sizeof(float);
constexpr size_t kMaxDynamicShared = 227 * 1024 - kStaticShared;

// ---------------------------------------------------------------------------------------------------------------
// Quantized GEMV on the tensor cores.
//
// Work split: a warp owns 16 consecutive rows (one mma tile) and walks along its slice of their columns (all of them,
// or a run of whole kUnroll-group units when gemv_quant_split cuts rows into slices) in groups of 64. In a group, lane
// (g, t) = (lane / 4, lane % 4) holds the 16 columns 16t..16t+15 of rows g and g + 8, which is exactly what the mma A
// fragment asks of that lane once the reduction index k is permuted: a dot product may sum its terms in any order, so
// k-slot → column is free as long as A (weights) and B (activations) use the same map. The codes of one row and group
// therefore arrive as one 8-byte load per lane (Q4), whole 32-byte sectors per row.
//
// Exactness: the activations are fp32; each group of 64 is scaled by a power of two into [2^14, 2^15) and split into
// hi + lo fp16 halves (22 significant bits: error ≤ 2^-22 |x| + 2^-39 · the group's peak). The mma's
// n = 8 columns are (batch row b, half s) at n = 2b + s, so lane t's accumulators c0 + c1 (row g) and c2 + c3
// (row g + 8) are batch row t's dot products with the group's codes. The affine terms follow in fp32:
// Σ (s·q + z)·x = s·2^e·Σ q·x' + z·Σ x.
//
// Code decoding: a register holds two columns ("a pair") in its low and high fp16 halves. One LOP3 ORs the codes at
// bit p of each half into the mantissa of 1024.0h, which gives 1024 + q·2^p exactly; one fp16 subtract (p = 0) or
// fused multiply-add by 2^-p, -1024·2^-p recovers q. pair_column says which of a lane's 16 columns the halves hold.
// (Masking alone, reading q·2^(p-24) as an fp16 subnormal, saves the fp16 op but measured 10-50x less accurate on
// the H200's tensor cores: docs/CUDA-KERNELS.md.)

__host__ __device__ constexpr int pair_column(int bits, int pair, int high) {
  return bits == 4 ? (pair / 4) * 8 + pair % 4 + 4 * high : pair + 8 * high;
}

__device__ inline uint32_t as_bits(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
__device__ inline __half2 as_half2(uint32_t u) { return *reinterpret_cast<__half2*>(&u); }

// fp16 bit pattern of ±2^k in both halves.
__host__ __device__ constexpr uint32_t half2_pow2(int k, bool negative = false) {
  const uint32_t h = (negative ? 0x8000u : 0u) | uint32_t(k + 15) << 10;
  return h | h << 16;
}

template <int Shift, uint32_t Mask>
__device__ inline uint32_t decode_pair(uint32_t word) {
  static_assert((Mask & 0xFC00FC00u) == 0 && (Mask & (0x00010001u << Shift)) != 0, "codes at bit Shift of a mantissa");
  uint32_t biased;  // (word & Mask) | 1024.0h in one LOP3
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(biased) : "r"(word), "n"(Mask), "n"(0x64006400u));
  if constexpr (Shift == 0) return as_bits(__hsub2(as_half2(biased), as_half2(half2_pow2(10))));
  return as_bits(__hfma2(as_half2(biased), as_half2(half2_pow2(-Shift)), as_half2(half2_pow2(10 - Shift, true))));
}

// The raw words of lane t's 16 columns of `group` in one row: Q4 two words; Q3 the 48 bits at bit 48t of the
// group's 6 words (in two words, shifted in decode); Q2 one word.
template <int Bits>
__device__ inline uint2 load_codes(const uint32_t* row, int group, int t) {
  if constexpr (Bits == 4) return __ldg(reinterpret_cast<const uint2*>(row + 8 * group + 2 * t));
  if constexpr (Bits == 2) return make_uint2(__ldg(row + 4 * group + t), 0u);
  const uint32_t* p = row + 6 * group + (3 * t) / 2;
  return make_uint2(__ldg(p), __ldg(p + 1));
}

// The 16 codes of load_codes as 8 half2 registers, register p holding columns pair_column(Bits, p, 0 / 1).
template <int Bits>
__device__ inline void decode(uint2 raw, int t, uint32_t (&h)[8]) {
  if constexpr (Bits == 4) {
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      const uint32_t word = w ? raw.y : raw.x, shifted = word >> 8;
      h[4 * w + 0] = decode_pair<0, 0x000F000Fu>(word);
      h[4 * w + 1] = decode_pair<4, 0x00F000F0u>(word);
      h[4 * w + 2] = decode_pair<0, 0x000F000Fu>(shifted);
      h[4 * w + 3] = decode_pair<4, 0x00F000F0u>(shifted);
    }
  } else if constexpr (Bits == 2) {
    const uint32_t word = raw.x, shifted = word >> 10;  // codes 0..7 in the low half, 8..15 in the high half
    h[0] = decode_pair<0, 0x00030003u>(word);
    h[1] = decode_pair<2, 0x000C000Cu>(word);
    h[2] = decode_pair<4, 0x00300030u>(word);
    h[3] = decode_pair<6, 0x00C000C0u>(word);
    h[4] = decode_pair<8, 0x03000300u>(word);
    h[5] = decode_pair<0, 0x00030003u>(shifted);
    h[6] = decode_pair<2, 0x000C000Cu>(shifted);
    h[7] = decode_pair<4, 0x00300030u>(shifted);
  } else {
    // Code k at bit 3k of v. Registers with codes k in the low half and k + 8 (24 bits further) in the high half.
    const uint64_t v = ((uint64_t(raw.y) << 32) | raw.x) >> (16 * (t & 1));
    const uint32_t low = (uint32_t(v) & 0xFFFFu) | (uint32_t(v >> 8) & 0xFFFF0000u);          // codes 0..4, 8..12
    const uint32_t high = (uint32_t(v >> 15) & 0xFFFFu) | (uint32_t(v >> 23) & 0xFFFF0000u);  // codes 5..7, 13..15
    const uint32_t low_shifted = low >> 9;                                                    // codes 3, 4, 11, 12
    h[0] = decode_pair<0, 0x00070007u>(low);
    h[1] = decode_pair<3, 0x00380038u>(low);
    h[2] = decode_pair<6, 0x01C001C0u>(low);
    h[3] = decode_pair<0, 0x00070007u>(low_shifted);
    h[4] = decode_pair<3, 0x00380038u>(low_shifted);
    h[5] = decode_pair<0, 0x00070007u>(high);
    h[6] = decode_pair<3, 0x00380038u>(high);
    h[7] = decode_pair<6, 0x01C001C0u>(high);
  }
}

__device__ inline void mma_f16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                               uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Shared memory of one block: the activation fragments, then per (batch row, group) the sum of
// the group's activations and the power of two that undoes their scaling.
//   fragments[(group·2 + half)·8B + lane] (uint4): B-fragment registers of two mma steps for lane (g, t), g < 2B.
constexpr size_t quant_shared_bytes(int groups, int batch) {
  return size_t(groups) * batch * (2 * 8 * sizeof(uint4) + sizeof(float2));
}

template <int Bits, int B>
__device__ void stage_activations(const GemvMatrix& m, int groups, uint4* fragments, float2* group_terms) {
  const int items = B * groups * 4;                       // item = (batch row, group, lane column t)
  for (int base = 0; base < items; base += blockDim.x) {  // uniform trip count: the shuffles need all
    const int item = base + threadIdx.x, t = item & 3, group = (item >> 2) % groups, b = (item >> 2) / groups;
    const bool active = item < items;
    float x[16] = {};
    if (active) {
      const float4* source = reinterpret_cast<const float4*>(m.x + size_t(b) * m.cols + group * kQuantGroup + 16 * t);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float4 v = __ldg(source + i);
        x[4 * i] = v.x, x[4 * i + 1] = v.y, x[4 * i + 2] = v.z, x[4 * i + 3] = v.w;
      }
    }
    float peak = 0.0f, sum = 0.0f;
#pragma unroll
    for (int i = 0; i < 16; ++i) peak = fmaxf(peak, fabsf(x[i])), sum += x[i];
#pragma unroll
    for (int offset = 1; offset < 4; offset <<= 1) {
      peak = fmaxf(peak, __shfl_xor_sync(0xffffffffu, peak, offset));
      sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    }
    if (!active) continue;
    // Scale the group's peak into [2^14, 2^15): inside fp16's range, and lo stays a normal number for |x'| ≥ 1/8.
    // Both 2^-e and 2^e stay normal floats for every finite peak.
    const int peak_exponent = int((__float_as_uint(peak) >> 23) & 0xffu) - 127;
    const int exponent = peak > 0.0f ? min(max(peak_exponent - 14, -126), 113) : 0;
    const float down = __uint_as_float(uint32_t(127 - exponent) << 23);
    uint32_t hi[8], lo[8];
#pragma unroll
    for (int p = 0; p < 8; ++p) {
      const float first = x[pair_column(Bits, p, 0)] * down, second = x[pair_column(Bits, p, 1)] * down;
      const __half2 h = __floats2half2_rn(first, second);
      const float2 rounded = __half22float2(h);
      hi[p] = as_bits(h);
      lo[p] = as_bits(__floats2half2_rn(first - rounded.x, second - rounded.y));
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      uint4* entry = fragments + (size_t(group) * 2 + half) * 8 * B + 4 * (2 * b) + t;
      entry[0] = make_uint4(hi[4 * half], hi[4 * half + 1], hi[4 * half + 2], hi[4 * half + 3]);
      entry[4] = make_uint4(lo[4 * half], lo[4 * half + 1], lo[4 * half + 2], lo[4 * half + 3]);
    }
    if (t == 0) group_terms[b * groups + group] = make_float2(sum, __uint_as_float(uint32_t(127 + exponent) << 23));
  }
}

// What one warp loads for kUnroll groups: codes of rows g and g + 8 of its tile, and the groups' scales and biases,
// lane t holding those of (t = 0: scales of row g, 1: scales of row g + 8, 2: biases of row g, 3: biases of g + 8).
struct WarpLoads {
  uint2 codes[kUnroll][2];
  uint32_t affine[kUnroll / 2];  // bf16 pairs: groups 2i and 2i + 1
};

// How the scale and bias rows may be read: 8 bytes (four groups) at a time, 4, or 2.
enum class AffineWidth { k8, k4, k2 };

__device__ inline AffineWidth affine_width(const GemvMatrix& m, int groups) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(m.scales) | reinterpret_cast<uintptr_t>(m.biases);
  if (groups % 4 == 0 && address % 8 == 0) return AffineWidth::k8;
  if (groups % 2 == 0 && address % 4 == 0) return AffineWidth::k4;
  return AffineWidth::k2;
}

// Loads groups [first_group, first_group + kUnroll) ∩ [.., end); first_group is a multiple of kUnroll.
template <int Bits>
__device__ inline void load_group_block(WarpLoads& loads, const uint32_t* const (&codes)[2],
                                        const __nv_bfloat16* affine, int first_group, int end, AffineWidth width,
                                        int t) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      loads.codes[u][r] = first_group + u < end ? load_codes<Bits>(codes[r], first_group + u, t) : make_uint2(0u, 0u);
  const __nv_bfloat16* source = affine + first_group;
#pragma unroll
  for (int i = 0; i < kUnroll / 2; ++i) {
    const int group = first_group + 2 * i;
    if (width == AffineWidth::k8) {
      if (i % 2 == 1) continue;
      const uint2 four = group < end ? __ldg(reinterpret_cast<const uint2*>(source + 2 * i)) : make_uint2(0u, 0u);
      loads.affine[i] = four.x;
      loads.affine[i + 1] = four.y;
      continue;
    }
    uint32_t pair = 0;
    if (width == AffineWidth::k4) {
      if (group < end) pair = __ldg(reinterpret_cast<const uint32_t*>(source + 2 * i));
    } else {
      const unsigned short* halves = reinterpret_cast<const unsigned short*>(source + 2 * i);
      if (group < end) pair = __ldg(halves);
      if (group + 1 < end) pair |= uint32_t(__ldg(halves + 1)) << 16;
    }
    loads.affine[i] = pair;
  }
}

__device__ inline float bf16_low(uint32_t pair) { return __uint_as_float(pair << 16); }
__device__ inline float bf16_high(uint32_t pair) { return __uint_as_float(pair & 0xFFFF0000u); }

// The columns of a matrix are cut into `slices` runs of whole kUnroll-group units (so that every slice starts at an
// aligned group); slice k starts at slice_start(k).
__device__ inline int slice_start(int k, int slices, int groups) {
  const int units = (groups + kUnroll - 1) / kUnroll;
  return min(k * units / slices * kUnroll, groups);
}

// Σ over groups [begin, end) of one warp's tile: acc[r] = row g + 8r's product with batch row t (lane (g, t), t < B).
template <int Bits, int B>
__device__ inline void tile_products(WarpLoads& current, const uint32_t* const (&codes)[2], const __nv_bfloat16* affine,
                                     AffineWidth width, int begin, int end, int groups, const uint4* fragments,
                                     const float2* group_terms, float (&acc)[2]) {
  const int lane = threadIdx.x % 32, t = lane % 4;
  for (int first = begin; first < end; first += kUnroll) {
    WarpLoads next;
    load_group_block<Bits>(next, codes, affine, first + kUnroll, end, width, t);
    uint32_t scale_bias[4];  // bf16 pairs of two groups: scale row g, scale row g + 8, bias g, bias g + 8
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int group = first + u;
      if (group >= end) break;
      uint4 b_fragment[2] = {};
      if (lane < 8 * B) {
        b_fragment[0] = fragments[(size_t(group) * 2) * 8 * B + lane];
        b_fragment[1] = fragments[(size_t(group) * 2 + 1) * 8 * B + lane];
      }
      const float2 terms = t < B ? group_terms[t * groups + group] : make_float2(0.0f, 0.0f);
      if (u % 2 == 0)
#pragma unroll
        for (int i = 0; i < 4; ++i) scale_bias[i] = __shfl_sync(0xffffffffu, current.affine[u / 2], (lane & ~3) | i);
      uint32_t a0[8], a1[8];
      decode<Bits>(current.codes[u][0], t, a0);
      decode<Bits>(current.codes[u][1], t, a1);
      float c[4] = {};
      mma_f16(c, a0[0], a1[0], a0[1], a1[1], b_fragment[0].x, b_fragment[0].y);
      mma_f16(c, a0[2], a1[2], a0[3], a1[3], b_fragment[0].z, b_fragment[0].w);
      mma_f16(c, a0[4], a1[4], a0[5], a1[5], b_fragment[1].x, b_fragment[1].y);
      mma_f16(c, a0[6], a1[6], a0[7], a1[7], b_fragment[1].z, b_fragment[1].w);
      const auto pick = [&](uint32_t pair) { return u % 2 ? bf16_high(pair) : bf16_low(pair); };
      acc[0] = fmaf(c[0] + c[1], pick(scale_bias[0]) * terms.y, fmaf(pick(scale_bias[2]), terms.x, acc[0]));
      acc[1] = fmaf(c[2] + c[3], pick(scale_bias[1]) * terms.y, fmaf(pick(scale_bias[3]), terms.x, acc[1]));
    }
    current = next;
  }
}

// Block (row block, matrix): warp w works on tile w % split.tiles and column slice w / split.tiles. Each warp leaves
// its partial sums in shared memory; then each output adds those of its tile's warps in slice order.
template <int Bits, int B>
__global__ void __launch_bounds__(kMaxWarps * 32)
    gemv_quant_kernel(GemvMatrix single, const GemvMatrix* matrices, GemvSplit split) {
  extern __shared__ uint4 shared[];
  __shared__ float partials[kMaxWarps][64];  // [warp][r·32 + lane]: lane (g, t)'s sum for row g + 8r, batch t
  const GemvMatrix m = matrices ? matrices[blockIdx.y] : single;
  const int block_row = blockIdx.x * split.tiles * kTileRows;
  if (block_row >= m.rows) return;  // the whole block is past this matrix's rows
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int groups = m.cols / kQuantGroup, row_words = m.cols / 32 * Bits, slice = warp / split.tiles;
  const int begin = slice_start(slice, split.splits, groups), end = slice_start(slice + 1, split.splits, groups);
  const int warp_row = block_row + (warp % split.tiles) * kTileRows;
  // Rows past the end re-read the last row; their results are never stored.
  const int row0 = min(warp_row + g, m.rows - 1), row1 = min(row0 + 8, m.rows - 1);
  const uint32_t* const codes[2] = {m.codes + size_t(row0) * row_words, m.codes + size_t(row1) * row_words};
  const __nv_bfloat16* affine = (t & 2 ? m.biases : m.scales) + size_t(t & 1 ? row1 : row0) * groups;
  const AffineWidth width = affine_width(m, groups);
  const bool has_rows = warp_row < m.rows;

  // The first loads are issued before staging, so that the activations' latency overlaps theirs.
  WarpLoads current;
  load_group_block<Bits>(current, codes, affine, begin, has_rows ? end : begin, width, t);
  uint4* fragments = shared;
  float2* group_terms = reinterpret_cast<float2*>(fragments + size_t(groups) * 16 * B);
  stage_activations<Bits, B>(m, groups, fragments, group_terms);
  __syncthreads();
  float acc[2] = {};
  if (has_rows) tile_products<Bits, B>(current, codes, affine, width, begin, end, groups, fragments, group_terms, acc);
  partials[warp][lane] = acc[0];
  partials[warp][32 + lane] = acc[1];
  __syncthreads();
  const int outputs = split.tiles * kTileRows * B;  // (tile, row in tile, batch row)
  for (int i = threadIdx.x; i < outputs; i += blockDim.x) {
    const int b = i % B, row_in_tile = (i / B) % kTileRows, tile = i / (B * kTileRows);
    const int row = block_row + tile * kTileRows + row_in_tile;
    if (row >= m.rows) continue;
    const int slot = (row_in_tile / 8) * 32 + (row_in_tile % 8) * 4 + b;
    float sum = 0.0f;
    for (int part = 0; part < split.splits; ++part) sum += partials[part * split.tiles + tile][slot];
    m.y[size_t(b) * m.rows + row] = sum;
  }
}

template <int Bits, int B>
cudaError_t launch_quant(const GemvMatrix& single, const GemvMatrix* matrices, int count, int max_rows, int max_cols,
                         cudaStream_t stream) {
  const GemvSplit split = gemv_quant_split(max_rows, max_cols, count, B);
  const size_t shared = quant_shared_bytes(max_cols / kQuantGroup, B);
  if (shared > kMaxDynamicShared) return cudaErrorInvalidValue;
  // Once for all: only a permission (occupancy follows each launch's own size), so it never changes between the
  // launches of a captured graph.
  static const cudaError_t opted_in = cudaFuncSetAttribute(
      gemv_quant_kernel<Bits, B>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kMaxDynamicShared));
  if (opted_in != cudaSuccess) return opted_in;
  const int tiles = (max_rows + kTileRows - 1) / kTileRows;
  const dim3 grid(unsigned((tiles + split.tiles - 1) / split.tiles), unsigned(count));
  gemv_quant_kernel<Bits, B><<<grid, split.tiles * split.splits * 32, shared, stream>>>(single, matrices, split);
  return cudaGetLastError();
}

// launch(std::integral_constant<int, B>{}) for the batch size B (1–4): the kernels take it as a template argument.
template <typename Launch>
cudaError_t with_batch(int batch, Launch&& launch) {
  switch (batch) {
    case 1:
      return launch(std::integral_constant<int, 1>{});
    case 2:
      return launch(std::integral_constant<int, 2>{});
    case 3:
      return launch(std::integral_constant<int, 3>{});
    case 4:
      return launch(std::integral_constant<int, 4>{});
    default:
      return cudaErrorInvalidValue;
  }
}

template <int Bits>
cudaError_t gemv_quant(const GemvMatrix& single, const GemvMatrix* matrices, int count, int max_rows, int max_cols,
                       int batch, cudaStream_t stream) {
  if (count <= 0 || max_rows <= 0 || max_cols <= 0 || max_cols % kQuantGroup != 0) return cudaErrorInvalidValue;
  return with_batch(batch, [&](auto b) {
    return launch_quant<Bits, decltype(b)::value>(single, matrices, count, max_rows, max_cols, stream);
  });
}

// ---------------------------------------------------------------------------------------------------------------
// Dense (BF16, F32): each row is split among split.splits warps (16-byte weight loads, fp32 FMA), whose sums are
// added in warp order; a block holds split.tiles rows. One warp per row already runs at the copy bandwidth when there
// are enough rows.

__device__ inline float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

template <typename T>
__device__ inline const T* dense_rows(const GemvMatrix& m) {
  if constexpr (sizeof(T) == 2)
    return m.dense;
  else
    return m.dense_f32;
}

// The weights of one 16-byte load as fp32.
__device__ inline void widen(uint4 packed, const __nv_bfloat16*, float (&w)[8]) {
  const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[2 * i] = __uint_as_float(words[i] << 16);
    w[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}
__device__ inline void widen(uint4 packed, const float*, float (&w)[4]) {
  w[0] = __uint_as_float(packed.x), w[1] = __uint_as_float(packed.y), w[2] = __uint_as_float(packed.z);
  w[3] = __uint_as_float(packed.w);
}

template <typename T, int B>
__global__ void __launch_bounds__(kMaxWarps * 32)
    gemv_dense_kernel(GemvMatrix single, const GemvMatrix* matrices, GemvSplit split) {
  constexpr int kPerLoad = 16 / sizeof(T);
  __shared__ float partials[kMaxWarps][kMaxGemvRows];
  const GemvMatrix m = matrices ? matrices[blockIdx.y] : single;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, part = warp / split.tiles;
  const int row = blockIdx.x * split.tiles + warp % split.tiles;
  if (int(blockIdx.x) * split.tiles >= m.rows) return;  // the whole block is past this matrix's rows
  const int chunks = m.cols / kPerLoad;
  const int begin = part * chunks / split.splits, end = (part + 1) * chunks / split.splits;
  float acc[B] = {};
  if (row < m.rows) {
    const T* rows = dense_rows<T>(m);
    const uint4* weights = reinterpret_cast<const uint4*>(rows + size_t(row) * m.cols);
    for (int c = begin + lane; c < end; c += 32) {
      float w[kPerLoad];
      widen(__ldg(weights + c), rows, w);
#pragma unroll
      for (int b = 0; b < B; ++b) {
        const float4* x = reinterpret_cast<const float4*>(m.x + size_t(b) * m.cols + size_t(c) * kPerLoad);
#pragma unroll
        for (int q = 0; q < kPerLoad / 4; ++q) {
          const float4 v = __ldg(x + q);
          acc[b] += w[4 * q] * v.x + w[4 * q + 1] * v.y + w[4 * q + 2] * v.z + w[4 * q + 3] * v.w;
        }
      }
    }
  }
#pragma unroll
  for (int b = 0; b < B; ++b) {
    const float sum = warp_sum(acc[b]);
    if (lane == 0) partials[warp][b] = sum;
  }
  __syncthreads();
  if (part != 0 || lane >= B || row >= m.rows) return;
  float sum = 0.0f;
  for (int p = 0; p < split.splits; ++p) sum += partials[p * split.tiles + warp][lane];
  m.y[size_t(lane) * m.rows + row] = sum;
}

template <typename T, int B>
cudaError_t launch_dense(const GemvMatrix& single, const GemvMatrix* matrices, int count, int max_rows, int max_cols,
                         cudaStream_t stream) {
  const GemvSplit split = gemv_dense_split(max_rows, max_cols, count);
  const dim3 grid(unsigned((max_rows + split.tiles - 1) / split.tiles), unsigned(count));
  gemv_dense_kernel<T, B><<<grid, split.tiles * split.splits * 32, 0, stream>>>(single, matrices, split);
  return cudaGetLastError();
}

template <typename T>
cudaError_t gemv_dense(const GemvMatrix& single, const GemvMatrix* matrices, int count, int max_rows, int max_cols,
                       int batch, cudaStream_t stream) {
  if (count <= 0 || max_rows <= 0 || max_cols <= 0 || max_cols % (16 / sizeof(T)) != 0) return cudaErrorInvalidValue;
  return with_batch(batch, [&](auto b) {
    return launch_dense<T, decltype(b)::value>(single, matrices, count, max_rows, max_cols, stream);
  });
}

// The most column slices (at most `units`) that still let every warp be resident at once (`warps_per_sm`, and at most
// `blocks_per_sm` blocks, on each of kSms); for those, the most tiles a block that keeps the single wave over 90 % of
// the multiprocessors, or else the fewest tiles a block that fit. Shapes with too many tiles for one wave get blocks of
// kMaxTiles tiles, one slice each, in several waves.
GemvSplit choose_split(int tiles, int count, int units, int warps_per_sm, int blocks_per_sm) {
  const int64_t tile_count = int64_t(tiles) * count, resident_warps = int64_t(kSms) * warps_per_sm;
  for (int slices = std::min(units, kMaxSplits); slices >= 1; --slices) {
    if (tile_count * slices > resident_warps) continue;
    int fitting = 0;  // the fewest tiles a block seen so far that fit in one wave
    for (int per_block = std::min({kMaxTiles, kMaxWarps / slices, tiles}); per_block >= 1; --per_block) {
      const int64_t blocks = int64_t((tiles + per_block - 1) / per_block) * count;
      const int64_t resident_blocks = int64_t(kSms) * std::min(warps_per_sm / (per_block * slices), blocks_per_sm);
      if (blocks > resident_blocks) continue;
      if (10 * blocks >= 9 * kSms) return {per_block, slices};
      fitting = per_block;
    }
    if (fitting > 0) return {fitting, slices};
  }
  return {std::min(kMaxTiles, tiles), 1};
}

}  // namespace

GemvSplit gemv_quant_split(int rows, int cols, int count, int batch) {
  const int groups = cols / kQuantGroup, units = (groups + kUnroll - 1) / kUnroll;
  const size_t block_shared = quant_shared_bytes(groups, batch) + kStaticShared + kReservedShared;
  const int blocks_per_sm = int(std::max<size_t>(1, kSharedPerSm / block_shared));
  return choose_split((rows + kTileRows - 1) / kTileRows, count, std::max(units, 1), kQuantWarpsPerSm, blocks_per_sm);
}

GemvSplit gemv_dense_split(int rows, int cols, int count) {
  // Slices of at least 256 columns: one 16-byte load a lane (BF16), two (F32).
  return choose_split(rows, count, std::max(1, cols / 256), kDenseWarpsPerSm, kMaxBlocksPerSm);
}

cudaError_t gemv_q4(const GemvMatrix* matrices, int count, int max_rows, int max_cols, int batch, cudaStream_t stream) {
  return gemv_quant<4>(GemvMatrix{}, matrices, count, max_rows, max_cols, batch, stream);
}

cudaError_t gemv_q3(const GemvMatrix* matrices, int count, int max_rows, int max_cols, int batch, cudaStream_t stream) {
  return gemv_quant<3>(GemvMatrix{}, matrices, count, max_rows, max_cols, batch, stream);
}

cudaError_t gemv_q2(const GemvMatrix* matrices, int count, int max_rows, int max_cols, int batch, cudaStream_t stream) {
  return gemv_quant<2>(GemvMatrix{}, matrices, count, max_rows, max_cols, batch, stream);
}

cudaError_t gemv_bf16(const GemvMatrix* matrices, int count, int max_rows, int max_cols, int batch,
                      cudaStream_t stream) {
  return gemv_dense<__nv_bfloat16>(GemvMatrix{}, matrices, count, max_rows, max_cols, batch, stream);
}

cudaError_t gemv_q4(const GemvMatrix& matrix, int batch, cudaStream_t stream) {
  return gemv_quant<4>(matrix, nullptr, 1, matrix.rows, matrix.cols, batch, stream);
}

cudaError_t gemv_q3(const GemvMatrix& matrix, int batch, cudaStream_t stream) {
  return gemv_quant<3>(matrix, nullptr, 1, matrix.rows, matrix.cols, batch, stream);
}

cudaError_t gemv_q2(const GemvMatrix& matrix, int batch, cudaStream_t stream) {
  return gemv_quant<2>(matrix, nullptr, 1, matrix.rows, matrix.cols, batch, stream);
}

cudaError_t gemv_bf16(const GemvMatrix& matrix, int batch, cudaStream_t stream) {
  return gemv_dense<__nv_bfloat16>(matrix, nullptr, 1, matrix.rows, matrix.cols, batch, stream);
}

cudaError_t gemv_f32(const GemvMatrix& matrix, int batch, cudaStream_t stream) {
  return gemv_dense<float>(matrix, nullptr, 1, matrix.rows, matrix.cols, batch, stream);
}

}  // namespace vavilov::cuda
