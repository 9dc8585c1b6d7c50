#include "model/weights.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "io/packed_store.h"
#include "model/mlx_quantization.h"
#include "model/packed_model.h"
#include "model/quantize.h"

namespace vavilov {

std::vector<std::span<const std::byte>> Matrix::storage() const {
  std::vector<std::span<const std::byte>> ranges{{data, size_t(rows) * row_bytes()}};
  if (nvfp4()) {
    ranges.push_back({reinterpret_cast<const std::byte*>(block_scales), size_t(rows) * size_t(cols / group)});
  } else if (quantized()) {
    const size_t group_bytes = size_t(rows) * size_t(cols / group) * sizeof(uint16_t);
    ranges.push_back({reinterpret_cast<const std::byte*>(scales), group_bytes});
    ranges.push_back({reinterpret_cast<const std::byte*>(biases), group_bytes});
  }
  return ranges;
}

Matrix Matrix::slice_rows(int64_t begin, int64_t count, std::string slice_name) const {
  Matrix slice = *this;
  slice.name = std::move(slice_name);
  slice.rows = count;
  slice.data = row(begin);
  if (nvfp4()) {
    slice.block_scales += begin * (cols / group);
  } else if (quantized()) {
    slice.scales += begin * (cols / group);
    slice.biases += begin * (cols / group);
  }
  return slice;
}

void PleWeights::table_row(int64_t row, float* out) const {
  auto after = std::upper_bound(shard_first_row.begin(), shard_first_row.end(), row);
  size_t shard = size_t(after - shard_first_row.begin()) - 1;
  const Matrix& m = table_shards[shard];
  if (m.quantized())
    dequantize_row(m, row - shard_first_row[shard], out);
  else
    to_f32(m.dtype, m.row(row - shard_first_row[shard]), out, size_t(m.cols));
}

namespace {

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// Reads tensors of one checkpoint under a key prefix, checking each against the shape the config implies.
class Reader {
 public:
  Reader(const TensorStore& store, std::string prefix, const MlxQuantization* mlx = nullptr,
         bool routed_experts = true)
      : store_(store), prefix_(std::move(prefix)), mlx_(mlx), routed_experts_(routed_experts) {}

  const TensorView& tensor(const std::string& name, const std::vector<int64_t>& shape, bool float_data = true) const {
    const TensorView& view = store_.get(prefix_ + name);
    check(!float_data || is_float(view.dtype), "{}: tensor {}: dtype {} is not a float type", view.file, view.name,
          dtype_name(view.dtype));
    check(view.shape == shape, "{}: tensor {}: expected shape {}, got {}", view.file, view.name, shape_string(shape),
          view.shape_string());
    return view;
  }

  // A weight of logical shape [rows, cols] (or [..., rows, cols], stacked): dense, or MLX-quantized.
  Matrix matrix(const std::string& name, const std::vector<int64_t>& shape) const {
    if (has_modelopt_scale(name) && store_.get(prefix_ + name).dtype == DType::U8) return nvfp4_matrix(name, shape);
    if (is_mlx_quantized(name)) return mlx_matrix(name, shape);
    const TensorView& view = tensor(name, shape);
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
    Matrix m{view.name, view.dtype, rows, shape.back(), view.data};
    if (view.dtype == DType::F8_E4M3 && has_modelopt_scale(name))
      m.tensor_scale = modelopt_scalar(name, ".weight_scale");
    return m;
  }
  Matrix matrix(const std::string& name, int64_t rows, int64_t cols) const { return matrix(name, {rows, cols}); }

  Vector vector(const std::string& name, const std::vector<int64_t>& shape) const {
    const TensorView& view = tensor(name, shape);
    Vector out(size_t(view.numel()));
    to_f32(view.dtype, view.data, out.data(), out.size());
    return out;
  }

  // Depthwise conv taps [channels, 1, kernel] as HF saves them, or [channels, kernel, 1] as MLX conversions move
  // them (the same bytes either way).
  Vector conv_taps(const std::string& name, int64_t channels, int64_t kernel) const {
    if (has(name) && store_.get(prefix_ + name).shape == std::vector<int64_t>{channels, kernel, 1})
      return vector(name, {channels, kernel, 1});
    return vector(name, {channels, 1, kernel});
  }

