// The kernel trace (src/cuda/kernel_trace.h) on the device: launches of known kernels, eager and captured into a graph
// and replayed, come back complete, in launch order, named, with releases that follow each other; a kernel launched
// around launch.cuh shows as unlisted; `vavilov bench`'s traced steps on a tiny model cover every launch of their
// passes. Only in a build with -DVAVILOV_KERNEL_TRACE=ON (skipped otherwise).
#include <gtest/gtest.h>

#include "cuda/kernel_trace.h"

#ifdef VAVILOV_KERNEL_TRACE
#include <cmath>

#include "cuda/bench.h"
#include "cuda/step_runner.h"
#include "cuda/synthetic.h"
#include "fixture_paths.h"
#include "model/config.h"
#endif

namespace vavilov {

#ifdef VAVILOV_KERNEL_TRACE
// tests/gpu/kernel_trace_kernels.cu: first_traced (3 blocks of 64 threads), around the launch helper when asked
// second_traced<<<7, 96>>>, then second_traced (5 × 128) and waits_twice (2 × 2 blocks of 32), each as a dependent
// launch; the first spins 20 us after its wait, each second_traced 40 us.
cudaError_t launch_known(int* counter, cudaStream_t stream, bool around_launch_helper);
#endif

namespace {

#ifdef VAVILOV_KERNEL_TRACE
using cuda::kernel_trace::Pass;

std::vector<Pass> traced_passes(bool graphs, bool around_launch_helper) {
  int* counter = nullptr;
  EXPECT_EQ(cudaMalloc(&counter, sizeof(int)), cudaSuccess);
  cuda::kernel_trace::start(1024);
  {
    cuda::StepRunner runner(64, 64, graphs);
    for (int pass = 0; pass < 3; ++pass)  // graphs: captured once, replayed three times
      runner.run({0, 2}, 0,
                 [&] { EXPECT_EQ(launch_known(counter, runner.stream(), around_launch_helper), cudaSuccess); });
    runner.finish();
  }
  const cuda::kernel_trace::Trace trace = cuda::kernel_trace::stop();
  cudaFree(counter);
  return cuda::kernel_trace::passes(cuda::kernel_trace::match(trace.entries, trace.launches));
}

void expect_known_passes(const std::vector<Pass>& passes, bool around_launch_helper) {
  ASSERT_EQ(passes.size(), 3u);
  const std::vector<std::string> named = {"first_traced", "second_traced", "waits_twice"};
  for (const Pass& p : passes) {
    EXPECT_EQ(p.kind, 0);
    EXPECT_EQ(p.rows, 2);
    ASSERT_EQ(p.kernels.size(), named.size() + around_launch_helper);
    std::vector<std::string> listed;
    double previous_start = -1, spans = 0;
    for (const auto& k : p.kernels) {
      EXPECT_TRUE(k.recorded) << k.name;
      EXPECT_GT(k.start_us, previous_start) << k.name;  // releases in launch order
      EXPECT_GE(k.span_us, 0) << k.name;
      previous_start = k.start_us;
      spans += k.span_us;
      if (k.listed) listed.push_back(k.name);
    }
    EXPECT_EQ(listed, named);
    EXPECT_NEAR(spans, p.total_us, 1e-6);
    // The spins: at least 20 and 40 us after the release (the unlisted launch, when there, spins 40 us as well).
    EXPECT_GE(p.kernels[0].span_us, 20.0);
    EXPECT_GE(p.kernels[1].span_us, 40.0);
    if (around_launch_helper) {
      EXPECT_FALSE(p.kernels[1].listed);
      EXPECT_EQ(p.kernels[1].blocks, 7u);
      EXPECT_TRUE(p.kernels[2].listed);
    }
  }
}

TEST(CudaKernelTrace, EagerLaunchesComeBackInOrderAndNamed) { expect_known_passes(traced_passes(false, false), false); }

TEST(CudaKernelTrace, GraphReplaysRunInCaptureOrder) { expect_known_passes(traced_passes(true, false), false); }

TEST(CudaKernelTrace, KernelsLaunchedAroundTheHelperShowAsUnlisted) {
  expect_known_passes(traced_passes(true, true), true);
}

TEST(CudaKernelTrace, BenchTracesEveryLaunchOfATinyModelsSteps) {
  ModelConfig config = load_model_config((test::mtp_fixtures() / "mtp_f32_hc4").string());
  config.mtp_num_layers = 1;
  std::shared_ptr<const cuda::DeviceModel> model = cuda::synthetic_model(config, {});
  cuda::BenchOptions options;
  options.context = 6;
  options.decode_steps = 2;
  options.prefill_lengths = {};
  options.trace = true;
  const cuda::BenchResult result = cuda::run_bench(model, options);
  ASSERT_EQ(result.trace.size(), 2u);
  for (const nlohmann::json& step : result.trace) {
    SCOPED_TRACE(step["drafts"].dump());
    EXPECT_EQ(step["unrecorded_launches"], 0);
    EXPECT_EQ(step["unlisted_entries"], 0);
    EXPECT_GT(step["step_ms_traced"].get<double>(), 0.0);
    EXPECT_GT(step["critical_path_us_per_step"].get<double>(), 0.0);
    for (const nlohmann::json& pass : step["passes"]) {
      SCOPED_TRACE(pass["pass"].dump() + " rows " + pass["rows"].dump());
      double spans = 0, previous = -1;
      for (const nlohmann::json& k : pass["kernels"]) {
        const std::string name = k["name"];
        EXPECT_FALSE(name.empty());
        EXPECT_NE(name, "(unnamed)");
        EXPECT_NE(name, "(unlisted)");
        EXPECT_GE(k["start_us"].get<double>(), previous) << name;
        previous = k["start_us"].get<double>();
        spans += k["span_us"].get<double>();
      }
      // Spans are rounded to 0.01 us each.
      EXPECT_NEAR(spans, pass["critical_path_us"].get<double>(), 0.01 * double(pass["kernels"].size()));
      if (pass["pass"] == "trunk") {  // every layer of the trunk, by type
        int layers = 0;
        for (const auto& [type, totals] : pass["by_layer_type"].items())
          if (type != "outside_layers") layers += totals["layers"].get<int>();
        EXPECT_EQ(layers, config.num_layers);
      }
    }
  }
  EXPECT_EQ(result.trace[0]["passes"].size(), 1u);  // a 1-row greedy step is one trunk pass
  EXPECT_EQ(result.trace[0]["passes"][0]["rows"], 1);
  EXPECT_EQ(result.trace[1]["passes"][0]["rows"], 4);
}
#else
TEST(CudaKernelTrace, NeedsATraceBuild) { GTEST_SKIP() << "built without -DVAVILOV_KERNEL_TRACE=ON"; }
#endif

}  // namespace
}  // namespace vavilov
