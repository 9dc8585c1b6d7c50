// The sparse MoE block: softmax router over all experts, top-k (renormalised), SwiGLU experts, and a shared
// expert scaled by its own sigmoid gate. Rows routed to the same expert are computed together.
#include <algorithm>
#include <numeric>
#include <vector>

#include "cpu/layers.h"
#include "cpu/linear.h"
#include "cpu/ops.h"

namespace vavilov::cpu {

namespace {

// y = down(silu(gate x) ⊙ up x) for `rows` rows.
void feed_forward(const FeedForwardWeights& w, const float* x, int64_t rows, float* y) {
  const int64_t inner = w.gate.rows;
  std::vector<float> gate(size_t(rows * inner)), up(size_t(rows * inner));
  matmul(w.gate, x, rows, gate.data());
  matmul(w.up, x, rows, up.data());
  swiglu_inplace(gate.data(), up.data(), rows * inner);
  matmul(w.down, gate.data(), rows, y);
}

struct Route {
  int64_t row;
  float weight;
};

}  // namespace

void moe(const MoeWeights& w, const ModelConfig& c, const float* x, int64_t rows, float* y) {
  const int64_t h = c.hidden_size, experts = c.num_experts, top_k = c.num_experts_per_tok;
  std::vector<float> logits(size_t(rows * experts));
  matmul(w.router, x, rows, logits.data());
  std::vector<std::vector<Route>> routes(static_cast<size_t>(experts));
  std::vector<int64_t> order(static_cast<size_t>(experts));
  for (int64_t r = 0; r < rows; ++r) {
    float* probs = logits.data() + r * experts;
    softmax(probs, experts);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(), [&](int64_t a, int64_t b) {
      return probs[a] > probs[b] || (probs[a] == probs[b] && a < b);
    });
    float total = 0.0f;
    for (int64_t i = 0; i < top_k; ++i) total += probs[order[i]];
    for (int64_t i = 0; i < top_k; ++i)
      routes[order[i]].push_back({r, c.norm_topk_prob ? probs[order[i]] / total : probs[order[i]]});
  }

  feed_forward(w.shared, x, rows, y);
  std::vector<float> shared_gate(static_cast<size_t>(rows));
  matmul(w.shared_gate, x, rows, shared_gate.data());
  for (int64_t r = 0; r < rows; ++r) {
    const float scale = sigmoid(shared_gate[r]);
    for (int64_t d = 0; d < h; ++d) y[r * h + d] *= scale;
  }

  std::vector<float> gathered, out;
  for (int64_t e = 0; e < experts; ++e) {
    const auto& routed = routes[e];
    if (routed.empty()) continue;
    const int64_t count = int64_t(routed.size());
    gathered.resize(size_t(count * h));
    out.resize(size_t(count * h));
    for (int64_t i = 0; i < count; ++i) std::copy_n(x + routed[i].row * h, h, gathered.data() + i * h);
    feed_forward(w.experts[e], gathered.data(), count, out.data());
    for (int64_t i = 0; i < count; ++i)
      for (int64_t d = 0; d < h; ++d) y[routed[i].row * h + d] += routed[i].weight * out[i * h + d];
  }
}

}  // namespace vavilov::cpu
