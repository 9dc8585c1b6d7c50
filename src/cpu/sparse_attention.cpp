// Gated full attention over the tokens the QSA indexer selects: the top budget/ratio blocks of `ratio` keys by
// the indexer's pooled-key score, plus the incomplete tail. Short contexts select every block.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/error.h"
#include "core/threads.h"
#include "cpu/layers.h"
#include "cpu/linear.h"
#include "cpu/ops.h"

namespace vavilov::cpu {

namespace {

struct RopeTable {
  std::vector<float> cos, sin;
  RopeTable(int64_t position, const ModelConfig& c) : cos(size_t(c.rotary_dim)), sin(size_t(c.rotary_dim)) {
    rope_tables(position, c.rope_theta, c.rotary_dim, cos.data(), sin.data());
  }
  void apply(float* x, int64_t rotary_dim) const { apply_rope(x, cos.data(), sin.data(), rotary_dim); }
};

// Appends raw indexer keys and the pooled keys of every block they complete.
void append_index_keys(const SparseAttentionWeights& w, const ModelConfig& c, AttentionState& state,
                       const float* index_qk, int64_t rows) {
  const int64_t ihd = c.indexer_head_dim, stride = int64_t(c.indexer_n_heads + 1) * ihd;
  const int64_t ratio = c.indexer_compress_ratio;
  for (int64_t t = 0; t < rows; ++t) {
    const float* raw = index_qk + t * stride + int64_t(c.indexer_n_heads) * ihd;
    state.index_keys.insert(state.index_keys.end(), raw, raw + ihd);
  }
  int64_t cached = int64_t(state.index_keys.size()) / ihd;
  for (int64_t block = int64_t(state.block_keys.size()) / ihd; (block + 1) * ratio <= cached; ++block) {
    std::vector<float> pooled(size_t(ihd), 0.0f), normed(static_cast<size_t>(ihd));
    for (int64_t i = 0; i < ratio; ++i)
      for (int64_t d = 0; d < ihd; ++d) pooled[d] += state.index_keys[size_t((block * ratio + i) * ihd + d)];
    for (auto& v : pooled) v /= float(ratio);
    rms_norm_zero_centred(pooled.data(), w.index_k_norm.data(), 1, ihd, c.rms_norm_eps, normed.data());
    RopeTable(block * ratio, c).apply(normed.data(), c.rotary_dim);
    state.block_keys.insert(state.block_keys.end(), normed.begin(), normed.end());
  }
}

// Token positions a query at `position` attends to.
std::vector<int64_t> select_tokens(const ModelConfig& c, const AttentionState& state, const float* index_query,
                                   int64_t position) {
  const int64_t visible = position + 1, ratio = c.indexer_compress_ratio, ihd = c.indexer_head_dim;
  const int64_t blocks = visible / ratio, keep = c.indexer_budget / ratio;
  std::vector<int64_t> tokens;
  if (blocks <= keep) {
    tokens.resize(static_cast<size_t>(visible));
    std::iota(tokens.begin(), tokens.end(), 0);
    return tokens;
  }
  std::vector<float> score(size_t(blocks), 0.0f);
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t h = 0; h < c.indexer_n_heads; ++h)
      score[b] += std::max(0.0f, dot(index_query + h * ihd, state.block_keys.data() + b * ihd, ihd));
    score[b] /= std::sqrt(float(ihd));
  }
  std::vector<int64_t> order(static_cast<size_t>(blocks));
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + keep, order.end(),
                    [&](int64_t a, int64_t b) { return score[a] > score[b] || (score[a] == score[b] && a < b); });
  order.resize(static_cast<size_t>(keep));
  std::sort(order.begin(), order.end());
  for (int64_t b : order)
    for (int64_t i = 0; i < ratio; ++i) tokens.push_back(b * ratio + i);
  for (int64_t p = blocks * ratio; p < visible; ++p) tokens.push_back(p);
  return tokens;
}

}  // namespace

