#include "cuda/device_sampler.h"

#include <algorithm>
#include <bit>
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
  const size_t p_bytes = aligned(kMaxRows * row * sizeof(double)),
               q_bytes = aligned((kMaxRows - 1) * row * sizeof(double));
  const size_t adjusted_bytes = aligned(kMaxRows * row * sizeof(float));
  const size_t small[] = {aligned(kMaxRows * sizeof(int32_t)), aligned(sizeof(SampledVerifyOutcome)),
                          aligned(kMaxRows * sizeof(int32_t)), aligned(sizeof(SamplerState))};
  memory_ =
      device_alloc(p_bytes + q_bytes + adjusted_bytes + small[0] + small[1] + small[2] + small[3], "device sampling");
  char* at = static_cast<char*>(memory_.get());
  p_ = reinterpret_cast<double*>(at);
  q_ = reinterpret_cast<double*>(at += p_bytes);
  adjusted_ = reinterpret_cast<float*>(at += q_bytes);
  status_ = reinterpret_cast<int32_t*>(at += adjusted_bytes);
  outcome_ = reinterpret_cast<SampledVerifyOutcome*>(at += small[0]);
  draft_tokens_ = reinterpret_cast<int32_t*>(at += small[1]);
  generator_ = reinterpret_cast<SamplerState*>(at + small[2]);
}

void DeviceSampler::prepare(std::span<const int32_t> rows, const SampleRequest& request, StepRunner& runner) {
  const int count = int(rows.size());
  check(count >= 1 && count <= kMaxRows, "device sampling: {} rows (1–{})", count, kMaxRows);
  std::vector<LogitAdjustment> adjustments;
  std::vector<float> biases;
  std::vector<int32_t> row_begin{0};
  for (int r = 0; r < count; ++r) {
    append_row_adjustments(*request.options, *request.history, rows.subspan(1, size_t(r)), adjustments, biases);
    row_begin.push_back(int32_t(adjustments.size()));
  }
  // One host image of [row_begin | tokens | stops | adjustments | biases]. Each part has room that only grows (a power
  // of two), so that the parts stay where captured launches read them from step to step.
  const size_t parts[] = {row_begin.size() * sizeof(int32_t), rows.size() * sizeof(int32_t),
                          request.stops.size() * sizeof(int64_t), adjustments.size() * sizeof(LogitAdjustment),
                          biases.size() * sizeof(float)};
  const void* sources[] = {row_begin.data(), rows.data(), request.stops.data(), adjustments.data(), biases.data()};
  bool moved = false;
  size_t offsets[5], total = 0;
  for (int i = 0; i < 5; ++i) {
    const size_t room = std::bit_ceil(std::max(parts[i], size_t(256)));
    if (room > part_room_[i]) part_room_[i] = room, moved = true;
    offsets[i] = total;
    total += part_room_[i];
  }
  staging_.assign(total, 0);
  for (int i = 0; i < 5; ++i)
    if (parts[i]) std::memcpy(staging_.data() + offsets[i], sources[i], parts[i]);
  if (total > input_capacity_) {  // no launch of this sequence is in flight between calls
    input_capacity_ = std::max(total, 2 * input_capacity_);
    inputs_ = device_alloc(input_capacity_, "device sampling inputs");
    moved = true;
  }
  char* device = static_cast<char*>(inputs_.get());
  runner.upload(device, staging_.data(), total);
  uploaded_ = {reinterpret_cast<const int32_t*>(device + offsets[0]),
               reinterpret_cast<const LogitAdjustment*>(device + offsets[3]),
               reinterpret_cast<const float*>(device + offsets[4]),
               reinterpret_cast<const int32_t*>(device + offsets[1]),
               reinterpret_cast<const int64_t*>(device + offsets[2]),
               int(request.stops.size())};
  // Captured launches hold these addresses, the stop count and the settings: a change is another graph.
  const DeviceSamplingOptions options = device_options(*request.options);
  if (moved || uploaded_.stop_count != stop_count_ || std::memcmp(&options, &options_, sizeof options) != 0)
    ++generation_;
  stop_count_ = uploaded_.stop_count;
  options_ = options;
  const SamplerState generator{request.rng_state, 0};
  runner.upload(generator_, &generator, sizeof generator);
  int32_t ok[kMaxRows];
  std::fill(ok, ok + kMaxRows, kSampleOk);
  runner.upload(status_, ok, sizeof ok);  // the launches write only the rows they find bad
}

void DeviceSampler::launch_distributions(const float* logits, int count, double* probs, cudaStream_t stream) {
  DistributionRows rows;
  rows.logits = logits;
  rows.logits_stride = vocab_;
  rows.adjustments = uploaded_.adjustments;
  rows.row_begin = uploaded_.row_begin;
  rows.biases = uploaded_.biases;
  rows.adjusted = adjusted_;
  rows.probs = probs;
  rows.status = status_;
  cuda_check(sample_distributions(rows, count, vocab_, options_, stream), "sampling distributions");
}

const int32_t* DeviceSampler::launch_verify(const float* logits, int rows, cudaStream_t stream) {
  launch_distributions(logits, rows, p_, stream);
  cuda_check(sampled_verify(p_, q_, uploaded_.tokens, rows, vocab_, uploaded_.stops, uploaded_.stop_count, generator_,
                            outcome_, stream),
             "sampled verify");
  return outcome_->emitted;
}

const int32_t* DeviceSampler::launch_draft(const float* logits, int index, cudaStream_t stream) {
  check(index >= 0 && index < kMaxRows - 1, "device sampling: draft index {} (0–{})", index, kMaxRows - 2);
  double* q = q_ + size_t(index) * size_t(vocab_);
  launch_distributions(logits, 1, q, stream);
  cuda_check(sampled_draw(q, vocab_, generator_, draft_tokens_ + index, stream), "sampled draft");
  return draft_tokens_ + index;
}

void DeviceSampler::download_outcome(int rows, StepRunner& runner) {
  runner.download(host_status_, status_, size_t(rows) * sizeof(int32_t));
  runner.download(&host_generator_, generator_, sizeof host_generator_);
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
  prepare(rows, request, runner);
  launch_verify(logits, count, runner.stream());
  SampledVerifyOutcome outcome{};
  runner.download(&outcome, outcome_, sizeof outcome);
  download_outcome(count, runner);
  runner.finish();
  check_status(count);
  check(outcome.kept >= 1 && outcome.kept <= count, "sampled verify: the device kept {} of {} rows", outcome.kept,
        count);
  return {std::vector<int32_t>(outcome.emitted, outcome.emitted + outcome.kept), uniforms()};
}

int32_t DeviceSampler::draft(const float* logits, int index, const SampleRequest& request, StepRunner& runner) {
  const int32_t none = 0;  // one row, penalised by the history alone; a draw reads no row tokens
  prepare(std::span<const int32_t>(&none, 1), request, runner);
  const int32_t* device_token = launch_draft(logits, index, runner.stream());
  int32_t token = -1;
  runner.download(&token, device_token, sizeof token);
  download_outcome(1, runner);
  runner.finish();
  check_status(1);
  check(token >= 0 && token < vocab_, "sampled draft: the device drew token {}", token);
  return token;
}

void DeviceSampler::replace(int index, int32_t token, StepRunner& runner) {
  check(index >= 0 && index < kMaxRows - 1 && token >= 0 && token < vocab_, "replace_draft: draft {} token {}", index,
        token);
  cuda_check(point_mass(q_ + size_t(index) * size_t(vocab_), vocab_, token, runner.stream()), "replace draft");
  runner.finish();
}

}  // namespace vavilov::cuda
