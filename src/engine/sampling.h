#pragma once
// Token selection: greedy or sampled, with the OpenAI/vLLM logit processors. One function (`distribution`) turns
// logits into the filtered distribution, so plain sampling, MTP drafts and speculative verification all filter
// identically (docs/SAMPLING.md).
//
// Order of application, per row of logits:
//   1. logit bias           logit[id] += bias
//   2. repetition penalty   tokens seen in prompt or output: logit > 0 ? logit / r : logit · r
//      frequency penalty    logit −= frequency · (times the token was generated)
//      presence penalty     logit −= presence · (1 if the token was generated)
//   3. temperature          logit / T (T = 0: greedy, the argmax after steps 1–2; steps 4–7 cannot change it)
//   4. top-k                keep the k largest (ties: lower id first)
//   5. top-p                keep the smallest most-probable prefix whose probability reaches p
//   6. min-p                keep tokens whose probability is ≥ min_p · the largest probability
//   7. normalise and draw   inverse CDF over token ids with one uniform from the sequence's generator
#include <cstdint>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

namespace vavilov {

struct SamplingOptions {
  float temperature = 0;  // 0: greedy
  int top_k = 0;          // 0: off
  float top_p = 1;        // 1: off
  float min_p = 0;        // 0: off
  // OpenAI semantics, over generated tokens only (like vLLM).
  float presence_penalty = 0, frequency_penalty = 0;
  float repetition_penalty = 1;                       // HF/vLLM semantics, over prompt and generated tokens
  std::vector<std::pair<int32_t, float>> logit_bias;  // (token id, added logit); ids outside the vocabulary: error
  uint64_t seed = 0;                                  // one stream per sequence, seeded with this

  bool greedy() const { return temperature <= 0; }
  // Whether steps 1–2 can change the logits.
  bool adjusts_logits() const;
};

// Checks ranges (temperature ≥ 0, top_k ≥ 0, 0 < top_p ≤ 1, 0 ≤ min_p ≤ 1, repetition_penalty > 0, bias ids).
void validate(const SamplingOptions& options, int64_t vocab);

// The tokens that penalties look at: which appeared in the prompt, how often each was generated. Verification
// pushes a row's drafts and pops them again, so every row is penalised by exactly the tokens before it.
class TokenHistory {
 public:
  void add_prompt(std::span<const int32_t> prompt);
  void push(int32_t token);
  void pop(int32_t token);

  struct Seen {
    bool in_prompt = false;
    int32_t generated = 0;
  };
  const std::unordered_map<int32_t, Seen>& seen() const { return seen_; }

 private:
  std::unordered_map<int32_t, Seen> seen_;
};

// A counter-based 64-bit generator (SplitMix64): the same seed gives the same stream on every machine and thread.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  double uniform();  // [0, 1), 53 random bits
  // The stream's position: a device that draws the next n uniforms itself (cuda/sampling.cuh) starts from state(),
  // and the host then skips them with advance(n).
  uint64_t state() const { return state_; }
  void advance(int64_t n) { state_ += uint64_t(n) * kIncrement; }
  static constexpr uint64_t kIncrement = 0x9e3779b97f4a7c15ull;

 private:
  uint64_t state_;
};

// Steps 1–2 applied to a copy of the logits.
std::vector<float> adjusted_logits(const float* logits, int64_t vocab, const SamplingOptions& options,
                                   const TokenHistory& history);

// Steps 1–6 and the normalisation: probabilities over the whole vocabulary, 0 for filtered tokens. Sampling only
// (temperature > 0).
std::vector<double> distribution(const float* logits, int64_t vocab, const SamplingOptions& options,
                                 const TokenHistory& history);
// The same into `probs`, whose memory is reused (a decoder keeps its buffers from row to row).
void distribution(const float* logits, int64_t vocab, const SamplingOptions& options, const TokenHistory& history,
                  std::vector<double>& probs);

// Step 7 on a distribution (need not be normalised; must have positive mass).
int32_t draw(std::span<const double> weights, Rng& rng);

// The next token: the argmax of the adjusted logits when greedy (cpu::argmax: the lowest id among equal maxima, NaN
// as std::max_element treats it), else a draw from `distribution`.
int32_t choose(const float* logits, int64_t vocab, const SamplingOptions& options, const TokenHistory& history,
               Rng& rng);

}  // namespace vavilov
