#pragma once
// The CUDA backend behind the engine's seam (engine/backend.h): the whole model on one GPU.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "engine/backend.h"

namespace vavilov::cuda {

struct DeviceModel;

// How many CUDA devices are usable (0 when there is no driver or no GPU).
int device_count();

// Whether the GPU kernels run this matrix as stored: dense F32/BF16/F16/F8_E4M3, NVFP4 with a multiple of 16 columns,
// MLX affine at 2–8 bits with whole groups of a multiple of 8 columns (every layout the loaders accept).
bool runs_on_gpu(const Matrix& m);

// Uploads the model's weights to the GPU once; every sequence the factory makes shares them and keeps its own state
// (attention caches, fp32 recurrent state and what a rollback of a recorded pass needs) on the GPU.
SequenceFactory sequence_factory(const Model& model);
// With expert_cache_mb ≥ 0 (--expert-cache-mb): the routed experts in pinned host memory behind a device cache of that
// many MB (0: none; every expert read over the bus), src/cuda/expert_cache.h. `stats_line`, when given, is set to a
// function that describes the cache's hits, traffic and occupancy so far (empty without a cache).
SequenceFactory sequence_factory(const Model& model, int64_t expert_cache_mb,
                                 std::function<std::string()>* stats_line = nullptr);
// Sequences over weights already on the GPU (synthetic weights, benchmarks).
SequenceFactory sequence_factory(std::shared_ptr<const DeviceModel> weights);

}  // namespace vavilov::cuda
