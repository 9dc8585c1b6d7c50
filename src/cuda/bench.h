#pragma once
// `vavilov bench`: decode and prefill speed of a model on the GPU against the bytes each step must read and the
// device's measured copy bandwidth.
#include <algorithm>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cuda/device_model.h"
#include "engine/backend.h"

namespace vavilov::cuda {

struct BenchOptions {
  int64_t context = 64;  // prompt tokens before the decode steps
  int decode_steps = 20;
  std::vector<int64_t> prefill_lengths{512, 8192};
  uint64_t seed = 1;
  // Also trace a 1-row step and, with an MTP head, a 3-draft verify step kernel by kernel (needs a build with
  // -DVAVILOV_KERNEL_TRACE=ON; kernel_trace.h): `decode_steps` steps each after warm-up, in fresh sequences.
  bool trace = false;
};

struct DecodeMeasurement {
  int drafts = 0;
  double step_ms = 0;  // one verify step at full acceptance: trunk over 1 + drafts rows, rollback, head passes
  double tokens_per_second = 0;  // (1 + drafts) / step
  double bytes = 0;              // weight bytes the step must read (dense once, the expected union of routed experts)
};

// A whole greedy step at forced full acceptance (GreedyStep::accept_all) through greedy_step: fused on the device (one
// graph, one synchronisation) and composed from the seam's calls (SequenceBackend's default), in the same sequence.
struct GreedyStepMeasurement {
  int drafts = 0;
  double fused_ms = 0, composed_ms = 0;
};

// Sampled decoding (temperature 0.7, top-p 0.95, as a chat client sends) against greedy, per backend call: a 1-row
// trunk pass and its token, a 4-row verify pass and its rows' tokens, one draft from a head stack; sampled on the
// device (verify_sampled, draft_sampled) or by the host from downloaded logits (the Decoder with
// VAVILOV_DEVICE_SAMPLING=0). Each the mean of `decode_steps` calls after warm-up.
struct SamplingMeasurement {
  double row_greedy_ms = 0, row_device_ms = 0, row_host_ms = 0;
  double verify4_greedy_ms = 0, verify4_device_ms = 0, verify4_host_ms = 0;
  double draft_greedy_ms = 0, draft_device_ms = 0, draft_host_ms = 0;
  // Whole 3-draft steps with the rejections a random model gives: greedy (greedy_step), sampled as one graph
  // (sampled_step) and sampled through the Decoder's calls.
  double step3_greedy_ms = 0, step3_sampled_fused_ms = 0, step3_sampled_calls_ms = 0;
};

struct BenchResult {
  std::string gpu;
  double copy_bandwidth_gbs = 0;  // device-to-device copy, bytes read + written per second
  double weight_bytes = 0;
  std::vector<DecodeMeasurement> decode;            // drafts 0..3 (1..3 only with an MTP head)
  double chained_pass_ms = 0;                       // one chained MTP draft pass (head layer + lm_head, one row)
  std::vector<GreedyStepMeasurement> greedy_steps;  // drafts 1..3, with an MTP head
  SamplingMeasurement sampling;
  std::vector<std::pair<int64_t, double>> prefill_tokens_per_second;
  nlohmann::json trace;  // with BenchOptions::trace: one kernel_trace::summarise() per traced step kind
  // With an expert cache (DeviceModel::expert_cache): per draft count, over its timed steps, the hit rate, the bytes
  // read from host memory per step and their rate; at the end, the cache's totals and occupancy.
  nlohmann::json expert_cache;
};

// Host buffers of one sequence's steps: stacks and head stacks of the prompt's rows or a verify step's (1 + at most 3
// drafts), whichever is more. Greedy steps take token ids, not logits, from the device.
struct StepBuffers {
  static constexpr int64_t kVerifyRows = 4;
  std::vector<float> stacks, head;
  StepBuffers(const ModelConfig& c, int64_t context)
      : stacks(size_t(std::max(context, kVerifyRows) * c.hc_hidden())), head(stacks.size()) {}
};
// A fresh sequence's random prompt through the trunk and, with `head`, the MTP head (as Decoder::start leaves it).
void start_sequence(SequenceBackend& seq, const ModelConfig& c, int64_t context, bool head, uint64_t& rng,
                    StepBuffers& buffers);
// The backend calls of one greedy Decoder verify step with `drafts` drafts at full acceptance, greedy ids from the
// device.
void verify_step(SequenceBackend& seq, const ModelConfig& c, int drafts, uint64_t& rng, StepBuffers& buffers);

double measure_copy_bandwidth_gbs();
BenchResult run_bench(std::shared_ptr<const DeviceModel> model, const BenchOptions& options);

}  // namespace vavilov::cuda
