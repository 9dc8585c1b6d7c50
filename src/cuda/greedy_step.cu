#include <algorithm>

#include "cuda/greedy_step.cuh"
#include "cuda/launch.cuh"

namespace vavilov::cuda {

namespace {

constexpr int kRollbackThreads = 256;
constexpr int kRollbackBlocksPerBuffer = 32;
constexpr int kCopyThreads = 256;

__global__ void greedy_accept_kernel(const int32_t* rows_ids, const int32_t* greedy, const GreedyStepStops* stops,
                                     int rows, bool accept_all, const int64_t* position, GreedyStepState* state,
                                     int32_t* head_ids) {
  wait_for_producers();
  allow_dependents();
  if (threadIdx.x != 0) return;
  int32_t tokens[kGreedyStepMaxRows];
  for (int r = 0; r < rows; ++r) tokens[r] = rows_ids[r];
  int kept = 0;
  for (int r = 0; r < rows; ++r) {
    const bool has_draft = r + 1 < rows;
    const int32_t token = accept_all && has_draft ? tokens[r + 1] : greedy[r];
    state->emitted[r] = token;
    kept = r + 1;
    if (accept_all) continue;
    bool stop = false;
    for (int s = 0; s < stops->count; ++s) stop = stop || stops->ids[s] == token;
    if (!has_draft || token != tokens[r + 1] || stop) break;
  }
  for (int r = 0; r < rows; ++r) head_ids[r] = r < kept ? state->emitted[r] : greedy[r];
  for (int j = 0; j < kGreedyStepMaxDrafts; ++j) state->drafts[j] = 0;
  state->kept = kept;
  state->committed = position[0] + kept;
}

// grid (kRollbackBlocksPerBuffer, buffers): each block column copies one buffer, 16 bytes at a time where its size
// allows.
__global__ void greedy_rollback_kernel(const RollbackBuffer* buffers, const GreedyStepState* state, int rows) {
  wait_for_producers();
  allow_dependents();
  const int kept = state->kept;
  if (kept == rows) return;
  const RollbackBuffer b = buffers[blockIdx.y];
  const char* from = static_cast<const char*>(b.rows) + uint64_t(kept - 1) * b.bytes;
  char* to = static_cast<char*>(b.now);
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x, first = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool vectors =
      b.bytes % 16 == 0 && (reinterpret_cast<uintptr_t>(from) | reinterpret_cast<uintptr_t>(to)) % 16 == 0;
  if (vectors) {
    const uint64_t count = b.bytes / 16;
    for (uint64_t i = first; i < count; i += stride)
      reinterpret_cast<uint4*>(to)[i] = reinterpret_cast<const uint4*>(from)[i];
  } else {
    const uint64_t count = b.bytes / 4;
    for (uint64_t i = first; i < count; i += stride)
      reinterpret_cast<uint32_t*>(to)[i] = reinterpret_cast<const uint32_t*>(from)[i];
  }
}

__global__ void greedy_copy_row_kernel(const float* src, int64_t row_floats, bool from_kept,
                                       const GreedyStepState* state, float* dst, int64_t floats) {
  wait_for_producers();
  allow_dependents();
  const float* row = src + (from_kept ? int64_t(state->kept - 1) * row_floats : 0);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < floats; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = row[i];
}

__global__ void greedy_take_draft_kernel(int j, const int32_t* greedy, GreedyStepState* state, int32_t* ids,
                                         int64_t* position) {
  wait_for_producers();
  allow_dependents();
  if (threadIdx.x != 0) return;
  const int32_t draft = greedy[0];
  state->drafts[j] = draft;
  ids[0] = draft;
  position[0] = state->committed + j;
}

}  // namespace

cudaError_t greedy_accept(const int32_t* rows_ids, const int32_t* greedy, const GreedyStepStops* stops, int rows,
                          bool accept_all, const int64_t* position, GreedyStepState* state, int32_t* head_ids,
                          cudaStream_t stream) {
  if (rows < 1 || rows > kGreedyStepMaxRows) return cudaErrorInvalidValue;
  return launch_dependent(greedy_accept_kernel, dim3(1), dim3(32), 0, stream, rows_ids, greedy, stops, rows, accept_all,
                          position, state, head_ids);
}

cudaError_t greedy_rollback(const RollbackBuffer* buffers, int count, const GreedyStepState* state, int rows,
                            cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  return launch_dependent(greedy_rollback_kernel, dim3(kRollbackBlocksPerBuffer, unsigned(count)),
                          dim3(kRollbackThreads), 0, stream, buffers, state, rows);
}

cudaError_t greedy_copy_row(const float* src, int64_t row_floats, bool from_kept, const GreedyStepState* state,
                            float* dst, int64_t floats, cudaStream_t stream) {
  const int64_t blocks = std::min<int64_t>((floats + kCopyThreads * 4 - 1) / (kCopyThreads * 4), 264);
  return launch_dependent(greedy_copy_row_kernel, dim3(unsigned(std::max<int64_t>(blocks, 1))), dim3(kCopyThreads), 0,
                          stream, src, row_floats, from_kept, state, dst, floats);
}

cudaError_t greedy_take_draft(int j, const int32_t* greedy, GreedyStepState* state, int32_t* ids, int64_t* position,
                              cudaStream_t stream) {
  return launch_dependent(greedy_take_draft_kernel, dim3(1), dim3(32), 0, stream, j, greedy, state, ids, position);
}

}  // namespace vavilov::cuda
