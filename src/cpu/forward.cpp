#include "cpu/forward.h"

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "cpu/layers.h"
#include "cpu/linear.h"

namespace vavilov::cpu {

void decoder_layer(const LayerWeights& w, const ModelConfig& c, LayerState& state, int64_t first_position,
                   std::span<const int32_t> ids, float* stack, RowStates* row_states, int layer) {
  const int64_t rows = int64_t(ids.size()), h = c.hidden_size, sh = c.hc_hidden();
  std::vector<float> input(size_t(rows * h)), output(size_t(rows * h)), inject(size_t(rows * c.hc_count));
  if (w.ple) {
    std::vector<float> added(size_t(rows * sh));
    ple(*w.ple, c, state.ple, ids.data(), stack, rows, added.data(), row_states ? &row_states->ple[layer] : nullptr);
    for (size_t i = 0; i < added.size(); ++i) stack[i] += added[i];
  }
  hyper_read(w.attn_hc, c, stack, rows, input.data(), inject.data());
  if (w.kind == LayerKind::GatedDeltaNet)
    gated_deltanet(w.gdn, c, state.gdn, input.data(), rows, output.data(),
                   row_states ? &row_states->gdn[layer] : nullptr);
  else
    sparse_attention(w.attn, c, state.attn, first_position, input.data(), rows, output.data());
  hyper_write(inject.data(), output.data(), rows, c, stack);

  hyper_read(w.mlp_hc, c, stack, rows, input.data(), inject.data());
  moe(w.moe, c, input.data(), rows, output.data());
  hyper_write(inject.data(), output.data(), rows, c, stack);
}

void logits_from_stacks(const Model& model, const GatedResidualWeights& mixer, const float* stacks, int64_t rows,
                        float* logits) {
  std::vector<float> hidden(size_t(rows * model.config.hidden_size));
  hyper_read(mixer, model.config, stacks, rows, hidden.data(), nullptr);
  matmul(model.lm_head, hidden.data(), rows, logits);
}

void forward(const Model& model, SequenceState& state, std::span<const int32_t> ids, const ForwardOutputs& outputs) {
  const ModelConfig& c = model.config;
  const int64_t rows = int64_t(ids.size()), h = c.hidden_size, sh = c.hc_hidden();
  check(rows > 0, "forward: no tokens");
  for (int32_t id : ids) check(id >= 0 && id < c.vocab_size, "token id {} is outside the vocabulary [0, {})", id,
                               c.vocab_size);

  std::vector<float> stack(size_t(rows * sh));
  std::vector<float> row(static_cast<size_t>(h));
  for (int64_t t = 0; t < rows; ++t) {
    matrix_row(model.embed, ids[t], row.data());
    for (int64_t s = 0; s < c.hc_count; ++s) std::copy(row.begin(), row.end(), stack.begin() + t * sh + s * h);
  }
  if (outputs.row_states) {
    outputs.row_states->gdn.assign(size_t(c.num_layers), {});
    outputs.row_states->ple.assign(size_t(c.num_layers), {});
  }
  for (int i = 0; i < c.num_layers; ++i)
    decoder_layer(model.layers[i], c, state.layers[i], state.position, ids, stack.data(), outputs.row_states, i);
  state.position += rows;

  if (outputs.stacks) std::copy(stack.begin(), stack.end(), outputs.stacks);
  if (!outputs.logits) return;
  if (outputs.all_rows)
    logits_from_stacks(model, model.final_mixer, stack.data(), rows, outputs.logits);
  else
    logits_from_stacks(model, model.final_mixer, stack.data() + (rows - 1) * sh, 1, outputs.logits);
}

}  // namespace vavilov::cpu
