#include "cuda/device_model.h"

#include <cmath>
#include <cstring>

#include "core/error.h"

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
    model_.memory.push_back(device_alloc(size, "weight upload"));
    void* device = model_.memory.back().get();
    cuda_check(cudaMemcpy(device, host, size, cudaMemcpyHostToDevice), "weight upload");
    model_.bytes += size;
    return device;
  }
  template <typename T>
  const T* array(const std::vector<T>& values) {
    return static_cast<const T*>(bytes(values.data(), values.size() * sizeof(T)));
  }
  const float* vector(const Vector& values) { return array(values); }

  DeviceMatrix matrix(const Matrix& m) {
    DeviceMatrix d;
    d.rows = int(m.rows);
    d.cols = int(m.cols);
    if (m.quantized()) {
      check(m.bits == 4, "{}: {}-bit weights are not supported on the GPU (use --quantize q4 or none)", m.name, m.bits);
      d.format = WeightFormat::Q4;
      d.data = bytes(m.data, size_t(m.rows) * m.row_bytes());
      const size_t groups = size_t(m.rows) * size_t(m.cols / kQuantGroup);
      d.scales = static_cast<const uint16_t*>(bytes(m.scales, groups * 2));
      d.biases = static_cast<const uint16_t*>(bytes(m.biases, groups * 2));
    } else if (m.dtype == DType::BF16 || m.dtype == DType::F32) {
      d.format = m.dtype == DType::BF16 ? WeightFormat::BF16 : WeightFormat::F32;
      d.data = bytes(m.data, size_t(m.rows) * m.row_bytes());
    } else {  // F16, F8: widened once
      std::vector<float> wide(size_t(m.rows * m.cols));
      for (int64_t r = 0; r < m.rows; ++r) to_f32(m.dtype, m.row(r), wide.data() + r * m.cols, size_t(m.cols));
      d.format = WeightFormat::F32;
      d.data = array(wide);
    }
    return d;
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
    for (const FeedForwardWeights& expert : w.experts) {
      gate.push_back(matrix(expert.gate));
      up.push_back(matrix(expert.up));
      down.push_back(matrix(expert.down));
    }
    auto same_format = [](const std::vector<DeviceMatrix>& all, const std::vector<DeviceMatrix>& other) {
      for (const DeviceMatrix& m : all)
        if (m.format != all.front().format) return false;
      for (const DeviceMatrix& m : other)
        if (m.format != all.front().format) return false;
      return true;
    };
    check(same_format(gate, up) && same_format(down, {}), "{}: experts of one layer differ in weight format",
          w.router.name);
    d.gate_up_format = gate.front().format;
    d.down_format = down.front().format;
    d.expert_gate = array(gate);
    d.expert_up = array(up);
    d.expert_down = array(down);
    return d;
  }

  DevicePle ple(const PleWeights& w) {
    DevicePle d;
    // Dense BF16 shards keep their bytes; any other table format (F32, F16, F8, MLX-quantized) is widened to F32.
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
    d.table.format = dtype == DType::BF16 ? WeightFormat::BF16 : WeightFormat::F32;
    d.table.rows = int(w.table_rows);
    d.table.cols = int(width);
    d.table.data = bytes(table.data(), table.size());
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
  DeviceModel& model_;
};

}  // namespace

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
  check(c.head_dim <= 1024, "{}: head_dim {} > 1024 is not supported on the GPU", name, c.head_dim);
}

std::unique_ptr<DeviceModel> upload_model(const Model& model) {
  auto d = std::make_unique<DeviceModel>();
  const ModelConfig& c = model.config;
  check_supported(c, model.directory);
  d->config = c;
  d->name = model.directory;
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
  return d;
}

}  // namespace vavilov::cuda
