#pragma once
// Hyper-connection read and write on the GPU (the CPU's gated residual, src/cpu/layers.h): the S residual streams of
// a row are read through a low-rank mix into one layer input, and the layer's output is written back into every
// stream with a per-stream gate. The write also normalises the updated streams for the next read, so that a step
// does not launch a separate RMSNorm for it. Passes of 1–4 rows with Q4 mixers take hc_fused_read instead: the whole
// read in two launches, with the write before it folded in.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/device_matrix.h"

namespace vavilov::cuda {

// low = silu(low / S) in place.
void hc_low_activation(float* low, int64_t n, int streams, cudaStream_t stream);

// input[r, d] = Σ_s σ(mix[r, s, d])·normed[r, s, d] / S.
void hc_combine(const float* mix, const float* normed, int rows, int streams, int hidden, float* input,
                cudaStream_t stream);

// stack[r, s, :] += 2σ(inject[r, s] / S)·y[r, :] (inject: the raw projection). With norm_weight, also
// normed[r, s, :] = zero-centred RMSNorm of the updated stack[r, s, :] with weight norm_weight + s·hidden (the next
// read's first step, with the same arithmetic as rms_norm).
void hc_write(const float* inject, const float* y, int rows, int streams, int hidden, float* stack,
              const float* norm_weight, float eps, float* normed, cudaStream_t stream);

// The fused decode read (hc_fused_read.cu): the whole read of 1–4 rows in two kernels when the mixers are Q4.
struct HcFusedRead {
  DeviceMatrix mix_down, mix_up, inject;  // inject.data null: the read has no inject (a final mixer)
  const float* norm = nullptr;            // g [S·H]
  int streams = 0, hidden = 0;
  float eps = 0.0f;
};

// Whether hc_fused_read takes these mixers, norm and rows: Q4 (group 64, 8-byte aligned codes), rank a multiple of 64,
// hidden a multiple of 64, at most 4 streams, inject at most 16 rows, a 16-byte aligned norm, 1–4 rows.
bool hc_fused_read_fits(const DeviceMatrix& mix_down, const DeviceMatrix& mix_up, const DeviceMatrix* inject,
                        const float* norm, int streams, int hidden, int rows);

// Floats of hc_fused_read's scratch for `outputs` = mix_down rows + inject rows.
size_t hc_fused_read_scratch_floats(int outputs);

// input = the read of stack (as hc_write's norm, mix_down, hc_low_activation, mix_up and hc_combine compute it);
// inject = the read's raw inject projections [rows, inject rows], when it has inject. With `pending`, the previous
// write is applied first, in place: stack[r, s, :] += 2σ(inject[r, s] / S)·y[r, :] with the inject values found on
// entry (hc_write without its norm), so that a write followed by a read costs no launch of its own. With y_fixed (one
// row, pending only), the pending y is read from y_fixed's fixed-point sums instead (fixed_sum.cuh: expert_decode.cuh's
// 1-row output), and the read sets them back to zero. stack, y, y_fixed, scratch and input must be 16-byte aligned
// (cudaErrorMisalignedAddress otherwise).
cudaError_t hc_fused_read(const HcFusedRead& read, int rows, float* stack, bool pending, const float* y, float* inject,
                          float* scratch, float* input, cudaStream_t stream, unsigned long long* y_fixed = nullptr);

}  // namespace vavilov::cuda
