#include "cuda/gemv.cuh"

#include <cuda_fp16.h>

namespace vavilov::cuda {

namespace {

// Tuning knobs of the quantized kernels; bench/cuda/run.sh sweeps them with -D, the defaults are the measured best.
// VAVILOV_GEMV_WARPS, when set, fixes the warps per block instead of choosing them per launch (launch_quant).
#ifndef VAVILOV_GEMV_STAGES
#define VAVILOV_GEMV_STAGES 4
#endif
#ifndef VAVILOV_GEMV_TILES
#define VAVILOV_GEMV_TILES 1
#endif
constexpr int kStages = VAVILOV_GEMV_STAGES;  // depth of each warp's copy pipeline (stages in flight: kStages - 1)
constexpr int kTiles = VAVILOV_GEMV_TILES;    // 16-row tiles per warp; they share the activation fragments
constexpr int kTileRows = 16;                 // rows of one tensor-core tile (mma m16n8k16)

// ---------------------------------------------------------------------------------------------------------------
// Quantized GEMV on the tensor cores.
//
// Work split: a warp owns 16 consecutive rows (one mma tile) and walks along them in groups of 64 columns. In a
// group, lane (g, t) = (lane / 4, lane % 4) holds the 16 columns 16t..16t+15 of rows g and g + 8, which is exactly
// what the mma A fragment asks of that lane once the reduction index k is permuted: a dot product may sum its terms
// in any order, so k-slot → column is free as long as A (weights) and B (activations) use the same map. The codes
// of one row and group therefore arrive as one 8-byte load per lane (Q4), coalesced into 32-byte sectors per row.
//
// Exactness: a code q (0..15) is exact in fp16, so A = q. The activations are fp32; each group of 64 is scaled by a
// power of two into [2^14, 2^15) and split into hi + lo fp16 halves (22 significant bits, error ≤ 2^-22 |x| plus
// 2^-25 of the group's scaled peak). The mma's n = 8 columns are (batch row b, half s) at n = 2b + s, so lane t's
// accumulators c0 + c1 (row g) and c2 + c3 (row g + 8) are batch row t's dot products with that group's codes.
// The group's affine terms follow in fp32: Σ (s·q + z)·x = s·2^e·Σ q·x' + z·Σ x.
//
// Code decoding: OR-ing codes into the mantissa of 1024.0h gives 1024 + q·2^p exactly in each half of a register;
// one fused multiply-add by 2^-p, -1024·2^-p recovers q. Each (word & mask) | magic is one LOP3; a register yields
// two columns ("a pair"). pair_column says which columns of a lane's 16 the low and high halves hold.

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

template <int Shift>  // the masked codes sit at bit Shift of each half: the value is 1024 + q·2^Shift
__device__ inline uint32_t decode_pair(uint32_t word, uint32_t mask) {
  const __half2 biased = as_half2((word & mask) | 0x64006400u);
  if constexpr (Shift == 0) return as_bits(__hsub2(biased, as_half2(half2_pow2(10))));
  return as_bits(__hfma2(biased, as_half2(half2_pow2(-Shift)), as_half2(half2_pow2(10 - Shift, true))));
}

// Codes travel global → shared memory through each warp's own cp.async pipeline: a stage is kStageGroups groups of
// the warp's 16 rows, copied as whole 16-byte pieces of rows (Q3: 8-byte), so that a warp's copies cover full
// 128-byte lines; a load straight into the mma layout would fetch only 32 bytes of a row per instruction, and the
// number of requests in flight, not bytes, then limits the bandwidth. Rows are padded against bank conflicts.
template <int Bits>
struct StageLayout {
  static constexpr int kGroupBytes = 8 * Bits;                   // one row's codes of one group
  static constexpr int kStageGroups = Bits == 4 ? 4 : 8;         // groups per stage
  static constexpr int kRowBytes = kStageGroups * kGroupBytes;   // 128 (Q4, Q2) or 192 (Q3) bytes of a row
  static constexpr int kCopyBytes = Bits == 3 ? 8 : 16;          // Q3 rows are only 8-byte aligned
  static constexpr int kRowStride = kRowBytes + (Bits == 2 ? 16 : 32);  // the mma reads hit distinct banks
  static constexpr int kTileBytes = kTileRows * kRowStride;
  static constexpr int kWarpBytes = kStages * kTiles * kTileBytes;
};

// The raw words of lane t's 16 columns of group u of a staged row: Q4 two words; Q3 the 48 bits at bit 48t of the
// group's 6 words (in two words, shifted in decode); Q2 one word.
template <int Bits>
__device__ inline uint2 staged_codes(const unsigned char* row, int u, int t) {
  const unsigned char* group = row + u * StageLayout<Bits>::kGroupBytes;
  if constexpr (Bits == 4) return *reinterpret_cast<const uint2*>(group + 8 * t);
  if constexpr (Bits == 2) return make_uint2(*reinterpret_cast<const uint32_t*>(group + 4 * t), 0u);
  const uint32_t* words = reinterpret_cast<const uint32_t*>(group) + (3 * t) / 2;
  return make_uint2(words[0], words[1]);
}

// The 16 codes of staged_codes as 8 half2 registers, register p holding columns pair_column(Bits, p, 0 / 1).
template <int Bits>
__device__ inline void decode(uint2 raw, int t, uint32_t (&h)[8]) {
  if constexpr (Bits == 4) {
#pragma unroll
    for (int w = 0; w < 2; ++w) {
      const uint32_t word = w ? raw.y : raw.x, shifted = word >> 8;
      h[4 * w + 0] = decode_pair<0>(word, 0x000F000Fu);
      h[4 * w + 1] = decode_pair<4>(word, 0x00F000F0u);
      h[4 * w + 2] = decode_pair<0>(shifted, 0x000F000Fu);
      h[4 * w + 3] = decode_pair<4>(shifted, 0x00F000F0u);
    }
  } else if constexpr (Bits == 2) {
    const uint32_t word = raw.x, shifted = word >> 10;  // codes 0..7 in the low half, 8..15 in the high half
    h[0] = decode_pair<0>(word, 0x00030003u);
    h[1] = decode_pair<2>(word, 0x000C000Cu);
    h[2] = decode_pair<4>(word, 0x00300030u);
    h[3] = decode_pair<6>(word, 0x00C000C0u);
    h[4] = decode_pair<8>(word, 0x03000300u);
    h[5] = decode_pair<0>(shifted, 0x00030003u);
    h[6] = decode_pair<2>(shifted, 0x000C000Cu);
    h[7] = decode_pair<4>(shifted, 0x00300030u);
  } else {
    // Code k at bit 3k of v. Registers with codes k in the low half and k + 8 (24 bits further) in the high half.
    const uint64_t v = ((uint64_t(raw.y) << 32) | raw.x) >> (16 * (t & 1));
    const uint32_t low = (uint32_t(v) & 0xFFFFu) | (uint32_t(v >> 8) & 0xFFFF0000u);           // codes 0..4, 8..12
    const uint32_t high = (uint32_t(v >> 15) & 0xFFFFu) | (uint32_t(v >> 23) & 0xFFFF0000u);  // codes 5..7, 13..15
    const uint32_t low_shifted = low >> 9;                                                     // codes 3, 4, 11, 12
    h[0] = decode_pair<0>(low, 0x00070007u);
    h[1] = decode_pair<3>(low, 0x00380038u);
    h[2] = decode_pair<6>(low, 0x01C001C0u);
    h[3] = decode_pair<0>(low_shifted, 0x00070007u);
    h[4] = decode_pair<3>(low_shifted, 0x00380038u);
    h[5] = decode_pair<0>(high, 0x00070007u);
    h[6] = decode_pair<3>(high, 0x00380038u);
    h[7] = decode_pair<6>(high, 0x01C001C0u);
  }
}

__device__ inline void mma_f16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                               uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Shared memory of one block: the activation fragments, then per (batch row, group) the sum of the group's
// activations and the power of two that undoes their scaling.
//   fragments[(group·2 + half)·8B + lane] (uint4): B-fragment registers of two mma steps for lane (g, t), g < 2B.
template <int B>
constexpr size_t quant_shared_bytes(int cols) {
  return size_t(cols / kQuantGroup) * B * (2 * 8 * sizeof(uint4) + sizeof(float2));
}

template <int Bits, int B>
__device__ void stage_activations(const GemvMatrix& m, uint4* fragments, float2* group_terms) {
  const int groups = m.cols / kQuantGroup, items = B * groups * 4;  // item = (batch row, group, lane column t)
  for (int base = 0; base < items; base += blockDim.x) {              // uniform trip count: the shuffles need all
    const int item = base + threadIdx.x, t = item & 3, group = (item >> 2) % groups, b = (item >> 2) / groups;
    const bool active = item < items;
    float x[16] = {};
    if (active) {
      const float4* source = reinterpret_cast<const float4*>(m.x + size_t(b) * m.cols + group * 64 + 16 * t);
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
    // Scale the group's peak into [2^14, 2^15): far inside fp16's range, and lo stays a normal number for |x'| ≥ 1/8.
    const int peak_exponent = int((__float_as_uint(peak) >> 23) & 0xffu) - 127;
    const int exponent = peak > 0.0f ? min(max(peak_exponent - 14, -112), 113) : 0;
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

__device__ inline void copy_async(void* shared, const void* global, int bytes, bool valid) {
  const uint32_t address = uint32_t(__cvta_generic_to_shared(shared));
  if (bytes == 16)  // .cg: straight to shared memory, not kept in L1; a source size of 0 fills zeros
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(address), "l"(global), "r"(valid ? 16 : 0));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(address), "l"(global), "r"(valid ? 8 : 0));
}
__device__ inline void copy_commit() { asm volatile("cp.async.commit_group;"); }
template <int Pending>
__device__ inline void copy_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(Pending));
}

// How the scale and bias rows may be read: 8 bytes (four groups) at a time, 4, or 2.
enum class AffineWidth { k8, k4, k2 };

__device__ inline AffineWidth affine_width(const GemvMatrix& m, int groups) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(m.scales) | reinterpret_cast<uintptr_t>(m.biases);
  if (groups % 4 == 0 && address % 8 == 0) return AffineWidth::k8;
  if (groups % 2 == 0 && address % 4 == 0) return AffineWidth::k4;
  return AffineWidth::k2;
}

