#include "cuda/device_sampler.h"

#include <cstring>
#include <map>

#include "core/error.h"

namespace vavilov::cuda {

namespace {

size_t aligned(size_t bytes) { return (bytes + 255) / 256 * 256; }

DeviceSamplingOptions device_options(const SamplingOptions& o) {
  DeviceSamplingOptions d;
  d.temperature = o.temperature, d.top_p = o.top_p, d.min_p = o.min_p, d.top_k = o.top_k;
  d.repetition = o.repetition_penalty, d.presence = o.presence_penalty, d.frequency = o.frequency_penalty;
  return d;
}

}  // namespace

void append_row_adjustments(const SamplingOptions& o, const TokenHistory& history, std::span<const int32_t> extra,
                            std::vector<LogitAdjustment>& out, std::vector<float>& biases) {
  struct Entry {
    std::vector<float> biases;
    int32_t generated = 0;
    bool seen = false;
  };
  std::map<int32_t, Entry> by_id;
  for (const auto& [id, bias] : o.logit_bias) by_id[id].biases.push_back(bias);
  if (o.repetition_penalty != 1 || o.presence_penalty != 0 || o.frequency_penalty != 0) {
    for (const auto& [id, seen] : history.seen()) by_id[id].seen = true, by_id[id].generated = seen.generated;
    for (int32_t id : extra) by_id[id].seen = true, ++by_id[id].generated;
  }
  for (const auto& [id, e] : by_id) {
    const int32_t begin = int32_t(biases.size());
    biases.insert(biases.end(), e.biases.begin(), e.biases.end());
    out.push_back({id, begin, int32_t(biases.size()), e.generated, e.seen ? 1 : 0});
  }
}

DeviceSampler::DeviceSampler(int64_t vocab) : vocab_(vocab) {
  const size_t row = size_t(vocab);
  const size_t p_bytes = aligned(kMaxRows * row * sizeof(double)), q_bytes = aligned((kMaxRows - 1) * row * sizeof(double));
  const size_t adjusted_bytes = aligned(kMaxRows * row * sizeof(float));
  const size_t small = aligned(kMaxRows * sizeof(int32_t)) + aligned(sizeof(SampledVerifyOutcome)) + 256;
  memory_ = device_alloc(p_bytes + q_bytes + adjusted_bytes + small, "device sampling");
  char* base = static_cast<char*>(memory_.get());
  p_ = reinterpret_cast<double*>(base);
  q_ = reinterpret_cast<double*>(base + p_bytes);
  adjusted_ = reinterpret_cast<float*>(base + p_bytes + q_bytes);
  char* rest = base + p_bytes + q_bytes + adjusted_bytes;
  status_ = reinterpret_cast<int32_t*>(rest);
  outcome_ = reinterpret_cast<SampledVerifyOutcome*>(rest + aligned(kMaxRows * sizeof(int32_t)));
  draft_token_ = reinterpret_cast<int32_t*>(rest + aligned(kMaxRows * sizeof(int32_t)) +
                                            aligned(sizeof(SampledVerifyOutcome)));
}

DeviceSampler::Uploaded DeviceSampler::upload(int count, std::span<const int32_t> extra,
                                              std::span<const int32_t> tokens, const SampleRequest& request,
                                              StepRunner& runner) {
  std::vector<LogitAdjustment> adjustments;
  std::vector<float> biases;
  std::vector<int32_t> row_begin{0};
  for (int r = 0; r < count; ++r) {
    append_row_adjustments(*request.options, *request.history, extra.first(size_t(r)), adjustments, biases);
    row_begin.push_back(int32_t(adjustments.size()));
  }
  // One host image of [row_begin | tokens | stops | adjustments | biases], each part 256-byte aligned.
  const size_t parts[] = {row_begin.size() * sizeof(int32_t), tokens.size() * sizeof(int32_t),
                          request.stops.size() * sizeof(int64_t), adjustments.size() * sizeof(LogitAdjustment),
                          biases.size() * sizeof(float)};
  const void* sources[] = {row_begin.data(), tokens.data(), request.stops.data(), adjustments.data(), biases.data()};
  size_t offsets[5], total = 0;
  for (int i = 0; i < 5; ++i) offsets[i] = total, total += aligned(parts[i]);
  staging_.assign(total, 0);
  for (int i = 0; i < 5; ++i)
    if (parts[i]) std::memcpy(staging_.data() + offsets[i], sources[i], parts[i]);
  if (total > input_capacity_) {  // no launch of this sequence is in flight between calls
    input_capacity_ = std::max(total, 2 * input_capacity_);
    inputs_ = device_alloc(input_capacity_, "device sampling inputs");
  }
  char* device = static_cast<char*>(inputs_.get());
  runner.upload(device, staging_.data(), total);
  return {reinterpret_cast<const int32_t*>(device + offsets[0]),
          reinterpret_cast<const LogitAdjustment*>(device + offsets[3]),
          reinterpret_cast<const float*>(device + offsets[4]),
          reinterpret_cast<const int32_t*>(device + offsets[1]),
          reinterpret_cast<const int64_t*>(device + offsets[2]),
          int(request.stops.size())};
}

void DeviceSampler::launch_distributions(const float* logits, int count, const Uploaded& uploaded,
                                         const SampleRequest& request, double* probs, StepRunner& runner) {
  DistributionRows rows;
  rows.logits = logits;
  rows.logits_stride = vocab_;
  rows.adjustments = uploaded.adjustments;
  rows.row_begin = uploaded.row_begin;
  rows.biases = uploaded.biases;
  rows.adjusted = adjusted_;
  rows.probs = probs;
  rows.status = status_;
  cuda_check(sample_distributions(rows, count, vocab_, device_options(*request.options), runner.stream()),
             "sampling distributions");
  runner.download(host_status_, status_, size_t(count) * sizeof(int32_t));
}

// engine::distribution's errors, for the rows the device found bad.
void DeviceSampler::check_status(int count) const {
  for (int r = 0; r < count; ++r) {
    const int32_t status = host_status_[r];
    check(status != kSampleAllBanned, "every token has logit -inf after logit bias and penalties");
    check(status != kSampleNoMass, "the filtered distribution has no finite mass (an infinite logit?)");
    check(status == kSampleOk, "the logit of token {} is NaN", status);
  }
}

SampledVerify DeviceSampler::verify(const float* logits, std::span<const int32_t> rows, const SampleRequest& request,
                                    StepRunner& runner) {
  const int count = int(rows.size());
  check(count >= 1 && count <= kMaxRows, "verify_sampled: {} rows (1–{})", count, kMaxRows);
  const Uploaded uploaded = upload(count, rows.subspan(1), rows, request, runner);
  launch_distributions(logits, count, uploaded, request, p_, runner);
  cuda_check(sampled_verify(p_, q_, uploaded.tokens, count, vocab_, uploaded.stops, uploaded.stop_count,
                            request.rng_state, outcome_, runner.stream()),
             "sampled verify");
  SampledVerifyOutcome outcome{};
  runner.download(&outcome, outcome_, sizeof outcome);
  runner.finish();
  check_status(count);
  check(outcome.kept >= 1 && outcome.kept <= count, "sampled verify: the device kept {} of {} rows", outcome.kept,
        count);
  return {std::vector<int32_t>(outcome.emitted, outcome.emitted + outcome.kept), outcome.uniforms};
}

int32_t DeviceSampler::draft(const float* logits, int index, const SampleRequest& request, StepRunner& runner) {
  check(index >= 0 && index < kMaxRows - 1, "draft_sampled: draft index {} (0–{})", index, kMaxRows - 2);
  const Uploaded uploaded = upload(1, {}, {}, request, runner);
  double* q = q_ + size_t(index) * size_t(vocab_);
  launch_distributions(logits, 1, uploaded, request, q, runner);
  cuda_check(sampled_draw(q, vocab_, request.rng_state, draft_token_, runner.stream()), "sampled draft");
  int32_t token = -1;
  runner.download(&token, draft_token_, sizeof token);
  runner.finish();
  check_status(1);
  check(token >= 0 && token < vocab_, "sampled draft: the device drew token {}", token);
  return token;
}

void DeviceSampler::replace(int index, int32_t token, StepRunner& runner) {
  check(index >= 0 && index < kMaxRows - 1 && token >= 0 && token < vocab_, "replace_draft: draft {} token {}",
        index, token);
  cuda_check(point_mass(q_ + size_t(index) * size_t(vocab_), vocab_, token, runner.stream()), "replace draft");
  runner.finish();
}

}  // namespace vavilov::cuda
