#pragma once
// The model's weights on the GPU, uploaded once from a loaded Model: dense F32/BF16/F8 matrices stay in their dtype
// (F16 becomes F32), MLX affine matrices (any width and group) keep their codes, scales and biases, NVFP4 ones their
// codes, block scales and tensor scale; the PLE table keeps BF16 or affine shards as stored; vectors become fp32.
#include <cuda_runtime.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cuda/device_matrix.h"
#include "model/weights.h"

namespace vavilov::cuda {

// Throws vavilov::Error naming `what` when a CUDA call failed.
void cuda_check(cudaError_t status, const char* what);

struct CudaFree {
  void operator()(void* p) const { cudaFree(p); }
};
using DeviceAllocation = std::unique_ptr<void, CudaFree>;
DeviceAllocation device_alloc(size_t bytes, const char* what);

struct PinnedFree {
  void operator()(void* p) const { cudaFreeHost(p); }
};
using HostAllocation = std::unique_ptr<void, PinnedFree>;
// Pinned host memory the kernels read through the same pointer (cudaHostAllocMapped); an error naming `what`.
HostAllocation host_alloc(size_t bytes, const std::string& what);

class ExpertCache;  // expert_cache.h

struct DeviceGatedResidual {
  const float* norm = nullptr;
  DeviceMatrix mix_down, mix_up, inject;
  bool has_inject = false;
};

struct DeviceGatedDeltaNet {
  DeviceMatrix in_qkv, in_z, in_b, in_a, out;
  const float *conv = nullptr, *a_log = nullptr, *dt_bias = nullptr, *norm = nullptr;
};

struct DeviceAttention {
  DeviceMatrix q, k, v, o, index_qk;
  const float *q_norm = nullptr, *k_norm = nullptr, *index_q_norm = nullptr, *index_k_norm = nullptr;
};

struct DeviceFeedForward {
  DeviceMatrix gate, up, down;
};

struct DeviceMoe {
  DeviceMatrix router, shared_gate;
  DeviceFeedForward shared;
  // Device arrays of num_experts matrices each. gate_up_format: the format all gate and up matrices share, or Mixed
  // when they differ (per-expert precision, or gate and up apart); down_format likewise for the down matrices.
  const DeviceMatrix *expert_gate = nullptr, *expert_up = nullptr, *expert_down = nullptr;
  WeightFormat gate_up_format = WeightFormat::F32, down_format = WeightFormat::F32;
  double expert_bytes = 0;  // weight bytes of one expert (gate, up, down), the mean over the layer's experts
  int cache_layer = -1;     // with an expert cache (DeviceModel::expert_cache): the layer's index there
};

struct DevicePle {
  DeviceMatrix table;  // every shard, concatenated: [table_rows, head_width]
  const int64_t *multipliers = nullptr, *head_sizes = nullptr, *head_offsets = nullptr;
  DeviceMatrix key_proj, value_proj;
  const float *norm_key = nullptr, *norm_query = nullptr, *norm_conv = nullptr, *conv = nullptr;
};

struct DeviceLayer {
  LayerKind kind = LayerKind::GatedDeltaNet;
  DeviceGatedResidual attn_hc, mlp_hc;
  DeviceGatedDeltaNet gdn;
  DeviceAttention attn;
  DeviceMoe moe;
  std::optional<DevicePle> ple;
};

struct DeviceMtp {
  const float *pre_fc_norm_embedding = nullptr, *pre_fc_norm_hidden = nullptr;
  DeviceMatrix fc_embedding, fc_hidden;
  DeviceLayer layer;
  DeviceGatedResidual final_mixer;
};

struct DeviceModel {
  ModelConfig config;
  std::string name;  // the model directory, for errors
  DeviceMatrix embed, lm_head;
  std::vector<DeviceLayer> layers;
  DeviceGatedResidual final_mixer;
  std::optional<DeviceMtp> mtp;
  const float* inv_freq = nullptr;  // RoPE inverse frequencies [rotary_dim / 2], as the CPU computes them
  std::vector<DeviceAllocation> memory;
  size_t bytes = 0;  // device memory held by the weights
  // --expert-cache-mb: the routed experts in host memory behind a bounded device cache (null: all on the device).
  std::shared_ptr<ExpertCache> expert_cache;
};

// The geometry limits the kernels were written for (ops.cu); an error naming the config field otherwise.
void check_supported(const ModelConfig& config, const std::string& name);

// Uploads every weight in its stored format (F16 widened to F32); an error naming the tensor for affine layouts the
// kernels cannot address (device_model.cpp, `affine`).
// expert_cache_bytes ≥ 0: the routed experts go to pinned host memory behind a device cache of that size
// (expert_cache.h; --expert-cache-mb).
std::unique_ptr<DeviceModel> upload_model(const Model& model, int64_t expert_cache_bytes = -1);

}  // namespace vavilov::cuda
