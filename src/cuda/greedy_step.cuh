#pragma once
// The small kernels of a fused greedy verify step (CudaSequence::greedy_step, engine/backend.h's GreedyStep): the
// accepted prefix decided on the device, the recurrent states rolled back from the recorded rows in one launch, the
// rows the MTP head continues from picked by the kept count, and each draft handed to the next chained pass. Each is a
// dependent launch (launch.cuh) that waits before it reads or writes anything, so a whole step captures as one graph
// with no host synchronisation inside.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace vavilov::cuda {

constexpr int kGreedyStepMaxRows = 4;    // the last token and up to 3 drafts (the recorded rows of a pass)
constexpr int kGreedyStepMaxDrafts = 3;  // drafts a step proposes for the next
constexpr int kGreedyStepMaxStops = 64;  // stop tokens the device compares against

// What a step leaves for the host: one download.
struct GreedyStepState {
  int32_t kept;                          // rows kept: 1 + accepted drafts
  int32_t emitted[kGreedyStepMaxRows];   // [kept]: the tokens the step emits
  int32_t drafts[kGreedyStepMaxDrafts];  // the next step's drafts
  int64_t committed;                     // the trunk's position after the step
};

// The stop tokens, uploaded when they change (once per sequence).
struct GreedyStepStops {
  int32_t count;
  int32_t ids[kGreedyStepMaxStops];
};

// One recurrent state and its copies after each recorded row (RecurrentBuffer in sequence.cpp); bytes a multiple of 4.
struct RollbackBuffer {
  void* now;
  const void* rows;
  uint64_t bytes;
};

// One block. rows_ids[0, rows): the pass's tokens [last, drafts…]; greedy[r]: the trunk's greedy id of row r;
// position[0]: the pass's first position. Keeps draft r + 1 while it equals greedy[r] and greedy[r] is no stop
// (accept_all, benchmarks only: every draft, the emitted tokens then being the drafts and the last row's id). Writes
// state (kept, emitted, committed) and head_ids[r] = the token after row r (emitted[r]; past the kept rows greedy[r],
// which only feeds head rows past the committed position). head_ids may alias rows_ids.
cudaError_t greedy_accept(const int32_t* rows_ids, const int32_t* greedy, const GreedyStepStops* stops, int rows,
                          bool accept_all, const int64_t* position, GreedyStepState* state, int32_t* head_ids,
                          cudaStream_t stream);

// Every buffer's state after recorded row kept − 1 copied back into it, in one launch; nothing when every row was
// kept (state->kept == rows).
cudaError_t greedy_rollback(const RollbackBuffer* buffers, int count, const GreedyStepState* state, int rows,
                            cudaStream_t stream);

// dst[0, floats) = src[row · row_floats …]: row = state->kept − 1 when from_kept, else 0.
cudaError_t greedy_copy_row(const float* src, int64_t row_floats, bool from_kept, const GreedyStepState* state,
                            float* dst, int64_t floats, cudaStream_t stream);

// One block. Draft j = greedy[0]: into state->drafts[j] and ids[0]; position[0] = state->committed + j (the next
// chained head pass's position).
cudaError_t greedy_take_draft(int j, const int32_t* greedy, GreedyStepState* state, int32_t* ids, int64_t* position,
                              cudaStream_t stream);

}  // namespace vavilov::cuda
