#include "cuda/bench.h"

#include <nvtx3/nvToolsExt.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <string>

#include "core/error.h"
#include "cuda/backend.h"
#include "cuda/expert_cache.h"
#include "cuda/kernel_trace.h"

namespace vavilov::cuda {

namespace {

double residual_bytes(const DeviceGatedResidual& g) {
  return matrix_bytes(g.mix_down) + matrix_bytes(g.mix_up) + (g.has_inject ? matrix_bytes(g.inject) : 0.0);
}

// Every weight of a layer but the routed experts.
double dense_layer_bytes(const DeviceLayer& l) {
  double bytes = residual_bytes(l.attn_hc) + residual_bytes(l.mlp_hc);
  if (l.kind == LayerKind::GatedDeltaNet)
    for (const DeviceMatrix* m : {&l.gdn.in_qkv, &l.gdn.in_z, &l.gdn.in_b, &l.gdn.in_a, &l.gdn.out})
      bytes += matrix_bytes(*m);
  else
    for (const DeviceMatrix* m : {&l.attn.q, &l.attn.k, &l.attn.v, &l.attn.o, &l.attn.index_qk})
      bytes += matrix_bytes(*m);
  bytes += matrix_bytes(l.moe.router) + matrix_bytes(l.moe.shared_gate);
  bytes += matrix_bytes(l.moe.shared.gate) + matrix_bytes(l.moe.shared.up) + matrix_bytes(l.moe.shared.down);
  if (l.ple) bytes += matrix_bytes(l.ple->key_proj) + matrix_bytes(l.ple->value_proj);
  return bytes;
}

class ByteModel {
 public:
  explicit ByteModel(const DeviceModel& m) : m_(m), c_(m.config), expert_(m.layers.front().moe.expert_bytes) {}
  // Expected distinct experts of `rows` rows under uniform random routing.
  double experts(int rows) const {
    const double e = c_.num_experts, k = c_.num_experts_per_tok;
    return e * (1 - std::pow(1 - k / e, rows));
  }
  double trunk(int rows) const {
    double bytes = residual_bytes(m_.final_mixer) + matrix_bytes(m_.lm_head);
    for (const DeviceLayer& l : m_.layers) bytes += dense_layer_bytes(l) + experts(rows) * expert_;
    return bytes;
  }
  double head(int rows) const {
    const DeviceMtp& h = *m_.mtp;
    return matrix_bytes(h.fc_embedding) + matrix_bytes(h.fc_hidden) + dense_layer_bytes(h.layer) +
           experts(rows) * expert_ + residual_bytes(h.final_mixer) + matrix_bytes(m_.lm_head);
  }
  // A verify step with d drafts at full acceptance: the trunk over 1 + d rows, the head folded over them, d − 1 chains.
  double step(int drafts) const {
    return drafts == 0 ? trunk(1) : trunk(drafts + 1) + head(drafts + 1) + (drafts - 1) * head(1);
  }

 private:
  const DeviceModel& m_;
  const ModelConfig& c_;
  double expert_ = 0;
};

constexpr int64_t kPrefillWarmupTokens = 64;  // a prefill-path pass (more than 4 rows) before the timed ones

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::vector<int32_t> random_ids(int64_t n, int64_t vocab, uint64_t& state) {
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (auto& id : ids) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    id = int32_t((state >> 33) % uint64_t(vocab));
  }
  return ids;
}

#ifdef VAVILOV_KERNEL_TRACE
constexpr size_t kTraceCapacity = size_t(1) << 20;  // entries: ~1500 kernels a 3-draft step, far more steps than asked

// Steps with 0 and 3 drafts traced in fresh sequences (their graphs captured while tracing), after the warm-up steps
// the untimed measurement makes too; each summary also holds the traced and the untraced step time.
nlohmann::json trace_steps(const SequenceFactory& sequences, const ModelConfig& c, const BenchOptions& options,
                           const std::vector<DecodeMeasurement>& untraced, uint64_t& rng, StepBuffers& buffers) {
  nlohmann::json out = nlohmann::json::array();
  for (int drafts : {0, int(StepBuffers::kVerifyRows) - 1}) {
    if (size_t(drafts) >= untraced.size()) break;
    kernel_trace::start(kTraceCapacity);
    auto seq = sequences();
    start_sequence(*seq, c, options.context, drafts > 0, rng, buffers);
    for (int i = 0; i < 3; ++i) verify_step(*seq, c, drafts, rng, buffers);
    kernel_trace::clear();
    const double start = now_ms();
    for (int i = 0; i < options.decode_steps; ++i) verify_step(*seq, c, drafts, rng, buffers);
    const double step_ms = (now_ms() - start) / options.decode_steps;
    const kernel_trace::Trace trace = kernel_trace::stop();
    nlohmann::json summary = kernel_trace::summarise(
        kernel_trace::passes(kernel_trace::match(trace.entries, trace.launches)), options.decode_steps);
    summary["drafts"] = drafts;
    summary["clock_granularity_ns"] = kernel_trace::clock_granularity_ns(trace.entries);
    summary["step_ms_traced"] = step_ms;
    summary["step_ms_untraced"] = untraced[size_t(drafts)].step_ms;
    out.push_back(std::move(summary));
  }
  return out;
}
#endif

}  // namespace

