// A GPU sequence's state exported to the host (SequenceBackend::export_state, in the CPU engine's layout) and imported
// into another sequence (import_state): on the GPU the continuation is bit-identical to the uninterrupted sequence;
// between GPU and CPU it stays within the GPU-vs-CPU bound of test_cuda_model.cpp; a state of another geometry is
// refused with an error naming the mismatch. This is what the server's prefix cache does with GPU sequences.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "cuda/backend.h"
#include "engine/backend.h"
#include "engine/speculative.h"
#include "error_of.h"
#include "fixture_paths.h"
#include "model/weights.h"
#include "reference_logits.h"

namespace vavilov {
namespace {

// fp32 on both devices, the same weights: only the order of fp32 roundings differs (test_cuda_model.cpp's bound).
constexpr double kFp32Tolerance = 1e-3;
constexpr size_t kDecodeSteps = 6;

// Everything a sequence produces when it continues from its current state: every row's logits and stacks over the
// rest of the prompt, then decode steps of one row over fixed ids (the same on every device, so that a near-tie in
// an argmax cannot make two runs diverge), and with an MTP head its stacks and logits over those rows.
std::vector<float> continuation(const Model& model, SequenceBackend& sequence, std::span<const int32_t> rest,
                                std::span<const int32_t> decode_ids) {
  const size_t vocab = size_t(model.config.vocab_size), sh = size_t(model.config.hc_hidden());
  std::vector<float> out(rest.size() * vocab), stacks(rest.size() * sh);
  sequence.forward(rest, {true, out.data(), stacks.data(), false});
  out.insert(out.end(), stacks.begin(), stacks.end());
  for (size_t step = 0; step + 1 < decode_ids.size(); ++step) {
    std::vector<float> logits(vocab), stack(sh);
    sequence.forward(decode_ids.subspan(step, 1), {false, logits.data(), stack.data(), false});
    out.insert(out.end(), logits.begin(), logits.end());
    if (!model.mtp) continue;
    std::vector<float> head(sh), head_logits(vocab);
    sequence.mtp_forward(stack.data(), decode_ids.subspan(step + 1, 1), head.data(), MtpRows::Last);
    sequence.mtp_logits(head.data(), 1, head_logits.data());
    out.insert(out.end(), head.begin(), head.end());
    out.insert(out.end(), head_logits.begin(), head_logits.end());
  }
  return out;
}

// Runs the first `count` prompt tokens, and the MTP head over them (each stack paired with the token after it) so that
// its caches are part of the state.
void prefill(const Model& model, SequenceBackend& sequence, std::span<const int32_t> prompt, size_t count) {
  const size_t sh = size_t(model.config.hc_hidden());
  std::vector<float> stacks(count * sh);
  sequence.forward(prompt.first(count), {false, nullptr, stacks.data(), false});
  if (!model.mtp) return;
  std::vector<float> head(sh);
  sequence.mtp_forward(stacks.data(), prompt.subspan(1, count), head.data(), MtpRows::Last);
}

// Every float of a state (attention caches, GDN, PLE conv, and the MTP layer's unless trunk_only), in field order;
// the PLE ids apart.
std::vector<float> floats_of(const SequenceState& state, bool trunk_only = false) {
  std::vector<float> all;
  auto add = [&](const LayerState& layer) {
    for (const auto* v : {&layer.gdn.conv, &layer.gdn.recurrent, &layer.attn.keys, &layer.attn.values,
                          &layer.attn.index_keys, &layer.attn.block_keys, &layer.ple.conv_rows})
      all.insert(all.end(), v->begin(), v->end());
  };
  for (const LayerState& layer : state.layers) add(layer);
  if (!trunk_only) add(state.mtp);
  return all;
}

std::vector<int64_t> ple_ids_of(const SequenceState& state) {
  std::vector<int64_t> ids;
  for (const LayerState& layer : state.layers)
    ids.insert(ids.end(), layer.ple.previous_ids.begin(), layer.ple.previous_ids.end());
  return ids;
}

size_t differing_values(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return std::max(a.size(), b.size());
  size_t differing = 0;
  for (size_t i = 0; i < a.size(); ++i) differing += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  return differing;
}

class GpuStateTransfer : public ::testing::TestWithParam<std::filesystem::path> {
 protected:
  void SetUp() override {
    ASSERT_GT(cuda::device_count(), 0) << "the GPU tests need a CUDA device";
    fixture = std::make_unique<test::ReferenceFixture>(GetParam());
    model = load_model(fixture->dir.string());
    gpu = cuda::sequence_factory(*model);
    // Split mid-block of the indexer's pooling, past at least one complete block.
    split = fixture->prompt.size() * 2 / 3;
    if (split % size_t(model->config.indexer_compress_ratio) == 0) --split;
  }
  std::span<const int32_t> prompt() const { return fixture->prompt; }
  std::span<const int32_t> rest() const { return prompt().subspan(split); }
  // The fixture's greedy continuation as fixed decode inputs.
  std::span<const int32_t> decode_ids() const {
    return std::span<const int32_t>(fixture->greedy).first(kDecodeSteps + 1);
  }

