#include "engine/speculative.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string_view>

#include "core/error.h"
#include "cpu/forward.h"

namespace vavilov {

bool device_sampling_enabled_by_environment() {
  const char* value = std::getenv("VAVILOV_DEVICE_SAMPLING");
  return !value || std::string_view(value) != "0";
}

double SpeculativeStats::mean_accepted() const {
  int64_t total = 0;
  for (int64_t a : accepted) total += a;
  return verify_steps ? double(total) / double(verify_steps) : 0.0;
}

double SpeculativeStats::tokens_per_step() const { return verify_steps ? double(emitted) / double(verify_steps) : 0.0; }

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

Decoder::Decoder(const Model& model, const GenerateOptions& options, const SpeculativeOptions& speculative,
                 const SequenceFactory& device)
    : model_(model),
      c_(model.config),
      options_(options),
      spec_(speculative),
      sequence_(device ? device() : cpu_sequence(model)),
      stops_(stop_token_ids(model)),
      rng_(options.sampling.seed),
      drafts_wanted_(speculative.drafts),
      greedy_ids_(options.sampling.greedy() && !options.sampling.adjusts_logits()),
      device_sampling_(!options.sampling.greedy() && sequence_->samples_on_device() &&
                       !speculative.acceptance_override && device_sampling_enabled_by_environment()) {
  validate(options.sampling, c_.vocab_size);
  check(spec_.drafts >= 0 && spec_.drafts <= 3, "--drafts must be 0..3, got {}", spec_.drafts);
  check(spec_.drafts == 0 || model.mtp.has_value(), "{}: speculative decoding needs the MTP head (mtp.* tensors)",
        model.directory);
  check(!spec_.on_step || sequence_->cpu_state(), "the on_step hook needs the CPU backend");
  stops_.insert(stops_.end(), options.stop_ids.begin(), options.stop_ids.end());
  stats_.proposed.assign(size_t(spec_.drafts), 0);
  stats_.accepted.assign(size_t(spec_.drafts), 0);
}

SequenceState& Decoder::state() {
  SequenceState* state = sequence_->cpu_state();
  check(state != nullptr, "this decoder's state lives on a device, not in the CPU engine");
  return *state;
}

// The CPU engine's own state, else the device's exported into exported_ (its storage reused from chunk to chunk).
const SequenceState& Decoder::chunk_state() {
  if (const SequenceState* state = sequence_->cpu_state()) return *state;
  sequence_->export_state(exported_);
  return exported_;
}

// Whether on_chunk sees the state at prompt position `end` (a chunk boundary before the last chunk). A device's
// state crosses to the host to be kept (~118 MB at Flash-Next: the GDN states), so a device snapshots only after 1, 2,
// 4, 8, ... chunks (a shared system prompt is found again to within half its length) and before the last chunk (where
// a continued conversation resumes): O(log n) copies a prompt instead of one a chunk. The CPU engine's state costs no
// transfer and is offered at every boundary.
bool Decoder::wants_chunk_state(int64_t end) const {
  if (sequence_->cpu_state() != nullptr) return true;
  return snapshot_boundary(end, int64_t(prompt_.size()), options_.prefill_chunk);
}

bool snapshot_boundary(int64_t end, int64_t prompt_size, int64_t chunk) {
  if (chunk <= 0) return false;  // one chunk: no boundary before the last
  const int64_t chunks = end / chunk;
  return end + chunk >= prompt_size || (chunks & (chunks - 1)) == 0;
}

bool Decoder::is_stop(int32_t token) const {
  return !options_.ignore_eos && std::find(stops_.begin(), stops_.end(), token) != stops_.end();
}

int32_t Decoder::start(std::span<const int32_t> prompt, const SequenceState* prefix,
                       const std::function<void(const SequenceState&)>& on_chunk) {
  begin(prompt, prefix);
  for (;;)
    if (const int32_t first = prefill_next(on_chunk); first >= 0) return first;
}

void Decoder::begin(std::span<const int32_t> prompt, const SequenceState* prefix) {
  check(!prompt.empty(), "the prompt is empty");
  if (prefix) {
    check(prefix->position < int64_t(prompt.size()) && (spec_.drafts == 0 || prefix->mtp_position == prefix->position),
          "prefix state at position {} cannot start a {}-token prompt", prefix->position, prompt.size());
    sequence_->import_state(*prefix);
  }
  history_.add_prompt(prompt);
  prompt_.assign(prompt.begin(), prompt.end());
}

int32_t Decoder::prefill_next(const std::function<void(const SequenceState&)>& on_chunk) {
  const int64_t sh = c_.hc_hidden(), vocab = c_.vocab_size, n = int64_t(prompt_.size());
  const int64_t begin = sequence_->position();
  check(begin < n, "prefill_next: the prompt is already prefilled");
  const int64_t count = std::min(options_.prefill_chunk > 0 ? options_.prefill_chunk : n, n - begin);
  const bool last = begin + count == n;
  const std::span<const int32_t> prompt(prompt_);
  std::vector<float> logits(last && !greedy_ids_ ? size_t(vocab) : 0), stacks(spec_.drafts ? size_t(count * sh) : 0);
  int32_t next = -1;
  sequence_->forward(prompt.subspan(size_t(begin), size_t(count)),
                     {false, last && !greedy_ids_ ? logits.data() : nullptr, spec_.drafts ? stacks.data() : nullptr,
                      false, last && greedy_ids_ ? &next : nullptr});
  if (last) {
    if (!greedy_ids_) next = choose(logits.data(), vocab, options_.sampling, history_, rng_);
    history_.push(next);
  }
  rows_ = {next};
  if (spec_.drafts) {
    // Head rows pair each stack with the token after it: the next prompt token, or the first generated one.
    std::vector<int32_t> next_ids(prompt.begin() + begin + 1, prompt.begin() + begin + count);
    next_ids.push_back(last ? next : prompt[size_t(begin + count)]);
    fold_head(stacks.data(), next_ids, last);
  }
  if (!last && on_chunk && wants_chunk_state(begin + count)) on_chunk(chunk_state());
  if (last) prompt_.clear();
  return next;
}

// Row r's token, given the tokens before it (history_ holds them). A row that emits its draft lets the next row
// continue; the last row (no draft) gives the bonus token.
int32_t Decoder::verify_row(const float* logits, int64_t row) {
  const int64_t vocab = c_.vocab_size;
  const bool has_draft = row + 1 < int64_t(rows_.size());
  if (options_.sampling.greedy() || !has_draft) return choose(logits, vocab, options_.sampling, history_, rng_);
  std::vector<double>& p = verify_p_;
  distribution(logits, vocab, options_.sampling, history_, p);
  std::vector<double>& q = draft_q_[size_t(row)];
  const int32_t x = rows_[size_t(row) + 1];
  const double px = p[size_t(x)], qx = q[size_t(x)];
  const double keep = spec_.acceptance_override ? spec_.acceptance_override(px, qx) : std::min(1.0, px / qx);
  if (rng_.uniform() < keep) return x;
  // Rejected: the residual max(0, p − q) holds exactly the mass the draft could not supply. It is empty only when
  // p = q, where rejection is impossible under the lossless rule.
  double residual = 0;
  for (size_t i = 0; i < q.size(); ++i) residual += q[i] = std::max(0.0, p[i] - q[i]);
  return draw(residual > 0 ? std::span<const double>(q) : std::span<const double>(p), rng_);
}

std::vector<int32_t> Decoder::accept(const float* logits, const float* stacks) {
  const int64_t count = int64_t(rows_.size()), proposed = count - 1, vocab = c_.vocab_size;
  std::vector<int32_t> emitted;
  for (int64_t r = 0; r < count; ++r) {
    const int32_t token = verify_row(logits + r * vocab, r);
    emitted.push_back(token);
    history_.push(token);
    if (r == proposed || token != rows_[size_t(r) + 1] || is_stop(token)) break;
  }
  return commit(std::move(emitted), stacks);
}

// The device's verification of the rows (SequenceBackend::verify_sampled), the Decoder's rule with the same uniforms:
// the whole step fused where the backend can (sampled_step), else its calls.
std::vector<int32_t> Decoder::step_sampled_on_device() {
  SampledStepResult fused;
  if (spec_.drafts > 0 && sequence_->sampled_step(fused_step_request(), sample_request(), fused)) {
    rng_.advance(fused.uniforms);
    return take_fused_step(std::move(fused.step));
  }
  float* stacks = verify_stacks();
  sequence_->forward(rows_, {true, nullptr, stacks, true, nullptr, true});
  SampledVerify verified = sequence_->verify_sampled(rows_, sample_request());
  rng_.advance(verified.uniforms);
  for (int32_t token : verified.emitted) history_.push(token);
  return commit(std::move(verified.emitted), stacks);
}

SampleRequest Decoder::sample_request() const { return {&options_.sampling, &history_, rng_.state(), stops()}; }

// The tokens that end a step (none when EOS is ignored).
std::span<const int64_t> Decoder::stops() const {
  return options_.ignore_eos ? std::span<const int64_t>() : std::span<const int64_t>(stops_);
}

// The verify step's emitted tokens (already in the history): keeps their rows, rolls back the rest, drafts the next
// step.
std::vector<int32_t> Decoder::commit(std::vector<int32_t> emitted, const float* stacks) {
  const int64_t count = int64_t(rows_.size()), proposed = count - 1;
  const int64_t first = sequence_->position() - count;
  const int64_t accepted = int64_t(emitted.size()) - 1;
  sequence_->keep_rows(first, accepted + 1);
  count_step(proposed, accepted);
  std::vector<int32_t> committed(rows_.begin(), rows_.begin() + accepted + 1);
  rows_ = {emitted.back()};
  if (spec_.drafts) fold_head(stacks, emitted);
  if (spec_.on_step) spec_.on_step(state(), committed);
  return emitted;
}

// The statistics of a verify step that accepted `accepted` of `proposed` drafts, and the adaptive draft count.
void Decoder::count_step(int64_t proposed, int64_t accepted) {
  ++stats_.verify_steps;
  for (int64_t j = 0; j < proposed; ++j) {
    ++stats_.proposed[size_t(j)];
    if (j < accepted) ++stats_.accepted[size_t(j)];
  }
  if (spec_.adaptive) drafts_wanted_ = accepted == proposed ? spec_.drafts : 1;
  stats_.emitted += accepted + 1;
}

// The step greedy_step and sampled_step take: verify rows_, then draft as fold_head would.
GreedyStep Decoder::fused_step_request() const {
  GreedyStep step;
  step.rows = rows_;
  step.stops = stops();
  step.stack_size = c_.hc_hidden();
  step.head = spec_.drafts > 0;
  step.drafts = spec_.drafts;
  step.drafts_after_rejection = spec_.adaptive ? std::min(spec_.drafts, 1) : spec_.drafts;
  step.draft_override = spec_.draft_override ? &spec_.draft_override : nullptr;
  return step;
}

// A step the backend ran whole: its emitted tokens into the history, the statistics, the next rows.
std::vector<int32_t> Decoder::take_fused_step(GreedyStepResult result) {
  const int64_t proposed = int64_t(rows_.size()) - 1, accepted = int64_t(result.emitted.size()) - 1;
  check(accepted >= 0 && accepted <= proposed, "a fused step: {} tokens emitted for {} rows", result.emitted.size(),
        rows_.size());
  for (int32_t token : result.emitted) history_.push(token);
  count_step(proposed, accepted);
  std::vector<int32_t> committed(rows_.begin(), rows_.begin() + accepted + 1);
  rows_ = {result.emitted.back()};
  rows_.insert(rows_.end(), result.drafts.begin(), result.drafts.end());
  if (spec_.on_step) spec_.on_step(state(), committed);
  return std::move(result.emitted);
}

// Greedy ids only: the whole step is the backend's (SequenceBackend::greedy_step), which a device runs without the
// host in between; the drafts it returns follow the rules fold_head applies on the logits path.
std::vector<int32_t> Decoder::step_greedy() { return take_fused_step(sequence_->greedy_step(fused_step_request())); }

std::vector<int32_t> Decoder::step() {
  Decoder* self = this;
  return step_batch(model_, std::span<Decoder* const>(&self, 1)).front();
}

// The head over the committed rows (trunk stacks paired with their next tokens), then the first draft from the last
// row and chained drafts from the head's own stacks. Chained entries leave the head's cache afterwards.
void Decoder::fold_head(const float* trunk_stacks, std::span<const int32_t> next_ids, bool draft) {
  const int64_t rows = int64_t(next_ids.size()), sh = c_.hc_hidden(), vocab = c_.vocab_size;
  const int64_t committed = sequence_->position();  // the head covers every committed position afterwards
  truncate_head(committed - rows);
  std::vector<float> chain(static_cast<size_t>(sh)), logits(greedy_ids_ ? 0 : static_cast<size_t>(vocab));
  sequence_->mtp_forward(trunk_stacks, next_ids, chain.data(), MtpRows::Last);
  for (int j = 0; draft && j < drafts_wanted_; ++j) {
    if (j > 0) {
      std::vector<float> chained(static_cast<size_t>(sh));
      sequence_->mtp_forward(chain.data(), std::span<const int32_t>(&rows_.back(), 1), chained.data(), MtpRows::Last);
      chain.swap(chained);
    }
    if (greedy_ids_) {
      add_draft(sequence_->draft_greedy(chain.data()), false, committed + j + 1);
      continue;
    }
    if (device_sampling_) {
      const int32_t draft = sequence_->draft_sampled(chain.data(), j, sample_request());
      rng_.advance(1);
      add_draft(draft, true, committed + j + 1);
      continue;
    }
    sequence_->draft_logits(chain.data(), logits.data());
    add_draft(logits.data(), committed + j + 1);
  }
  // The drafts were pushed so that later drafts saw them; verification pushes what it emits.
  for (size_t j = 1; j < rows_.size(); ++j) history_.pop(rows_[j]);
  truncate_head(committed);
}

// Drafts with the same filters and history the trunk's row will use, so p and q are comparable.
void Decoder::add_draft(const float* head_logits, int64_t position) {
  const int64_t vocab = c_.vocab_size;
  const SamplingOptions& sampling = options_.sampling;
  if (sampling.greedy()) {
    add_draft(choose(head_logits, vocab, sampling, history_, rng_), false, position);
    return;
  }
  std::vector<double>& q = draft_distribution(rows_.size() - 1);
  distribution(head_logits, vocab, sampling, history_, q);
  add_draft(draw(q, rng_), true, position);
}

// sampled: the draft was drawn from draft_distribution(its index), which an override replaces by a point mass.
void Decoder::add_draft(int32_t draft, bool sampled, int64_t position) {
  if (spec_.draft_override) {
    const int32_t replaced = spec_.draft_override(position, draft);
    if (replaced != draft && sampled && device_sampling_) {
      sequence_->replace_draft(int(rows_.size() - 1), replaced);
    } else if (replaced != draft && sampled) {
      std::vector<double>& q = draft_distribution(rows_.size() - 1);
      q.assign(size_t(c_.vocab_size), 0.0);
      q[size_t(replaced)] = 1.0;
    }
    draft = replaced;
  }
  history_.push(draft);
  rows_.push_back(draft);
}

// Draft j's q, kept from step to step so that its memory is reused.
std::vector<double>& Decoder::draft_distribution(size_t j) {
  if (draft_q_.size() <= j) draft_q_.resize(j + 1);
  return draft_q_[j];
}

void Decoder::truncate_head(int64_t position) { sequence_->truncate_head(position); }

float* Decoder::verify_logits() {
  verify_logits_.resize(rows_.size() * size_t(c_.vocab_size));
  return verify_logits_.data();
}

float* Decoder::verify_stacks() {
  verify_stacks_.resize(rows_.size() * size_t(c_.hc_hidden()));
  return verify_stacks_.data();
}

std::vector<int32_t> Decoder::step_alone() {
  if (greedy_ids_) return step_greedy();
  if (device_sampling_) return step_sampled_on_device();
  float* stacks = verify_stacks();
  float* logits = verify_logits();
  sequence_->forward(rows_, {true, logits, stacks, true});
  return accept(logits, stacks);
}

// CPU decoders share one batched trunk pass; decoders on other devices step on their own.
std::vector<std::vector<int32_t>> step_batch(const Model& model, std::span<Decoder* const> decoders) {
  std::vector<cpu::SequenceChunk> chunks;
  for (Decoder* decoder : decoders) {
    SequenceBackend& sequence = decoder->backend();
    if (!sequence.cpu_state()) continue;
    chunks.push_back({sequence.cpu_state(),
                      decoder->rows(),
                      {true, decoder->verify_logits(), decoder->verify_stacks(), sequence.cpu_row_states()}});
  }
  if (!chunks.empty()) cpu::forward_batch(model, chunks);
  std::vector<std::vector<int32_t>> emitted;
  for (Decoder* decoder : decoders)
    emitted.push_back(decoder->backend().cpu_state()
                          ? decoder->accept(decoder->verify_logits(), decoder->verify_stacks())
                          : decoder->step_alone());
  return emitted;
}

namespace {
double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}
}  // namespace

std::vector<int32_t> generate_speculative(const Model& model, std::span<const int32_t> prompt,
                                          const GenerateOptions& options, const SpeculativeOptions& speculative,
                                          GenerateStats& stats, SpeculativeStats& spec_stats,
                                          const std::function<void(int32_t)>& on_token, const SequenceFactory& device) {
  Decoder decoder(model, options, speculative, device);
  auto start = std::chrono::steady_clock::now();
  std::vector<int32_t> pending{decoder.start(prompt)};
  stats.prompt_tokens = int64_t(prompt.size());
  stats.prefill_seconds = seconds_since(start);

  start = std::chrono::steady_clock::now();
  std::vector<int32_t> generated;
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
    pending = decoder.step();
  }
  stats.generated_tokens = int64_t(generated.size());
  stats.decode_seconds = seconds_since(start);
  spec_stats.add(decoder.stats());
  return generated;
}

}  // namespace vavilov
