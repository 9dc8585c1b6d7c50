#pragma once
// The qwen4_exp text configuration, parsed from config.json (qwen4_exp with text_config, or qwen4_exp_text)
// and validated field by field, as transformers' Qwen4ExpTextConfig does.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace vavilov {

enum class LayerKind { GatedDeltaNet, SparseAttention };

struct ModelConfig {
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int num_layers = 0;
  std::vector<LayerKind> layer_kinds;
  float rms_norm_eps = 1e-6f;
  std::vector<int64_t> eos_token_ids;  // the first one is the n-gram pad/cut token
  bool tie_word_embeddings = false;

  // Attention.
  int num_attention_heads = 0;
  int num_key_value_heads = 0;
  int head_dim = 0;
  double rope_theta = 10000.0;
  int rotary_dim = 0;  // head_dim * partial_rotary_factor

  // QSA indexer (sparse attention).
  int indexer_n_heads = 0;
  int indexer_head_dim = 0;
  int indexer_budget = 0;
  int indexer_compress_ratio = 0;

  // Gated DeltaNet.
  int linear_num_key_heads = 0;
  int linear_num_value_heads = 0;
  int linear_key_head_dim = 0;
  int linear_value_head_dim = 0;
  int linear_conv_kernel_dim = 4;
  bool gdn_gate_sigmoid = true;  // output_gate_type: sigmoid, else silu

  // MoE.
  int num_experts = 0;
  int num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  int64_t shared_expert_intermediate_size = 0;
  bool norm_topk_prob = true;

  // Hyper-connections.
  int hc_count = 0;
  int hc_lowrank = 0;

  // PLE (hashed n-gram embedding).
  std::vector<int> ple_layers;  // zero-based layer indices
  int64_t ple_embed_dim = 0;
  int ple_conv_kernel_size = 4;
  int ngram_size = 3;
  int heads_per_ngram = 8;
  int split_ngram_parts = 0;

  int mtp_num_layers = 0;

  int64_t hc_hidden() const { return hc_count * hidden_size; }
  int ngram_heads() const { return (ngram_size - 1) * heads_per_ngram; }
  int64_t eos() const { return eos_token_ids.empty() ? -1 : eos_token_ids.front(); }
  bool is_ple_layer(int layer) const;
  int64_t gdn_key_dim() const { return int64_t(linear_num_key_heads) * linear_key_head_dim; }
  int64_t gdn_value_dim() const { return int64_t(linear_num_value_heads) * linear_value_head_dim; }
  int64_t gdn_conv_dim() const { return 2 * gdn_key_dim() + gdn_value_dim(); }
};

// Parses config JSON text; `source` names the file in errors.
ModelConfig parse_model_config(std::string_view json_text, std::string_view source);
ModelConfig load_model_config(const std::string& model_directory);

}  // namespace vavilov