// The backend calls of one greedy Decoder verify step at full acceptance (engine/speculative.cpp): the trunk's and the
// drafts' greedy ids come from the device (TrunkOutputs::greedy, draft_greedy), no logits.
void verify_step(SequenceBackend& seq, const ModelConfig& c, int drafts, uint64_t& rng, StepBuffers& buffers) {
  std::vector<float>&stacks = buffers.stacks, &head_stacks = buffers.head;
  const bool head = drafts > 0;
  const int64_t rows = drafts + 1, sh = c.hc_hidden(), vocab = c.vocab_size;
  const std::vector<int32_t> ids = random_ids(rows, vocab, rng);
  const int64_t first = seq.position();
  int32_t greedy[StepBuffers::kVerifyRows];
  seq.forward(ids, {true, nullptr, stacks.data(), true, greedy});
  seq.keep_rows(first, rows);
  if (!head) return;
  const int64_t committed = seq.position();
  seq.truncate_head(committed - rows);
  std::vector<int32_t> next(ids.begin() + 1, ids.end());
  next.push_back(greedy[rows - 1]);
  seq.mtp_forward(stacks.data(), next, head_stacks.data(), MtpRows::Last);
  std::vector<float> chain(head_stacks.begin(), head_stacks.begin() + sh), chained(static_cast<size_t>(sh));
  int32_t draft = next.back();
  for (int j = 0; j < drafts; ++j) {
    if (j > 0) {  // chained on the previous draft, as the Decoder does
      seq.mtp_forward(chain.data(), std::span<const int32_t>(&draft, 1), chained.data(), MtpRows::Last);
      chain.swap(chained);
    }
    draft = seq.draft_greedy(chain.data());
  }
  seq.truncate_head(committed);
}

// Fused and composed greedy steps with `drafts` drafts at forced full acceptance, each after warm-up steps, in one
// sequence: each step verifies the drafts the step before proposed.
static GreedyStepMeasurement measure_greedy_steps(const SequenceFactory& sequences, const ModelConfig& c,
                                                  const BenchOptions& options, int drafts, uint64_t& rng,
                                                  StepBuffers& buffers) {
  auto seq = sequences();
  start_sequence(*seq, c, options.context, true, rng, buffers);
  std::vector<int32_t> rows = random_ids(drafts + 1, c.vocab_size, rng);
  GreedyStep step;
  step.stack_size = c.hc_hidden();
  step.head = true;
  step.drafts = step.drafts_after_rejection = drafts;
  step.accept_all = true;
  auto steps = [&](int count, bool fused) {
    for (int i = 0; i < count; ++i) {
      step.rows = rows;
      GreedyStepResult result = fused ? seq->greedy_step(step) : seq->SequenceBackend::greedy_step(step);
      check(result.emitted.size() == rows.size() && int(result.drafts.size()) == drafts,
            "bench: a forced greedy step kept {} of {} rows", result.emitted.size(), rows.size());
      rows = {result.emitted.back()};
      rows.insert(rows.end(), result.drafts.begin(), result.drafts.end());
    }
  };
  GreedyStepMeasurement m;
  m.drafts = drafts;
  for (bool fused : {true, false}) {
    steps(3, fused);  // warm-up (graph capture)
    const double start = now_ms();
    steps(options.decode_steps, fused);
    (fused ? m.fused_ms : m.composed_ms) = (now_ms() - start) / options.decode_steps;
  }
  return m;
}