  std::unique_ptr<test::ReferenceFixture> fixture;
  std::unique_ptr<Model> model;
  SequenceFactory gpu;
  size_t split = 0;
};

TEST_P(GpuStateTransfer, ImportedGpuStateContinuesBitIdentically) {
  auto uninterrupted = gpu();
  prefill(*model, *uninterrupted, prompt(), split);
  SequenceState state;
  uninterrupted->export_state(state);
  EXPECT_EQ(state.position, int64_t(split));
  EXPECT_EQ(state.mtp_position, model->mtp ? int64_t(split) : 0);
  auto resumed = gpu();
  resumed->import_state(state);
  EXPECT_EQ(resumed->position(), int64_t(split));
  SequenceState again;
  resumed->export_state(again);
  EXPECT_EQ(differing_values(floats_of(again), floats_of(state)), 0u) << "export after import";
  EXPECT_EQ(ple_ids_of(again), ple_ids_of(state));
  const std::vector<float> want = continuation(*model, *uninterrupted, rest(), decode_ids());
  const std::vector<float> got = continuation(*model, *resumed, rest(), decode_ids());
  EXPECT_EQ(differing_values(got, want), 0u) << "of " << want.size() << " logits, stacks and head values";
}

TEST_P(GpuStateTransfer, StatesMoveBetweenGpuAndCpu) {
  // The same prefix on both devices: the exported states agree field for field within the bound (one layout).
  auto on_gpu = gpu();
  auto on_cpu = cpu_sequence(*model);
  prefill(*model, *on_gpu, prompt(), split);
  prefill(*model, *on_cpu, prompt(), split);
  SequenceState gpu_state, cpu_state;
  on_gpu->export_state(gpu_state);
  on_cpu->export_state(cpu_state);
  EXPECT_LE(test::relative_error(floats_of(gpu_state), floats_of(cpu_state)), kFp32Tolerance);
  EXPECT_EQ(ple_ids_of(gpu_state), ple_ids_of(cpu_state));
  const std::vector<float> cpu_continued = continuation(*model, *on_cpu, rest(), decode_ids());
  const std::vector<float> gpu_continued = continuation(*model, *on_gpu, rest(), decode_ids());
  // GPU → CPU and CPU → GPU, each against its source device's uninterrupted run.
  auto cpu_from_gpu = cpu_sequence(*model);
  cpu_from_gpu->import_state(gpu_state);
  EXPECT_LE(test::relative_error(continuation(*model, *cpu_from_gpu, rest(), decode_ids()), gpu_continued),
            kFp32Tolerance);
  auto gpu_from_cpu = gpu();
  gpu_from_cpu->import_state(cpu_state);
  EXPECT_LE(test::relative_error(continuation(*model, *gpu_from_cpu, rest(), decode_ids()), cpu_continued),
            kFp32Tolerance);
}

// The scheduler's path: a GPU decoder hands out its state at prompt chunk boundaries; GPU decoders started from those
// states (speculative, as the server runs them) emit the uninterrupted decoder's tokens.
TEST_P(GpuStateTransfer, DecoderResumesFromChunkStates) {
  GenerateOptions options;
  options.max_tokens = 12;
  options.ignore_eos = true;
  options.prefill_chunk = 5;  // passes of more rows than a recorded pass: the prefill branches
  SpeculativeOptions speculative;
  speculative.drafts = model->mtp ? 2 : 0;
  std::vector<SequenceState> saved;
  Decoder full(*model, options, speculative, gpu);
  std::vector<int32_t> want{full.start(fixture->prompt, nullptr, [&](const SequenceState& s) { saved.push_back(s); })};
  while (int64_t(want.size()) < options.max_tokens) {
    auto more = full.step();
    want.insert(want.end(), more.begin(), more.end());
  }
  want.resize(size_t(options.max_tokens));
  // A device's states come at snapshot_boundary()'s chunks only: after 1, 2, 4, ... chunks and before the last.
  std::vector<int64_t> boundaries;
  for (int64_t end = 5; end < int64_t(fixture->prompt.size()); end += 5)
    if (snapshot_boundary(end, int64_t(fixture->prompt.size()), 5)) boundaries.push_back(end);
  ASSERT_EQ(saved.size(), boundaries.size());
  for (size_t i = 0; i < saved.size(); ++i) EXPECT_EQ(saved[i].position, boundaries[i]);
  ASSERT_FALSE(saved.empty());
  for (const SequenceState& prefix : {saved.front(), saved.back()}) {
    Decoder resumed(*model, options, speculative, gpu);
    std::vector<int32_t> got{resumed.start(fixture->prompt, &prefix)};
    while (int64_t(got.size()) < options.max_tokens) {
      auto more = resumed.step();
      got.insert(got.end(), more.begin(), more.end());
    }
    got.resize(size_t(options.max_tokens));
    EXPECT_EQ(got, want) << "prefix of " << prefix.position << " tokens";
  }
}

// Another fixture's state (another geometry), and this model's state with one vector cut short, are refused with the
// field named; the sequence keeps its own state and still runs.
TEST_P(GpuStateTransfer, RefusesStateOfAnotherGeometry) {
  auto sequence = gpu();
  prefill(*model, *sequence, prompt(), split);
  SequenceState own;
  sequence->export_state(own);
  for (const auto& other_dir : test::model_fixture_dirs()) {
    auto other = load_model(other_dir.string());
    auto cpu = cpu_sequence(*other);
    const std::vector<int32_t> ids(split + 1, 1);
    prefill(*other, *cpu, ids, split);
    SequenceState foreign;
    cpu->export_state(foreign);
    // A trunk of as many layers and values at the same position may be of the same geometry (and a state without
    // head caches fits a model with a head).
    if (foreign.layers.size() == own.layers.size() && floats_of(foreign, true).size() == floats_of(own, true).size())
      continue;
    const std::string error = test::error_of([&] { sequence->import_state(foreign); });
    EXPECT_NE(error.find("sequence state:"), std::string::npos) << other_dir.filename() << ": " << error;
  }
  for (size_t i = 0; i < own.layers.size(); ++i) {
    SequenceState cut = own;
    LayerState& layer = cut.layers[i];
    std::vector<float>& part = layer.gdn.recurrent.empty() ? layer.attn.keys : layer.gdn.recurrent;
    part.pop_back();
    const std::string field = layer.gdn.recurrent.empty() ? "attention keys" : "GDN recurrent state";
    const std::string error = test::error_of([&] { sequence->import_state(cut); });
    EXPECT_NE(error.find("layer " + std::to_string(i) + " " + field), std::string::npos) << error;
  }
  EXPECT_EQ(sequence->position(), int64_t(split));
  SequenceState after;
  sequence->export_state(after);
  EXPECT_EQ(differing_values(floats_of(after), floats_of(own)), 0u);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, GpuStateTransfer, ::testing::ValuesIn(test::model_fixture_dirs()),
                         [](const auto& info) { return info.param.filename().string(); });

}  // namespace
}  // namespace vavilov
