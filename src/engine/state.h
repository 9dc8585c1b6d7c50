#pragma once
// Everything one sequence carries from step to step. Attention caches only grow, so a snapshot stores the
// position plus copies of the fixed-size recurrent parts; restoring truncates the caches to that position.
#include <cstdint>
#include <vector>

#include "model/weights.h"

namespace vavilov {

struct GatedDeltaNetState {
  std::vector<float> conv;       // last (kernel − 1) pre-conv qkv columns, oldest first: [kernel−1, conv_dim]
  std::vector<float> recurrent;  // [value_heads, key_head_dim, value_head_dim]
};

struct AttentionState {
  std::vector<float> keys, values;  // [position, kv_heads, head_dim], keys after norm and RoPE
  std::vector<float> index_keys;    // raw indexer keys [position, index_head_dim]
  std::vector<float> block_keys;    // pooled, normalised, rotated keys of complete blocks [blocks, index_head_dim]
};

struct PleState {
  std::vector<int64_t> previous_ids;  // the ngram_size − 1 tokens before the next one (EOS at the start)
  std::vector<float> conv_rows;       // last (kernel−1)·dilation normalised rows [rows, S·H], oldest first
};

struct LayerState {
  GatedDeltaNetState gdn;
  AttentionState attn;
  PleState ple;
};

struct SequenceState {
  int64_t position = 0;
  std::vector<LayerState> layers;
  LayerState mtp;            // the MTP layer's own caches
  int64_t mtp_position = 0;  // how many positions the MTP layer has cached
};

struct StateSnapshot {
  int64_t position = 0, mtp_position = 0;
  std::vector<GatedDeltaNetState> gdn;
  std::vector<PleState> ple;
};

// The recurrent parts of the state after each row but the last of one multi-row forward pass (the live state holds
// the last), so that a speculative verify step can keep any prefix of its rows: [layer][row]. Reusing one RowStates
// across steps reuses its storage.
struct RowStates {
  std::vector<std::vector<GatedDeltaNetState>> gdn;
  std::vector<std::vector<PleState>> ple;
};

// Sizes `rows` to `count` states shaped like `like`, keeping their storage; the contents are for the caller to fill.
void shape_row_states(std::vector<GatedDeltaNetState>& rows, size_t count, const GatedDeltaNetState& like);
void shape_row_states(std::vector<PleState>& rows, size_t count, const PleState& like);

// Element counts of a layer's state vectors at `position` tokens, for the parts the layer has (0 for the others).
struct LayerStateSizes {
  size_t gdn_conv = 0, gdn_recurrent = 0, kv = 0, index_keys = 0, block_keys = 0, ple_previous = 0, ple_conv = 0;
};
LayerStateSizes layer_state_sizes(const ModelConfig& c, bool gdn, bool attention, bool ple, int64_t position);

SequenceState new_sequence_state(const Model& model);
// Checks that `state` is shaped for a model of this config (with an MTP head or not) at its own positions: the layer
// count, each layer's GDN, attention and PLE vectors, the MTP caches; PLE ids inside the vocabulary. Throws an error
// naming the first field that does not fit and both sizes (a state of another geometry).
void check_state_fits(const SequenceState& state, const ModelConfig& config, bool has_mtp);
StateSnapshot snapshot(const SequenceState& state);
// Returns the state to a snapshot taken earlier in the same sequence (caches truncated, recurrences copied back).
void restore(SequenceState& state, const StateSnapshot& snap, const ModelConfig& config);
// Keeps the first `kept` rows of the last forward pass (which started at `first_position` and recorded `rows`). The
// kept row's record is swapped into the state, so `rows` holds no valid record afterwards.
void keep_rows(SequenceState& state, RowStates& rows, int64_t first_position, int64_t kept, const ModelConfig& config);
// Truncates attention caches of one layer to `position` tokens.
void truncate_attention(AttentionState& attn, int64_t position, const ModelConfig& config);

}  // namespace vavilov