  std::vector<int64_t> int64s(const std::string& name, int64_t n) const {
    const TensorView& view = tensor(name, {n}, false);
    check(view.dtype == DType::I64, "{}: tensor {}: expected dtype I64, got {}", view.file, view.name,
          dtype_name(view.dtype));
    std::vector<int64_t> out(static_cast<size_t>(n));
    std::memcpy(out.data(), view.data, size_t(n) * 8);
    return out;
  }

  bool has(const std::string& name) const { return store_.contains(prefix_ + name); }
  Reader sub(const std::string& name) const { return Reader(store_, prefix_ + name, mlx_, routed_experts_); }
  // False when the routed experts come from elsewhere (a packed store's expert records).
  bool routed_experts() const { return routed_experts_; }
  const TensorStore& store() const { return store_; }
  const std::string& prefix() const { return prefix_; }

  // MLX packs a quantized module's weight as uint32 codes beside `.scales` and `.biases`.
  bool is_mlx_quantized(const std::string& name) const {
    const TensorView* view = store_.find(prefix_ + name);
    return view != nullptr && (view->dtype == DType::U32 || store_.contains(prefix_ + module_of(name) + ".scales"));
  }

 private:
  // ModelOpt exports put a module's scales beside its weight: `.weight_scale` (NVFP4 block scales, or FP8's
  // per-tensor scale) and, for NVFP4, `.weight_scale_2`.
  bool has_modelopt_scale(const std::string& name) const {
    return store_.contains(prefix_ + name) && store_.contains(prefix_ + module_of(name) + ".weight_scale");
  }

  float modelopt_scalar(const std::string& name, const char* suffix) const {
    const std::string scale_name = prefix_ + module_of(name) + suffix;
    const TensorView* view = store_.find(scale_name);
    check(view != nullptr, "{}: missing tensor {} (the ModelOpt-quantized weight {}{} needs it)", store_.directory(),
          scale_name, prefix_, name);
    check(view->dtype == DType::F32 && view->numel() == 1, "{}: tensor {}: expected one F32 value, got {} {}",
          view->file, view->name, dtype_name(view->dtype), view->shape_string());
    float value;
    std::memcpy(&value, view->data, 4);
    check(std::isfinite(value) && value > 0, "{}: tensor {}: scale {} is not a positive number", view->file, view->name,
          value);
    return value;
  }

  // An NVFP4 weight of logical shape [..., rows, cols]: `.weight` U8 [..., rows, cols/2], `.weight_scale`
  // F8_E4M3 [..., rows, cols/16], `.weight_scale_2` F32 (one value).
  Matrix nvfp4_matrix(const std::string& name, const std::vector<int64_t>& shape) const {
    constexpr int64_t kBlock = 16;
    const TensorView& codes = store_.get(prefix_ + name);
    const int64_t cols = shape.back();
    check(cols % kBlock == 0, "{}: tensor {}: {} input columns do not split into NVFP4 blocks of {}", codes.file,
          codes.name, cols, kBlock);
    std::vector<int64_t> packed = shape, grouped = shape;
    packed.back() = cols / 2;
    grouped.back() = cols / kBlock;
    check(codes.shape == packed, "{}: tensor {}: expected shape {} (two e2m1 codes a byte), got {}", codes.file,
          codes.name, shape_string(packed), codes.shape_string());
    const TensorView& scales = store_.get(prefix_ + module_of(name) + ".weight_scale");
    check(scales.dtype == DType::F8_E4M3, "{}: tensor {}: expected F8_E4M3 block scales, got {}", scales.file,
          scales.name, dtype_name(scales.dtype));
    check(scales.shape == grouped, "{}: tensor {}: expected shape {} (one scale per {} columns), got {}", scales.file,
          scales.name, shape_string(grouped), kBlock, scales.shape_string());
    Matrix m{codes.name, DType::BF16, 1, cols, codes.data, 4};
    for (size_t i = 0; i + 1 < shape.size(); ++i) m.rows *= shape[i];
    m.group = kBlock;
    m.block_scales = reinterpret_cast<const uint8_t*>(scales.data);
    m.tensor_scale = modelopt_scalar(name, ".weight_scale_2");
    return m;
  }