// The mean time of `count` calls of `call` after three untimed ones.
static double mean_ms(int count, const std::function<void()>& call) {
  for (int i = 0; i < 3; ++i) call();
  const double start = now_ms();
  for (int i = 0; i < count; ++i) call();
  return (now_ms() - start) / count;
}

static SamplingMeasurement measure_sampling(const SequenceFactory& sequences, const ModelConfig& c, bool has_head,
                                            const BenchOptions& options, uint64_t& rng, StepBuffers& buffers) {
  SamplingOptions sampling;
  sampling.temperature = 0.7f;
  sampling.top_p = 0.95f;
  TokenHistory history;
  Rng generator(options.seed);
  const SampleRequest request{&sampling, &history, generator.state(), {}};
  const int64_t vocab = c.vocab_size;
  std::vector<float> logits(size_t(StepBuffers::kVerifyRows * vocab));
  std::vector<double> probs;
  auto host_sample = [&](int rows) {
    for (int r = 0; r < rows; ++r) {
      distribution(logits.data() + r * vocab, vocab, sampling, history, probs);
      draw(probs, generator);
    }
  };
  auto seq = sequences();
  start_sequence(*seq, c, options.context, has_head, rng, buffers);
  SamplingMeasurement m;
  // Recorded trunk passes that keep one row (a rejected verify step).
  auto pass = [&](int rows, int mode) {  // 0: greedy ids, 1: sampled on the device, 2: logits to the host
    const std::vector<int32_t> ids = random_ids(rows, vocab, rng);
    int32_t greedy[StepBuffers::kVerifyRows];
    TrunkOutputs out{true, mode == 2 ? logits.data() : nullptr, nullptr, true, mode == 0 ? greedy : nullptr, mode == 1};
    const int64_t first = seq->position();
    seq->forward(ids, out);
    if (mode == 1) seq->verify_sampled(ids, request);
    if (mode == 2) host_sample(rows);
    seq->keep_rows(first, 1);
  };
  for (int rows : {1, int(StepBuffers::kVerifyRows)}) {
    double* ms[3] = {rows == 1 ? &m.row_greedy_ms : &m.verify4_greedy_ms,
                     rows == 1 ? &m.row_device_ms : &m.verify4_device_ms,
                     rows == 1 ? &m.row_host_ms : &m.verify4_host_ms};
    for (int mode = 0; mode < 3; ++mode) *ms[mode] = mean_ms(options.decode_steps, [&] { pass(rows, mode); });
  }
  if (!has_head) return m;
  const float* head = buffers.head.data();
  m.draft_greedy_ms = mean_ms(options.decode_steps, [&] { seq->draft_greedy(head); });
  m.draft_device_ms = mean_ms(options.decode_steps, [&] { seq->draft_sampled(head, 0, request); });
  m.draft_host_ms = mean_ms(options.decode_steps, [&] {
    seq->draft_logits(head, logits.data());
    host_sample(1);
  });
  // Whole 3-draft steps, each verifying the drafts the step before proposed (rejections as they come): the greedy
  // fused step, the sampled one fused (sampled_step), and the sampled one as the Decoder's calls.
  constexpr int kDrafts = 3;
  GreedyStep step;
  step.stack_size = c.hc_hidden();
  step.head = true;
  step.drafts = step.drafts_after_rejection = kDrafts;
  const int64_t sh = c.hc_hidden();
  std::vector<float> chain(static_cast<size_t>(sh)), chained(chain.size());
  auto steps = [&](int mode) {  // 0: greedy fused, 1: sampled fused, 2: sampled through the calls
    auto s = sequences();
    start_sequence(*s, c, options.context, true, rng, buffers);
    std::vector<int32_t> rows = random_ids(kDrafts + 1, vocab, rng);
    step.rows = rows;
    SampledStepResult fused;
    if (mode == 1 && !s->sampled_step(step, request, fused)) return 0.0;  // not fused for this model (0 in the JSON)
    return mean_ms(options.decode_steps, [&] {
      step.rows = rows;
      if (mode == 0) fused.step = s->greedy_step(step);
      if (mode == 1) s->sampled_step(step, request, fused);
      if (mode < 2) {
        rows = {fused.step.emitted.back()};
        rows.insert(rows.end(), fused.step.drafts.begin(), fused.step.drafts.end());
        return;
      }
      const int64_t first = s->position();
      s->forward(rows, {true, nullptr, buffers.stacks.data(), true, nullptr, true});
      const std::vector<int32_t> emitted = s->verify_sampled(rows, request).emitted;
      s->keep_rows(first, int64_t(emitted.size()));
      const int64_t committed = s->position();
      s->truncate_head(committed - int64_t(emitted.size()));
      s->mtp_forward(buffers.stacks.data(), emitted, chain.data(), MtpRows::Last);
      rows = {emitted.back()};
      for (int j = 0; j < kDrafts; ++j) {
        if (j > 0) {
          s->mtp_forward(chain.data(), std::span<const int32_t>(&rows.back(), 1), chained.data(), MtpRows::Last);
          chain.swap(chained);
        }
        rows.push_back(s->draft_sampled(chain.data(), j, request));
      }
      s->truncate_head(committed);
    });
  };
  m.step3_greedy_ms = steps(0);
  m.step3_sampled_fused_ms = steps(1);
  m.step3_sampled_calls_ms = steps(2);
  return m;
}

