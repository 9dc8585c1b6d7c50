#pragma once
// The expert cache's two kernels (expert_cache.cu): counting a pass's picks, and writing array entries in 8-byte words.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/device_matrix.h"

namespace vavilov::cuda {

// uses[id] += 1 for each of the `count` picks; reads[0] += the distinct experts among them, reads[1] += those whose
// gate entry points into [slots_begin, slots_end) (read from a device copy). A dependent launch (wait, then trigger).
cudaError_t count_expert_use(const int* ids, int count, int experts, uint32_t* uses, unsigned long long* reads,
                             const DeviceMatrix* gate, const void* slots_begin, const void* slots_end,
                             cudaStream_t stream);

struct ExpertEntryUpdate {
  DeviceMatrix* target;
  DeviceMatrix value;
};
// *updates[i].target = updates[i].value, each 8-byte word in one store (readers running meanwhile see every word
// either old or new). `updates` may be mapped host memory.
cudaError_t write_expert_entries(const ExpertEntryUpdate* updates, int count, cudaStream_t stream);

}  // namespace vavilov::cuda