  static std::string module_of(const std::string& name) {
    const std::string suffix = ".weight";
    bool has_suffix =
        name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
    return has_suffix ? name.substr(0, name.size() - suffix.size()) : name;
  }

  // An MLX affine-quantized weight of logical shape [..., rows, cols]: `.weight` uint32 [..., rows, cols·bits/32],
  // `.scales` and `.biases` bf16 [..., rows, cols/group], bits and group from config.json's quantization section.
  Matrix mlx_matrix(const std::string& name, const std::vector<int64_t>& shape) const {
    const TensorView& codes = store_.get(prefix_ + name);
    const std::string module = prefix_ + module_of(name);
    check(mlx_ != nullptr,
          "{}: tensor {}: MLX-quantized (uint32 codes or {}.scales), but config.json declares no "
          "quantization",
          codes.file, codes.name, module);
    std::optional<QuantSpec> spec = mlx_->for_module(module);
    check(spec.has_value(), "{}: tensor {}: quantized, but config.json's quantization marks {} as not quantized",
          codes.file, codes.name, module);
    const int64_t cols = shape.back();
    check(cols % spec->group == 0 && cols * spec->bits % 32 == 0,
          "{}: tensor {}: {} input columns do not split into groups of {} of {}-bit codes", codes.file, codes.name,
          cols, spec->group, spec->bits);
    std::vector<int64_t> packed = shape, grouped = shape;
    packed.back() = cols * spec->bits / 32;
    grouped.back() = cols / spec->group;
    check(codes.dtype == DType::U32, "{}: tensor {}: expected U32 packed codes, got {}", codes.file, codes.name,
          dtype_name(codes.dtype));
    check(codes.shape == packed, "{}: tensor {}: expected shape {} ({}-bit codes of {} columns), got {}", codes.file,
          codes.name, shape_string(packed), spec->bits, cols, codes.shape_string());
    const uint16_t* params[2];
    const char* suffixes[2] = {".scales", ".biases"};
    for (int i = 0; i < 2; ++i) {
      const TensorView* view = store_.find(module + suffixes[i]);
      check(view != nullptr, "{}: missing tensor {}{} (the quantized weight {} needs scales and biases)",
            store_.directory(), module, suffixes[i], codes.name);
      check(view->dtype == DType::BF16, "{}: tensor {}: expected BF16, got {}", view->file, view->name,
            dtype_name(view->dtype));
      check(view->shape == grouped, "{}: tensor {}: expected shape {} (groups of {}), got {}", view->file, view->name,
            shape_string(grouped), spec->group, view->shape_string());
      params[i] = reinterpret_cast<const uint16_t*>(view->data);
    }
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
    return Matrix{codes.name, DType::BF16, rows, cols, codes.data, spec->bits, params[0], params[1], spec->group};
  }

