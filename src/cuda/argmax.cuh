#pragma once
// Each row's greedy token on the device: the argmax of a row of logits, so that a greedy decode step downloads 4 bytes
// a row instead of the vocabulary's logits. Two dependent launches (launch.cuh): every row split over up to
// kArgmaxMaxChunks blocks, each finding its chunk's best (value, index); then one block a row combining them. The
// order (larger value first, then lower index) is total, so the result does not depend on the blocks' schedule.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace vavilov::cuda {

constexpr int kArgmaxMaxChunks = 128;

// One chunk's best: its value and index (−1: the chunk holds only NaN).
struct ArgmaxPartial {
  float value;
  int32_t index;
};

// Scratch argmax_rows needs for `rows` rows.
constexpr size_t argmax_scratch_count(int rows) { return size_t(rows) * kArgmaxMaxChunks; }

// ids[r] = the argmax of logits[r·vocab, (r+1)·vocab) by cpu::argmax's rule (cpu/argmax.h), which is
// std::max_element's: 0 when the row's first value is NaN, else the lowest index of the largest non-NaN value (every
// value NaN but the first, or all −inf: 0). scratch: argmax_scratch_count(rows) partials. Inside stream capture too.
cudaError_t argmax_rows(const float* logits, int rows, int64_t vocab, ArgmaxPartial* scratch, int32_t* ids,
                        cudaStream_t stream);

}  // namespace vavilov::cuda