void start_sequence(SequenceBackend& seq, const ModelConfig& c, int64_t context, bool head, uint64_t& rng,
                    StepBuffers& buffers) {
  std::vector<int32_t> prompt = random_ids(context, c.vocab_size, rng);
  int32_t first = 0;
  seq.forward(prompt, {false, nullptr, buffers.stacks.data(), false, &first});
  if (!head) return;
  // As Decoder::start: head rows pair each stack with the token after it, the last one with the first generated.
  std::vector<int32_t> next(prompt.begin() + 1, prompt.end());
  next.push_back(first);
  seq.mtp_forward(buffers.stacks.data(), next, buffers.head.data(), MtpRows::Last);
}

double measure_copy_bandwidth_gbs() {
  const size_t bytes = size_t(2) << 30;
  DeviceAllocation a = device_alloc(bytes, "copy bandwidth"), b = device_alloc(bytes, "copy bandwidth");
  cuda_check(cudaMemset(a.get(), 1, bytes), "copy bandwidth");
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (int i = 0; i < 3; ++i) cudaMemcpy(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice);
  constexpr int kIterations = 20;
  cudaEventRecord(start);
  for (int i = 0; i < kIterations; ++i) cudaMemcpyAsync(b.get(), a.get(), bytes, cudaMemcpyDeviceToDevice);
  cudaEventRecord(stop);
  cuda_check(cudaEventSynchronize(stop), "copy bandwidth");
  float ms = 0;
  cudaEventElapsedTime(&ms, start, stop);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return 2.0 * double(bytes) * kIterations / (double(ms) * 1e-3) / 1e9;
}

// The expert cache over `steps` timed steps: hits, host traffic (the bytes misses read over the bus) and its rate.
static nlohmann::json cache_window(const ExpertCacheStats& a, const ExpertCacheStats& b, int steps, double step_ms) {
  const double reads = double(b.expert_reads - a.expert_reads), hits = double(b.hits - a.hits);
  const double missed = (b.missed_bytes - a.missed_bytes) / steps;
  return {{"hit_rate", reads > 0 ? hits / reads : 0.0},
          {"expert_reads_per_step", reads / steps},
          {"host_read_mb_per_step", missed / 1e6},
          {"host_read_gbs", missed / (step_ms * 1e-3) / 1e9},
          {"promoted_mb_per_step", (b.promoted_bytes - a.promoted_bytes) / steps / 1e6},
          {"promotions_per_step", double(b.promotions - a.promotions) / steps}};
}

static nlohmann::json cache_totals(const ExpertCacheStats& s) {
  return {{"budget_mb", double(s.budget_bytes) / (1024.0 * 1024.0)},
          {"expert_mb", double(s.slot_bytes) / (1024.0 * 1024.0)},
          {"slots", s.slots},
          {"resident", s.resident},
          {"occupancy", s.slots ? double(s.resident) / s.slots : 0.0},
          {"resident_mb", s.resident_bytes / (1024.0 * 1024.0)},
          {"host_expert_mb", s.host_bytes / (1024.0 * 1024.0)},
          {"hit_rate", s.hit_rate()},
          {"expert_reads", s.expert_reads},
          {"promotions", s.promotions},
          {"evictions", s.evictions},
          {"promoted_mb", s.promoted_bytes / 1e6},
          {"rounds", s.rounds},
          {"rounds_skipped_busy", s.rounds_busy}};
}

