#pragma once
// The CUDA backend behind the engine's seam (engine/backend.h): the whole model on one GPU.
#include <memory>

#include "engine/backend.h"

namespace vavilov::cuda {

struct DeviceModel;

// How many CUDA devices are usable (0 when there is no driver or no GPU).
int device_count();

// Whether the GPU kernels run this matrix as stored: dense F32/BF16/F16/F8_E4M3, NVFP4 with a multiple of 16 columns,
// MLX affine at 2–8 bits with whole groups of a multiple of 8 columns (every layout the loaders accept).
bool runs_on_gpu(const Matrix& m);

// Uploads the model's weights to the GPU once; every sequence the factory makes shares them and keeps its own state
// (attention caches, fp32 recurrent state and per-row snapshots) on the GPU.
SequenceFactory sequence_factory(const Model& model);
// Sequences over weights already on the GPU (synthetic weights, benchmarks).
SequenceFactory sequence_factory(std::shared_ptr<const DeviceModel> weights);

}  // namespace vavilov::cuda