// Scales and biases of one stage go to registers (they are 1/8 of Q4's bytes): lane t loads those of
// (t = 0: scales of row g, 1: scales of row g + 8, 2: biases of row g, 3: biases of row g + 8) as bf16 pairs.
template <int Bits>
struct StageAffine {
  uint32_t pairs[kTiles][StageLayout<Bits>::kStageGroups / 2];
};

template <int Bits>
__device__ inline void load_affine(StageAffine<Bits>& affine, const __nv_bfloat16* const (&rows)[kTiles],
                                   int first_group, int groups, AffineWidth width) {
#pragma unroll
  for (int tile = 0; tile < kTiles; ++tile)
#pragma unroll
    for (int i = 0; i < StageLayout<Bits>::kStageGroups / 2; ++i) {
      const int group = first_group + 2 * i;
      const __nv_bfloat16* source = rows[tile] + group;
      uint32_t pair = 0;
      if (width == AffineWidth::k8) {
        if (i % 2 == 1) continue;
        const uint2 four = group < groups ? __ldg(reinterpret_cast<const uint2*>(source)) : make_uint2(0u, 0u);
        affine.pairs[tile][i] = four.x;
        affine.pairs[tile][i + 1] = four.y;
        continue;
      }
      if (width == AffineWidth::k4) {
        if (group < groups) pair = __ldg(reinterpret_cast<const uint32_t*>(source));
      } else {
        const unsigned short* halves = reinterpret_cast<const unsigned short*>(source);
        if (group < groups) pair = __ldg(halves);
        if (group + 1 < groups) pair |= uint32_t(__ldg(halves + 1)) << 16;
      }
      affine.pairs[tile][i] = pair;
    }
}