BenchResult run_bench(std::shared_ptr<const DeviceModel> model, const BenchOptions& options) {
  check(!options.trace || kernel_trace::kBuilt, "bench --trace: this binary was built without VAVILOV_KERNEL_TRACE");
  const ModelConfig& c = model->config;
  BenchResult result;
  cudaDeviceProp properties{};
  cuda_check(cudaGetDeviceProperties(&properties, 0), "device properties");
  result.gpu = properties.name;
  result.copy_bandwidth_gbs = measure_copy_bandwidth_gbs();
  result.weight_bytes = double(model->bytes);
  const ByteModel bytes(*model);
  SequenceFactory sequences = sequence_factory(model);
  uint64_t rng = options.seed;
  const int64_t sh = c.hc_hidden(), vocab = c.vocab_size;
  StepBuffers buffers(c, options.context);

  const bool has_head = model->mtp.has_value();
  for (int drafts = 0; drafts < (has_head ? StepBuffers::kVerifyRows : 1); ++drafts) {
    auto seq = sequences();
    start_sequence(*seq, c, options.context, has_head, rng, buffers);
    for (int i = 0; i < 3; ++i) verify_step(*seq, c, drafts, rng, buffers);  // warm-up
    const ExpertCacheStats before = model->expert_cache ? model->expert_cache->stats() : ExpertCacheStats{};
    const double start = now_ms();
    for (int i = 0; i < options.decode_steps; ++i) verify_step(*seq, c, drafts, rng, buffers);
    DecodeMeasurement m;
    m.drafts = drafts;
    m.step_ms = (now_ms() - start) / options.decode_steps;
    if (model->expert_cache)
      result.expert_cache["decode"][std::to_string(drafts)] =
          cache_window(before, model->expert_cache->stats(), options.decode_steps, m.step_ms);
    m.tokens_per_second = (drafts + 1) / (m.step_ms * 1e-3);
    m.bytes = bytes.step(drafts);
    result.decode.push_back(m);
  }
#ifdef VAVILOV_KERNEL_TRACE
  if (options.trace) result.trace = trace_steps(sequences, c, options, result.decode, rng, buffers);
#endif
  if (has_head) {
    auto seq = sequences();
    start_sequence(*seq, c, options.context, true, rng, buffers);
    std::vector<float> chained(static_cast<size_t>(sh));
    const int32_t id = 0;
    const double start = now_ms();
    for (int i = 0; i < options.decode_steps; ++i) {
      seq->mtp_forward(buffers.head.data(), std::span<const int32_t>(&id, 1), chained.data(), MtpRows::Last);
      seq->draft_greedy(chained.data());
      seq->truncate_head(options.context);
    }
    result.chained_pass_ms = (now_ms() - start) / options.decode_steps;
  }
  for (int drafts = 1; has_head && drafts < StepBuffers::kVerifyRows; ++drafts)
    result.greedy_steps.push_back(measure_greedy_steps(sequences, c, options, drafts, rng, buffers));
  result.sampling = measure_sampling(sequences, c, has_head, options, rng, buffers);
  if (!options.prefill_lengths.empty()) {  // first-use costs (module loading, library handles) stay out of the timings
    auto seq = sequences();
    int32_t first = 0;
    seq->forward(random_ids(kPrefillWarmupTokens, vocab, rng), {false, nullptr, nullptr, false, &first});
  }
  for (int64_t length : options.prefill_lengths) {
    auto seq = sequences();
    const std::vector<int32_t> prompt = random_ids(length, vocab, rng);
    cuda_check(cudaDeviceSynchronize(), "prefill");
    const std::string range = "prefill" + std::to_string(length);  // isolates the pass for ncu --nvtx-include
    nvtxRangePushA(range.c_str());
    const double start = now_ms();
    int32_t first = 0;
    seq->forward(prompt, {false, nullptr, nullptr, false, &first});
    nvtxRangePop();
    result.prefill_tokens_per_second.push_back({length, double(length) / ((now_ms() - start) * 1e-3)});
  }
  if (model->expert_cache) result.expert_cache["totals"] = cache_totals(model->expert_cache->stats());
  return result;
}

}  // namespace vavilov::cuda