namespace {

// Normalises and rotates one segment's keys and appends them, its values and its indexer keys to the caches.
void append_caches(const SparseAttentionWeights& w, const ModelConfig& c, const Segment& seg, float* k_rows,
                   const float* v_rows, const float* index_qk) {
  const int64_t kv_heads = c.num_key_value_heads, hd = c.head_dim;
  AttentionState& state = seg.state->attn;
  check(int64_t(state.keys.size()) == seg.first_position * kv_heads * hd,
        "attention cache holds {} positions, expected {}", state.keys.size() / size_t(kv_heads * hd),
        seg.first_position);
  for (int64_t t = 0; t < seg.rows; ++t) {
    RopeTable rope(seg.first_position + t, c);
    for (int64_t h = 0; h < kv_heads; ++h) {
      float* key = k_rows + (t * kv_heads + h) * hd;
      rms_norm_zero_centred(key, w.k_norm.data(), 1, hd, c.rms_norm_eps, key);
      rope.apply(key, c.rotary_dim);
    }
  }
  state.keys.insert(state.keys.end(), k_rows, k_rows + seg.rows * kv_heads * hd);
  state.values.insert(state.values.end(), v_rows, v_rows + seg.rows * kv_heads * hd);
  append_index_keys(w, c, state, index_qk, seg.rows);
}

// Normalises and rotates one segment's queries and indexer queries.
void prepare_queries(const SparseAttentionWeights& w, const ModelConfig& c, const Segment& seg, const float* q_rows,
                     const float* index_qk, float* queries, float* index_queries) {
  const int64_t heads = c.num_attention_heads, hd = c.head_dim;
  const int64_t ihd = c.indexer_head_dim, index_stride = int64_t(c.indexer_n_heads + 1) * ihd;
  for (int64_t t = 0; t < seg.rows; ++t) {
    RopeTable rope(seg.first_position + t, c);
    for (int64_t h = 0; h < heads; ++h) {
      float* dst = queries + (t * heads + h) * hd;
      rms_norm_zero_centred(q_rows + (t * heads + h) * 2 * hd, w.q_norm.data(), 1, hd, c.rms_norm_eps, dst);
      rope.apply(dst, c.rotary_dim);
    }
    for (int64_t h = 0; h < c.indexer_n_heads; ++h) {
      float* dst = index_queries + (t * c.indexer_n_heads + h) * ihd;
      rms_norm_zero_centred(index_qk + t * index_stride + h * ihd, w.index_q_norm.data(), 1, ihd, c.rms_norm_eps,
                            dst);
      rope.apply(dst, c.rotary_dim);
    }
  }
}

// Gated attention output [heads · head_dim] of one row over the tokens its indexer selects.
void attend_row(const ModelConfig& c, const AttentionState& state, int64_t position, const float* queries,
                const float* index_queries, const float* gate, float* out) {
  const int64_t heads = c.num_attention_heads, kv_heads = c.num_key_value_heads, hd = c.head_dim;
  const float scale = 1.0f / std::sqrt(float(hd));
  std::vector<int64_t> tokens = select_tokens(c, state, index_queries, position);
  std::vector<float> weights(tokens.size());
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t kv = h / (heads / kv_heads);
    for (size_t i = 0; i < tokens.size(); ++i)
      weights[i] = scale * dot(queries + h * hd, state.keys.data() + (tokens[i] * kv_heads + kv) * hd, hd);
    softmax(weights.data(), int64_t(weights.size()));
    float* head_out = out + h * hd;
    std::fill(head_out, head_out + hd, 0.0f);
    for (size_t i = 0; i < tokens.size(); ++i) {
      const float* value = state.values.data() + (tokens[i] * kv_heads + kv) * hd;
      for (int64_t d = 0; d < hd; ++d) head_out[d] += weights[i] * value[d];
    }
    for (int64_t d = 0; d < hd; ++d) head_out[d] *= sigmoid(gate[h * 2 * hd + d]);
  }
}

}  // namespace

void sparse_attention(const SparseAttentionWeights& w, const ModelConfig& c, std::span<const Segment> segments,
                      const float* x, int64_t rows, float* y) {
  const int64_t heads = c.num_attention_heads, kv_heads = c.num_key_value_heads, hd = c.head_dim;
  const int64_t ihd = c.indexer_head_dim, index_stride = int64_t(c.indexer_n_heads + 1) * ihd;
  std::vector<float> q(size_t(rows * heads * 2 * hd)), k(size_t(rows * kv_heads * hd)), v(k.size());
  std::vector<float> index_qk(size_t(rows * index_stride));
  matmul(w.q, x, rows, q.data());
  matmul(w.k, x, rows, k.data());
  matmul(w.v, x, rows, v.data());
  matmul(w.index_qk, x, rows, index_qk.data());

  std::vector<float> queries(size_t(rows * heads * hd)), index_queries(size_t(rows * c.indexer_n_heads * ihd));
  std::vector<const Segment*> row_segment(static_cast<size_t>(rows));
  for (const Segment& seg : segments) {
    int64_t r = seg.row_begin;
    append_caches(w, c, seg, k.data() + r * kv_heads * hd, v.data() + r * kv_heads * hd,
                  index_qk.data() + r * index_stride);
    prepare_queries(w, c, seg, q.data() + r * heads * 2 * hd, index_qk.data() + r * index_stride,
                    queries.data() + r * heads * hd, index_queries.data() + r * c.indexer_n_heads * ihd);
    for (int64_t t = 0; t < seg.rows; ++t) row_segment[size_t(r + t)] = &seg;
  }

  std::vector<float> attended(size_t(rows * heads * hd));
  // Rows per task: at least ~1 M multiply-adds over the cached keys, so short contexts stay on the calling thread.
  int64_t longest = 1;
  for (const Segment& seg : segments) longest = std::max(longest, seg.first_position + seg.rows);
  const size_t grain = std::max<size_t>(1, size_t((1 << 20) / (longest * heads * hd * 2)));
  parallel_for(size_t(rows), grain, [&](size_t begin, size_t end) {
    for (size_t t = begin; t < end; ++t) {
      const Segment& seg = *row_segment[t];
      int64_t r = int64_t(t);
      attend_row(c, seg.state->attn, seg.first_position + r - seg.row_begin, queries.data() + r * heads * hd,
                 index_queries.data() + r * c.indexer_n_heads * ihd, q.data() + r * heads * 2 * hd + hd,
                 attended.data() + r * heads * hd);
    }
  });
  matmul(w.o, attended.data(), rows, y);
}

void extend_attention_cache(const SparseAttentionWeights& w, const ModelConfig& c, const Segment& seg,
                            const float* x) {
  const int64_t kv_heads = c.num_key_value_heads, hd = c.head_dim;
  const int64_t index_stride = int64_t(c.indexer_n_heads + 1) * c.indexer_head_dim;
  std::vector<float> k(size_t(seg.rows * kv_heads * hd)), v(k.size()), index_qk(size_t(seg.rows * index_stride));
  matmul(w.k, x, seg.rows, k.data());
  matmul(w.v, x, seg.rows, v.data());
  matmul(w.index_qk, x, seg.rows, index_qk.data());
  append_caches(w, c, seg, k.data(), v.data(), index_qk.data());
}

}  // namespace vavilov::cpu