// Issues the copies of stage `stage` (kStageGroups groups of the warp's rows) into `ring` slot; past the last group
// the copies fill zeros.
template <int Bits>
__device__ inline void copy_stage(unsigned char* slot, const unsigned char* codes, size_t row_bytes, int first_row,
                                  int rows, int stage, int groups, int lane) {
  using L = StageLayout<Bits>;
  constexpr int kPiecesPerRow = L::kRowBytes / L::kCopyBytes;
  const size_t offset = size_t(stage) * L::kRowBytes;
#pragma unroll
  for (int tile = 0; tile < kTiles; ++tile)
#pragma unroll
    for (int i = 0; i < kTileRows * kPiecesPerRow / 32; ++i) {
      const int piece = lane + 32 * i, r = piece / kPiecesPerRow, column = (piece % kPiecesPerRow) * L::kCopyBytes;
      const int row = min(first_row + tile * kTileRows + r, rows - 1);
      const bool valid = offset + column < size_t(groups) * L::kGroupBytes;
      const unsigned char* source = codes + size_t(row) * row_bytes + (valid ? offset + column : 0);
      copy_async(slot + tile * L::kTileBytes + r * L::kRowStride + column, source, L::kCopyBytes, valid);
    }
}

__device__ inline float bf16_low(uint32_t pair) { return __uint_as_float(pair << 16); }
__device__ inline float bf16_high(uint32_t pair) { return __uint_as_float(pair & 0xFFFF0000u); }

