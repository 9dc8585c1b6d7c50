#include "cuda/state_transfer.h"

#include <vector>

#include "core/error.h"
#include "cuda/device_model.h"

namespace vavilov::cuda {
namespace {

// The sizes of a layer's vectors at `position` tokens, in elements, for the parts `view` has (0 for the others).
struct LayerSizes {
  size_t gdn_conv, gdn_recurrent, kv, index_keys, block_keys, ple_previous, ple_conv;
};

LayerSizes layer_sizes(const ModelConfig& c, const DeviceLayerStateView& v, int64_t position) {
  const size_t p = size_t(position), index = size_t(c.indexer_head_dim);
  LayerSizes s{};
  if (v.gdn_conv) s.gdn_conv = size_t(c.linear_conv_kernel_dim - 1) * size_t(c.gdn_conv_dim());
  if (v.gdn_recurrent)
    s.gdn_recurrent =
        size_t(c.linear_num_value_heads) * size_t(c.linear_key_head_dim) * size_t(c.linear_value_head_dim);
  if (v.attention) {
    s.kv = p * size_t(c.num_key_value_heads) * size_t(c.head_dim);
    s.index_keys = p * index;
    s.block_keys = size_t(position / c.indexer_compress_ratio) * index;
  }
  if (v.ple_previous) s.ple_previous = size_t(c.ngram_size - 1);
  if (v.ple_conv) s.ple_conv = size_t(c.ple_conv_kernel_size - 1) * size_t(c.ngram_size) * size_t(c.hc_hidden());
  return s;
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
  const LayerSizes s = layer_sizes(c, v, position);
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
  const LayerSizes s = layer_sizes(c, v, position);
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
