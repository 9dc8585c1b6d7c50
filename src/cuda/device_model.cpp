#include "cuda/device_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "cuda/attention.cuh"
#include "cuda/backend.h"
#include "cuda/expert_cache.h"

namespace vavilov::cuda {

void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) fail("CUDA error in {}: {}", what, cudaGetErrorString(status));
}

DeviceAllocation device_alloc(size_t bytes, const char* what) {
  void* p = nullptr;
  cuda_check(cudaMalloc(&p, std::max<size_t>(bytes, 1)), what);
  return DeviceAllocation(p);
}

namespace {

class Uploader {
 public:
  explicit Uploader(DeviceModel& model) : model_(model) {}

  const void* bytes(const void* host, size_t size) {
    if (placing_) return place(host, size);
    model_.memory.push_back(device_alloc(size, "weight upload"));
    void* device = model_.memory.back().get();
    cuda_check(cudaMemcpy(device, host, size, cudaMemcpyHostToDevice), "weight upload");
    model_.bytes += size;
    return device;
  }
  struct Part {
    const void* host;
    size_t size;
  };
  // One device allocation holding `parts` back to back.
  const void* concatenated(const std::vector<Part>& parts) {
    size_t total = 0;
    for (const Part& part : parts) total += part.size;
    model_.memory.push_back(device_alloc(total, "weight upload"));
    auto* device = static_cast<std::byte*>(model_.memory.back().get());
    size_t offset = 0;
    for (const Part& part : parts) {
      cuda_check(cudaMemcpy(device + offset, part.host, part.size, cudaMemcpyHostToDevice), "weight upload");
      offset += part.size;
    }
    model_.bytes += total;
    return device;
  }
  template <typename T>
  const T* array(const std::vector<T>& values) {
    return static_cast<const T*>(bytes(values.data(), values.size() * sizeof(T)));
  }
  const float* vector(const Vector& values) { return array(values); }

  DeviceMatrix matrix(const Matrix& m) {
    check(runs_on_gpu(m), "{}: weights of {} bits at group {} ({}, {} columns) are not supported on the GPU", m.name,
          m.bits, m.group, dtype_name(m.dtype), m.cols);
    DeviceMatrix d;
    d.rows = int(m.rows);
    d.cols = int(m.cols);
    d.tensor_scale = m.tensor_scale;
    if (m.nvfp4()) {
      d.format = WeightFormat::NVFP4;
      d.data = bytes(m.data, size_t(m.rows) * size_t(m.cols / 2));
      d.block_scales = static_cast<const uint8_t*>(bytes(m.block_scales, size_t(m.rows) * size_t(m.cols / 16)));
    } else if (m.quantized()) {
      affine(m, d);
      d.data = bytes(m.data, size_t(m.rows) * m.row_bytes());
      const size_t groups = size_t(m.rows) * size_t(m.cols / m.group);
      d.scales = static_cast<const uint16_t*>(bytes(m.scales, groups * 2));
      d.biases = static_cast<const uint16_t*>(bytes(m.biases, groups * 2));
    } else if (m.dtype == DType::BF16 || m.dtype == DType::F32 || m.dtype == DType::F8_E4M3) {
      d.format = m.dtype == DType::BF16  ? WeightFormat::BF16
                 : m.dtype == DType::F32 ? WeightFormat::F32
                                         : WeightFormat::F8;  // e4m3 bytes as stored, times tensor_scale in the kernels
      d.data = bytes(m.data, size_t(m.rows) * m.row_bytes());
    } else {  // F16: widened once
      std::vector<float> wide(size_t(m.rows * m.cols));
      for (int64_t r = 0; r < m.rows; ++r) {
        float* row = wide.data() + r * m.cols;
        to_f32(m.dtype, m.row(r), row, size_t(m.cols));
        for (int64_t i = 0; m.tensor_scale != 1.0f && i < m.cols; ++i) row[i] *= m.tensor_scale;
      }
      d.format = WeightFormat::F32;
      d.tensor_scale = 1.0f;
      d.data = array(wide);
    }
    return d;
  }

