#include "cpu/forward.h"

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "cpu/layers.h"
#include "cpu/linear.h"

namespace vavilov::cpu {

void decoder_layer(const LayerWeights& w, const ModelConfig& c, std::span<const Segment> segments, float* stack,
                   int64_t rows) {
  const int64_t h = c.hidden_size, sh = c.hc_hidden();
  std::vector<float> input(size_t(rows * h)), output(size_t(rows * h)), inject(size_t(rows * c.hc_count));
  if (w.ple) {
    std::vector<float> added(size_t(rows * sh));
    ple(*w.ple, c, segments, stack, rows, added.data());
    for (size_t i = 0; i < added.size(); ++i) stack[i] += added[i];
  }
  hyper_read(w.attn_hc, c, stack, rows, input.data(), inject.data());
  if (w.kind == LayerKind::GatedDeltaNet)
    gated_deltanet(w.gdn, c, segments, input.data(), rows, output.data());
  else
    sparse_attention(w.attn, c, segments, input.data(), rows, output.data());
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

namespace {

// Segments of every chunk for one layer, with per-row state recording where asked.
std::vector<Segment> layer_segments(std::span<const SequenceChunk> chunks, int layer) {
  std::vector<Segment> segments;
  int64_t row = 0;
  for (const SequenceChunk& chunk : chunks) {
    Segment seg;
    seg.state = &chunk.state->layers[size_t(layer)];
    seg.first_position = chunk.state->position;
    seg.row_begin = row;
    seg.rows = int64_t(chunk.ids.size());
    seg.ids = chunk.ids.data();
    if (RowStates* recorded = chunk.outputs.row_states) {
      seg.gdn_rows = &recorded->gdn[size_t(layer)];
      seg.ple_rows = &recorded->ple[size_t(layer)];
    }
    segments.push_back(seg);
    row += seg.rows;
  }
  return segments;
}

}  // namespace

void forward_batch(const Model& model, std::span<const SequenceChunk> chunks) {
  const ModelConfig& c = model.config;
  const int64_t h = c.hidden_size, sh = c.hc_hidden(), vocab = c.vocab_size;
  int64_t rows = 0;
  for (const SequenceChunk& chunk : chunks) {
    check(!chunk.ids.empty(), "forward: no tokens");
    for (int32_t id : chunk.ids)
      check(id >= 0 && id < vocab, "token id {} is outside the vocabulary [0, {})", id, vocab);
    if (chunk.outputs.row_states) {
      chunk.outputs.row_states->gdn.resize(size_t(c.num_layers));
      chunk.outputs.row_states->ple.resize(size_t(c.num_layers));
    }
    rows += int64_t(chunk.ids.size());
  }

  std::vector<float> stack(size_t(rows * sh));
  std::vector<float> row_values(static_cast<size_t>(h));
  int64_t t = 0;
  for (const SequenceChunk& chunk : chunks)
    for (int32_t id : chunk.ids) {
      matrix_row(model.embed, id, row_values.data());
      for (int64_t s = 0; s < c.hc_count; ++s) std::copy(row_values.begin(), row_values.end(), stack.begin() + t * sh + s * h);
      ++t;
    }
  for (int i = 0; i < c.num_layers; ++i)
    decoder_layer(model.layers[i], c, layer_segments(chunks, i), stack.data(), rows);

  // The final mixer and lm_head once over every row that needs logits, whichever sequence it belongs to.
  std::vector<float> wanted;
  int64_t row = 0;
  for (const SequenceChunk& chunk : chunks) {
    const int64_t n = int64_t(chunk.ids.size());
    chunk.state->position += n;
    const float* chunk_stack = stack.data() + row * sh;
    if (chunk.outputs.stacks) std::copy(chunk_stack, chunk_stack + n * sh, chunk.outputs.stacks);
    if (chunk.outputs.logits) {
      const float* first = chunk.outputs.all_rows ? chunk_stack : chunk_stack + (n - 1) * sh;
      wanted.insert(wanted.end(), first, chunk_stack + n * sh);
    }
    row += n;
  }
  if (wanted.empty()) return;
  const int64_t logit_rows = int64_t(wanted.size()) / sh;
  std::vector<float> logits(size_t(logit_rows * vocab));
  logits_from_stacks(model, model.final_mixer, wanted.data(), logit_rows, logits.data());
  const float* next = logits.data();
  for (const SequenceChunk& chunk : chunks) {
    if (!chunk.outputs.logits) continue;
    const int64_t n = chunk.outputs.all_rows ? int64_t(chunk.ids.size()) : 1;
    std::copy(next, next + n * vocab, chunk.outputs.logits);
    next += n * vocab;
  }
}

}  // namespace vavilov::cpu
