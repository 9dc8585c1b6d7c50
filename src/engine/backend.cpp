#include "engine/backend.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "cpu/argmax.h"
#include "cpu/forward.h"
#include "cpu/mtp.h"

namespace vavilov {

namespace {

class CpuSequence final : public SequenceBackend {
 public:
  explicit CpuSequence(const Model& model) : model_(model), state_(new_sequence_state(model)) {}

  int64_t position() const override { return state_.position; }
  // Greedy ids come from the logits on the host (into scratch when the caller wants no logits).
  void forward(std::span<const int32_t> ids, const TrunkOutputs& out) override {
    const int64_t rows = out.logits || out.greedy ? (out.all_rows ? int64_t(ids.size()) : 1) : 0;
    float* logits = out.logits;
    if (!logits && out.greedy) {
      greedy_logits_.resize(size_t(rows * model_.config.vocab_size));
      logits = greedy_logits_.data();
    }
    cpu::forward(model_, state_, ids, {out.all_rows, logits, out.stacks, out.record_rows ? &rows_ : nullptr});
    for (int64_t r = 0; out.greedy && r < rows; ++r)
      out.greedy[r] = cpu::argmax(logits + r * model_.config.vocab_size, model_.config.vocab_size);
  }
  void keep_rows(int64_t first_position, int64_t kept) override {
    vavilov::keep_rows(state_, rows_, first_position, kept, model_.config);
  }
  void mtp_forward(const float* stacks, std::span<const int32_t> next_ids, float* head_stacks,
                   MtpRows output) override {
    cpu::mtp_forward(model_, state_, stacks, next_ids, head_stacks, output);
  }
  void mtp_logits(const float* head_stacks, int64_t rows, float* logits) override {
    cpu::mtp_logits(model_, head_stacks, rows, logits);
  }
  void mtp_greedy(const float* head_stacks, int64_t rows, int32_t* ids) override {
    const int64_t vocab = model_.config.vocab_size;
    greedy_logits_.resize(size_t(rows * vocab));
    mtp_logits(head_stacks, rows, greedy_logits_.data());
    for (int64_t r = 0; r < rows; ++r) ids[r] = cpu::argmax(greedy_logits_.data() + r * vocab, vocab);
  }
  // Through an int8 copy of the draft vocabulary's lm_head rows, made on the first draft: with full bf16 rows the
  // two draft lm_heads of a step cost about as much as the head's two layer passes (docs/MTP.md).
  void draft_logits(const float* head_stack, float* logits) override {
    if (draft_head_.ids.empty()) draft_head_ = cpu::draft_lm_head(model_, draft_vocabulary(model_));
    cpu::mtp_draft_logits(model_, draft_head_, head_stack, logits);
  }
  int32_t draft_greedy(const float* head_stack) override {
    greedy_logits_.resize(size_t(model_.config.vocab_size));
    draft_logits(head_stack, greedy_logits_.data());
    return cpu::argmax(greedy_logits_.data(), model_.config.vocab_size);
  }
  void truncate_head(int64_t position) override {
    truncate_attention(state_.mtp.attn, position, model_.config);
    state_.mtp_position = position;
  }
  void export_state(SequenceState& state) override { state = state_; }
  void import_state(const SequenceState& state) override {
    check_state_fits(state, model_.config, model_.mtp.has_value());
    state_ = state;
  }
  SequenceState* cpu_state() override { return &state_; }
  RowStates* cpu_row_states() override { return &rows_; }

 private:
  const Model& model_;
  SequenceState state_;
  RowStates rows_;
  cpu::DraftLmHead draft_head_;
  std::vector<float> greedy_logits_;  // logits behind greedy ids the caller did not ask the logits of
};

}  // namespace

SampledVerify SequenceBackend::verify_sampled(std::span<const int32_t>, const SampleRequest&) {
  fail("this device does not sample on the device (samples_on_device)");
}

int32_t SequenceBackend::draft_sampled(const float*, int, const SampleRequest&) {
  fail("this device does not sample on the device (samples_on_device)");
}

void SequenceBackend::replace_draft(int, int32_t) {
  fail("this device does not sample on the device (samples_on_device)");
}

GreedyStepResult SequenceBackend::greedy_step(const GreedyStep& step) {
  const int64_t count = int64_t(step.rows.size()), first = position();
  std::vector<float> stacks(static_cast<size_t>(count * step.stack_size));
  std::vector<int32_t> greedy(static_cast<size_t>(count));
  forward(step.rows, {true, nullptr, stacks.data(), true, greedy.data()});
  GreedyStepResult result;
  for (int64_t r = 0; r < count; ++r) {
    const bool has_draft = r + 1 < count;
    const int32_t token = step.accept_all && has_draft ? step.rows[size_t(r) + 1] : greedy[size_t(r)];
    result.emitted.push_back(token);
    if (step.accept_all) continue;
    const bool stop = std::find(step.stops.begin(), step.stops.end(), token) != step.stops.end();
    if (!has_draft || token != step.rows[size_t(r) + 1] || stop) break;
  }
  const int64_t kept = int64_t(result.emitted.size());
  keep_rows(first, kept);
  if (!step.head) return result;
  // The head over the kept rows (trunk stacks paired with their next tokens), the first draft from the last row,
  // chained drafts from the head's own stacks; the chained entries leave the head's cache afterwards.
  const int64_t committed = position();
  truncate_head(committed - kept);
  std::vector<float> chain(size_t(step.stack_size)), chained(chain.size());
  mtp_forward(stacks.data(), result.emitted, chain.data(), MtpRows::Last);
  const int wanted = kept == count ? step.drafts : step.drafts_after_rejection;
  for (int j = 0; j < wanted; ++j) {
    if (j > 0) {
      mtp_forward(chain.data(), std::span<const int32_t>(&result.drafts.back(), 1), chained.data(), MtpRows::Last);
      chain.swap(chained);
    }
    int32_t draft = draft_greedy(chain.data());
    if (step.draft_override) draft = (*step.draft_override)(committed + j + 1, draft);
    result.drafts.push_back(draft);
  }
  truncate_head(committed);
  return result;
}

std::vector<int32_t> draft_vocabulary(const Model& model, int64_t count) {
  const std::filesystem::path path = std::filesystem::path(model.directory) / "draft_vocab.json";
  if (model.directory.empty() || !std::filesystem::is_regular_file(path)) return {};
  std::ifstream in(path);
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not valid JSON ({})", path.string(), e.what());
  }
  check(json.is_object() && json.contains("token_ids") && json["token_ids"].is_array(),
        "{}: expected an object with a \"token_ids\" array", path.string());
  std::vector<int32_t> ids;
  std::vector<bool> seen(size_t(model.config.vocab_size), false);
  for (const nlohmann::json& id : json["token_ids"]) {
    if (int64_t(ids.size()) == count) break;
    check(id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() < model.config.vocab_size &&
              !seen[id.get<size_t>()],
          "{}: token_ids holds {}, not a new id in [0, {})", path.string(), id.dump(), model.config.vocab_size);
    seen[id.get<size_t>()] = true;
    ids.push_back(id.get<int32_t>());
  }
  check(!ids.empty(), "{}: token_ids is empty", path.string());
  return ids;
}

std::unique_ptr<SequenceBackend> cpu_sequence(const Model& model) { return std::make_unique<CpuSequence>(model); }

}  // namespace vavilov