  // Format, bits and group of an MLX affine matrix: Q4/Q3/Q2 at group 64 (the fast kernels), Affine otherwise.
  static void affine(const Matrix& m, DeviceMatrix& d) {
    d.bits = m.bits;
    d.group = int(m.group);
    d.format = WeightFormat::Affine;
    if (m.group == kQuantGroup && m.bits == 4) d.format = WeightFormat::Q4;
    if (m.group == kQuantGroup && m.bits == 3) d.format = WeightFormat::Q3;
    if (m.group == kQuantGroup && m.bits == 2) d.format = WeightFormat::Q2;
  }

  DeviceGatedResidual gated_residual(const GatedResidualWeights& w) {
    DeviceGatedResidual d;
    d.norm = vector(w.norm);
    d.mix_down = matrix(w.mix_down);
    d.mix_up = matrix(w.mix_up);
    d.has_inject = !w.inject.empty();
    if (d.has_inject) d.inject = matrix(w.inject);
    return d;
  }

  DeviceFeedForward feed_forward(const FeedForwardWeights& w) { return {matrix(w.gate), matrix(w.up), matrix(w.down)}; }

  DeviceMoe moe(const MoeWeights& w) {
    DeviceMoe d;
    d.router = matrix(w.router);
    d.shared_gate = matrix(w.shared_gate);
    d.shared = feed_forward(w.shared);
    std::vector<DeviceMatrix> gate, up, down;
    if (model_.expert_cache) {
      cached_experts(w, d, gate, up, down);
    } else {
      for (const FeedForwardWeights& expert : w.experts) {
        gate.push_back(matrix(expert.gate));
        up.push_back(matrix(expert.up));
        down.push_back(matrix(expert.down));
      }
    }
    // Per-expert precision (--experts with a mixed store, MLX per-module overrides): a layer whose experts differ
    // in format is summarised as Mixed, and the expert kernels read each matrix's own format.
    auto common_format = [](std::initializer_list<const std::vector<DeviceMatrix>*> lists) {
      const DeviceMatrix& first = lists.begin()[0]->front();
      for (const std::vector<DeviceMatrix>* list : lists)
        for (const DeviceMatrix& m : *list)
          if (m.format != first.format || m.bits != first.bits || m.group != first.group) return WeightFormat::Mixed;
      return first.format;
    };
    d.gate_up_format = common_format({&gate, &up});
    d.down_format = common_format({&down});
    for (size_t e = 0; e < gate.size(); ++e)
      d.expert_bytes += matrix_bytes(gate[e]) + matrix_bytes(up[e]) + matrix_bytes(down[e]);
    d.expert_bytes /= double(gate.size());
    if (d.cache_layer >= 0) return d;
    d.expert_gate = array(gate);
    d.expert_up = array(up);
    d.expert_down = array(down);
    return d;
  }

  // The layer's routed experts in pinned host memory behind the model's expert cache: one blob per expert (its
  // matrices' parts back to back, 256-byte aligned), sized by a first pass that only measures.
  void cached_experts(const MoeWeights& w, DeviceMoe& d, std::vector<DeviceMatrix>& gate, std::vector<DeviceMatrix>& up,
                      std::vector<DeviceMatrix>& down) {
    placing_ = true;
    size_t stride = 0;
    for (const FeedForwardWeights& expert : w.experts) {
      blob_ = nullptr;
      blob_used_ = 0;
      for (const Matrix* m : {&expert.gate, &expert.up, &expert.down}) matrix(*m);
      stride = std::max(stride, aligned(blob_used_));
    }
    const std::string what = "routed experts of " + w.experts.front().gate.name;
    HostAllocation host = host_alloc(stride * w.experts.size(), what);
    for (size_t e = 0; e < w.experts.size(); ++e) {
      blob_ = static_cast<std::byte*>(host.get()) + e * stride;
      blob_used_ = 0;
      gate.push_back(matrix(w.experts[e].gate));
      up.push_back(matrix(w.experts[e].up));
      down.push_back(matrix(w.experts[e].down));
    }
    placing_ = false;
    ExpertCache& cache = *model_.expert_cache;
    d.cache_layer = cache.add_layer(std::move(host), stride, gate, up, down);
    d.expert_gate = cache.gate(d.cache_layer);
    d.expert_up = cache.up(d.cache_layer);
    d.expert_down = cache.down(d.cache_layer);
  }

