// The kernel trace's mapping and report (src/cuda/kernel_trace_report.*), on hand-made entries whose spans are worked
// out by hand below: device entries matched to noted launches, passes cut at end markers, averages and totals.
#include <gtest/gtest.h>

#include "cuda/kernel_trace_report.h"

namespace vavilov {
namespace {

using namespace cuda::kernel_trace;

LaunchRecord launch(std::string name, uint32_t blocks, std::string scope = "", int layer = -1) {
  LaunchRecord r;
  r.name = std::move(name);
  r.blocks = blocks;
  r.threads = 128;
  r.scope = std::move(scope);
  r.layer = layer;
  return r;
}

LaunchRecord marker(int kind, int rows) {
  LaunchRecord r = launch("kernel_trace::pass_end_marker", 1);
  r.threads = 32;
  r.pass_end = true;
  r.pass_kind = kind;
  r.pass_rows = rows;
  return r;
}

Entry entry(uint64_t grid, uint64_t arrived_ns, uint64_t released_ns, uint32_t blocks, uint32_t threads = 128) {
  return {grid, arrived_ns, released_ns, 0, blocks, threads, false};
}

Entry marker_entry(uint64_t grid, uint64_t released_ns) {
  Entry e = entry(grid, released_ns, released_ns, 1, 32);
  e.pass_end = true;
  return e;
}

TEST(KernelTrace, MatchesEntriesToLaunchesInOrder) {
  const std::vector<LaunchRecord> launches = {launch("a", 10), launch("b", 20), launch("c", 30), marker(0, 1)};
  // b waits twice (two entries of grid 2: the first counts); an unlisted 99-block kernel between b and c.
  const std::vector<Entry> entries = {entry(1, 0, 1000, 10),    entry(2, 500, 3000, 20),  entry(2, 3100, 3100, 20),
                                      entry(3, 3000, 4000, 99), entry(4, 3500, 6000, 30), marker_entry(5, 9000)};
  const std::vector<MatchedKernel> m = match(entries, launches);
  ASSERT_EQ(m.size(), 5u);
  EXPECT_EQ(m[0].launch.name, "a");
  EXPECT_EQ(m[1].launch.name, "b");
  EXPECT_EQ(m[1].entry.released_ns, 3000u);
  EXPECT_FALSE(m[2].listed);
  EXPECT_EQ(m[2].entry.blocks, 99u);
  EXPECT_EQ(m[3].launch.name, "c");
  EXPECT_TRUE(m[4].launch.pass_end);
  for (const MatchedKernel& k : m) EXPECT_TRUE(k.recorded);
}

TEST(KernelTrace, RepeatedWaitAfterTheNextKernelsEntryCountsOnce) {
  const std::vector<LaunchRecord> launches = {launch("a", 10), launch("b", 20), marker(0, 1)};
  const std::vector<Entry> entries = {entry(1, 0, 1000, 10), entry(2, 0, 2000, 20), entry(1, 2100, 2100, 10),
                                      marker_entry(3, 3000)};
  const std::vector<MatchedKernel> m = match(entries, launches);
  ASSERT_EQ(m.size(), 3u);
  for (const MatchedKernel& k : m) {
    EXPECT_TRUE(k.recorded);
    EXPECT_TRUE(k.listed);
  }
  EXPECT_EQ(m[1].entry.released_ns, 2000u);
}

TEST(KernelTrace, ReplaysWithTheSameGridIdsKeepEveryEntry) {
  // A graph of one kernel replayed three times, its grid id the same each time.
  std::vector<LaunchRecord> launches;
  std::vector<Entry> entries;
  for (uint64_t pass = 0; pass < 3; ++pass) {
    launches.push_back(launch("a", 10));
    launches.push_back(marker(0, 1));
    entries.push_back(entry(7, 0, 10000 * pass, 10));
    entries.push_back(marker_entry(8, 10000 * pass + 2000));
  }
  const std::vector<Pass> p = passes(match(entries, launches));
  ASSERT_EQ(p.size(), 3u);
  for (const Pass& one : p) {
    ASSERT_EQ(one.kernels.size(), 1u);
    EXPECT_TRUE(one.kernels[0].recorded);
    EXPECT_DOUBLE_EQ(one.kernels[0].span_us, 2.0);
  }
}

TEST(KernelTrace, ClockGranularityIsTheReleasesCommonStep) {
  EXPECT_EQ(clock_granularity_ns({entry(1, 0, 1000, 1), entry(2, 0, 3000, 1), entry(3, 0, 6000, 1)}), 1000u);
  EXPECT_EQ(clock_granularity_ns({entry(1, 0, 64, 1), entry(2, 0, 160, 1), entry(3, 0, 192, 1)}), 32u);
  EXPECT_EQ(clock_granularity_ns({entry(1, 0, 5, 1)}), 0u);
}

TEST(KernelTrace, LaunchWithoutEntryIsUnrecorded) {
  const std::vector<LaunchRecord> launches = {launch("a", 10), launch("silent", 20), launch("c", 30), marker(0, 1)};
  const std::vector<Entry> entries = {entry(1, 0, 1000, 10), entry(3, 0, 4000, 30), marker_entry(4, 5000)};
  const std::vector<MatchedKernel> m = match(entries, launches);
  ASSERT_EQ(m.size(), 4u);
  EXPECT_TRUE(m[0].recorded);
  EXPECT_FALSE(m[1].recorded);
  EXPECT_TRUE(m[1].listed);
  EXPECT_TRUE(m[2].recorded);
  EXPECT_EQ(m[2].launch.name, "c");
  const std::vector<Pass> p = passes(m);
  ASSERT_EQ(p.size(), 1u);
  // a: 1000 → 4000 (the silent kernel's time goes to the one before it), c: 4000 → 5000.
  EXPECT_DOUBLE_EQ(p[0].kernels[0].span_us, 3.0);
  EXPECT_DOUBLE_EQ(p[0].kernels[1].span_us, 0.0);
  EXPECT_DOUBLE_EQ(p[0].kernels[2].span_us, 1.0);
}

TEST(KernelTrace, PassesTakeSpansFromReleases) {
  const std::vector<LaunchRecord> launches = {launch("a", 10), launch("b", 20), marker(0, 1),
                                              launch("a", 10), launch("b", 20), marker(1, 4)};
  const std::vector<Entry> entries = {entry(1, 0, 10000, 10),     entry(2, 10500, 13000, 20), marker_entry(3, 20000),
                                      entry(4, 50000, 50000, 10), entry(5, 50000, 51000, 20), marker_entry(6, 55000)};
  const std::vector<Pass> p = passes(match(entries, launches));
  ASSERT_EQ(p.size(), 2u);
  EXPECT_EQ(p[0].kind, 0);
  EXPECT_EQ(p[0].rows, 1);
  EXPECT_DOUBLE_EQ(p[0].total_us, 10.0);  // 10000 → 20000 ns
  EXPECT_DOUBLE_EQ(p[0].kernels[0].start_us, 0.0);
  EXPECT_DOUBLE_EQ(p[0].kernels[0].span_us, 3.0);
  EXPECT_DOUBLE_EQ(p[0].kernels[0].waited_us, 10.0);
  EXPECT_DOUBLE_EQ(p[0].kernels[1].start_us, 3.0);
  EXPECT_DOUBLE_EQ(p[0].kernels[1].span_us, 7.0);
  EXPECT_DOUBLE_EQ(p[0].kernels[1].waited_us, 2.5);
  EXPECT_EQ(p[1].kind, 1);
  EXPECT_EQ(p[1].rows, 4);
  EXPECT_DOUBLE_EQ(p[1].total_us, 5.0);
}

TEST(KernelTrace, PassWithoutEntriesIsAnError) {
  EXPECT_THROW(passes(match({marker_entry(9, 1)}, {launch("a", 10), marker(0, 1)})), std::exception);
  EXPECT_THROW(passes(match({}, {launch("a", 10), marker(0, 1)})), std::exception);
}

// Two 1-row passes of two layers (gdn, attention) and one kernel outside them.
std::vector<Pass> two_passes(double second_gdn_span) {
  Pass p;
  p.kind = 0;
  p.rows = 1;
  auto span = [](std::string name, std::string scope, int layer, double us) {
    KernelSpan k;
    k.name = std::move(name);
    k.scope = std::move(scope);
    k.layer = layer;
    k.span_us = us;
    return k;
  };
  p.kernels = {span("gemv_kernel<4>", "gdn", 0, 4), span("gdn_decode_kernel<4, true>", "gdn", 0, 6),
               span("gemv_kernel<4>", "attention", 1, 5), span("attention_kernel", "attention", 1, 3),
               span("lm_head<1>", "", -1, 2)};
  p.total_us = 20;
  Pass q = p;
  q.kernels[1].span_us = second_gdn_span;
  q.total_us = 20 - 6 + second_gdn_span;
  return {p, q};
}

TEST(KernelTrace, SummaryAveragesPassesAndGroupsSpans) {
  const nlohmann::json s = summarise(two_passes(10), 2);
  EXPECT_EQ(s["steps"], 2);
  EXPECT_DOUBLE_EQ(s["critical_path_us_per_step"].get<double>(), 22.0);  // (20 + 24) / 2 passes, one a step
  ASSERT_EQ(s["passes"].size(), 1u);
  const nlohmann::json& pass = s["passes"][0];
  EXPECT_EQ(pass["pass"], "trunk");
  EXPECT_DOUBLE_EQ(pass["passes_per_step"].get<double>(), 1.0);
  EXPECT_DOUBLE_EQ(pass["kernels"][1]["span_us"].get<double>(), 8.0);  // (6 + 10) / 2
  // by kernel kind, largest first: gemv 4 + 5 = 9, gdn_decode 8, attention 3, lm_head 2.
  EXPECT_EQ(pass["by_kernel"][0]["kernel"], "gemv_kernel");
  EXPECT_EQ(pass["by_kernel"][0]["launches"], 2);
  EXPECT_DOUBLE_EQ(pass["by_kernel"][0]["span_us"].get<double>(), 9.0);
  EXPECT_DOUBLE_EQ(pass["by_kernel"][0]["share"].get<double>(), 0.4091);  // 9 / 22
  EXPECT_EQ(pass["by_kernel"][1]["kernel"], "gdn_decode_kernel");
  const nlohmann::json& types = pass["by_layer_type"];
  EXPECT_EQ(types["gdn"]["layers"], 1);
  EXPECT_DOUBLE_EQ(types["gdn"]["span_us"].get<double>(), 12.0);
  EXPECT_DOUBLE_EQ(types["attention"]["per_layer_us"].get<double>(), 8.0);
  EXPECT_DOUBLE_EQ(types["outside_layers"]["span_us"].get<double>(), 2.0);
  ASSERT_EQ(types["gdn"]["profile"].size(), 2u);
  EXPECT_EQ(types["gdn"]["profile"][1]["name"], "gdn_decode_kernel<4, true>");
}

TEST(KernelTrace, LayerProfileAveragesLayersOfOneType) {
  Pass p;
  for (int layer = 0; layer < 3; ++layer)
    for (int i = 0; i < 2; ++i) {
      KernelSpan k;
      k.name = i == 0 ? "read" : "mix";
      k.scope = "gdn";
      k.layer = layer;
      k.span_us = 1 + layer + 10 * i;  // read 1, 2, 3; mix 11, 12, 13
      p.kernels.push_back(k);
    }
  p.total_us = 42;
  const nlohmann::json types = summarise({p}, 1)["passes"][0]["by_layer_type"];
  EXPECT_EQ(types["gdn"]["layers"], 3);
  EXPECT_DOUBLE_EQ(types["gdn"]["per_layer_us"].get<double>(), 14.0);
  EXPECT_EQ(types["gdn"]["profile_layers"], 3);
  EXPECT_DOUBLE_EQ(types["gdn"]["profile"][0]["span_us"].get<double>(), 2.0);
  EXPECT_DOUBLE_EQ(types["gdn"]["profile"][1]["span_us"].get<double>(), 12.0);
}

TEST(KernelTrace, PassesOfOneShapeMustRunTheSameKernels) {
  std::vector<Pass> p = two_passes(6);
  p[1].kernels[2].name = "other";
  EXPECT_THROW(summarise(p, 2), std::exception);
  p[1].kernels.pop_back();
  EXPECT_THROW(summarise(p, 2), std::exception);
}

TEST(KernelTrace, ShortNamesDropNamespacesAndParameters) {
  EXPECT_EQ(short_kernel_name("void vavilov::cuda::(anonymous namespace)::gemv_kernel<4, 2>(vavilov::cuda::Plan, "
                              "float const*)"),
            "gemv_kernel<4, 2>");
  EXPECT_EQ(short_kernel_name("void vavilov::cuda::gdn_decode_kernel<(vavilov::cuda::Vec)4, true>(GdnShape)"),
            "gdn_decode_kernel<(Vec)4, true>");
  EXPECT_EQ(short_kernel_name("void vavilov::(anonymous namespace)::first_traced(int*)"), "first_traced");
  EXPECT_EQ(short_kernel_name("plain_c_kernel"), "plain_c_kernel");
  EXPECT_EQ(kernel_kind("gemv_kernel<4, 2>"), "gemv_kernel");
  EXPECT_EQ(kernel_kind("plain"), "plain");
}

}  // namespace
}  // namespace vavilov
