#include "cuda/synthetic.h"

#include <cmath>

#include "core/dtype.h"
#include "core/error.h"
#include "cuda/expert_cache.h"
#include "cuda/random_fill.cuh"

namespace vavilov::cuda {

namespace {

constexpr cudaStream_t kStream = nullptr;

class Builder {
 public:
  Builder(DeviceModel& model, const SyntheticOptions& options) : model_(model), options_(options) {}

  void* allocate(size_t bytes) {
    model_.memory.push_back(device_alloc(bytes, "synthetic weights"));
    model_.bytes += bytes;
    return model_.memory.back().get();
  }

  // `count` matrices [rows, cols] in one allocation.
  std::vector<DeviceMatrix> matrices(int count, int64_t rows, int64_t cols) {
    const bool q4 = options_.format == WeightFormat::Q4 && cols % 64 == 0;
    const float range = 1.0f / std::sqrt(float(cols));
    const size_t n = size_t(count) * size_t(rows) * size_t(cols);
    std::vector<DeviceMatrix> out(static_cast<size_t>(count));
    if (q4) {
      auto* codes = static_cast<uint32_t*>(allocate(n / 2));
      auto* scales = static_cast<uint16_t*>(allocate(n / 64 * 2));
      auto* biases = static_cast<uint16_t*>(allocate(n / 64 * 2));
      fill_words(codes, n / 8, options_.seed, next_stream_++, kStream);
      fill_constant_bf16(scales, n / 64, f32_to_bf16(2.0f * range / 15.0f), kStream);
      fill_constant_bf16(biases, n / 64, f32_to_bf16(-range), kStream);
      for (int e = 0; e < count; ++e) {
        const size_t first = size_t(e) * size_t(rows) * size_t(cols);
        out[size_t(e)] = {WeightFormat::Q4,  int(rows),           int(cols),
                          codes + first / 8, scales + first / 64, biases + first / 64};
      }
    } else {
      auto* values = static_cast<uint16_t*>(allocate(n * 2));
      fill_uniform_bf16(values, n, options_.seed, next_stream_++, -range, range, kStream);
      for (int e = 0; e < count; ++e)
        out[size_t(e)] = {WeightFormat::BF16, int(rows), int(cols), values + size_t(e) * size_t(rows) * size_t(cols)};
    }
    return out;
  }
  DeviceMatrix matrix(int64_t rows, int64_t cols) { return matrices(1, rows, cols).front(); }

  const float* constant(int64_t n, float value) {
    auto* p = static_cast<float*>(allocate(size_t(n) * 4));
    fill_constant(p, size_t(n), value, kStream);
    return p;
  }
  const float* uniform(int64_t n, float lo, float hi) {
    auto* p = static_cast<float*>(allocate(size_t(n) * 4));
    fill_uniform(p, size_t(n), options_.seed, next_stream_++, lo, hi, kStream);
    return p;
  }
  template <typename T>
  const T* array(const std::vector<T>& values) {
    void* p = allocate(values.size() * sizeof(T));
    cuda_check(cudaMemcpy(p, values.data(), values.size() * sizeof(T), cudaMemcpyHostToDevice), "synthetic weights");
    return static_cast<const T*>(p);
  }

  DeviceGatedResidual gated_residual(const ModelConfig& c, bool inject) {
    DeviceGatedResidual d;
    d.norm = constant(c.hc_hidden(), 0.0f);  // zero-centred: a factor of 1
    d.mix_down = matrix(c.hc_lowrank, c.hc_hidden());
    d.mix_up = matrix(c.hc_hidden(), c.hc_lowrank);
    d.has_inject = inject;
    if (inject) d.inject = matrix(c.hc_count, c.hc_hidden());
    return d;
  }

