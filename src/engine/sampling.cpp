#include "engine/sampling.h"

#include <algorithm>
#include <bit>
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
  uint64_t z = (state_ += kIncrement);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return double(z >> 11) * 0x1.0p-53;
}

namespace {

// Tokens in the filters' order (falling adjusted logit, then rising id) fall into buckets by the top bits of an
// order-preserving image of the logit: every token of a bucket comes before every token of a lower one. A filter that
// keeps a prefix of that order (top-k, top-p) then sorts only the bucket its cut falls in, not the vocabulary (a full
// sort of 248320 ids took ~35 ms a row).
constexpr int kBucketBits = 16;
constexpr size_t kBuckets = size_t(1) << kBucketBits;

uint32_t bucket_of(float logit) {
  const uint32_t bits = std::bit_cast<uint32_t>(logit == 0.0f ? 0.0f : logit);  // -0 ties with +0, as in ByLogit
  const uint32_t ordered = bits & 0x80000000u ? ~bits : bits | 0x80000000u;
  return ordered >> (32 - kBucketBits);
}

// Higher logit first; equal logits by lower id, so every filter is a deterministic function of the logits.
struct ByLogit {
  const float* logits;
  bool operator()(int32_t a, int32_t b) const { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); }
};

// Per-thread buffers, so that a row allocates nothing once a thread has sampled one.
struct Scratch {
  std::vector<float> adjusted;
  std::vector<uint32_t> buckets;  // each token's bucket
  std::vector<int64_t> count;     // tokens a bucket
  std::vector<double> mass;       // weight a bucket
  std::vector<int32_t> ids;       // the tokens of the bucket being sorted
};

Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

void adjust_into(const float* logits, int64_t vocab, const SamplingOptions& o, const TokenHistory& history,
                 std::vector<float>& out) {
  out.assign(logits, logits + vocab);
  for (const auto& [id, bias] : o.logit_bias) out[size_t(id)] += bias;
  for (const auto& [id, seen] : history.seen()) {
    float& logit = out[size_t(id)];
    if (o.repetition_penalty != 1) logit = logit > 0 ? logit / o.repetition_penalty : logit * o.repetition_penalty;
    if (seen.generated > 0) logit -= o.frequency_penalty * float(seen.generated) + o.presence_penalty;
  }
}

// bucket b's tokens (those of s.buckets equal to b) sorted in the filters' order, into s.ids.
void sort_bucket(const float* adjusted, Scratch& s, uint32_t b) {
  s.ids.clear();
  for (size_t id = 0; id < s.buckets.size(); ++id)
    if (s.buckets[id] == b) s.ids.push_back(int32_t(id));
  std::sort(s.ids.begin(), s.ids.end(), ByLogit{adjusted});
}

// Top-k: weight[id] = 0 for every token past the k first in the filters' order (the others keep theirs).
void keep_first(const float* adjusted, int64_t k, Scratch& s, std::vector<double>& weight) {
  s.count.assign(kBuckets, 0);
  for (uint32_t b : s.buckets) ++s.count[b];
  int64_t above = 0;
  uint32_t cut = kBuckets - 1;
  while (above + s.count[cut] < k) above += s.count[cut--];
  sort_bucket(adjusted, s, cut);
  for (size_t i = size_t(k - above); i < s.ids.size(); ++i) weight[size_t(s.ids[i])] = 0;
  for (size_t id = 0; id < weight.size(); ++id)
    if (s.buckets[id] < cut) weight[id] = 0;
}

// Top-p: keeps the shortest prefix (in the filters' order) of the tokens with weight whose weight reaches `target`,
// at least one token; zero weight elsewhere. A token of no weight never moves the sum, so whether it counts as kept
// does not change the distribution.
void keep_mass(const float* adjusted, double target, Scratch& s, std::vector<double>& weight) {
  s.mass.assign(kBuckets, 0.0);
  for (size_t id = 0; id < weight.size(); ++id) s.mass[s.buckets[id]] += weight[id];
  double kept = 0;
  int64_t b = int64_t(kBuckets) - 1;
  while (b >= 0 && kept + s.mass[size_t(b)] < target) kept += s.mass[size_t(b--)];
  // The buckets' sums round differently from the walk below, which may need the buckets after this one too.
  for (; b >= 0; --b) {
    if (s.mass[size_t(b)] == 0) continue;
    sort_bucket(adjusted, s, uint32_t(b));
    size_t n = 0;
    while (n < s.ids.size() && kept < target) kept += weight[size_t(s.ids[n++])];
    if (kept < target) continue;
    for (size_t i = n; i < s.ids.size(); ++i) weight[size_t(s.ids[i])] = 0;
    for (size_t id = 0; id < weight.size(); ++id)
      if (s.buckets[id] < uint32_t(b)) weight[id] = 0;
    return;
  }
}

}  // namespace

std::vector<float> adjusted_logits(const float* logits, int64_t vocab, const SamplingOptions& o,
                                   const TokenHistory& history) {
  std::vector<float> out;
  adjust_into(logits, vocab, o, history, out);
  return out;
}

void distribution(const float* logits, int64_t vocab, const SamplingOptions& o, const TokenHistory& history,
                  std::vector<double>& probs) {
  check(!o.greedy(), "distribution() needs temperature > 0");
  Scratch& s = scratch();
  adjust_into(logits, vocab, o, history, s.adjusted);
  const float* adjusted = s.adjusted.data();
  const bool top_k = o.top_k > 0 && o.top_k < vocab, ordered = top_k || o.top_p < 1;
  if (ordered) s.buckets.resize(size_t(vocab));
  float top = -INFINITY;
  bool nan = false;
  for (int64_t id = 0; id < vocab; ++id) {
    nan |= std::isnan(adjusted[id]);
    top = std::max(top, adjusted[id]);
  }
  if (nan) {
    const int64_t id = std::find_if(adjusted, adjusted + vocab, [](float x) { return std::isnan(x); }) - adjusted;
    check(false, "the logit of token {} is NaN", id);
  }
  if (ordered)
    for (int64_t id = 0; id < vocab; ++id) s.buckets[size_t(id)] = bucket_of(adjusted[id]);
  // Weight 1 marks a survivor of top-k until the weights replace the marks; top-k keeps the largest logit.
  probs.assign(size_t(vocab), 1.0);
  if (top_k) keep_first(adjusted, o.top_k, s, probs);
  check(top > -INFINITY, "every token has logit -inf after logit bias and penalties");
  double total = 0;
  for (int64_t id = 0; id < vocab; ++id) {
    double& w = probs[size_t(id)];
    if (w > 0) w = std::exp((double(adjusted[id]) - top) / o.temperature);
    total += w;
  }
  if (o.top_p < 1) keep_mass(adjusted, o.top_p * total, s, probs);
  if (o.min_p > 0) {
    const double floor = o.min_p;  // · the largest weight, exp(0) = 1: every filter keeps the top token
    for (double& w : probs)
      if (w < floor) w = 0;
  }
  if (o.top_p < 1 || o.min_p > 0) total = std::accumulate(probs.begin(), probs.end(), 0.0);
  check(total > 0 && std::isfinite(total), "the filtered distribution has no finite mass (an infinite logit?)");
  const double scale = 1 / total;
  for (double& w : probs) w *= scale;
}

std::vector<double> distribution(const float* logits, int64_t vocab, const SamplingOptions& options,
                                 const TokenHistory& history) {
  std::vector<double> probs;
  distribution(logits, vocab, options, history, probs);
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
