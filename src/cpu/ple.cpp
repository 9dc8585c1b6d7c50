// PLE: hashed n-gram embeddings of the last ngram_size tokens (segments cut at EOS), gated per stream by the
// normalised residual, plus a dilated depthwise conv over the normalised gated values.
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/layers.h"
#include "cpu/linear.h"
#include "cpu/ops.h"

namespace vavilov::cpu {

namespace {

// Table rows of every n-gram head for the token at history[index] (history holds the previous tokens first).
void ngram_rows(const PleWeights& w, const ModelConfig& c, const std::vector<int64_t>& history, size_t index,
                int64_t* rows) {
  const int64_t eos = c.eos();
  // context[s] = the token s steps back if no EOS lies strictly between it and the current token, else EOS.
  std::vector<int64_t> context(size_t(c.ngram_size));
  bool cut = false;
  for (int s = 0; s < c.ngram_size; ++s) {
    if (s >= 2 && history[index - s + 1] == eos) cut = true;
    context[s] = (s == 0 || !cut) ? history[index - s] : eos;
  }
  uint64_t mixed = uint64_t(context[0]) * uint64_t(w.multipliers[0]);
  for (int n = 2; n <= c.ngram_size; ++n) {
    mixed ^= uint64_t(context[n - 1]) * uint64_t(w.multipliers[n - 1]);  // wrapping int64 arithmetic, as torch
    for (int head = (n - 2) * c.heads_per_ngram; head < (n - 1) * c.heads_per_ngram; ++head) {
      int64_t remainder = int64_t(mixed) % w.head_sizes[head];
      if (remainder < 0) remainder += w.head_sizes[head];
      rows[head] = remainder + w.head_offsets[head];
    }
  }
}

}  // namespace

namespace {

// The concatenated n-gram embeddings [seg.rows, E] of one segment; advances its token history.
void segment_embeddings(const PleWeights& w, const ModelConfig& c, const Segment& seg, float* embedding) {
  const int64_t e_dim = c.ple_embed_dim, head_width = w.head_width(), context = c.ngram_size - 1;
  PleState& state = seg.state->ple;
  std::vector<int64_t> history(state.previous_ids);
  history.insert(history.end(), seg.ids, seg.ids + seg.rows);
  std::vector<int64_t> table_rows(size_t(c.ngram_heads()));
  for (int64_t t = 0; t < seg.rows; ++t) {
    ngram_rows(w, c, history, size_t(t + context), table_rows.data());
    for (int head = 0; head < c.ngram_heads(); ++head)
      w.table_row(table_rows[head], embedding + t * e_dim + head * head_width);
  }
  if (seg.ple_rows) {
    shape_row_states(*seg.ple_rows, size_t(seg.rows - 1), state);
    for (size_t t = 0; t < seg.ple_rows->size(); ++t)
      std::copy_n(history.begin() + int64_t(t) + 1, context, (*seg.ple_rows)[t].previous_ids.begin());
  }
  std::copy(history.end() - context, history.end(), state.previous_ids.begin());
}

// Dilated causal conv over one segment's normalised rows: taps at t − dilation·(kernel−1−k); the state holds the
// last (kernel−1)·dilation rows. out += silu(conv).
void segment_conv(const PleWeights& w, const ModelConfig& c, const Segment& seg, const float* normed, float* out) {
  const int64_t sh = c.hc_hidden(), kernel = c.ple_conv_kernel_size, dilation = c.ngram_size;
  const int64_t history_rows = (kernel - 1) * dilation;
  PleState& state = seg.state->ple;
  std::vector<float> window(state.conv_rows);
  window.insert(window.end(), normed, normed + seg.rows * sh);
  std::vector<float> conv(static_cast<size_t>(sh));
  for (int64_t t = 0; t < seg.rows; ++t) {
    for (int64_t ch = 0; ch < sh; ++ch) {
      float sum = 0.0f;
      for (int64_t k = 0; k < kernel; ++k)
        sum += w.conv[ch * kernel + k] * window[(t + history_rows - dilation * (kernel - 1 - k)) * sh + ch];
      conv[size_t(ch)] = sum;
    }
    silu_inplace(conv.data(), sh);
    for (int64_t ch = 0; ch < sh; ++ch) out[t * sh + ch] += conv[size_t(ch)];
  }
  std::copy(window.end() - history_rows * sh, window.end(), state.conv_rows.begin());
  if (seg.ple_rows)
    for (size_t t = 0; t < seg.ple_rows->size(); ++t)
      std::copy_n(window.begin() + int64_t(t + 1) * sh, history_rows * sh, (*seg.ple_rows)[t].conv_rows.begin());
}

}  // namespace

void ple(const PleWeights& w, const ModelConfig& c, std::span<const Segment> segments, const float* stack,
         int64_t rows, float* out) {
  const int64_t s_count = c.hc_count, h = c.hidden_size, sh = c.hc_hidden(), e_dim = c.ple_embed_dim;
  std::vector<float> embedding(size_t(rows * e_dim));
  for (const Segment& seg : segments) segment_embeddings(w, c, seg, embedding.data() + seg.row_begin * e_dim);

  std::vector<float> keys(size_t(rows * sh)), value(size_t(rows * h)), query(size_t(rows * sh));
  matmul(w.key_proj, embedding.data(), rows, keys.data());
  matmul(w.value_proj, embedding.data(), rows, value.data());
  std::vector<float> normed(size_t(rows * sh));
  for (int64_t t = 0; t < rows; ++t) {
    float* key = keys.data() + t * sh;
    rms_norm_zero_centred(key, w.norm_key.data(), s_count, h, c.rms_norm_eps, key);
    rms_norm_zero_centred(stack + t * sh, w.norm_query.data(), s_count, h, c.rms_norm_eps, query.data() + t * sh);
    for (int64_t s = 0; s < s_count; ++s) {
      float score = dot(key + s * h, query.data() + t * sh + s * h, h) / std::sqrt(float(h));
      float shaped = std::sqrt(std::max(std::fabs(score), 1e-6f)) * float((score > 0) - (score < 0));
      float gate = sigmoid(shaped);
      for (int64_t d = 0; d < h; ++d) out[t * sh + s * h + d] = gate * value[t * h + d];
    }
    rms_norm_zero_centred(out + t * sh, w.norm_conv.data(), s_count, h, c.rms_norm_eps, normed.data() + t * sh);
  }
  for (const Segment& seg : segments)
    segment_conv(w, c, seg, normed.data() + seg.row_begin * sh, out + seg.row_begin * sh);
}

}  // namespace vavilov::cpu
