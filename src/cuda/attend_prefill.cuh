#pragma once
// Sparse attention of a several-row pass (prefill) on the tensor cores: the queries of a kv head's heads over a tile
// of the positions their rows chose at once, so that every key and value row staged in shared memory serves up to 64
// queries (docs/CUDA.md, "Sparse attention"). sparse_attention() (attention.cuh) hands it the passes it takes.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/attention.cuh"

namespace vavilov::cuda {

// Whether attend_prefill takes a pass of `rows` rows whose rows see fewer than launch_tokens positions: more rows than
// a verify pass (4), a head dim of 8, 16, 32, 64, 128 or 256, and a launch span whose bit set of blocks fits in shared
// memory beside the tiles (~280k positions at head dim 256 on an H200).
bool attend_prefill_takes(const AttentionShape& shape, int rows, int launch_tokens);

// Its scratch (AttendScratch: values, stats, arrival counters), the same for passes of any number of rows: a launch
// splits its query tiles' positions only while blocks × chunks stay within a few per multiprocessor.
size_t attend_prefill_value_floats(const AttentionShape& shape);
size_t attend_prefill_stat_count(const AttentionShape& shape);
size_t attend_prefill_arrival_count(const AttentionShape& shape);

// sparse_attention's contract (attention.cuh) for a pass attend_prefill_takes.
void attend_prefill(const AttentionShape& shape, const float* queries, const float* q_gate, const float* keys,
                    const float* values, const uint8_t* selected, int rows, const int64_t* first_position,
                    const AttentionBounds& bounds, const AttendScratch& scratch, float* out, cudaStream_t stream);

}  // namespace vavilov::cuda
