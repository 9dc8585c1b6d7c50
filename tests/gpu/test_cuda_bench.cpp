// `vavilov bench`'s measurement loop (src/cuda/bench.cpp) on a synthetic model with an MTP head: every draft count is
// measured, also when the prompt is shorter than a verify step's rows (its host buffers must hold those rows).
#include <gtest/gtest.h>

#include <cmath>

#include "cuda/bench.h"
#include "cuda/synthetic.h"
#include "fixture_paths.h"
#include "model/config.h"

namespace vavilov {
namespace {

TEST(CudaBench, ShortPromptsMeasureEveryDraftCount) {
  ModelConfig config = load_model_config((test::mtp_fixtures() / "mtp_f32_hc4").string());
  config.mtp_num_layers = 1;  // the checkpoint's head is found by its weights; a synthetic model needs it stated
  std::shared_ptr<const cuda::DeviceModel> model = cuda::synthetic_model(config, {});
  for (int64_t context : {1, 3, 6}) {
    cuda::BenchOptions options;
    options.context = context;
    options.decode_steps = 2;
    options.prefill_lengths = {5};
    const cuda::BenchResult result = cuda::run_bench(model, options);
    ASSERT_EQ(result.decode.size(), 4u) << "context " << context;
    for (int drafts = 0; drafts < 4; ++drafts) {
      const cuda::DecodeMeasurement& m = result.decode[size_t(drafts)];
      EXPECT_EQ(m.drafts, drafts);
      EXPECT_GT(m.step_ms, 0.0);
      EXPECT_TRUE(std::isfinite(m.tokens_per_second));
      EXPECT_GT(m.bytes, 0.0);
    }
    EXPECT_GT(result.chained_pass_ms, 0.0);
    ASSERT_EQ(result.prefill_tokens_per_second.size(), 1u);
    EXPECT_GT(result.prefill_tokens_per_second[0].second, 0.0);
  }
}

}  // namespace
}  // namespace vavilov