template <int Bits, int B>
__device__ inline void compute_stage(const unsigned char* slot, const StageAffine<Bits>& affine,
                                     const uint4* fragments, const float2* group_terms, int first_group, int groups,
                                     int lane, float (&acc)[kTiles][2]) {
  using L = StageLayout<Bits>;
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int u = 0; u < L::kStageGroups; ++u) {
    const int group = first_group + u;
    if (group >= groups) break;
    uint4 b_fragment[2] = {};
    if (lane < 8 * B) {
      b_fragment[0] = fragments[(size_t(group) * 2) * 8 * B + lane];
      b_fragment[1] = fragments[(size_t(group) * 2 + 1) * 8 * B + lane];
    }
    const float2 terms = t < B ? group_terms[t * groups + group] : make_float2(0.0f, 0.0f);
#pragma unroll
    for (int tile = 0; tile < kTiles; ++tile) {
      uint32_t scale_bias[4];  // bf16 pairs of groups u & ~1, u | 1: scale row g, scale row g + 8, bias g, bias g + 8
#pragma unroll
      for (int i = 0; i < 4; ++i)
        scale_bias[i] = __shfl_sync(0xffffffffu, affine.pairs[tile][u / 2], (lane & ~3) | i);
      const unsigned char* rows = slot + tile * L::kTileBytes + g * L::kRowStride;
      uint32_t a0[8], a1[8];
      decode<Bits>(staged_codes<Bits>(rows, u, t), t, a0);
      decode<Bits>(staged_codes<Bits>(rows + 8 * L::kRowStride, u, t), t, a1);
      float c[4] = {};
      mma_f16(c, a0[0], a1[0], a0[1], a1[1], b_fragment[0].x, b_fragment[0].y);
      mma_f16(c, a0[2], a1[2], a0[3], a1[3], b_fragment[0].z, b_fragment[0].w);
      mma_f16(c, a0[4], a1[4], a0[5], a1[5], b_fragment[1].x, b_fragment[1].y);
      mma_f16(c, a0[6], a1[6], a0[7], a1[7], b_fragment[1].z, b_fragment[1].w);
      const auto pick = [&](uint32_t pair) { return u % 2 ? bf16_high(pair) : bf16_low(pair); };
      acc[tile][0] += pick(scale_bias[0]) * (terms.y * (c[0] + c[1])) + pick(scale_bias[2]) * terms.x;
      acc[tile][1] += pick(scale_bias[1]) * (terms.y * (c[2] + c[3])) + pick(scale_bias[3]) * terms.x;
    }
  }
}

