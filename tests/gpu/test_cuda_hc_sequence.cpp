// The fused hyper-connection reads inside a whole model (src/cuda/sequence.cpp: hyper_read, hyper_write): decode
// passes of 1–4 rows take hc_fused_read, with each layer's writes folded into the next read, while longer passes take
// the generic kernels (hc_write's norm, grouped products, hc_combine). Both run in fp32 over the same Q4 weights, so a
// model's logits, stacks and MTP outputs must agree between them to the fp32 bound of the other GPU tests (1e-3
// relative); a lost, doubled or misplaced write changes them by order one. Synthetic weights at a fixture's geometry
// (PLE, GDN and attention layers, an MTP head) with a rank of 64 so that the mixers are Q4.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "cuda/backend.h"
#include "cuda/hyper_connection.cuh"
#include "cuda/synthetic.h"
#include "fixture_paths.h"
#include "model/config.h"
#include "reference_logits.h"

namespace vavilov {
namespace {

constexpr double kFp32Tolerance = 1e-3;
constexpr int kPrompt = 12;

struct Outputs {
  std::vector<float> logits, stacks;
};

// The trunk over `ids` in passes of `chunk` rows, every row's logits and stacks.
Outputs trunk(SequenceBackend& sequence, const ModelConfig& c, const std::vector<int32_t>& ids, size_t chunk) {
  Outputs out;
  out.logits.resize(ids.size() * size_t(c.vocab_size));
  out.stacks.resize(ids.size() * size_t(c.hc_hidden()));
  for (size_t begin = 0; begin < ids.size(); begin += chunk) {
    const size_t count = std::min(chunk, ids.size() - begin);
    sequence.forward(std::span<const int32_t>(ids).subspan(begin, count),
                     {true, out.logits.data() + begin * size_t(c.vocab_size),
                      out.stacks.data() + begin * size_t(c.hc_hidden()), false});
  }
  return out;
}

// The MTP head over the trunk's stacks in passes of `chunk` rows: its stacks and their draft logits.
Outputs head(SequenceBackend& sequence, const ModelConfig& c, const std::vector<float>& stacks,
             const std::vector<int32_t>& next, size_t chunk) {
  const size_t sh = size_t(c.hc_hidden()), vocab = size_t(c.vocab_size);
  Outputs out;
  out.stacks.resize(next.size() * sh);
  out.logits.resize(next.size() * vocab);
  for (size_t begin = 0; begin < next.size(); begin += chunk) {
    const size_t count = std::min(chunk, next.size() - begin);
    sequence.mtp_forward(stacks.data() + begin * sh, std::span<const int32_t>(next).subspan(begin, count),
                         out.stacks.data() + begin * sh, MtpRows::All);
    sequence.mtp_logits(out.stacks.data() + begin * sh, int64_t(count), out.logits.data() + begin * vocab);
  }
  return out;
}

TEST(CudaHcSequence, FusedDecodeReadsMatchTheGenericPath) {
  ASSERT_GT(cuda::device_count(), 0) << "the GPU tests need a CUDA device";
  ModelConfig c = load_model_config((test::mtp_fixtures() / "mtp_bf16_hc4_sharded").string());
  c.hc_lowrank = 64;
  c.mtp_num_layers = 1;  // the fixture's checkpoint has the head; its config does not say so
  cuda::SyntheticOptions options;
  options.seed = 11;
  options.ngram_head_rows = 1009;
  std::shared_ptr<const cuda::DeviceModel> weights = cuda::synthetic_model(c, options);
  const cuda::DeviceGatedResidual& read = weights->layers[0].attn_hc;
  ASSERT_TRUE(
      cuda::hc_fused_read_fits(read.mix_down, read.mix_up, &read.inject, read.norm, c.hc_count, int(c.hidden_size), 4))
      << "the geometry must take the fused read";
  auto factory = cuda::sequence_factory(weights);

  std::mt19937 rng(5);
  std::uniform_int_distribution<int32_t> token(0, c.vocab_size - 1);
  std::vector<int32_t> ids(kPrompt), next(kPrompt);
  for (int i = 0; i < kPrompt; ++i) ids[size_t(i)] = token(rng), next[size_t(i)] = token(rng);

  auto generic = factory();
  const Outputs want = trunk(*generic, c, ids, ids.size());
  const Outputs want_head = head(*generic, c, want.stacks, next, next.size());
  for (size_t chunk : {size_t(1), size_t(3), size_t(4)}) {
    SCOPED_TRACE(testing::Message() << "passes of " << chunk << " rows");
    auto fused = factory();
    const Outputs got = trunk(*fused, c, ids, chunk);
    EXPECT_LE(test::relative_error(got.logits, want.logits), kFp32Tolerance);
    EXPECT_LE(test::relative_error(got.stacks, want.stacks), kFp32Tolerance);
    const Outputs got_head = head(*fused, c, want.stacks, next, chunk);
    EXPECT_LE(test::relative_error(got_head.stacks, want_head.stacks), kFp32Tolerance);
    EXPECT_LE(test::relative_error(got_head.logits, want_head.logits), kFp32Tolerance);
  }
}

}  // namespace
}  // namespace vavilov
