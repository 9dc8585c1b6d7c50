#include "engine/speculative.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "cpu/forward.h"
#include "cpu/mtp.h"

namespace vavilov {

double SpeculativeStats::mean_accepted() const {
  int64_t total = 0;
  for (int64_t a : accepted) total += a;
  return verify_steps ? double(total) / double(verify_steps) : 0.0;
}

double SpeculativeStats::tokens_per_step() const {
  return verify_steps ? double(emitted) / double(verify_steps) : 0.0;
}

void SpeculativeStats::add(const SpeculativeStats& other) {
  proposed.resize(std::max(proposed.size(), other.proposed.size()));
  accepted.resize(proposed.size());
  for (size_t i = 0; i < other.proposed.size(); ++i) {
    proposed[i] += other.proposed[i];
    accepted[i] += other.accepted[i];
  }
  verify_steps += other.verify_steps;
  emitted += other.emitted;
}

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// One sequence being decoded speculatively: the trunk state, the head's state (inside it), and the drafts.
class SpeculativeDecoder {
 public:
  SpeculativeDecoder(const Model& model, const GenerateOptions& options, const SpeculativeOptions& speculative,
                     SpeculativeStats& stats)
      : model_(model),
        c_(model.config),
        options_(options),
        spec_(speculative),
        stats_(stats),
        state_(new_sequence_state(model)),
        stops_(stop_token_ids(model)),
        drafts_wanted_(speculative.drafts) {
    check(spec_.drafts >= 0 && spec_.drafts <= 3, "--drafts must be 0..3, got {}", spec_.drafts);
    check(spec_.drafts == 0 || model.mtp.has_value(), "{}: speculative decoding needs the MTP head (mtp.* tensors)",
          model.directory);
    stops_.insert(stops_.end(), options.stop_ids.begin(), options.stop_ids.end());
    stats_.proposed.assign(size_t(spec_.drafts), 0);
    stats_.accepted.assign(size_t(spec_.drafts), 0);
  }

  // Prefills the prompt; returns the first generated token.
  int32_t start(std::span<const int32_t> prompt) {
    check(!prompt.empty(), "the prompt is empty");
    const int64_t n = int64_t(prompt.size()), sh = c_.hc_hidden(), vocab = c_.vocab_size;
    std::vector<float> stacks(size_t(n * sh)), logits(static_cast<size_t>(vocab));
    cpu::forward(model_, state_, prompt, {false, logits.data(), spec_.drafts ? stacks.data() : nullptr});
    int32_t next = argmax(logits.data(), vocab);
    if (spec_.drafts) {
      std::vector<int32_t> next_ids(prompt.begin() + 1, prompt.end());
      next_ids.push_back(next);
      fold_head(stacks.data(), next_ids);
    }
    return next;
  }

  // One verify step from `last` (committed, not yet run through the trunk). Returns the emitted tokens.
  std::vector<int32_t> step(int32_t last) {
    const int64_t first = state_.position, sh = c_.hc_hidden(), vocab = c_.vocab_size;
    std::vector<int32_t> rows{last};
    rows.insert(rows.end(), drafts_.begin(), drafts_.end());
    const int64_t count = int64_t(rows.size()), proposed = count - 1;
    std::vector<float> logits(size_t(count * vocab)), stacks(size_t(count * sh));
    RowStates row_states;
    cpu::forward(model_, state_, rows, {true, logits.data(), stacks.data(), &row_states});

    std::vector<int32_t> predicted(static_cast<size_t>(count));
    for (int64_t r = 0; r < count; ++r) predicted[r] = argmax(logits.data() + r * vocab, vocab);
    int64_t accepted = 0;
    while (accepted < proposed && rows[accepted + 1] == predicted[accepted] && !is_stop(predicted[accepted]))
      ++accepted;
    keep_rows(state_, row_states, first, accepted + 1, c_);

    ++stats_.verify_steps;
    for (int64_t j = 0; j < proposed; ++j) {
      ++stats_.proposed[size_t(j)];
      if (j < accepted) ++stats_.accepted[size_t(j)];
    }
    if (spec_.adaptive) drafts_wanted_ = accepted == proposed ? spec_.drafts : 1;

    std::vector<int32_t> emitted(predicted.begin(), predicted.begin() + accepted + 1);
    if (spec_.drafts) fold_head(stacks.data(), emitted);
    if (spec_.on_step) spec_.on_step(state_, std::span<const int32_t>(rows).first(size_t(accepted + 1)));
    return emitted;
  }

