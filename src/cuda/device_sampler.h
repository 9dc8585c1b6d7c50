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

  // `logits`: the rows' logits on the device, [rows.size(), vocab].
  SampledVerify verify(const float* logits, std::span<const int32_t> rows, const SampleRequest& request,
                       StepRunner& runner);
  // `logits`: one row on the device.
  int32_t draft(const float* logits, int index, const SampleRequest& request, StepRunner& runner);
  void replace(int index, int32_t token, StepRunner& runner);

 private:
  // What one call uploads (one copy): the rows' adjustments (row r penalised by the history and the first r of
  // `extra`), the rows' tokens and the stop tokens; where each landed on the device.
  struct Uploaded {
    const int32_t* row_begin;
    const LogitAdjustment* adjustments;
    const float* biases;
    const int32_t* tokens;
    const int64_t* stops;
    int stop_count;
  };
  Uploaded upload(int count, std::span<const int32_t> extra, std::span<const int32_t> tokens,
                  const SampleRequest& request, StepRunner& runner);
  void launch_distributions(const float* logits, int count, const Uploaded& uploaded, const SampleRequest& request,
                            double* probs, StepRunner& runner);
  void check_status(int count) const;

  int64_t vocab_;
  DeviceAllocation memory_;  // p, q, adjusted logits, status, outcome, draft token
  double *p_ = nullptr, *q_ = nullptr;
  float* adjusted_ = nullptr;
  int32_t *status_ = nullptr, *draft_token_ = nullptr;
  SampledVerifyOutcome* outcome_ = nullptr;
  DeviceAllocation inputs_;  // Uploaded's memory, grown on demand
  size_t input_capacity_ = 0;
  std::vector<unsigned char> staging_;
  int32_t host_status_[kMaxRows] = {};
};

// The logit adjustments (sampling.cuh) of one row penalised by `history` plus `extra` generated tokens, appended to
// `out` (biases into `biases`): one entry a token that has a bias or, with penalties on, was seen.
void append_row_adjustments(const SamplingOptions& options, const TokenHistory& history,
                            std::span<const int32_t> extra, std::vector<LogitAdjustment>& out,
                            std::vector<float>& biases);

}  // namespace vavilov::cuda
