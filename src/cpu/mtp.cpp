#include "cpu/mtp.h"

#include <vector>

#include "core/error.h"
#include "cpu/forward.h"
#include "cpu/layers.h"
#include "cpu/linear.h"
#include "cpu/ops.h"

namespace vavilov::cpu {

void mtp_forward(const Model& model, SequenceState& state, const float* stacks, std::span<const int32_t> next_ids,
                 float* head_stacks) {
  check(model.mtp.has_value(), "{}: the checkpoint has no MTP head (mtp.* tensors)", model.directory);
  const MtpWeights& w = *model.mtp;
  const ModelConfig& c = model.config;
  const int64_t rows = int64_t(next_ids.size()), h = c.hidden_size, sh = c.hc_hidden();
  for (int32_t id : next_ids) check(id >= 0 && id < c.vocab_size, "token id {} is outside the vocabulary", id);

  // e = fc_embedding · RMS0(embed[next])
  std::vector<float> normed(size_t(rows * h)), embedded(size_t(rows * h)), row(static_cast<size_t>(h));
  for (int64_t r = 0; r < rows; ++r) {
    matrix_row(model.embed, next_ids[r], row.data());
    rms_norm_zero_centred(row.data(), w.pre_fc_norm_embedding.data(), 1, h, c.rms_norm_eps, normed.data() + r * h);
  }
  matmul(w.fc_embedding, normed.data(), rows, embedded.data());

  // ĥ = RMS0 over all S·H values at once; R'[s] = fc_hidden · ĥ[s] + e for every stream s.
  std::vector<float> hidden_normed(size_t(rows * sh));
  for (int64_t r = 0; r < rows; ++r)
    rms_norm_zero_centred(stacks + r * sh, w.pre_fc_norm_hidden.data(), 1, sh, c.rms_norm_eps,
                          hidden_normed.data() + r * sh);
  matmul(w.fc_hidden, hidden_normed.data(), rows * c.hc_count, head_stacks);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t s = 0; s < c.hc_count; ++s)
      for (int64_t d = 0; d < h; ++d) head_stacks[(r * c.hc_count + s) * h + d] += embedded[r * h + d];

  Segment segment;
  segment.state = &state.mtp;
  segment.first_position = state.mtp_position;
  segment.rows = rows;
  segment.ids = next_ids.data();
  decoder_layer(w.layer, c, std::span<const Segment>(&segment, 1), head_stacks, rows);
  state.mtp_position += rows;
}

void mtp_logits(const Model& model, const float* head_stacks, int64_t rows, float* logits) {
  logits_from_stacks(model, model.mtp->final_mixer, head_stacks, rows, logits);
}

}  // namespace vavilov::cpu