  bool is_stop(int32_t token) const {
    return !options_.ignore_eos && std::find(stops_.begin(), stops_.end(), token) != stops_.end();
  }

 private:
  // The head over the committed rows (trunk stacks paired with their next tokens), then the first draft from the
  // last row and chained drafts from the head's own stacks. Chained entries leave the head's cache afterwards.
  void fold_head(const float* trunk_stacks, const std::vector<int32_t>& next_ids) {
    const int64_t rows = int64_t(next_ids.size()), sh = c_.hc_hidden(), vocab = c_.vocab_size;
    truncate_head(state_.position - rows);
    std::vector<float> head(size_t(rows * sh)), logits(static_cast<size_t>(vocab));
    cpu::mtp_forward(model_, state_, trunk_stacks, next_ids, head.data());
    const int64_t committed = state_.mtp_position;
    std::vector<float> chain(head.end() - sh, head.end());
    drafts_.clear();
    for (int j = 0; j < drafts_wanted_; ++j) {
      if (j > 0) {
        std::vector<float> chained(static_cast<size_t>(sh));
        cpu::mtp_forward(model_, state_, chain.data(), std::span<const int32_t>(&drafts_.back(), 1), chained.data());
        chain.swap(chained);
      }
      cpu::mtp_logits(model_, chain.data(), 1, logits.data());
      int32_t draft = argmax(logits.data(), vocab);
      if (spec_.draft_override) draft = spec_.draft_override(state_.position + j + 1, draft);
      drafts_.push_back(draft);
    }
    truncate_head(committed);
  }

  void truncate_head(int64_t position) {
    truncate_attention(state_.mtp.attn, position, c_);
    state_.mtp_position = position;
  }

  const Model& model_;
  const ModelConfig& c_;
  const GenerateOptions& options_;
  const SpeculativeOptions& spec_;
  SpeculativeStats& stats_;
  SequenceState state_;
  std::vector<int64_t> stops_;
  std::vector<int32_t> drafts_;
  int drafts_wanted_;
};

}  // namespace

std::vector<int32_t> generate_speculative(const Model& model, std::span<const int32_t> prompt,
                                          const GenerateOptions& options, const SpeculativeOptions& speculative,
                                          GenerateStats& stats, SpeculativeStats& spec_stats,
                                          const std::function<void(int32_t)>& on_token) {
  SpeculativeDecoder decoder(model, options, speculative, spec_stats);
  auto start = std::chrono::steady_clock::now();
  int32_t next = decoder.start(prompt);
  stats.prompt_tokens = int64_t(prompt.size());
  stats.prefill_seconds = seconds_since(start);

  start = std::chrono::steady_clock::now();
  std::vector<int32_t> generated;
  std::vector<int32_t> pending{next};
  for (;;) {
    bool done = false;
    for (int32_t token : pending) {
      generated.push_back(token);
      if (on_token) on_token(token);
      if (decoder.is_stop(token) || int64_t(generated.size()) >= options.max_tokens) {
        done = true;
        break;
      }
    }
    if (done) break;
    pending = decoder.step(generated.back());
    spec_stats.emitted += int64_t(pending.size());
  }
  stats.generated_tokens = int64_t(generated.size());
  stats.decode_seconds = seconds_since(start);
  return generated;
}

}  // namespace vavilov
