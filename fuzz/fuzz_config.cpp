// libFuzzer target for parse_model_config: the input is the text of a config.json. Only vavilov::Error may
// escape; anything else (nlohmann type_error, std::bad_alloc, sanitizer reports) is a finding. An accepted
// config is re-checked against the invariants the engine relies on, so a wrong "valid" answer is a finding too.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "core/error.h"
#include "model/config.h"

namespace {

void require(bool condition) {
  if (!condition) std::abort();
}

void check_invariants(const vavilov::ModelConfig& c) {
  require(c.num_layers > 0 && c.layer_kinds.size() == size_t(c.num_layers));
  require(c.hidden_size > 0 && c.vocab_size > 0 && c.head_dim > 0);
  require(c.num_key_value_heads > 0 && c.num_attention_heads % c.num_key_value_heads == 0);
  require(c.linear_num_key_heads > 0 && c.linear_num_value_heads % c.linear_num_key_heads == 0);
  require(c.rotary_dim > 0 && c.rotary_dim % 2 == 0 && c.rotary_dim <= c.head_dim);
  require(c.hc_count > 1);
  require(c.num_experts_per_tok > 0 && c.num_experts_per_tok <= c.num_experts);
  bool attention = c.mtp_num_layers > 0 ||
                   std::count(c.layer_kinds.begin(), c.layer_kinds.end(), vavilov::LayerKind::SparseAttention) > 0;
  if (attention) {
    require(c.indexer_n_heads > 0 && c.indexer_head_dim >= c.rotary_dim);
    require(c.indexer_compress_ratio > 0 && c.indexer_budget % c.indexer_compress_ratio == 0);
  }
  require(std::is_sorted(c.ple_layers.begin(), c.ple_layers.end()));
  require(std::adjacent_find(c.ple_layers.begin(), c.ple_layers.end()) == c.ple_layers.end());
  for (int layer : c.ple_layers) {
    require(layer >= 0 && layer < c.num_layers);
    require(c.layer_kinds[layer] == vavilov::LayerKind::GatedDeltaNet);
  }
  if (!c.ple_layers.empty()) {
    require(c.ngram_heads() > 0 && c.ple_embed_dim % c.ngram_heads() == 0);
    require(c.eos() >= 0 && c.eos() < c.vocab_size);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    check_invariants(vavilov::parse_model_config(text, "fuzz/config.json"));
  } catch (const vavilov::Error&) {
  }
  return 0;
}