template <int Bits, int B, int Warps>
__global__ void __launch_bounds__(Warps * 32) gemv_quant_kernel(const GemvMatrix* matrices) {
  using L = StageLayout<Bits>;
  extern __shared__ uint4 shared[];
  const GemvMatrix m = matrices[blockIdx.y];
  const int block_row = blockIdx.x * Warps * kTiles * kTileRows;
  if (block_row >= m.rows) return;  // the whole block is past this matrix's rows
  const int groups = m.cols / kQuantGroup, stages = (groups + L::kStageGroups - 1) / L::kStageGroups;
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, warp = threadIdx.x / 32;
  const int warp_row = block_row + warp * kTiles * kTileRows;
  const bool has_rows = warp_row < m.rows;
  const unsigned char* codes = reinterpret_cast<const unsigned char*>(m.codes);
  const size_t row_bytes = size_t(groups) * L::kGroupBytes;
  unsigned char* ring = reinterpret_cast<unsigned char*>(shared) + warp * L::kWarpBytes;
  uint4* fragments = shared + Warps * L::kWarpBytes / sizeof(uint4);
  float2* group_terms = reinterpret_cast<float2*>(fragments + size_t(groups) * 16 * B);

  const __nv_bfloat16* affine_rows[kTiles];
#pragma unroll
  for (int tile = 0; tile < kTiles; ++tile) {
    // Rows past the end re-read the last row; their results are never stored.
    const int row0 = min(warp_row + tile * kTileRows + g, m.rows - 1), row1 = min(row0 + 8, m.rows - 1);
    affine_rows[tile] = (t & 2 ? m.biases : m.scales) + size_t(t & 1 ? row1 : row0) * groups;
  }
  const AffineWidth width = affine_width(m, groups);

  // The first kStages - 1 stages are issued before the activations are staged, so that their latencies overlap.
  StageAffine<Bits> affine[kStages];
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (has_rows) {
      copy_stage<Bits>(ring + s * kTiles * L::kTileBytes, codes, row_bytes, warp_row, m.rows, s,
                       s < stages ? groups : 0, lane);
      load_affine<Bits>(affine[s], affine_rows, s * L::kStageGroups, groups, width);
    }
    copy_commit();
  }
  stage_activations<Bits, B>(m, fragments, group_terms);
  __syncthreads();
  if (!has_rows) return;

  float acc[kTiles][2] = {};
  for (int base = 0; base < stages; base += kStages) {
#pragma unroll
    for (int k = 0; k < kStages; ++k) {  // unrolled so that the ring slots and affine registers are static
      const int stage = base + k;
      if (stage >= stages) break;
      constexpr int kAhead = kStages - 1;
      const int next = (k + kAhead) % kStages;
      __syncwarp();  // every lane is done with the slot about to be refilled
      copy_stage<Bits>(ring + next * kTiles * L::kTileBytes, codes, row_bytes, warp_row, m.rows, stage + kAhead,
                       stage + kAhead < stages ? groups : 0, lane);
      load_affine<Bits>(affine[next], affine_rows, (stage + kAhead) * L::kStageGroups, groups, width);
      copy_commit();
      copy_wait<kAhead>();
      __syncwarp();  // the other lanes' copies of this stage are visible
      compute_stage<Bits, B>(ring + k * kTiles * L::kTileBytes, affine[k], fragments, group_terms,
                             stage * L::kStageGroups, groups, lane, acc);
    }
  }
  if (t >= B) return;
#pragma unroll
  for (int tile = 0; tile < kTiles; ++tile)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = warp_row + tile * kTileRows + g + 8 * r;
      if (row < m.rows) m.y[size_t(t) * m.rows + row] = acc[tile][r];
    }
}

template <int Bits, int B, int Warps>
cudaError_t launch_quant_with(const GemvMatrix* matrices, int count, int max_rows, size_t shared, cudaStream_t stream) {
  if (shared > 48 * 1024) {
    const cudaError_t error = cudaFuncSetAttribute(gemv_quant_kernel<Bits, B, Warps>,
                                                   cudaFuncAttributeMaxDynamicSharedMemorySize, int(shared));
    if (error != cudaSuccess) return error;
  }
  const int block_rows = Warps * kTiles * kTileRows;
  const dim3 grid((max_rows + block_rows - 1) / block_rows, count);
  gemv_quant_kernel<Bits, B, Warps><<<grid, Warps * 32, shared, stream>>>(matrices);
  return cudaGetLastError();
}

// Bytes in flight per multiprocessor are what set the bandwidth: each warp keeps kStages - 1 stages in flight, and
// its ring plus the block's activation fragments must fit in shared memory. So: the largest block (16, 8 or 4 warps)
// that fits and still gives every multiprocessor a block; if none gives every one a block, the smallest that fits.
template <int Bits, int B>
cudaError_t launch_quant(const GemvMatrix* matrices, int count, int max_rows, int max_cols, cudaStream_t stream) {
  int device = 0, multiprocessors = 0, shared_limit = 0;
  cudaError_t error = cudaGetDevice(&device);
  if (error == cudaSuccess) error = cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device);
  if (error == cudaSuccess)
    error = cudaDeviceGetAttribute(&shared_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (error != cudaSuccess) return error;
  const auto shared = [&](int warps) {
    return size_t(warps) * StageLayout<Bits>::kWarpBytes + quant_shared_bytes<B>(max_cols);
  };
  const auto blocks = [&](int warps) {
    return size_t(count) * ((max_rows + warps * kTiles * kTileRows - 1) / (warps * kTiles * kTileRows));
  };
#ifdef VAVILOV_GEMV_WARPS
  int warps = VAVILOV_GEMV_WARPS;
#else
  int warps = 0;
  for (int candidate : {16, 8, 4})
    if (shared(candidate) <= size_t(shared_limit) && (warps == 0 || blocks(warps) < size_t(multiprocessors)))
      warps = candidate;
  if (warps == 0) return cudaErrorInvalidValue;  // the activations alone do not fit: see gemv.cuh for the bound
#endif
  switch (warps) {
    case 16: return launch_quant_with<Bits, B, 16>(matrices, count, max_rows, shared(16), stream);
    case 8: return launch_quant_with<Bits, B, 8>(matrices, count, max_rows, shared(8), stream);
    default: return launch_quant_with<Bits, B, 4>(matrices, count, max_rows, shared(4), stream);
  }
}

