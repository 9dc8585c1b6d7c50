#include "model/weights.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "io/packed_store.h"
#include "model/packed_model.h"

namespace vavilov {

Matrix Matrix::slice_rows(int64_t begin, int64_t count, std::string slice_name) const {
  return Matrix{std::move(slice_name), dtype, count, cols, row(begin)};
}

const std::byte* PleWeights::table_row(int64_t row) const {
  auto after = std::upper_bound(shard_first_row.begin(), shard_first_row.end(), row);
  size_t shard = size_t(after - shard_first_row.begin()) - 1;
  return table_shards[shard].row(row - shard_first_row[shard]);
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
  Reader(const TensorStore& store, std::string prefix, bool routed_experts = true)
      : store_(store), prefix_(std::move(prefix)), routed_experts_(routed_experts) {}

  const TensorView& tensor(const std::string& name, const std::vector<int64_t>& shape, bool float_data = true) const {
    const TensorView& view = store_.get(prefix_ + name);
    check(!float_data || is_float(view.dtype), "{}: tensor {}: dtype {} is not a float type", view.file, view.name,
          dtype_name(view.dtype));
    check(view.shape == shape, "{}: tensor {}: expected shape {}, got {}", view.file, view.name, shape_string(shape),
          view.shape_string());
    return view;
  }

  Matrix matrix(const std::string& name, int64_t rows, int64_t cols) const {
    const TensorView& view = tensor(name, {rows, cols});
    return Matrix{view.name, view.dtype, rows, cols, view.data};
  }

  Vector vector(const std::string& name, const std::vector<int64_t>& shape) const {
    const TensorView& view = tensor(name, shape);
    Vector out(size_t(view.numel()));
    to_f32(view.dtype, view.data, out.data(), out.size());
    return out;
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
  Reader sub(const std::string& name) const { return Reader(store_, prefix_ + name, routed_experts_); }
  // False when the routed experts come from elsewhere (a packed store's expert records).
  bool routed_experts() const { return routed_experts_; }
  const TensorStore& store() const { return store_; }
  const std::string& prefix() const { return prefix_; }

 private:
  const TensorStore& store_;
  std::string prefix_;
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
  w.conv = r.vector("conv1d.weight", {c.gdn_conv_dim(), 1, c.linear_conv_kernel_dim});
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

// Experts come one tensor per expert (as transformers saves them) or fused per layer.
std::vector<FeedForwardWeights> read_experts(const Reader& r, const ModelConfig& c) {
  int64_t e_count = c.num_experts, h = c.hidden_size, inner = c.moe_intermediate_size;
  std::vector<FeedForwardWeights> experts;
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
  for (int64_t e = 0; e < e_count; ++e) experts.push_back(read_feed_forward(r.sub("experts." + std::to_string(e) + "."), h, inner));
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

PleWeights read_ple(const Reader& r, const ModelConfig& c) {
  PleWeights w;
  int heads = c.ngram_heads();
  int64_t head_width = c.ple_embed_dim / heads, sh = c.hc_hidden(), e = c.ple_embed_dim;
  w.multipliers = r.int64s("ple_embedding.layer_multipliers", c.ngram_size);
  w.head_sizes = r.int64s("ple_embedding.ngram_heads_vocab_sizes", heads);
  w.head_offsets = r.int64s("ple_embedding.ngram_heads_offsets", heads);
  // The table is saved as row shards; a single unsharded tensor is accepted too. It is never copied.
  std::vector<std::string> names;
  if (r.has("ple_embedding.ngram_embedding.weight")) {
    names.push_back("ple_embedding.ngram_embedding.weight");
  } else {
    for (int k = 0; r.has("ple_embedding.ngram_embedding.shard_" + std::to_string(k) + ".weight"); ++k)
      names.push_back("ple_embedding.ngram_embedding.shard_" + std::to_string(k) + ".weight");
    check(!names.empty(), "{}: missing tensor {}ple_embedding.ngram_embedding.shard_0.weight",
          r.store().directory(), r.prefix());
  }
  for (const auto& name : names) {
    const TensorView& view = r.store().get(r.prefix() + name);
    check(is_float(view.dtype) && view.shape.size() == 2 && view.shape[1] == head_width,
          "{}: tensor {}: expected a float [rows, {}] n-gram table shard, got {} {}", view.file, view.name,
          head_width, dtype_name(view.dtype), view.shape_string());
    check(view.dtype == (w.table_shards.empty() ? view.dtype : w.table_shards.front().dtype),
          "{}: tensor {}: n-gram table shards differ in dtype", view.file, view.name);
    w.shard_first_row.push_back(w.table_rows);
    w.table_shards.push_back(Matrix{view.name, view.dtype, view.shape[0], head_width, view.data});
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
  w.conv = r.vector("conv1d.weight", {sh, 1, c.ple_conv_kernel_size});
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

std::unique_ptr<Model> load_model(const std::string& path) {
  auto model = is_packed_store(path) ? load_packed_model(path, ExpertPrecision{}) : load_checkpoint(path);
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

  std::string prefix = store.contains("model.language_model.embed_tokens.weight") ? "model.language_model." : "model.";
  Reader trunk(store, prefix, routed_experts);
  model.embed = trunk.matrix("embed_tokens.weight", c.vocab_size, c.hidden_size);
  Reader top(store, "");
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
      model.mtp = read_mtp(Reader(store, mtp_prefix, routed_experts), c);
      break;
    }
  }
}

}  // namespace vavilov