  DevicePle ple(const PleWeights& w) {
    DevicePle d;
    d.table = affine_table(w);
    if (d.table.data == nullptr) d.table = dense_table(w);
    d.multipliers = array(w.multipliers);
    d.head_sizes = array(w.head_sizes);
    d.head_offsets = array(w.head_offsets);
    d.key_proj = matrix(w.key_proj);
    d.value_proj = matrix(w.value_proj);
    d.norm_key = vector(w.norm_key);
    d.norm_query = vector(w.norm_query);
    d.norm_conv = vector(w.norm_conv);
    d.conv = vector(w.conv);
    return d;
  }

  // MLX-quantized shards of one width and group (the released conversion: 4 bits at group 32) keep their codes,
  // scales and biases, each concatenated over the shards; a table stored otherwise gives an empty matrix.
  DeviceMatrix affine_table(const PleWeights& w) {
    const Matrix& first = w.table_shards.front();
    for (const Matrix& shard : w.table_shards)
      if (!shard.quantized() || shard.nvfp4() || shard.bits != first.bits || shard.group != first.group ||
          !runs_on_gpu(shard))
        return {};
    DeviceMatrix d;
    d.rows = int(w.table_rows);
    d.cols = int(w.head_width());
    affine(first, d);
    std::vector<Part> codes, scales, biases;
    for (const Matrix& shard : w.table_shards) {
      const size_t groups = size_t(shard.rows) * size_t(shard.cols / shard.group);
      codes.push_back({shard.data, size_t(shard.rows) * shard.row_bytes()});
      scales.push_back({shard.scales, groups * 2});
      biases.push_back({shard.biases, groups * 2});
    }
    d.data = concatenated(codes);
    d.scales = static_cast<const uint16_t*>(concatenated(scales));
    d.biases = static_cast<const uint16_t*>(concatenated(biases));
    return d;
  }

  // Dense BF16 shards keep their bytes; any other table format (F32, F16, F8, NVFP4) is widened to F32.
  DeviceMatrix dense_table(const PleWeights& w) {
    bool keep = true;
    for (const Matrix& shard : w.table_shards) keep = keep && !shard.quantized() && shard.dtype == DType::BF16;
    const DType dtype = keep ? DType::BF16 : DType::F32;
    const int64_t width = w.head_width();
    const size_t row_bytes = size_t(width) * dtype_size(dtype);
    std::vector<std::byte> table(size_t(w.table_rows) * row_bytes);
    if (keep) {
      size_t offset = 0;
      for (const Matrix& shard : w.table_shards) {
        std::memcpy(table.data() + offset, shard.data, size_t(shard.rows) * row_bytes);
        offset += size_t(shard.rows) * row_bytes;
      }
    } else {
      for (int64_t r = 0; r < w.table_rows; ++r)
        w.table_row(r, reinterpret_cast<float*>(table.data() + size_t(r) * row_bytes));
    }
    DeviceMatrix d;
    d.format = dtype == DType::BF16 ? WeightFormat::BF16 : WeightFormat::F32;
    d.rows = int(w.table_rows);
    d.cols = int(width);
    d.data = bytes(table.data(), table.size());
    return d;
  }

  DeviceLayer layer(const LayerWeights& w) {
    DeviceLayer d;
    d.kind = w.kind;
    d.attn_hc = gated_residual(w.attn_hc);
    d.mlp_hc = gated_residual(w.mlp_hc);
    if (w.kind == LayerKind::GatedDeltaNet) {
      const GatedDeltaNetWeights& g = w.gdn;
      d.gdn = {matrix(g.in_qkv), matrix(g.in_z),  matrix(g.in_b),    matrix(g.in_a), matrix(g.out),
               vector(g.conv),   vector(g.a_log), vector(g.dt_bias), vector(g.norm)};
    } else {
      const SparseAttentionWeights& a = w.attn;
      d.attn = {matrix(a.q),           matrix(a.k),      matrix(a.v),      matrix(a.o),
                matrix(a.index_qk),    vector(a.q_norm), vector(a.k_norm), vector(a.index_q_norm),
                vector(a.index_k_norm)};
    }
    d.moe = moe(w.moe);
    if (w.ple) d.ple = ple(*w.ple);
    return d;
  }