  const TensorStore& store_;
  std::string prefix_;
  const MlxQuantization* mlx_;
  bool routed_experts_ = true;
};

GatedResidualWeights read_gated_residual(const Reader& r, const ModelConfig& c, bool with_inject) {
  int64_t sh = c.hc_hidden();
  GatedResidualWeights w;
  w.norm = r.vector("hc_norm.weight", {sh});
  w.mix_down = r.matrix("input_mix_weight_down.weight", c.hc_lowrank, sh);
  w.mix_up = r.matrix("input_mix_weight_up.weight", sh, c.hc_lowrank);
  if (with_inject) w.inject = r.matrix("block_inject_weight.weight", c.hc_count, sh);
  return w;
}

GatedDeltaNetWeights read_gated_deltanet(const Reader& r, const ModelConfig& c) {
  int64_t h = c.hidden_size, heads = c.linear_num_value_heads;
  GatedDeltaNetWeights w;
  w.in_qkv = r.matrix("in_proj_qkv.weight", c.gdn_conv_dim(), h);
  w.in_z = r.matrix("in_proj_z.weight", c.gdn_value_dim(), h);
  w.in_b = r.matrix("in_proj_b.weight", heads, h);
  w.in_a = r.matrix("in_proj_a.weight", heads, h);
  w.out = r.matrix("out_proj.weight", h, c.gdn_value_dim());
  w.conv = r.conv_taps("conv1d.weight", c.gdn_conv_dim(), c.linear_conv_kernel_dim);
  w.a_log = r.vector("A_log", {heads});
  w.dt_bias = r.vector("dt_bias", {heads});
  w.norm = r.vector("norm.weight", {c.linear_value_head_dim});
  return w;
}

SparseAttentionWeights read_attention(const Reader& r, const ModelConfig& c) {
  int64_t h = c.hidden_size, hd = c.head_dim;
  SparseAttentionWeights w;
  w.q = r.matrix("q_proj.weight", int64_t(c.num_attention_heads) * hd * 2, h);
  w.k = r.matrix("k_proj.weight", int64_t(c.num_key_value_heads) * hd, h);
  w.v = r.matrix("v_proj.weight", int64_t(c.num_key_value_heads) * hd, h);
  w.o = r.matrix("o_proj.weight", h, int64_t(c.num_attention_heads) * hd);
  w.q_norm = r.vector("q_norm.weight", {hd});
  w.k_norm = r.vector("k_norm.weight", {hd});
  int64_t ihd = c.indexer_head_dim;
  w.index_qk = r.matrix("indexer.index_qk_proj.weight", int64_t(c.indexer_n_heads + 1) * ihd, h);
  w.index_q_norm = r.vector("indexer.q_layernorm.weight", {ihd});
  w.index_k_norm = r.vector("indexer.k_layernorm.weight", {ihd});
  return w;
}

FeedForwardWeights read_feed_forward(const Reader& r, int64_t hidden, int64_t inner) {
  return FeedForwardWeights{r.matrix("gate_proj.weight", inner, hidden), r.matrix("up_proj.weight", inner, hidden),
                            r.matrix("down_proj.weight", hidden, inner)};
}

// MLX conversions stack each projection of all experts in one tensor per layer (mlx-lm's SwitchGLU):
// switch_mlp.{gate,up,down}_proj.weight [E, out, in], quantized or dense.
std::vector<FeedForwardWeights> read_stacked_experts(const Reader& r, const ModelConfig& c) {
  int64_t e_count = c.num_experts, h = c.hidden_size, inner = c.moe_intermediate_size;
  Matrix gate = r.matrix("switch_mlp.gate_proj.weight", {e_count, inner, h});
  Matrix up = r.matrix("switch_mlp.up_proj.weight", {e_count, inner, h});
  Matrix down = r.matrix("switch_mlp.down_proj.weight", {e_count, h, inner});
  std::vector<FeedForwardWeights> experts;
  for (int64_t e = 0; e < e_count; ++e) {
    std::string tag = fmt::format("[{}]", e);
    experts.push_back({gate.slice_rows(e * inner, inner, gate.name + tag),
                       up.slice_rows(e * inner, inner, up.name + tag), down.slice_rows(e * h, h, down.name + tag)});
  }
  return experts;
}

// Experts come one tensor per expert (as transformers saves them) or fused per layer.
std::vector<FeedForwardWeights> read_experts(const Reader& r, const ModelConfig& c) {
  int64_t e_count = c.num_experts, h = c.hidden_size, inner = c.moe_intermediate_size;
  std::vector<FeedForwardWeights> experts;
  if (r.has("switch_mlp.gate_proj.weight")) return read_stacked_experts(r, c);
  if (r.has("experts.gate_up_proj")) {
    const TensorView& gate_up = r.tensor("experts.gate_up_proj", {e_count, 2 * inner, h});
    const TensorView& down = r.tensor("experts.down_proj", {e_count, h, inner});
    Matrix gate_up_all{gate_up.name, gate_up.dtype, e_count * 2 * inner, h, gate_up.data};
    Matrix down_all{down.name, down.dtype, e_count * h, inner, down.data};
    for (int64_t e = 0; e < e_count; ++e) {
      std::string tag = fmt::format("[{}]", e);
      experts.push_back({gate_up_all.slice_rows(e * 2 * inner, inner, gate_up.name + tag + ".gate"),
                         gate_up_all.slice_rows(e * 2 * inner + inner, inner, gate_up.name + tag + ".up"),
                         down_all.slice_rows(e * h, h, down.name + tag)});
    }
    return experts;
  }
  for (int64_t e = 0; e < e_count; ++e)
    experts.push_back(read_feed_forward(r.sub("experts." + std::to_string(e) + "."), h, inner));
  return experts;
}

MoeWeights read_moe(const Reader& r, const ModelConfig& c) {
  MoeWeights w;
  w.router = r.matrix("gate.weight", c.num_experts, c.hidden_size);
  if (r.routed_experts()) w.experts = read_experts(r, c);
  w.shared = read_feed_forward(r.sub("shared_expert."), c.hidden_size, c.shared_expert_intermediate_size);
  w.shared_gate = r.matrix("shared_expert_gate.weight", 1, c.hidden_size);
  return w;
}

// The table as one tensor, or row shards named shard_K (transformers) or shards.K (MLX conversions).
std::vector<std::string> ngram_shard_names(const Reader& r) {
  if (r.has("ple_embedding.ngram_embedding.weight")) return {"ple_embedding.ngram_embedding.weight"};
  std::vector<std::string> names;
  for (const char* spelling : {"ple_embedding.ngram_embedding.shard_", "ple_embedding.ngram_embedding.shards."}) {
    for (int k = 0; r.has(spelling + std::to_string(k) + ".weight"); ++k)
      names.push_back(spelling + std::to_string(k) + ".weight");
    if (!names.empty()) return names;
  }
  fail("{}: missing tensor {}ple_embedding.ngram_embedding.shard_0.weight", r.store().directory(), r.prefix());
}

PleWeights read_ple(const Reader& r, const ModelConfig& c) {
  PleWeights w;
  int heads = c.ngram_heads();
  int64_t head_width = c.ple_embed_dim / heads, sh = c.hc_hidden(), e = c.ple_embed_dim;
  w.multipliers = r.int64s("ple_embedding.layer_multipliers", c.ngram_size);
  w.head_sizes = r.int64s("ple_embedding.ngram_heads_vocab_sizes", heads);
  w.head_offsets = r.int64s("ple_embedding.ngram_heads_offsets", heads);
  // The table is saved as row shards; a single unsharded tensor is accepted too. It is never copied.
  std::vector<std::string> names = ngram_shard_names(r);
  for (const auto& name : names) {
    const TensorView& view = r.store().get(r.prefix() + name);
    Matrix shard;
    if (r.is_mlx_quantized(name)) {  // MLX: affine rows, group 32 in the released conversion
      check(view.shape.size() == 2, "{}: tensor {}: expected a 2-D n-gram table shard, got {}", view.file, view.name,
            view.shape_string());
      shard = r.matrix(name, view.shape[0], head_width);
    } else {
      check(is_float(view.dtype) && view.shape.size() == 2 && view.shape[1] == head_width,
            "{}: tensor {}: expected a float [rows, {}] n-gram table shard, got {} {}", view.file, view.name,
            head_width, dtype_name(view.dtype), view.shape_string());
      shard = Matrix{view.name, view.dtype, view.shape[0], head_width, view.data};
    }
    if (!w.table_shards.empty()) {
      const Matrix& first = w.table_shards.front();
      check(shard.dtype == first.dtype && shard.bits == first.bits && shard.group == first.group,
            "{}: tensor {}: n-gram table shards differ in dtype or quantization", view.file, view.name);
    }
    w.shard_first_row.push_back(w.table_rows);
    w.table_shards.push_back(shard);
    w.table_rows += view.shape[0];
  }
  for (int h = 0; h < heads; ++h) {
    check(w.head_sizes[h] > 0 && w.head_offsets[h] >= 0 && w.head_offsets[h] + w.head_sizes[h] <= w.table_rows,
          "{}: tensor {}ple_embedding.ngram_heads_offsets: head {} rows [{}, {}) exceed the table's {} rows",
          r.store().directory(), r.prefix(), h, w.head_offsets[h], w.head_offsets[h] + w.head_sizes[h], w.table_rows);
  }
  w.key_proj = r.matrix("key_proj.weight", sh, e);
  w.value_proj = r.matrix("value_proj.weight", c.hidden_size, e);
  w.norm_key = r.vector("norm_key.weight", {sh});
  w.norm_query = r.vector("norm_query.weight", {sh});
  w.norm_conv = r.vector("norm_conv.weight", {sh});
  w.conv = r.conv_taps("conv1d.weight", sh, c.ple_conv_kernel_size);
  return w;
}

LayerWeights read_layer(const Reader& r, const ModelConfig& c, LayerKind kind, bool has_ple) {
  LayerWeights w;
  w.kind = kind;
  w.attn_hc = read_gated_residual(r.sub("attn_hyper_connection."), c, true);
  w.mlp_hc = read_gated_residual(r.sub("mlp_hyper_connection."), c, true);
  if (kind == LayerKind::GatedDeltaNet)
    w.gdn = read_gated_deltanet(r.sub("linear_attn."), c);
  else
    w.attn = read_attention(r.sub("self_attn."), c);
  w.moe = read_moe(r.sub("mlp."), c);
  if (has_ple) w.ple = read_ple(r.sub("ple."), c);
  return w;
}

MtpWeights read_mtp(const Reader& r, const ModelConfig& c) {
  MtpWeights w;
  w.pre_fc_norm_embedding = r.vector("pre_fc_norm_embedding.weight", {c.hidden_size});
  w.pre_fc_norm_hidden = r.vector("pre_fc_norm_hidden.weight", {c.hc_hidden()});
  w.fc_embedding = r.matrix("fc_embedding.weight", c.hidden_size, c.hidden_size);
  w.fc_hidden = r.matrix("fc_hidden.weight", c.hidden_size, c.hidden_size);
  w.layer = read_layer(r.sub("layers.0."), c, LayerKind::SparseAttention, false);
  w.final_mixer = read_gated_residual(r.sub("hyper_connection_mixer."), c, false);
  return w;
}

void visit_feed_forward(FeedForwardWeights& w, const std::function<void(Matrix&)>& visit) {
  visit(w.gate);
  visit(w.up);
  visit(w.down);
}

void visit_gated_residual(GatedResidualWeights& w, const std::function<void(Matrix&)>& visit) {
  visit(w.mix_down);
  visit(w.mix_up);
  if (!w.inject.empty()) visit(w.inject);
}

void visit_layer(LayerWeights& w, const std::function<void(Matrix&)>& visit) {
  visit_gated_residual(w.attn_hc, visit);
  visit_gated_residual(w.mlp_hc, visit);
  if (w.kind == LayerKind::GatedDeltaNet) {
    for (Matrix* m : {&w.gdn.in_qkv, &w.gdn.in_z, &w.gdn.in_b, &w.gdn.in_a, &w.gdn.out}) visit(*m);
  } else {
    for (Matrix* m : {&w.attn.q, &w.attn.k, &w.attn.v, &w.attn.o, &w.attn.index_qk}) visit(*m);
  }
  visit(w.moe.router);
  for (auto& expert : w.moe.experts) visit_feed_forward(expert, visit);
  visit_feed_forward(w.moe.shared, visit);
  visit(w.moe.shared_gate);
  if (w.ple) {
    visit(w.ple->key_proj);
    visit(w.ple->value_proj);
  }
}

// MLX conversions (mlx-lm / mlx-vlm naming) keep the trunk under language_model.model. and the head as
// language_model.lm_head.
constexpr const char* kMlxTrunkPrefix = "language_model.model.";

void shift(Vector& weights, float offset) {
  for (float& v : weights) v += offset;
}

void centre_gated_residual(GatedResidualWeights& w) { shift(w.norm, -1.0f); }

void centre_layer(LayerWeights& w) {
  centre_gated_residual(w.attn_hc);
  centre_gated_residual(w.mlp_hc);
  if (w.kind == LayerKind::SparseAttention)
    for (Vector* v : {&w.attn.q_norm, &w.attn.k_norm, &w.attn.index_q_norm, &w.attn.index_k_norm}) shift(*v, -1.0f);
  if (w.ple)
    for (Vector* v : {&w.ple->norm_key, &w.ple->norm_query, &w.ple->norm_conv}) shift(*v, -1.0f);
}

// MLX conversions store the zero-centred RMSNorm weights already shifted (1 + w, so plain RMSNorm applies them), as
// Cherenkov documents for the released 4-bit conversion; the MTP head's pre_fc_norm_embedding/hidden were left
// unshifted and the GDN output norm is a plain weight in both conventions. The engine keeps HF's zero-centred form.
void centre_mlx_norms(Model& model) {
  for (auto& layer : model.layers) centre_layer(layer);
  centre_gated_residual(model.final_mixer);
  if (model.mtp) {
    centre_layer(model.mtp->layer);
    centre_gated_residual(model.mtp->final_mixer);
  }
}

}  // namespace

void for_each_matrix(Model& model, const std::function<void(Matrix&)>& visit) {
  visit(model.embed);
  if (model.lm_head.data != model.embed.data) visit(model.lm_head);
  for (auto& layer : model.layers) visit_layer(layer, visit);
  visit_gated_residual(model.final_mixer, visit);
  if (model.mtp) {
    visit(model.mtp->fc_embedding);
    visit(model.mtp->fc_hidden);
    visit_layer(model.mtp->layer, visit);
    visit_gated_residual(model.mtp->final_mixer, visit);
  }
}

std::unique_ptr<Model> load_model(const std::string& path, int expert_bits) {
  ExpertPrecision precision;
  if (expert_bits != 0) precision.preference = {expert_bits, kDensePrecision, 4, 3, 2};
  auto model = is_packed_store(path) ? load_packed_model(path, precision) : load_checkpoint(path);
  page_in_weights(*model, ProgressMode::Terminal);
  return model;
}

std::unique_ptr<Model> load_checkpoint(const std::string& directory) {
  auto model = std::make_unique<Model>();
  model->directory = directory;
  model->config = load_model_config(directory);
  model->store = std::make_unique<TensorStore>(directory);
  read_weights(*model, true);
  return model;
}

void read_weights(Model& model, bool routed_experts) {
  const ModelConfig& c = model.config;
  const TensorStore& store = *model.store;

  const std::optional<MlxQuantization> mlx = load_mlx_quantization(model.directory);
  const MlxQuantization* quantization = mlx ? &*mlx : nullptr;
  const bool mlx_layout = store.contains(kMlxTrunkPrefix + std::string("embed_tokens.weight"));
  std::string prefix = mlx_layout                                                   ? kMlxTrunkPrefix
                       : store.contains("model.language_model.embed_tokens.weight") ? "model.language_model."
                                                                                    : "model.";
  Reader trunk(store, prefix, quantization, routed_experts);
  model.embed = trunk.matrix("embed_tokens.weight", c.vocab_size, c.hidden_size);
  Reader top(store, mlx_layout ? "language_model." : "", quantization);
  if (top.has("lm_head.weight"))
    model.lm_head = top.matrix("lm_head.weight", c.vocab_size, c.hidden_size);
  else if (c.tie_word_embeddings)
    model.lm_head = model.embed;
  else
    store.get("lm_head.weight");  // throws: missing tensor
  for (int i = 0; i < c.num_layers; ++i)
    model.layers.push_back(
        read_layer(trunk.sub("layers." + std::to_string(i) + "."), c, c.layer_kinds[i], c.is_ple_layer(i)));
  model.final_mixer = read_gated_residual(trunk.sub("hyper_connection_mixer."), c, false);
  for (const char* mtp_prefix : {"mtp.", "model.mtp."}) {
    if (store.contains(std::string(mtp_prefix) + "fc_embedding.weight")) {
      model.mtp = read_mtp(Reader(store, mtp_prefix, quantization, routed_experts), c);
      break;
    }
  }
  if (mlx_layout) centre_mlx_norms(model);
}

}  // namespace vavilov
