#pragma once
// Seeded random weights made directly on the GPU for any geometry, so the real model size can be benchmarked without a
// checkpoint. Matrices are uniform in ±1/√cols (Q4: random codes with scale and bias spanning that range), norms are
// neutral, so activations stay finite through any number of layers.
#include <cstdint>
#include <memory>

#include "cuda/device_model.h"
#include "model/config.h"

namespace vavilov::cuda {

struct SyntheticOptions {
  uint64_t seed = 1;
  WeightFormat format = WeightFormat::Q4;  // Q4 or BF16 (matrices whose width is not a multiple of 64 stay BF16)
  int64_t ngram_head_rows = 100003;        // rows per n-gram head (the real table is far larger; reads are the same)
  int64_t expert_cache_bytes = -1;         // ≥ 0: routed experts in host memory behind a device cache of that size
                                           // (expert_cache.h)
};

std::unique_ptr<DeviceModel> synthetic_model(const ModelConfig& config, const SyntheticOptions& options);

}  // namespace vavilov::cuda
