#pragma once
// A GPU sequence's state to and from the host's SequenceState (engine/state.h). The device buffers mirror the CPU
// engine's layout vector for vector (GDN conv [kernel−1, conv_dim] oldest first and recurrent [heads, dk, dv]; keys and
// values [position, kv_heads, head_dim]; raw indexer keys [position, index_dim]; pooled block keys of complete blocks
// [position / ratio, index_dim]; PLE ids and conv window [(kernel−1)·dilation, S·H] oldest first), so a transfer is
// one plain copy per vector: a state exported here continues on the CPU and the reverse.
#include <cuda_runtime.h>

#include <cstdint>

#include "engine/state.h"
#include "model/config.h"

namespace vavilov::cuda {

// One layer's state buffers on the device; null where the layer has no such part (GDN, PLE).
struct DeviceLayerStateView {
  float *gdn_conv = nullptr, *gdn_recurrent = nullptr;
  bool attention = false;  // an attention layer: caches of attention_capacity positions (null while 0)
  float *keys = nullptr, *values = nullptr, *index_keys = nullptr, *block_keys = nullptr;
  int64_t attention_capacity = 0;
  int64_t* ple_previous = nullptr;
  float* ple_conv = nullptr;
};

// Copies the layer's state at `position` tokens into `layer` (sized exactly; parts the view lacks left empty), queued
// on `stream`: the caller synchronises it before reading `layer`.
void download_layer_state(const ModelConfig& config, const DeviceLayerStateView& view, int64_t position,
                          LayerState& layer, cudaStream_t stream);
// Copies `layer` (shaped for `position` tokens: check_state_fits) into the view's buffers, which hold at least
// `position` attention rows; queued on `stream`.
void upload_layer_state(const ModelConfig& config, const DeviceLayerStateView& view, int64_t position,
                        const LayerState& layer, cudaStream_t stream);

}  // namespace vavilov::cuda