 private:
  static size_t aligned(size_t n) { return (n + 255) / 256 * 256; }
  // bytes() while placing experts: into the current blob (or, measuring, nowhere: offsets only).
  const void* place(const void* host, size_t size) {
    const size_t offset = aligned(blob_used_);
    blob_used_ = offset + size;
    if (!blob_) return reinterpret_cast<const void*>(offset + 256);  // measuring: never dereferenced
    std::memcpy(blob_ + offset, host, size);
    return blob_ + offset;
  }

  DeviceModel& model_;
  bool placing_ = false;
  std::byte* blob_ = nullptr;
  size_t blob_used_ = 0;
};

}  // namespace

bool runs_on_gpu(const Matrix& m) {
  if (m.nvfp4()) return m.cols % 16 == 0;
  if (m.quantized())
    return m.bits >= 2 && m.bits <= 8 && m.group % 8 == 0 && m.cols % m.group == 0 && (m.cols * m.bits) % 32 == 0;
  const bool scaled = m.dtype == DType::F8_E4M3 || m.dtype == DType::F16;  // the scale is applied (kernel, widening)
  return (m.dtype == DType::F32 || m.dtype == DType::BF16 || scaled) && (scaled || m.tensor_scale == 1.0f);
}

void check_supported(const ModelConfig& c, const std::string& name) {
  check(c.linear_key_head_dim <= 128, "{}: linear_key_head_dim {} > 128 is not supported on the GPU", name,
        c.linear_key_head_dim);
  check(c.linear_conv_kernel_dim <= 8, "{}: linear_conv_kernel_dim {} > 8 is not supported on the GPU", name,
        c.linear_conv_kernel_dim);
  check((c.ple_conv_kernel_size - 1) * c.ngram_size < 64, "{}: the PLE conv window is too long for the GPU", name);
  check(c.ngram_size <= 16, "{}: ngram_size {} > 16 is not supported on the GPU", name, c.ngram_size);
  check(c.num_experts <= 2048 && c.num_experts_per_tok <= 32, "{}: more than 2048 experts or 32 per token", name);
  check(c.indexer_head_dim <= 1024, "{}: indexer_head_dim {} > 1024 is not supported on the GPU", name,
        c.indexer_head_dim);
  check(c.head_dim <= kMaxAttentionHeadDim, "{}: head_dim {} > {} is not supported on the GPU", name, c.head_dim,
        kMaxAttentionHeadDim);
}

std::unique_ptr<DeviceModel> upload_model(const Model& model, int64_t expert_cache_bytes) {
  auto d = std::make_unique<DeviceModel>();
  const ModelConfig& c = model.config;
  check_supported(c, model.directory);
  d->config = c;
  d->name = model.directory;
  if (expert_cache_bytes >= 0) d->expert_cache = std::make_shared<ExpertCache>(expert_cache_bytes, "--expert-cache-mb");
  Uploader up(*d);
  d->embed = up.matrix(model.embed);
  const bool tied = model.lm_head.data == model.embed.data && model.lm_head.bits == model.embed.bits;
  d->lm_head = tied ? d->embed : up.matrix(model.lm_head);
  for (const LayerWeights& layer : model.layers) d->layers.push_back(up.layer(layer));
  d->final_mixer = up.gated_residual(model.final_mixer);
  if (model.mtp) {
    const MtpWeights& m = *model.mtp;
    DeviceMtp mtp;
    mtp.pre_fc_norm_embedding = up.vector(m.pre_fc_norm_embedding);
    mtp.pre_fc_norm_hidden = up.vector(m.pre_fc_norm_hidden);
    mtp.fc_embedding = up.matrix(m.fc_embedding);
    mtp.fc_hidden = up.matrix(m.fc_hidden);
    mtp.layer = up.layer(m.layer);
    mtp.final_mixer = up.gated_residual(m.final_mixer);
    d->mtp = mtp;
  }
  std::vector<float> inv_freq(size_t(c.rotary_dim / 2));
  for (size_t j = 0; j < inv_freq.size(); ++j)
    inv_freq[j] = float(1.0 / std::pow(c.rope_theta, double(2 * j) / double(c.rotary_dim)));
  d->inv_freq = up.array(inv_freq);
  if (d->expert_cache) d->expert_cache->finish();
  return d;
}

}  // namespace vavilov::cuda
