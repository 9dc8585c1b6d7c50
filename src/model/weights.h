#pragma once
// The qwen4_exp weights as the engine uses them: large matrices stay in the memory-mapped checkpoint in their
// stored dtype; small vectors (norms, conv taps, decay parameters) are converted to fp32 once at load.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "io/safetensors.h"
#include "model/config.h"

namespace vavilov {

// W [rows, cols], row-major, used as y = W x. Dense in a float dtype, or affine-quantized (`bits` 4/3/2): codes packed
// least-significant first into little-endian uint32 words (3-bit codes run on across word boundaries), and per group
// of `group` columns a bf16 scale and bias, w = scale·q + bias (MLX's layout, so such checkpoints map onto it bit for
// bit). Matrix products need kQuantGroup; other groups (MLX's group-32 n-gram table) are only read row by row.
constexpr int64_t kQuantGroup = 64;

struct Matrix {
  std::string name;
  DType dtype = DType::F32;  // dense element type (quantized matrices: BF16, the type of scales and biases)
  int64_t rows = 0, cols = 0;
  const std::byte* data = nullptr;   // dense rows, or packed codes
  int bits = 0;                      // 0: dense
  const uint16_t* scales = nullptr;  // [rows, cols / group] bf16
  const uint16_t* biases = nullptr;
  int64_t group = kQuantGroup;  // columns per scale and bias
  // NVIDIA NVFP4 (ModelOpt exports; bits 4, group 16): data holds e2m1 codes, two a byte with the even column in the
  // low nibble, and block_scales an e4m3 scale per 16 columns [rows, cols/16]; w = e2m1 · block scale · tensor_scale.
  const uint8_t* block_scales = nullptr;
  float tensor_scale = 1.0f;  // NVFP4's weight_scale_2; dense F8_E4M3 weights' per-tensor weight_scale

  bool empty() const { return rows == 0; }
  bool quantized() const { return bits != 0; }
  bool nvfp4() const { return block_scales != nullptr; }
  size_t row_bytes() const { return quantized() ? size_t(cols) * size_t(bits) / 8 : size_t(cols) * dtype_size(dtype); }
  const std::byte* row(int64_t r) const { return data + size_t(r) * row_bytes(); }
  // Rows [begin, begin + count) as a matrix of their own (fused expert tensors are split this way).
  Matrix slice_rows(int64_t begin, int64_t count, std::string slice_name) const;
  // Every byte range the matrix reads: rows or codes, then (quantized) scales and biases or NVFP4 block scales.
  std::vector<std::span<const std::byte>> storage() const;
  // Affine codes at group kQuantGroup with bf16 scales and biases: the layout the packed store's records hold.
  bool group64_affine() const { return quantized() && !nvfp4() && group == kQuantGroup; }
};

using Vector = std::vector<float>;

struct GatedResidualWeights {
  Vector norm;              // [S·H], zero-centred
  Matrix mix_down, mix_up;  // [R, S·H], [S·H, R]
  Matrix inject;            // [S, S·H]; empty on final mixers
};

struct GatedDeltaNetWeights {
  Matrix in_qkv, in_z, in_b, in_a, out;
  Vector conv;  // [conv_dim, kernel]
  Vector a_log, dt_bias;
  Vector norm;  // [value_head_dim], plain weight
};

struct SparseAttentionWeights {
  Matrix q, k, v, o;
  Vector q_norm, k_norm;
  Matrix index_qk;  // [(index_heads + 1) · index_head_dim, H]
  Vector index_q_norm, index_k_norm;
};

struct FeedForwardWeights {
  Matrix gate, up, down;
};

struct MoeWeights {
  Matrix router;  // [E, H]
  std::vector<FeedForwardWeights> experts;
  FeedForwardWeights shared;
  Matrix shared_gate;  // [1, H]
};

struct PleWeights {
  std::vector<Matrix> table_shards;  // row shards of the n-gram table, in order
  std::vector<int64_t> shard_first_row;
  int64_t table_rows = 0;
  std::vector<int64_t> multipliers;   // [ngram_size]
  std::vector<int64_t> head_sizes;    // [ngram heads]
  std::vector<int64_t> head_offsets;  // [ngram heads]
  Matrix key_proj, value_proj;        // [S·H, E], [H, E]
  Vector norm_key, norm_query, norm_conv;
  Vector conv;  // [S·H, kernel]

  // One table row as fp32 (dense shards converted, quantized ones dequantized).
  void table_row(int64_t row, float* out) const;
  int64_t head_width() const { return table_shards.front().cols; }
};

struct LayerWeights {
  LayerKind kind = LayerKind::GatedDeltaNet;
  GatedResidualWeights attn_hc, mlp_hc;
  GatedDeltaNetWeights gdn;
  SparseAttentionWeights attn;
  MoeWeights moe;
  std::optional<PleWeights> ple;
};

// The MTP head's own weights (SGLang/vLLM definition); it shares embed_tokens and lm_head with the trunk.
struct MtpWeights {
  Vector pre_fc_norm_embedding, pre_fc_norm_hidden;
  Matrix fc_embedding, fc_hidden;
  LayerWeights layer;
  GatedResidualWeights final_mixer;
};

class PackedStore;

struct Model {
  ModelConfig config;
  std::string directory;
  std::unique_ptr<TensorStore> store;
  std::shared_ptr<const PackedStore> packed;  // maps the expert records when loaded from a packed store
  std::vector<std::vector<std::byte>> owned;  // weights made at load (quantized copies)
  Matrix embed, lm_head;
  std::vector<LayerWeights> layers;
  GatedResidualWeights final_mixer;
  std::optional<MtpWeights> mtp;
};

// Loads a checkpoint directory or a packed store (recognised by its manifest.json), then reads every weight into
// memory, with progress on a terminal. A store's routed experts come from the records at `expert_bits` (4, 3 or 2)
// where it holds them, else (and with expert_bits 0) from the most precise it holds.
std::unique_ptr<Model> load_model(const std::string& path, int expert_bits = 0);

// Loads config.json and the safetensors of a model directory; every tensor's presence, dtype and shape is
// checked against the config, and errors name the file and the tensor. Weights stay mapped, unread.
std::unique_ptr<Model> load_checkpoint(const std::string& directory);

// Fills the model's weights from model.store and model.config; routed experts only when `routed_experts`
// (a packed store keeps them in records of their own).
void read_weights(Model& model, bool routed_experts);

// Every weight matrix of the model (trunk, MTP head, embeddings, lm_head; not the PLE table).
void for_each_matrix(Model& model, const std::function<void(Matrix&)>& visit);

}  // namespace vavilov
