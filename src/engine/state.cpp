#include "engine/state.h"

#include <fmt/core.h>

#include <string>
#include <utility>

#include "core/error.h"

namespace vavilov {

namespace {

LayerState new_layer_state(const ModelConfig& c, LayerKind kind, bool has_ple) {
  const LayerStateSizes sizes = layer_state_sizes(c, kind == LayerKind::GatedDeltaNet, false, has_ple, 0);
  LayerState s;
  s.gdn.conv.assign(sizes.gdn_conv, 0.0f);
  s.gdn.recurrent.assign(sizes.gdn_recurrent, 0.0f);
  s.ple.previous_ids.assign(sizes.ple_previous, c.eos());
  s.ple.conv_rows.assign(sizes.ple_conv, 0.0f);
  return s;
}

}  // namespace

LayerStateSizes layer_state_sizes(const ModelConfig& c, bool gdn, bool attention, bool ple, int64_t position) {
  const size_t p = size_t(position), index = size_t(c.indexer_head_dim);
  LayerStateSizes s;
  if (gdn) {
    s.gdn_conv = size_t(c.linear_conv_kernel_dim - 1) * size_t(c.gdn_conv_dim());
    s.gdn_recurrent =
        size_t(c.linear_num_value_heads) * size_t(c.linear_key_head_dim) * size_t(c.linear_value_head_dim);
  }
  if (attention) {
    s.kv = p * size_t(c.num_key_value_heads) * size_t(c.head_dim);
    s.index_keys = p * index;
    s.block_keys = size_t(position / c.indexer_compress_ratio) * index;
  }
  if (ple) {
    s.ple_previous = size_t(c.ngram_size - 1);
    s.ple_conv = size_t(c.ple_conv_kernel_size - 1) * size_t(c.ngram_size) * size_t(c.hc_hidden());
  }
  return s;
}

SequenceState new_sequence_state(const Model& model) {
  const ModelConfig& c = model.config;
  SequenceState state;
  for (int i = 0; i < c.num_layers; ++i)
    state.layers.push_back(new_layer_state(c, c.layer_kinds[i], c.is_ple_layer(i)));
  return state;
}

namespace {

void check_size(size_t have, size_t want, const char* field, const std::string& where) {
  check(have == want, "sequence state: {} {} has {} values, this model's takes {} (a state of another geometry?)",
        where, field, have, want);
}

// One layer's vectors against their shapes at `position` tokens: those of the parts it has, empty for the others.
void check_layer_fits(const LayerState& layer, const ModelConfig& c, bool gdn, bool attention, bool ple,
                      int64_t position, const std::string& where) {
  const LayerStateSizes want = layer_state_sizes(c, gdn, attention, ple, position);
  check_size(layer.gdn.conv.size(), want.gdn_conv, "GDN conv state", where);
  check_size(layer.gdn.recurrent.size(), want.gdn_recurrent, "GDN recurrent state", where);
  check_size(layer.attn.keys.size(), want.kv, "attention keys", where);
  check_size(layer.attn.values.size(), want.kv, "attention values", where);
  check_size(layer.attn.index_keys.size(), want.index_keys, "indexer keys", where);
  check_size(layer.attn.block_keys.size(), want.block_keys, "indexer block keys", where);
  check_size(layer.ple.previous_ids.size(), want.ple_previous, "PLE previous ids", where);
  check_size(layer.ple.conv_rows.size(), want.ple_conv, "PLE conv window", where);
  for (int64_t id : layer.ple.previous_ids)
    check(id == c.eos() || (id >= 0 && id < c.vocab_size), "sequence state: {} PLE previous id {} is outside [0, {})",
          where, id, c.vocab_size);
}

}  // namespace

void check_state_fits(const SequenceState& state, const ModelConfig& c, bool has_mtp) {
  check(state.layers.size() == size_t(c.num_layers), "sequence state: {} layers, this model has {}",
        state.layers.size(), c.num_layers);
  check(state.position >= 0 && state.mtp_position >= 0 && state.mtp_position <= state.position,
        "sequence state: position {} and MTP position {} are not 0 ≤ MTP ≤ position", state.position,
        state.mtp_position);
  check(has_mtp || state.mtp_position == 0, "sequence state: MTP position {} for a model without an MTP head",
        state.mtp_position);
  for (int i = 0; i < c.num_layers; ++i) {
    const LayerKind kind = c.layer_kinds[size_t(i)];
    check_layer_fits(state.layers[size_t(i)], c, kind == LayerKind::GatedDeltaNet, kind == LayerKind::SparseAttention,
                     c.is_ple_layer(i), state.position, fmt::format("layer {}", i));
  }
  check_layer_fits(state.mtp, c, false, has_mtp, false, state.mtp_position, "MTP layer");
}

StateSnapshot snapshot(const SequenceState& state) {
  StateSnapshot snap;
  snap.position = state.position;
  snap.mtp_position = state.mtp_position;
  for (const auto& layer : state.layers) {
    snap.gdn.push_back(layer.gdn);
    snap.ple.push_back(layer.ple);
  }
  return snap;
}

void truncate_attention(AttentionState& attn, int64_t position, const ModelConfig& c) {
  size_t kv = size_t(c.num_key_value_heads) * size_t(c.head_dim);
  size_t index = size_t(c.indexer_head_dim);
  if (attn.keys.size() < size_t(position) * kv) return;  // not an attention layer, or nothing cached yet
  attn.keys.resize(size_t(position) * kv);
  attn.values.resize(size_t(position) * kv);
  attn.index_keys.resize(size_t(position) * index);
  attn.block_keys.resize(size_t(position / c.indexer_compress_ratio) * index);
}

void restore(SequenceState& state, const StateSnapshot& snap, const ModelConfig& config) {
  check(snap.position <= state.position && snap.gdn.size() == state.layers.size(),
        "state snapshot at position {} does not belong to this sequence (at {})", snap.position, state.position);
  for (size_t i = 0; i < state.layers.size(); ++i) {
    state.layers[i].gdn = snap.gdn[i];
    state.layers[i].ple = snap.ple[i];
    truncate_attention(state.layers[i].attn, snap.position, config);
  }
  truncate_attention(state.mtp.attn, snap.mtp_position, config);
  state.position = snap.position;
  state.mtp_position = snap.mtp_position;
}

void keep_rows(SequenceState& state, RowStates& rows, int64_t first_position, int64_t kept, const ModelConfig& config) {
  check(kept >= 1 && first_position + kept <= state.position, "keep_rows: cannot keep {} rows from position {}", kept,
        first_position);
  if (first_position + kept == state.position) return;
  for (size_t i = 0; i < state.layers.size(); ++i) {
    // Swapped, not copied: the record is not read again, and its storage stays shaped for the next pass.
    if (!rows.gdn[i].empty()) std::swap(state.layers[i].gdn, rows.gdn[i][size_t(kept - 1)]);
    if (!rows.ple[i].empty()) std::swap(state.layers[i].ple, rows.ple[i][size_t(kept - 1)]);
    truncate_attention(state.layers[i].attn, first_position + kept, config);
  }
  state.position = first_position + kept;
}

void shape_row_states(std::vector<GatedDeltaNetState>& rows, size_t count, const GatedDeltaNetState& like) {
  rows.resize(count);
  for (GatedDeltaNetState& row : rows) {
    row.conv.resize(like.conv.size());
    row.recurrent.resize(like.recurrent.size());
  }
}

void shape_row_states(std::vector<PleState>& rows, size_t count, const PleState& like) {
  rows.resize(count);
  for (PleState& row : rows) {
    row.previous_ids.resize(like.previous_ids.size());
    row.conv_rows.resize(like.conv_rows.size());
  }
}

}  // namespace vavilov
