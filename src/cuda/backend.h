#pragma once
// The CUDA backend behind the engine's seam (engine/backend.h): the whole model on one GPU.
#include <memory>

#include "engine/backend.h"

namespace vavilov::cuda {

struct DeviceModel;

// How many CUDA devices are usable (0 when there is no driver or no GPU).
int device_count();

// Uploads the model's weights to the GPU once; every sequence the factory makes shares them and keeps its own state
// (attention caches, fp32 recurrent state and per-row snapshots) on the GPU.
SequenceFactory sequence_factory(const Model& model);
// Sequences over weights already on the GPU (synthetic weights, benchmarks).
SequenceFactory sequence_factory(std::shared_ptr<const DeviceModel> weights);

}  // namespace vavilov::cuda
