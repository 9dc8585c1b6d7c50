#include "engine/sampling.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"
#include "cpu/argmax.h"

namespace vavilov {

bool SamplingOptions::adjusts_logits() const {
  return !logit_bias.empty() || presence_penalty != 0 || frequency_penalty != 0 || repetition_penalty != 1;
}

void validate(const SamplingOptions& o, int64_t vocab) {
  check(o.temperature >= 0 && std::isfinite(o.temperature), "temperature must be >= 0, got {}", o.temperature);
  check(o.top_k >= 0, "top_k must be >= 0, got {}", o.top_k);
  check(o.top_p > 0 && o.top_p <= 1, "top_p must be in (0, 1], got {}", o.top_p);
  check(o.min_p >= 0 && o.min_p <= 1, "min_p must be in [0, 1], got {}", o.min_p);
  check(o.repetition_penalty > 0 && std::isfinite(o.repetition_penalty), "repetition_penalty must be > 0, got {}",
        o.repetition_penalty);
  check(std::isfinite(o.presence_penalty) && std::isfinite(o.frequency_penalty), "penalties must be finite");
  for (const auto& [id, bias] : o.logit_bias)
    check(id >= 0 && id < vocab && !std::isnan(bias), "logit_bias: token {} (bias {}) outside the vocabulary of {}", id,
          bias, vocab);
}

void TokenHistory::add_prompt(std::span<const int32_t> prompt) {
  for (int32_t token : prompt) seen_[token].in_prompt = true;
}

void TokenHistory::push(int32_t token) { ++seen_[token].generated; }

void TokenHistory::pop(int32_t token) {
  auto it = seen_.find(token);
  check(it != seen_.end() && it->second.generated > 0, "TokenHistory::pop: token {} was not pushed", token);
  if (--it->second.generated == 0 && !it->second.in_prompt) seen_.erase(it);
}

double Rng::uniform() {
  uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return double(z >> 11) * 0x1.0p-53;
}

std::vector<float> adjusted_logits(const float* logits, int64_t vocab, const SamplingOptions& o,
                                   const TokenHistory& history) {
  std::vector<float> out(logits, logits + vocab);
  for (const auto& [id, bias] : o.logit_bias) out[size_t(id)] += bias;
  for (const auto& [id, seen] : history.seen()) {
    float& logit = out[size_t(id)];
    if (o.repetition_penalty != 1) logit = logit > 0 ? logit / o.repetition_penalty : logit * o.repetition_penalty;
    if (seen.generated > 0) logit -= o.frequency_penalty * float(seen.generated) + o.presence_penalty;
  }
  return out;
}

namespace {

// Higher logit first; equal logits by lower id, so every filter is a deterministic function of the logits.
struct ByLogit {
  const std::vector<float>& logits;
  bool operator()(int32_t a, int32_t b) const {
    return logits[size_t(a)] > logits[size_t(b)] || (logits[size_t(a)] == logits[size_t(b)] && a < b);
  }
};

std::vector<int32_t> top_k_ids(const std::vector<float>& logits, int top_k) {
  std::vector<int32_t> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  if (top_k > 0 && size_t(top_k) < ids.size()) {
    std::nth_element(ids.begin(), ids.begin() + top_k, ids.end(), ByLogit{logits});
    ids.resize(size_t(top_k));
  }
  return ids;
}

// Drops the tail of `ids` (sorted by falling probability) once the kept mass reaches top_p of the total.
void top_p_filter(std::vector<int32_t>& ids, const std::vector<double>& probs, double top_p) {
  double total = 0, kept = 0;
  for (int32_t id : ids) total += probs[size_t(id)];
  size_t n = 0;
  while (n < ids.size() && kept < top_p * total) kept += probs[size_t(ids[n++])];
  ids.resize(std::max<size_t>(n, 1));
}

void min_p_filter(std::vector<int32_t>& ids, const std::vector<double>& probs, double min_p) {
  double top = 0;
  for (int32_t id : ids) top = std::max(top, probs[size_t(id)]);
  std::erase_if(ids, [&](int32_t id) { return probs[size_t(id)] < min_p * top; });
}

}  // namespace

std::vector<double> distribution(const float* logits, int64_t vocab, const SamplingOptions& o,
                                 const TokenHistory& history) {
  check(!o.greedy(), "distribution() needs temperature > 0");
  const std::vector<float> adjusted = adjusted_logits(logits, vocab, o, history);
  std::vector<int32_t> ids = top_k_ids(adjusted, o.top_k);
  float top = -INFINITY;
  for (int32_t id : ids) top = std::max(top, adjusted[size_t(id)]);
  check(top > -INFINITY, "every token has logit -inf after logit bias and penalties");
  std::vector<double> weights(size_t(vocab), 0.0);
  for (int32_t id : ids) weights[size_t(id)] = std::exp((double(adjusted[size_t(id)]) - top) / o.temperature);
  if (o.top_p < 1) {
    std::sort(ids.begin(), ids.end(), ByLogit{adjusted});
    top_p_filter(ids, weights, o.top_p);
  }
  if (o.min_p > 0) min_p_filter(ids, weights, o.min_p);
  std::vector<double> probs(size_t(vocab), 0.0);
  double total = 0;
  for (int32_t id : ids) total += weights[size_t(id)];
  for (int32_t id : ids) probs[size_t(id)] = weights[size_t(id)] / total;
  return probs;
}

int32_t draw(std::span<const double> weights, Rng& rng) {
  const double total = std::accumulate(weights.begin(), weights.end(), 0.0);
  check(total > 0, "draw: the distribution has no mass");
  double target = rng.uniform() * total;
  int32_t last = -1;
  for (size_t id = 0; id < weights.size(); ++id) {
    if (weights[id] <= 0) continue;
    last = int32_t(id);
    if (target < weights[id]) return last;
    target -= weights[id];
  }
  return last;  // rounding left `target` just past the end
}

int32_t choose(const float* logits, int64_t vocab, const SamplingOptions& o, const TokenHistory& history, Rng& rng) {
  if (!o.greedy()) return draw(distribution(logits, vocab, o, history), rng);
  if (!o.adjusts_logits()) return cpu::argmax(logits, vocab);
  return cpu::argmax(adjusted_logits(logits, vocab, o, history).data(), vocab);
}

}  // namespace vavilov
