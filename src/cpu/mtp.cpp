#include "cpu/mtp.h"

#include <cmath>
#include <numeric>
#include <vector>

#include "core/error.h"
#include "cpu/forward.h"
#include "cpu/layers.h"
#include "cpu/linear.h"
#include "cpu/ops.h"

namespace vavilov::cpu {

namespace {

// R'[r, s] = fc_hidden · RMS0(stacks[r])[s] + fc_embedding · RMS0(embed[next_ids[r]]) for every stream s: the
// RMS norm runs over all S·H values of a row at once, fc_hidden over each stream.
void fold(const Model& model, const float* stacks, std::span<const int32_t> next_ids, float* folded) {
  const MtpWeights& w = *model.mtp;
  const ModelConfig& c = model.config;
  const int64_t rows = int64_t(next_ids.size()), h = c.hidden_size, sh = c.hc_hidden();
  std::vector<float> normed(size_t(rows * h)), embedded(size_t(rows * h)), row(static_cast<size_t>(h));
  for (int64_t r = 0; r < rows; ++r) {
    matrix_row(model.embed, next_ids[r], row.data());
    rms_norm_zero_centred(row.data(), w.pre_fc_norm_embedding.data(), 1, h, c.rms_norm_eps, normed.data() + r * h);
  }
  matmul(w.fc_embedding, normed.data(), rows, embedded.data());
  std::vector<float> hidden_normed(size_t(rows * sh));
  for (int64_t r = 0; r < rows; ++r)
    rms_norm_zero_centred(stacks + r * sh, w.pre_fc_norm_hidden.data(), 1, sh, c.rms_norm_eps,
                          hidden_normed.data() + r * sh);
  matmul(w.fc_hidden, hidden_normed.data(), rows * c.hc_count, folded);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t s = 0; s < c.hc_count; ++s)
      for (int64_t d = 0; d < h; ++d) folded[(r * c.hc_count + s) * h + d] += embedded[r * h + d];
}

}  // namespace

void mtp_forward(const Model& model, SequenceState& state, const float* stacks, std::span<const int32_t> next_ids,
                 float* head_stacks, MtpRows output) {
  check(model.mtp.has_value(), "{}: the checkpoint has no MTP head (mtp.* tensors)", model.directory);
  const MtpWeights& w = *model.mtp;
  const ModelConfig& c = model.config;
  const int64_t rows = int64_t(next_ids.size()), sh = c.hc_hidden();
  for (int32_t id : next_ids) check(id >= 0 && id < c.vocab_size, "token id {} is outside the vocabulary", id);

  // Rows whose output is not read only leave their keys in the head's caches.
  const int64_t cache_only = output == MtpRows::Last ? rows - 1 : 0;
  if (cache_only > 0) {
    std::vector<float> folded(size_t(cache_only * sh)), input(size_t(cache_only * c.hidden_size));
    fold(model, stacks, next_ids.first(size_t(cache_only)), folded.data());
    hyper_read(w.layer.attn_hc, c, folded.data(), cache_only, input.data(), nullptr);
    Segment segment;
    segment.state = &state.mtp;
    segment.first_position = state.mtp_position;
    segment.rows = cache_only;
    segment.ids = next_ids.data();
    extend_attention_cache(w.layer.attn, c, segment, input.data());
    state.mtp_position += cache_only;
  }

  const int64_t full = rows - cache_only;
  fold(model, stacks + cache_only * sh, next_ids.subspan(size_t(cache_only)), head_stacks);
  Segment segment;
  segment.state = &state.mtp;
  segment.first_position = state.mtp_position;
  segment.rows = full;
  segment.ids = next_ids.data() + cache_only;
  decoder_layer(w.layer, c, std::span<const Segment>(&segment, 1), head_stacks, full);
  state.mtp_position += full;
}

void mtp_logits(const Model& model, const float* head_stacks, int64_t rows, float* logits) {
  logits_from_stacks(model, model.mtp->final_mixer, head_stacks, rows, logits);
}

DraftLmHead draft_lm_head(const Model& model, std::vector<int32_t> ids) {
  DraftLmHead head;
  head.rows = quantize_int8(model.lm_head, ids);
  if (ids.empty()) {
    ids.resize(size_t(model.config.vocab_size));
    std::iota(ids.begin(), ids.end(), 0);
    head.every_id = true;
  }
  head.ids = std::move(ids);
  return head;
}

void mtp_draft_logits(const Model& model, const DraftLmHead& lm_head, const float* head_stack, float* logits) {
  std::vector<float> hidden(static_cast<size_t>(model.config.hidden_size));
  hyper_read(model.mtp->final_mixer, model.config, head_stack, 1, hidden.data(), nullptr);
  const int64_t vocab = model.config.vocab_size;
  if (lm_head.every_id) {
    int8_matvec(lm_head.rows, hidden.data(), logits);
    return;
  }
  std::vector<float> scores(lm_head.ids.size());
  int8_matvec(lm_head.rows, hidden.data(), scores.data());
  std::fill(logits, logits + vocab, -INFINITY);
  for (size_t i = 0; i < scores.size(); ++i) logits[lm_head.ids[i]] = scores[i];
}

}  // namespace vavilov::cpu
