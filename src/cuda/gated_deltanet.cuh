#pragma once
// Gated DeltaNet on the GPU (spec §7, CPU mirror: src/cpu/gated_deltanet.cpp): the causal conv, the decode step
// (conv, gates, delta rule and gated output norm in one launch, a block per value head) and the
// chunk-parallel prefill (64-token chunks in the WY form, the state passed from chunk to chunk). All data fp32; the
// prefill's matrix products run on tensor cores as 3×TF32 (fp32 accuracy) or, where asked, as one TF32 pass or
// with bf16 operands (GdnProducts). No kernel allocates or waits for the host, so a captured CUDA graph can hold them.
#include <cuda_runtime.h>

#include <cstddef>

namespace vavilov::cuda {

struct GdnShape {
  int heads, key_heads, dk, dv, conv_dim, key_dim;
};

// The limits of these kernels (the release has dk = dv = 128).
constexpr int kGdnMaxKeyDim = 128;
constexpr int kGdnMaxValueDim = 256;

// One pass of `rows` tokens through a GDN layer after its projections and conv.
struct GdnInputs {
  const float* qkv;      // [rows, conv_dim]: q | k | v after the conv (q, k not yet l2-normalised)
  const float* b;        // [rows, heads] in_proj_b outputs: β = σ(b)
  const float* a;        // [rows, heads] in_proj_a outputs: g = −e^{a_log}·softplus(a + dt_bias)
  const float* a_log;    // [heads]
  const float* dt_bias;  // [heads]
  const float* z;        // [rows, heads·dv] output gate inputs
  const float* norm;     // [dv] output norm weight (plain w)
  float eps;
  bool sigmoid_gate;  // output gate σ(z), else silu(z)
  int rows;
};

// Causal depthwise conv with silu over x [rows, channels] in place; state [kernel−1, channels] advanced;
// row_states (optional) [rows, kernel−1, channels] gets the state after every row.
void gdn_conv(const float* taps, int channels, int kernel, float* state, float* x, int rows, float* row_states,
              cudaStream_t stream);

// Decode: at most kGdnDecodeMaxRows rows, one after the other. recurrent [heads, dk, dv] advanced; row_states
// (optional, gdn_row_state_floats) gets, in a pass of several rows, what gdn_replay needs to rebuild the state after
// any of them: the state before the pass, then each row's update; out [rows, heads·dv] = the gated, normalised
// core output. one_row_body: a pass of 1 row at dk = dv = 128 runs the kernel's 1-row instantiation (a smaller body,
// bit-identical results); false runs the general one (for the tests and the A/B). Default: gdn_decode_one_row_body().
constexpr int kGdnDecodeMaxRows = 8;
bool gdn_decode_one_row_body();  // true unless VAVILOV_GDN_ONE_ROW=0 (read once)
void gdn_decode(const GdnShape& shape, const GdnInputs& in, float* recurrent, float* row_states, float* out,
                cudaStream_t stream, bool one_row_body = gdn_decode_one_row_body());

// A recorded decode pass's row_states: the state before the pass [heads, dk, dv], then per row t and head the row's
// update [gdn_row_update_floats]: the decay at 0, k̂ (the l2-normalised key) at kGdnUpdateKeys, δ = β(v − S'ᵀk̂) after
// it. The state after row t is decay·S + k̂ δᵀ of the one before, entry by entry (one fp32 product, one fma). A 64 KB
// state a head once, where a snapshot a row would write it every row (the decode kernel's stores, from a block a head,
// are what its time goes to at several rows). None in a 1-row pass: nothing can be rolled back there.
constexpr int kGdnUpdateKeys = 4;
__host__ __device__ inline size_t gdn_row_update_floats(const GdnShape& s) {
  return (size_t(kGdnUpdateKeys + s.dk + s.dv) + 3) / 4 * 4;
}
inline size_t gdn_row_state_floats(const GdnShape& s, int rows) {
  return size_t(s.heads) * (size_t(s.dk) * s.dv + size_t(rows) * gdn_row_update_floats(s));
}

// Rebuilds `recurrent` as it was after `kept` (or *kept_rows, when not null: read on the device) of a recorded pass's
// `rows` rows, from its row_states, for each of `count` buffers; nothing when every row is kept.
struct GdnReplay {
  const float* row_states;
  float* recurrent;
};
void gdn_replay(const GdnShape& shape, const GdnReplay* buffers, int count, const int* kept_rows, int kept, int rows,
                cudaStream_t stream);

// The causal conv of a decode pass: taps [conv_dim, kernel] (kernel ≤ kGdnMaxConvKernel), state [kernel−1, conv_dim]
// advanced past the pass's rows, row_states (optional) [rows, kernel−1, conv_dim] the state after every row.
constexpr int kGdnMaxConvKernel = 8;
struct GdnConvState {
  const float* taps;
  int kernel;
  float* state;
  float* row_states;
};

// Decode with the conv folded in: the same results as gdn_conv on qkv followed by gdn_decode, in one launch. qkv
// holds the pass's raw projections (q | k | v before the conv; in.qkv is not read). A block per value head; the value
// heads of one key head form a thread-block cluster. Where that exceeds a portable cluster (more than 8 value heads a
// key head) or the conv is wider than 4, the two kernels run instead, and qkv is convolved in place.
// dependent: launch it as a programmatic dependent launch, whose blocks load the recurrent state, the conv state and
// the taps while the kernel before it in the stream still runs and wait for that kernel before reading anything else.
// So that kernel must not write this layer's recurrent or conv state (in a pass it is the layer's input products).
// one_row_body as for gdn_decode.
void gdn_conv_decode(const GdnShape& shape, const GdnConvState& conv, float* qkv, GdnInputs in, float* recurrent,
                     float* row_states, float* out, bool dependent, cudaStream_t stream,
                     bool one_row_body = gdn_decode_one_row_body());

// Whether gdn_conv_decode runs as one launch at this shape and conv width.
bool gdn_conv_decode_fused(const GdnShape& shape, int conv_kernel);

// How many of gdn_conv_decode's clusters the device holds at once on an idle GPU (cudaOccupancyMaxActiveClusters; 0
// where it is not fused at a conv width of 4, −1 on a CUDA error): for the benchmark.
int gdn_conv_decode_resident_clusters(const GdnShape& shape);

// The arithmetic of the prefill's matrix products (tensor cores, fp32 accumulators).
// Tf32x3: every fp32 operand split into a tf32 hi and lo, three mma a product (fp32 accuracy: ~3e-5 of the float64
// recurrence at the release shape). Tf32: each operand rounded to tf32 once (unit roundoff 2⁻¹¹), one mma a product.
// Both keep the scratch in fp32. Bf16: each operand rounded to bf16 once (unit roundoff 2⁻⁹, fla's arithmetic
// class), m16n8k16 bf16 mma; the values that are only product operands (W, U and Δ, the normalised keys and queries,
// P, S₀) are stored in the scratch as bf16, while the state across chunks, the gates, decays, norms and
// exponentials stay fp32. gdn_prefill_products(): VAVILOV_GEMM_PRECISION (cuda/gemm.cuh) fp32 → Tf32x3, tf32 →
// Tf32, bf16 → Bf16.
enum class GdnProducts { Tf32x3, Tf32, Bf16 };
GdnProducts gdn_prefill_products();

// The prefill's prepare blocks (same results either way): each takes all value heads of a key head (their q and k
// rows' staging, norms and products shared) or one value head (3× the blocks at the release, each shorter: the
// faster where few chunks would leave the GPU mostly idle); Auto picks one value head a block where those blocks all
// fit on the GPU at once.
enum class GdnPrepareBlocks { Auto, PerValueHead, PerKeyHead };

// Prefill: any number of rows, 64-token chunks in parallel (no per-row states). scratch holds
// gdn_chunk_scratch_floats(shape, rows) floats (enough for every GdnProducts); out as for gdn_decode.
constexpr int kGdnChunk = 64;
size_t gdn_chunk_scratch_floats(const GdnShape& shape, int rows);
void gdn_prefill(const GdnShape& shape, const GdnInputs& in, float* recurrent, float* scratch, float* out,
                 cudaStream_t stream, GdnProducts products = gdn_prefill_products(),
                 GdnPrepareBlocks prepare_blocks = GdnPrepareBlocks::Auto);

}  // namespace vavilov::cuda
