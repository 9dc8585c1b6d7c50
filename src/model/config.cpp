#include "model/config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "core/error.h"

namespace vavilov {

using nlohmann::json;

bool ModelConfig::is_ple_layer(int layer) const {
  return std::binary_search(ple_layers.begin(), ple_layers.end(), layer);
}

namespace {

// Every size is capped at INT32_MAX so that products of two sizes (hc_count * hidden_size, heads * head_dim)
// always fit in int64 and the int fields of ModelConfig never truncate.
constexpr int64_t kMaxSize = std::numeric_limits<int32_t>::max();
// Layer counts size per-layer vectors; a bound keeps a hostile file from allocating gigabytes.
constexpr int64_t kMaxLayers = 1 << 16;

constexpr size_t kDescribeLimit = 64;

// Appends a rendering of `value` to `out`, stopping once `out` is long enough. json::dump() would recurse through
// the whole value (a hostile file nests 100k arrays and overflows the stack) and render all of it; this stops
// at the length limit, and a depth limit bounds the recursion. `replace` keeps dump() from throwing on bad UTF-8.
void render(const json& value, int depth, std::string& out) {
  if (!value.is_structured()) {
    out += value.dump(-1, ' ', false, json::error_handler_t::replace);
    return;
  }
  out += value.is_array() ? '[' : '{';
  if (depth >= 3 && !value.empty()) out += "...";
  if (depth >= 3) return void(out += value.is_array() ? ']' : '}');
  bool first = true;
  for (auto it = value.begin(); it != value.end() && out.size() <= kDescribeLimit; ++it, first = false) {
    if (!first) out += ", ";
    if (value.is_object()) out += json(it.key()).dump(-1, ' ', false, json::error_handler_t::replace) + ": ";
    render(*it, depth + 1, out);
  }
  out += value.is_array() ? ']' : '}';
}

// A short, single-line rendering of a JSON value for error messages.
std::string describe(const json& value) {
  std::string text;
  render(value, 0, text);
  if (text.size() > kDescribeLimit) text = text.substr(0, kDescribeLimit - 3) + "...";
  return text;
}

// One JSON object of the config with the dotted path that leads to it, so that every error can name the file
// and the full field path. All type checks live here: nothing below calls json::get on an unchecked value.
class Fields {
 public:
  Fields(const json& object, std::string_view source, std::string prefix)
      : object_(object), source_(source), prefix_(std::move(prefix)) {}

  template <typename... Args>
  [[noreturn]] void error(std::string_view name, fmt::format_string<Args...> format, Args&&... args) const {
    fail("{}: field {}{}: {}", source_, prefix_, name, fmt::format(format, std::forward<Args>(args)...));
  }

  // Absent → nullptr. A JSON null counts as absent only for fields HF types as optional (`X | None`).
  const json* find(std::string_view name, bool nullable = false) const {
    auto it = object_.find(name);
    if (it == object_.end() || (nullable && it->is_null())) return nullptr;
    return &*it;
  }

  int64_t integer(std::string_view name, std::optional<int64_t> fallback, int64_t min = 1,
                  int64_t max = kMaxSize) const {
    const json* value = find(name);
    if (!value) {
      if (!fallback) error(name, "missing (required)");
      return *fallback;
    }
    return checked_integer(name, *value, min, max);
  }

  std::optional<int64_t> optional_integer(std::string_view name, int64_t min = 1) const {
    const json* value = find(name, true);
    if (!value) return std::nullopt;
    return checked_integer(name, *value, min);
  }

  int64_t checked_integer(std::string_view name, const json& value, int64_t min, int64_t max = kMaxSize) const {
    // Integers only: HF's strict dataclass rejects 4.0 and true for an int field, and so do we.
    if (!value.is_number_integer()) error(name, "{}, got {}", integer_rule(min), describe(value));
    if (value.is_number_unsigned() && value.get<uint64_t>() > uint64_t(max))
      error(name, "must be at most {}, got {}", max, describe(value));
    int64_t result = value.get<int64_t>();
    if (result < min) error(name, "{}, got {}", integer_rule(min), result);
    if (result > max) error(name, "must be at most {}, got {}", max, result);
    return result;
  }

  double positive_number(std::string_view name, double fallback) const {
    const json* value = find(name);
    if (!value) return fallback;
    if (!value->is_number() || !(value->get<double>() > 0) || !std::isfinite(value->get<double>()))
      error(name, "must be a positive finite number, got {}", describe(*value));
    return value->get<double>();
  }

  bool boolean(std::string_view name, bool fallback) const {
    const json* value = find(name);
    if (!value) return fallback;
    if (!value->is_boolean()) error(name, "must be true or false, got {}", describe(*value));
    return value->get<bool>();
  }

