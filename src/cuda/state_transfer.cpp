#include "cuda/state_transfer.h"

#include <vector>

#include "core/error.h"
#include "cuda/device_model.h"

namespace vavilov::cuda {
namespace {

// The sizes of a layer's vectors at `position` tokens, for the parts `view` has.
LayerStateSizes layer_sizes(const ModelConfig& c, const DeviceLayerStateView& v, int64_t position) {
  return layer_state_sizes(c, v.gdn_recurrent != nullptr, v.attention, v.ple_conv != nullptr, position);
}

template <typename T>
void download(const T* device, std::vector<T>& host, size_t count, cudaStream_t stream) {
  host.resize(count);
  if (count)
    cuda_check(cudaMemcpyAsync(host.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost, stream), "state export");
}

template <typename T>
void upload(T* device, const std::vector<T>& host, cudaStream_t stream) {
  if (!host.empty())
    cuda_check(cudaMemcpyAsync(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice, stream),
               "state import");
}

}  // namespace

void download_layer_state(const ModelConfig& c, const DeviceLayerStateView& v, int64_t position, LayerState& layer,
                          cudaStream_t stream) {
  check(!v.attention || position <= v.attention_capacity, "state export: {} positions in a cache of {}", position,
        v.attention_capacity);
  const LayerStateSizes s = layer_sizes(c, v, position);
  download(v.gdn_conv, layer.gdn.conv, s.gdn_conv, stream);
  download(v.gdn_recurrent, layer.gdn.recurrent, s.gdn_recurrent, stream);
  download(v.keys, layer.attn.keys, s.kv, stream);
  download(v.values, layer.attn.values, s.kv, stream);
  download(v.index_keys, layer.attn.index_keys, s.index_keys, stream);
  download(v.block_keys, layer.attn.block_keys, s.block_keys, stream);
  download(v.ple_previous, layer.ple.previous_ids, s.ple_previous, stream);
  download(v.ple_conv, layer.ple.conv_rows, s.ple_conv, stream);
}

void upload_layer_state(const ModelConfig& c, const DeviceLayerStateView& v, int64_t position, const LayerState& layer,
                        cudaStream_t stream) {
  check(!v.attention || position <= v.attention_capacity, "state import: {} positions in a cache of {}", position,
        v.attention_capacity);
  const LayerStateSizes s = layer_sizes(c, v, position);
  // check_state_fits has shaped the layer for this model; these guard the copies' bounds all the same.
  check(layer.gdn.conv.size() == s.gdn_conv && layer.gdn.recurrent.size() == s.gdn_recurrent &&
            layer.attn.keys.size() == s.kv && layer.attn.values.size() == s.kv &&
            layer.attn.index_keys.size() == s.index_keys && layer.attn.block_keys.size() == s.block_keys &&
            layer.ple.previous_ids.size() == s.ple_previous && layer.ple.conv_rows.size() == s.ple_conv,
        "state import: a layer's vectors do not match the GPU layer's buffers");
  upload(v.gdn_conv, layer.gdn.conv, stream);
  upload(v.gdn_recurrent, layer.gdn.recurrent, stream);
  upload(v.keys, layer.attn.keys, stream);
  upload(v.values, layer.attn.values, stream);
  upload(v.index_keys, layer.attn.index_keys, stream);
  upload(v.block_keys, layer.attn.block_keys, stream);
  upload(v.ple_previous, layer.ple.previous_ids, stream);
  upload(v.ple_conv, layer.ple.conv_rows, stream);
}

}  // namespace vavilov::cuda