  DeviceMoe moe(const ModelConfig& c) {
    DeviceMoe d;
    const int64_t h = c.hidden_size, inner = c.moe_intermediate_size, shared = c.shared_expert_intermediate_size;
    d.router = matrix(c.num_experts, h);
    d.shared_gate = matrix(1, h);
    d.shared = {matrix(shared, h), matrix(shared, h), matrix(h, shared)};
    const size_t allocations = model_.memory.size(), bytes = model_.bytes;
    std::vector<DeviceMatrix> gate = matrices(c.num_experts, inner, h), up = matrices(c.num_experts, inner, h);
    std::vector<DeviceMatrix> down = matrices(c.num_experts, h, inner);
    d.gate_up_format = gate.front().format;
    d.down_format = down.front().format;
    d.expert_bytes = 2 * matrix_bytes(gate.front()) + matrix_bytes(down.front());
    if (model_.expert_cache) {
      // The same values, moved to pinned host memory (one blob per expert) and their device arrays freed.
      HostAllocation host = to_host_blobs({&gate, &up, &down});
      const size_t stride = host_stride_;
      model_.memory.resize(allocations);
      model_.bytes = bytes;
      ExpertCache& cache = *model_.expert_cache;
      d.cache_layer = cache.add_layer(std::move(host), stride, gate, up, down);
      d.expert_gate = cache.gate(d.cache_layer);
      d.expert_up = cache.up(d.cache_layer);
      d.expert_down = cache.down(d.cache_layer);
      return d;
    }
    d.expert_gate = array(gate);
    d.expert_up = array(up);
    d.expert_down = array(down);
    return d;
  }

  // Expert e's matrices of every list copied into blob e of one pinned host allocation (parts 256-byte aligned; each
  // part of all experts is one strided copy, as matrices() keeps a part's experts back to back); the lists then point
  // there. host_stride_: the blob size.
  HostAllocation to_host_blobs(std::initializer_list<std::vector<DeviceMatrix>*> lists) {
    const auto aligned = [](size_t n) { return (n + 255) / 256 * 256; };
    struct Part {
      const void** field;  // in expert 0's matrix
      size_t bytes, offset;
    };
    std::vector<std::pair<std::vector<DeviceMatrix>*, std::vector<Part>>> layout;
    size_t stride = 0;
    for (std::vector<DeviceMatrix>* list : lists) {
      DeviceMatrix& m = list->front();
      const MatrixParts p = matrix_parts(m);
      std::vector<Part> parts;
      const std::pair<const void**, size_t> fields[] = {
          {&m.data, p.data},
          {reinterpret_cast<const void**>(&m.scales), p.scales},
          {reinterpret_cast<const void**>(&m.biases), p.biases},
          {reinterpret_cast<const void**>(&m.block_scales), p.block_scales}};
      for (const auto& [field, size] : fields)
        if (size) {
          parts.push_back({field, size, stride});
          stride = aligned(stride + size);
        }
      layout.emplace_back(list, parts);
    }
    const size_t count = lists.begin()[0]->size();
    HostAllocation host = host_alloc(stride * count, "synthetic routed experts");
    auto* base = static_cast<std::byte*>(host.get());
    for (auto& [list, parts] : layout) {
      for (const Part& part : parts)
        cuda_check(cudaMemcpy2D(base + part.offset, stride, *part.field, part.bytes, part.bytes, count,
                                cudaMemcpyDeviceToHost),
                   "synthetic routed experts");
      DeviceMatrix& first = list->front();
      for (size_t e = 0; e < count; ++e) {
        DeviceMatrix m = first;
        std::byte* blob = base + e * stride;
        for (const Part& part : parts) {
          const auto field_offset = reinterpret_cast<std::byte*>(part.field) - reinterpret_cast<std::byte*>(&first);
          *reinterpret_cast<const void**>(reinterpret_cast<std::byte*>(&m) + field_offset) = blob + part.offset;
        }
        (*list)[e] = m;
      }
    }
    host_stride_ = stride;
    return host;
  }

  DevicePle ple(const ModelConfig& c) {
    DevicePle d;
    const int heads = c.ngram_heads();
    const int64_t width = c.ple_embed_dim / heads, rows = options_.ngram_head_rows * heads;
    auto* table = static_cast<uint16_t*>(allocate(size_t(rows * width) * 2));
    fill_uniform_bf16(table, size_t(rows * width), options_.seed, next_stream_++, -0.1f, 0.1f, kStream);
    d.table = {WeightFormat::BF16, int(rows), int(width), table};
    std::vector<int64_t> multipliers(static_cast<size_t>(c.ngram_size)), sizes(static_cast<size_t>(heads));
    std::vector<int64_t> offsets(static_cast<size_t>(heads));
    uint64_t state = options_.seed;
    for (auto& m : multipliers) m = int64_t(next_random(state) | 1u);
    for (int h = 0; h < heads; ++h) {
      sizes[size_t(h)] = options_.ngram_head_rows;
      offsets[size_t(h)] = h * options_.ngram_head_rows;
    }
    d.multipliers = array(multipliers);
    d.head_sizes = array(sizes);
    d.head_offsets = array(offsets);
    d.key_proj = matrix(c.hc_hidden(), c.ple_embed_dim);
    d.value_proj = matrix(c.hidden_size, c.ple_embed_dim);
    d.norm_key = constant(c.hc_hidden(), 0.0f);
    d.norm_query = constant(c.hc_hidden(), 0.0f);
    d.norm_conv = constant(c.hc_hidden(), 0.0f);
    d.conv = uniform(c.hc_hidden() * c.ple_conv_kernel_size, -0.5f, 0.5f);
    return d;
  }