  std::optional<std::string> optional_string(std::string_view name, bool nullable) const {
    const json* value = find(name, nullable);
    if (!value) return std::nullopt;
    if (!value->is_string()) error(name, "must be a string, got {}", describe(*value));
    return value->get<std::string>();
  }

  // A nested object such as rope_parameters; nullopt when absent or null.
  std::optional<Fields> object(std::string_view name) const {
    const json* value = find(name, true);
    if (!value) return std::nullopt;
    if (!value->is_object()) error(name, "must be an object, got {}", describe(*value));
    return Fields(*value, source_, prefix_ + std::string(name) + ".");
  }

  const json& raw() const { return object_; }
  std::string_view source() const { return source_; }
  const std::string& prefix() const { return prefix_; }

 private:
  static std::string integer_rule(int64_t min) {
    if (min == 1) return "must be a positive integer";
    if (min == 0) return "must be a non-negative integer";
    return fmt::format("must be an integer >= {}", min);
  }

  const json& object_;
  std::string_view source_;
  std::string prefix_;
};

int as_int(int64_t value) { return static_cast<int>(value); }  // safe: every size is <= kMaxSize

void parse_core(const Fields& f, ModelConfig& c) {
  c.vocab_size = f.integer("vocab_size", 248320);
  c.hidden_size = f.integer("hidden_size", 2048);
  c.num_layers = as_int(f.integer("num_hidden_layers", 40, 1, kMaxLayers));
  c.rms_norm_eps = float(f.positive_number("rms_norm_eps", 1e-6));
  std::string act = f.optional_string("hidden_act", false).value_or("silu");
  if (act != "silu") f.error("hidden_act", "must be \"silu\", got {}", describe(act));
  std::string gate = f.optional_string("output_gate_type", true).value_or(act);
  if (gate != "sigmoid" && gate != "silu")
    f.error("output_gate_type", "must be sigmoid or silu, got {}", describe(gate));
  c.gdn_gate_sigmoid = gate == "sigmoid";
  c.norm_topk_prob = f.boolean("norm_topk_prob", true);
}

LayerKind layer_kind(const Fields& f, size_t index, const json& entry) {
  std::string name = fmt::format("layer_types[{}]", index);
  if (!entry.is_string()) f.error(name, "must be a string, got {}", describe(entry));
  const std::string& type = entry.get_ref<const std::string&>();
  if (type == "linear_attention") return LayerKind::GatedDeltaNet;
  // The released checkpoint says full_attention for layers that do use the QSA indexer (HF maps it the same way).
  if (type == "full_attention" || type == "qwen_sparse_attention" || type == "deepseek_sparse_attention")
    return LayerKind::SparseAttention;
  f.error(name, "unknown layer type {}", describe(entry));
}

void parse_layer_types(const Fields& f, ModelConfig& c) {
  const json* types = f.find("layer_types", true);
  if (!types) {
    // HF's fallback: every interval-th layer (1-based) is attention, the rest GDN.
    int64_t interval = f.integer("full_attention_interval", 4);
    for (int i = 0; i < c.num_layers; ++i)
      c.layer_kinds.push_back((i + 1) % interval ? LayerKind::GatedDeltaNet : LayerKind::SparseAttention);
    return;
  }
  if (!types->is_array()) f.error("layer_types", "must be a list of strings, got {}", describe(*types));
  if (types->size() != size_t(c.num_layers))
    f.error("layer_types", "has {} entries but num_hidden_layers is {}", types->size(), c.num_layers);
  for (size_t i = 0; i < types->size(); ++i) c.layer_kinds.push_back(layer_kind(f, i, (*types)[i]));
}

// rope_theta and partial_rotary_factor live in rope_parameters (transformers v5); older files put rope_theta
// at the top level.
void parse_rope(const Fields& f, ModelConfig& c) {
  std::optional<Fields> rope = f.object("rope_parameters");
  c.rope_theta = f.positive_number("rope_theta", 10000.0);
  double factor = 1.0;
  if (rope) {
    c.rope_theta = rope->positive_number("rope_theta", c.rope_theta);
    factor = rope->positive_number("partial_rotary_factor", 1.0);
    if (factor > 1.0) rope->error("partial_rotary_factor", "must be in (0, 1], got {}", factor);
  }
  c.rotary_dim = int(double(c.head_dim) * factor);  // truncation, as Python's int() does
  std::string field = rope ? "rope_parameters.partial_rotary_factor" : "head_dim";
  if (c.rotary_dim <= 0 || c.rotary_dim % 2)
    f.error(field, "gives rotary_dim {} (head_dim {} x {}), which must be positive and even", c.rotary_dim, c.head_dim,
            factor);
}

void parse_attention(const Fields& f, ModelConfig& c) {
  c.num_attention_heads = as_int(f.integer("num_attention_heads", 16));
  c.num_key_value_heads = as_int(f.integer("num_key_value_heads", 2));
  if (c.num_attention_heads % c.num_key_value_heads)
    f.error("num_key_value_heads", "must divide num_attention_heads ({}), got {}", c.num_attention_heads,
            c.num_key_value_heads);
  c.head_dim = as_int(f.integer("head_dim", 256));
  parse_rope(f, c);
}

bool has_attention(const ModelConfig& c) {
  return c.mtp_num_layers > 0 ||
         std::find(c.layer_kinds.begin(), c.layer_kinds.end(), LayerKind::SparseAttention) != c.layer_kinds.end();
}

// Every attention layer of this engine runs the QSA indexer, so its fields are required whenever there is one;
// otherwise they follow HF's rule: all or none.
void parse_indexer(const Fields& f, ModelConfig& c) {
  static constexpr const char* kNames[] = {"indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget",
                                           "indexer_compress_ratio"};
  std::optional<int64_t> values[5];
  bool any = has_attention(c);
  for (int i = 0; i < 5; ++i) any |= (values[i] = f.optional_integer(kNames[i])).has_value();
  if (!any) return;
  for (int i = 0; i < 5; ++i)
    if (!values[i]) f.error(kNames[i], "missing (required for sparse attention layers)");
  c.indexer_n_heads = as_int(*values[0]);
  if (*values[1] != 1) f.error("indexer_kv_heads", "must be 1 (Qwen4-Exp QSA has one key head), got {}", *values[1]);
  c.indexer_head_dim = as_int(*values[2]);
  c.indexer_budget = as_int(*values[3]);
  c.indexer_compress_ratio = as_int(*values[4]);
  if (c.indexer_budget % c.indexer_compress_ratio)
    f.error("indexer_budget", "must be divisible by indexer_compress_ratio ({}), got {}", c.indexer_compress_ratio,
            c.indexer_budget);
  if (c.rotary_dim > c.indexer_head_dim)
    f.error("indexer_head_dim", "must be at least rotary_dim ({}) so RoPE fits the index head, got {}", c.rotary_dim,
            c.indexer_head_dim);
}

void parse_gdn(const Fields& f, ModelConfig& c) {
  c.linear_num_key_heads = as_int(f.integer("linear_num_key_heads", 16));
  c.linear_num_value_heads = as_int(f.integer("linear_num_value_heads", 32));
  if (c.linear_num_value_heads % c.linear_num_key_heads)
    f.error("linear_num_value_heads", "must be a multiple of linear_num_key_heads ({}), got {}", c.linear_num_key_heads,
            c.linear_num_value_heads);
  c.linear_key_head_dim = as_int(f.integer("linear_key_head_dim", 128));
  c.linear_value_head_dim = as_int(f.integer("linear_value_head_dim", 128));
  c.linear_conv_kernel_dim = as_int(f.integer("linear_conv_kernel_dim", 4));
}

void parse_moe(const Fields& f, ModelConfig& c) {
  c.num_experts = as_int(f.integer("num_experts", 512));
  c.num_experts_per_tok = as_int(f.integer("num_experts_per_tok", 10));
  if (c.num_experts_per_tok > c.num_experts)
    f.error("num_experts_per_tok", "must be in [1, num_experts = {}], got {}", c.num_experts, c.num_experts_per_tok);
  c.moe_intermediate_size = f.integer("moe_intermediate_size", 512);
  c.shared_expert_intermediate_size = f.integer("shared_expert_intermediate_size", 512);
}

void parse_hyper_connections(const Fields& f, ModelConfig& c) {
  c.hc_count = as_int(f.integer("hc_count", 4));
  if (c.hc_count <= 1) f.error("hc_count", "must be > 1, got {}", c.hc_count);
  c.hc_lowrank = as_int(f.integer("hc_lowrank", 320));
}

void parse_eos(const Fields& f, ModelConfig& c) {
  const json* eos = f.find("eos_token_id", true);
  if (!eos) return;
  if (eos->is_array()) {
    for (size_t i = 0; i < eos->size(); ++i)
      c.eos_token_ids.push_back(f.checked_integer(fmt::format("eos_token_id[{}]", i), (*eos)[i], 0));
  } else {
    if (!eos->is_number_integer())
      f.error("eos_token_id", "must be a token id or a list of them, got {}", describe(*eos));
    c.eos_token_ids.push_back(f.checked_integer("eos_token_id", *eos, 0));
  }
  for (int64_t id : c.eos_token_ids)
    if (id >= c.vocab_size) f.error("eos_token_id", "token {} is outside the vocabulary ({})", id, c.vocab_size);
}

// ple_layer_ids are ONE-based in the file; stored zero-based, sorted and unique (HF sorts a set).
void parse_ple_layers(const Fields& f, ModelConfig& c) {
  const json* ids = f.find("ple_layer_ids", true);
  if (!ids) return;
  if (!ids->is_array()) f.error("ple_layer_ids", "must be a list of layer ids, got {}", describe(*ids));
  for (size_t i = 0; i < ids->size(); ++i) {
    std::string name = fmt::format("ple_layer_ids[{}]", i);
    int64_t id = f.checked_integer(name, (*ids)[i], 1);
    if (id > c.num_layers) f.error(name, "must be a one-based layer id in [1, {}], got {}", c.num_layers, id);
    if (c.layer_kinds[id - 1] != LayerKind::GatedDeltaNet)
      f.error(name, "layer {} is not a linear_attention layer; PLE is only supported there", id);
    c.ple_layers.push_back(as_int(id - 1));
  }
  std::sort(c.ple_layers.begin(), c.ple_layers.end());
  c.ple_layers.erase(std::unique(c.ple_layers.begin(), c.ple_layers.end()), c.ple_layers.end());
}

void parse_ple(const Fields& f, ModelConfig& c) {
  parse_ple_layers(f, c);
  c.ple_embed_dim = f.optional_integer("ple_embed_dim").value_or(c.hidden_size);
  c.ple_conv_kernel_size = as_int(f.integer("ple_conv_kernel_size", 4));
  c.ngram_size = as_int(f.integer("ngram_size", 3));
  c.heads_per_ngram = as_int(f.integer("heads_per_ngram", 8));
  c.split_ngram_parts = as_int(f.integer("split_ngram_parts", 512));
  if (c.ple_layers.empty()) return;
  if (c.ngram_size < 2) f.error("ngram_size", "must be at least 2 when PLE layers are used, got {}", c.ngram_size);
  int64_t heads = int64_t(c.ngram_size - 1) * c.heads_per_ngram;
  if (heads > kMaxSize) f.error("heads_per_ngram", "(ngram_size - 1) * heads_per_ngram = {} is too large", heads);
  if (c.ple_embed_dim % heads)
    f.error("ple_embed_dim", "must be divisible by (ngram_size - 1) * heads_per_ngram = {}, got {}", heads,
            c.ple_embed_dim);
  // The first EOS id is the n-gram pad/cut token.
  if (c.eos_token_ids.empty()) f.error("eos_token_id", "is required when ple_layer_ids is set");
}

// The nested (qwen4_exp with text_config) or top-level (qwen4_exp_text) object that holds the text config.
Fields text_fields(const json& root, std::string_view source) {
  Fields top(root, source, "");
  std::optional<std::string> type = top.optional_string("model_type", false);
  if (!type) top.error("model_type", "missing (must be \"qwen4_exp\" or \"qwen4_exp_text\")");
  if (*type == "qwen4_exp_text") return top;
  if (*type != "qwen4_exp")
    top.error("model_type", "must be \"qwen4_exp\" or \"qwen4_exp_text\", got {}", describe(*type));
  std::optional<Fields> text = top.object("text_config");
  if (!text) top.error("text_config", "missing (required when model_type is qwen4_exp)");
  return *text;
}

}  // namespace

ModelConfig parse_model_config(std::string_view json_text, std::string_view source) {
  json root = json::parse(json_text.begin(), json_text.end(), nullptr, false);
  check(!root.is_discarded(), "{}: not valid JSON", source);
  check(root.is_object(), "{}: not a JSON object", source);
  Fields f = text_fields(root, source);
  ModelConfig c;
  parse_core(f, c);
  parse_layer_types(f, c);
  c.mtp_num_layers = as_int(f.integer("mtp_num_hidden_layers", 0, 0, kMaxLayers));
  parse_attention(f, c);
  parse_indexer(f, c);
  parse_gdn(f, c);
  parse_moe(f, c);
  parse_hyper_connections(f, c);
  parse_eos(f, c);
  parse_ple(f, c);
  // The composite config carries tie_word_embeddings at the top; the text config's own value wins.
  c.tie_word_embeddings =
      f.boolean("tie_word_embeddings", Fields(root, source, "").boolean("tie_word_embeddings", false));
  return c;
}

// Takes a model directory (the usual case) or, for tools and tests, the path of a .json file itself.
ModelConfig load_model_config(const std::string& model_directory) {
  namespace fs = std::filesystem;
  fs::path path(model_directory);
  if (path.extension() != ".json") path /= "config.json";
  std::ifstream in(path, std::ios::binary);
  check(in.good(), "{}: cannot open the model config", path.string());
  std::stringstream text;
  text << in.rdbuf();
  return parse_model_config(text.str(), path.string());
}

}  // namespace vavilov