template <int Bits>
cudaError_t gemv_quant(const GemvMatrix* matrices, int count, int max_rows, int max_cols, int batch,
                       cudaStream_t stream) {
  if (count <= 0 || max_rows <= 0 || max_cols <= 0 || max_cols % kQuantGroup != 0) return cudaErrorInvalidValue;
  switch (batch) {
    case 1: return launch_quant<Bits, 1>(matrices, count, max_rows, max_cols, stream);
    case 2: return launch_quant<Bits, 2>(matrices, count, max_rows, max_cols, stream);
    case 3: return launch_quant<Bits, 3>(matrices, count, max_rows, max_cols, stream);
    case 4: return launch_quant<Bits, 4>(matrices, count, max_rows, max_cols, stream);
    default: return cudaErrorInvalidValue;
  }
}

// ---------------------------------------------------------------------------------------------------------------
// BF16: one warp per row, 16-byte weight loads; at batch 1 this already runs at the copy bandwidth.

constexpr int kBf16Warps = 8;

__device__ inline float warp_sum(float v) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

template <int B>
__global__ void __launch_bounds__(kBf16Warps * 32) gemv_bf16_kernel(const GemvMatrix* matrices) {
  const GemvMatrix m = matrices[blockIdx.y];
  const int row = blockIdx.x * kBf16Warps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= m.rows) return;
  const uint4* weights = reinterpret_cast<const uint4*>(m.dense + size_t(row) * m.cols);
  float acc[B] = {};
  for (int c = lane; c < m.cols / 8; c += 32) {
    const uint4 packed = __ldg(weights + c);
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
    float w[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(pairs[i]);
      w[2 * i] = f.x;
      w[2 * i + 1] = f.y;
    }
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const float4* x = reinterpret_cast<const float4*>(m.x + size_t(b) * m.cols + c * 8);
      const float4 lo = __ldg(x), hi = __ldg(x + 1);
      acc[b] += w[0] * lo.x + w[1] * lo.y + w[2] * lo.z + w[3] * lo.w + w[4] * hi.x + w[5] * hi.y + w[6] * hi.z +
                w[7] * hi.w;
    }
  }
#pragma unroll
  for (int b = 0; b < B; ++b) {
    const float sum = warp_sum(acc[b]);
    if (lane == 0) m.y[size_t(b) * m.rows + row] = sum;
  }
}

template <int B>
cudaError_t launch_bf16(const GemvMatrix* matrices, int count, int max_rows, cudaStream_t stream) {
  dim3 grid((max_rows + kBf16Warps - 1) / kBf16Warps, count);
  gemv_bf16_kernel<B><<<grid, kBf16Warps * 32, 0, stream>>>(matrices);
  return cudaGetLastError();
}

}  // namespace

cudaError_t gemv_q4(const GemvMatrix* matrices, int count, int max_rows, int max_cols, int batch,
                    cudaStream_t stream) {
  return gemv_quant<4>(matrices, count, max_rows, max_cols, batch, stream);
}

cudaError_t gemv_q3(const GemvMatrix* matrices, int count, int max_rows, int max_cols, int batch,
                    cudaStream_t stream) {
  return gemv_quant<3>(matrices, count, max_rows, max_cols, batch, stream);
}

cudaError_t gemv_q2(const GemvMatrix* matrices, int count, int max_rows, int max_cols, int batch,
                    cudaStream_t stream) {
  return gemv_quant<2>(matrices, count, max_rows, max_cols, batch, stream);
}

cudaError_t gemv_bf16(const GemvMatrix* matrices, int count, int max_rows, int batch, cudaStream_t stream) {
  switch (batch) {
    case 1: return launch_bf16<1>(matrices, count, max_rows, stream);
    case 2: return launch_bf16<2>(matrices, count, max_rows, stream);
    case 3: return launch_bf16<3>(matrices, count, max_rows, stream);
    case 4: return launch_bf16<4>(matrices, count, max_rows, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace vavilov::cuda
