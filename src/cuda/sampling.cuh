#pragma once
// Sampling on the device: docs/SAMPLING.md's rule (engine/sampling.h) over rows of logits that never leave the GPU,
// and the Decoder's lossless verification of sampled drafts (engine/speculative.cpp), so that a sampled step downloads
// a few tokens instead of the vocabulary's logits a row and leaves no distribution to the host. A row is one cluster
// of 16 blocks of 1024 threads; every sum runs in a fixed order, so the results do not depend on the schedule. The
// uniforms are the sequence's own SplitMix64 stream (engine::Rng), drawn on the device in the order the host would
// draw them. Plain launches that wait for everything before them, so a captured step may hold them.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace vavilov::cuda {

// One token's logit adjustments for one row (engine/sampling.cpp's adjusted_logits): biases [bias_begin, bias_end)
// added in order, then, when `seen` (in the prompt or generated), the repetition penalty, then the frequency and
// presence penalties when generated > 0.
struct LogitAdjustment {
  int32_t id;
  int32_t bias_begin, bias_end;
  int32_t generated;
  int32_t seen;
};

struct DeviceSamplingOptions {
  float temperature = 1, top_p = 1, min_p = 0;
  float repetition = 1, presence = 0, frequency = 0;
  int32_t top_k = 0;
};

// Row r's logits at logits + r·logits_stride; its adjustments are adjustments[row_begin[r], row_begin[r + 1]).
struct DistributionRows {
  const float* logits = nullptr;
  int64_t logits_stride = 0;
  const LogitAdjustment* adjustments = nullptr;
  const int32_t* row_begin = nullptr;
  const float* biases = nullptr;
  float* adjusted = nullptr;  // scratch [rows, vocab]
  double* probs = nullptr;    // out [rows, vocab], row r at probs + r·vocab
  int32_t* status = nullptr;  // [rows]: set to kSampleAllBanned, kSampleNoMass or the id of a NaN logit, else untouched
};

constexpr int32_t kSampleOk = -1, kSampleAllBanned = -2, kSampleNoMass = -3;

// probs row r = distribution(logits row r) (engine/sampling.h: steps 1–6 and the normalisation, temperature > 0).
cudaError_t sample_distributions(const DistributionRows& rows, int count, int64_t vocab,
                                 const DeviceSamplingOptions& options, cudaStream_t stream);

// What a sampled verify step leaves on the device (and the host downloads).
struct SampledVerifyOutcome {
  int32_t kept;        // rows whose token was emitted
  int32_t emitted[4];  // [kept]: the tokens, then the rows' own tokens (any valid id for greedy_accept's head rows)
};

// The sequence's generator (engine::Rng) on the device: its state, and how many uniforms the kernels drew from it.
struct SamplerState {
  uint64_t state;
  int32_t uniforms;
};

// The Decoder's verification of rows [last, drafts…] (rows ≤ 4): row r < rows − 1 accepts draft tokens[r + 1] with
// probability min(1, p_r(x) / q_r(x)), else draws from normalise(max(0, p_r − q_r)) (p_r when that is empty) and
// ends; the last row draws the bonus token from p_r; a stop token ends the step. p: [rows, vocab], q: [rows − 1,
// vocab]. The uniforms come from `generator`, which is advanced. One cluster.
cudaError_t sampled_verify(const double* p, const double* q, const int32_t* tokens, int rows, int64_t vocab,
                           const int64_t* stops, int stop_count, SamplerState* generator, SampledVerifyOutcome* outcome,
                           cudaStream_t stream);

// *token = draw(probs) with the generator's next uniform (engine/sampling.h's draw). One cluster.
cudaError_t sampled_draw(const double* probs, int64_t vocab, SamplerState* generator, int32_t* token,
                         cudaStream_t stream);

// probs = a point mass at `token` (a replaced draft's q).
cudaError_t point_mass(double* probs, int64_t vocab, int32_t token, cudaStream_t stream);

}  // namespace vavilov::cuda