  DeviceLayer layer(const ModelConfig& c, LayerKind kind, bool has_ple) {
    DeviceLayer d;
    const int64_t h = c.hidden_size;
    d.kind = kind;
    d.attn_hc = gated_residual(c, true);
    d.mlp_hc = gated_residual(c, true);
    if (kind == LayerKind::GatedDeltaNet) {
      const int heads = c.linear_num_value_heads;
      d.gdn = {matrix(c.gdn_conv_dim(), h),
               matrix(c.gdn_value_dim(), h),
               matrix(heads, h),
               matrix(heads, h),
               matrix(h, c.gdn_value_dim()),
               uniform(c.gdn_conv_dim() * c.linear_conv_kernel_dim, -0.5f, 0.5f),
               constant(heads, 0.0f),
               constant(heads, 0.0f),
               constant(c.linear_value_head_dim, 1.0f)};
    } else {
      const int64_t hd = c.head_dim, ihd = c.indexer_head_dim;
      d.attn = {matrix(int64_t(c.num_attention_heads) * hd * 2, h),
                matrix(int64_t(c.num_key_value_heads) * hd, h),
                matrix(int64_t(c.num_key_value_heads) * hd, h),
                matrix(h, int64_t(c.num_attention_heads) * hd),
                matrix(int64_t(c.indexer_n_heads + 1) * ihd, h),
                constant(hd, 0.0f),
                constant(hd, 0.0f),
                constant(ihd, 0.0f),
                constant(ihd, 0.0f)};
    }
    d.moe = moe(c);
    if (has_ple) d.ple = ple(c);
    return d;
  }

 private:
  static uint64_t next_random(uint64_t& state) {  // splitmix64
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }

  DeviceModel& model_;
  SyntheticOptions options_;
  uint64_t next_stream_ = 1;
  size_t host_stride_ = 0;
};

}  // namespace

std::unique_ptr<DeviceModel> synthetic_model(const ModelConfig& c, const SyntheticOptions& options) {
  check(options.format == WeightFormat::Q4 || options.format == WeightFormat::BF16, "synthetic weights are Q4 or BF16");
  auto d = std::make_unique<DeviceModel>();
  d->config = c;
  d->name = "synthetic";
  if (options.expert_cache_bytes >= 0)
    d->expert_cache = std::make_shared<ExpertCache>(options.expert_cache_bytes, "--expert-cache-mb");
  Builder build(*d, options);
  d->embed = build.matrix(c.vocab_size, c.hidden_size);
  d->lm_head = c.tie_word_embeddings ? d->embed : build.matrix(c.vocab_size, c.hidden_size);
  for (int i = 0; i < c.num_layers; ++i)
    d->layers.push_back(build.layer(c, c.layer_kinds[size_t(i)], c.is_ple_layer(i)));
  d->final_mixer = build.gated_residual(c, false);
  if (c.mtp_num_layers > 0) {
    DeviceMtp mtp;
    mtp.pre_fc_norm_embedding = build.constant(c.hidden_size, 0.0f);
    mtp.pre_fc_norm_hidden = build.constant(c.hc_hidden(), 0.0f);
    mtp.fc_embedding = build.matrix(c.hidden_size, c.hidden_size);
    mtp.fc_hidden = build.matrix(c.hidden_size, c.hidden_size);
    mtp.layer = build.layer(c, LayerKind::SparseAttention, false);
    mtp.final_mixer = build.gated_residual(c, false);
    d->mtp = mtp;
  }
  std::vector<float> inv_freq(size_t(c.rotary_dim / 2));
  for (size_t j = 0; j < inv_freq.size(); ++j)
    inv_freq[j] = float(1.0 / std::pow(c.rope_theta, double(2 * j) / double(c.rotary_dim)));
  d->inv_freq = build.array(inv_freq);
  cuda_check(cudaDeviceSynchronize(), "synthetic weights");
  if (d->expert_cache) d->expert_cache->finish();
  return d;
}

}  // namespace vavilov::cuda
