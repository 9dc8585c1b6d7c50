#pragma once
// One sequence's sampling on the device (sampling.cuh): the verify rows' distributions p, the drafts' q, the adjusted
// logits, the rows' logit adjustments, and the host side of SequenceBackend::verify_sampled, draft_sampled and
// replace_draft. Each call is a few launches, one download of a few tokens and one synchronisation.
#include <cstdint>
#include <span>
#include <vector>

#include "cuda/device_model.h"
#include "cuda/sampling.cuh"
#include "cuda/step_runner.h"
#include "engine/backend.h"

namespace vavilov::cuda {

class DeviceSampler {
 public:
  static constexpr int kMaxRows = 4;  // a verify pass: the last token and up to three drafts

  explicit DeviceSampler(int64_t vocab);

  // Backend calls, one synchronisation each. `logits`: the rows' logits on the device, [rows.size(), vocab].
  SampledVerify verify(const float* logits, std::span<const int32_t> rows, const SampleRequest& request,
                       StepRunner& runner);
  // `logits`: one row on the device.
  int32_t draft(const float* logits, int index, const SampleRequest& request, StepRunner& runner);
  void replace(int index, int32_t token, StepRunner& runner);

  // A step's parts, for a captured step (CudaSequence::sampled_step). prepare() uploads what the launches read (the
  // rows' adjustments, row r penalised by the history and the drafts before it, the tokens, the stops, the generator)
  // outside the graph; the launches read it from addresses that stay put while generation() is unchanged. Drafts use
  // row 0's adjustments (a fused step has no penalties, whose tokens the device would decide).
  void prepare(std::span<const int32_t> rows, const SampleRequest& request, StepRunner& runner);
  const int32_t* launch_verify(const float* logits, int rows, cudaStream_t stream);  // the rows' tokens on the device
  const int32_t* launch_draft(const float* logits, int index, cudaStream_t stream);  // draft `index` on the device
  // Downloads the uniforms drawn since prepare() and the rows' statuses (delivered by the runner's finish()).
  void download_outcome(int rows, StepRunner& runner);
  int uniforms() const { return host_generator_.uniforms; }
  // Checks the statuses of the last launches' rows: engine::distribution's errors.
  void check_status(int rows) const;
  uint64_t generation() const { return generation_; }

 private:
  struct Uploaded {  // where prepare()'s inputs landed on the device
    const int32_t* row_begin;
    const LogitAdjustment* adjustments;
    const float* biases;
    const int32_t* tokens;
    const int64_t* stops;
    int stop_count;
  };
  void launch_distributions(const float* logits, int count, double* probs, cudaStream_t stream);

  int64_t vocab_;
  DeviceAllocation memory_;  // p, q, adjusted logits, statuses, outcome, draft tokens, generator: fixed for life
  double *p_ = nullptr, *q_ = nullptr;
  float* adjusted_ = nullptr;
  int32_t *status_ = nullptr, *draft_tokens_ = nullptr;
  SampledVerifyOutcome* outcome_ = nullptr;
  SamplerState* generator_ = nullptr;
  DeviceAllocation inputs_;  // Uploaded's memory, grown on demand (a growth bumps generation_)
  size_t input_capacity_ = 0, part_room_[5] = {};
  int stop_count_ = -1;
  Uploaded uploaded_{};
  DeviceSamplingOptions options_{};
  uint64_t generation_ = 0;
  std::vector<unsigned char> staging_;
  int32_t host_status_[kMaxRows] = {};
  SamplerState host_generator_{};
};

// The logit adjustments (sampling.cuh) of one row penalised by `history` plus `extra` generated tokens, appended to
// `out` (biases into `biases`): one entry a token that has a bias or, with penalties on, was seen.
void append_row_adjustments(const SamplingOptions& options, const TokenHistory& history, std::span<const int32_t> extra,
                            std::vector<LogitAdjustment>& out, std::vector<float>& biases);

}  // namespace vavilov::cuda
