// vavilov bench: decode and prefill speed on the GPU, as JSON (bench/results/). Needs the CUDA backend.
#include <fmt/chrono.h>
#include <fmt/core.h>

#include <chrono>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "cli/commands.h"
#include "cli/common.h"
#include "core/error.h"
#include "io/atomic_file.h"
#include "model/weights.h"
#ifdef VAVILOV_HAVE_CUDA
#include "cuda/backend.h"
#include "cuda/bench.h"
#include "cuda/kernel_trace.h"
#include "cuda/synthetic.h"
#endif

namespace vavilov::cli {

namespace {
struct BenchArgs {
  std::string synthetic, model, weights = "q4", out, trace, commit = "unknown", prefill = "512,8192";
  int layers = 0, experts = 0;
  int64_t expert_cache_mb = -1;
  uint64_t seed = 1;
  int64_t context = 64;
  int steps = 20;
};

#ifdef VAVILOV_HAVE_CUDA
// The weights to measure: synthetic at a config's geometry (optionally its first N layers), or a checkpoint.
std::shared_ptr<const cuda::DeviceModel> bench_weights(const BenchArgs& args, nlohmann::json& geometry) {
  check(args.synthetic.empty() != args.model.empty(), "bench: give either --synthetic CONFIG.json or --model DIR");
  check(args.experts == 0 || !args.model.empty(), "bench: --experts needs --model");
  if (!args.model.empty()) {
    auto model = load_model_quantized(args.model, QuantizeOptions{args.weights == "q4" ? "q4" : "none", args.experts});
    geometry["model"] = args.model;
    if (args.experts) geometry["expert_bits"] = args.experts;
    return cuda::upload_model(*model, args.expert_cache_mb < 0 ? -1 : args.expert_cache_mb * 1024 * 1024);
  }
  ModelConfig c = load_model_config(args.synthetic);
  if (args.layers > 0) {
    check(args.layers <= c.num_layers, "--layers {}: the config has {} layers", args.layers, c.num_layers);
    c.num_layers = args.layers;
    c.layer_kinds.resize(size_t(args.layers));
    std::erase_if(c.ple_layers, [&](int layer) { return layer >= args.layers; });
  }
  cuda::check_supported(c, args.synthetic);
  cuda::SyntheticOptions options;
  options.seed = args.seed;
  options.format = args.weights == "q4" ? cuda::WeightFormat::Q4 : cuda::WeightFormat::BF16;
  options.expert_cache_bytes = args.expert_cache_mb < 0 ? -1 : args.expert_cache_mb * 1024 * 1024;
  geometry["synthetic_config"] = args.synthetic;
  geometry["seed"] = args.seed;
  geometry["ngram_head_rows"] = options.ngram_head_rows;
  return cuda::synthetic_model(c, options);
}

// The kernel trace's file: the run's identity and one summary per traced step kind (docs/CUDA.md, "Kernel trace").
void write_trace(const BenchArgs& args, const nlohmann::json& identity, const cuda::BenchResult& r) {
  nlohmann::json out = identity;
  out["traced_steps"] = r.trace;
  out["notes"] =
      "per kernel of each pass (averaged over the traced passes of that shape): start_us, its release (%globaltimer "
      "in block 0 after wait_for_producers) after the pass's first; span_us, to the next kernel's release (its share "
      "of the critical path); waited_us, how long block 0 sat at its wait (started ahead of its producers). "
      "critical_path_us: the pass's first release to its end marker's; by_kernel and by_layer_type sum the spans";
  const std::string text = out.dump(1) + "\n";
  write_file_atomically(args.trace, text.data(), text.size());
}

void run_bench(const BenchArgs& args) {
  check(args.trace.empty() || cuda::kernel_trace::kBuilt,
        "bench --trace: this binary was built without the kernel trace (cmake -DVAVILOV_KERNEL_TRACE=ON)");
  check(cuda::device_count() > 0, "bench: no CUDA device is available");
  nlohmann::json geometry;
  auto weights = bench_weights(args, geometry);
  const ModelConfig& c = weights->config;
  geometry["layers"] = c.num_layers;
  geometry["hidden_size"] = c.hidden_size;
  geometry["vocab_size"] = c.vocab_size;
  geometry["experts"] = c.num_experts;
  geometry["experts_per_token"] = c.num_experts_per_tok;
  geometry["mtp"] = weights->mtp.has_value();
  geometry["context"] = args.context;
  if (args.expert_cache_mb >= 0) geometry["expert_cache_mb"] = args.expert_cache_mb;

  cuda::BenchOptions options;
  options.context = args.context;
  options.decode_steps = args.steps;
  options.seed = args.seed;
  options.trace = !args.trace.empty();
  options.prefill_lengths.clear();
  for (int32_t length : parse_ids(args.prefill)) options.prefill_lengths.push_back(length);
  const cuda::BenchResult r = cuda::run_bench(weights, options);

  nlohmann::json out;
  out["date"] =
      fmt::format("{:%Y-%m-%dT%H:%M:%SZ}", std::chrono::floor<std::chrono::seconds>(std::chrono::system_clock::now()));
  out["gpu"] = r.gpu;
  out["commit"] = args.commit;
  out["geometry"] = geometry;
  out["weights"] = {{"format", args.weights}, {"device_bytes", r.weight_bytes}};
  out["copy_bandwidth_gbs"] = r.copy_bandwidth_gbs;
  nlohmann::json tok_s, step_ms, bytes, fraction;
  for (const cuda::DecodeMeasurement& m : r.decode) {
    const std::string key = std::to_string(m.drafts);
    tok_s[key] = m.tokens_per_second;
    step_ms[key] = m.step_ms;
    bytes[key] = m.bytes;
    fraction[key] = m.bytes / (m.step_ms * 1e-3) / (r.copy_bandwidth_gbs * 1e9);
  }
  out["decode_tok_s"] = tok_s;
  out["step_ms"] = step_ms;
  out["bytes_per_step"] = bytes;
  out["roofline_fraction_per_drafts"] = fraction;
  out["roofline_fraction"] = fraction["0"];
  if (r.decode.size() == 4) {
    out["verify3_roofline_fraction"] = fraction["3"];
    out["verify3_over_single"] = r.decode[3].step_ms / r.decode[0].step_ms;
    out["chained_pass_ms"] = r.chained_pass_ms;
  }
  if (!r.greedy_steps.empty()) {  // whole greedy steps at forced acceptance: one graph vs the seam's calls
    nlohmann::json fused, composed;
    for (const cuda::GreedyStepMeasurement& m : r.greedy_steps) {
      fused[std::to_string(m.drafts)] = m.fused_ms;
      composed[std::to_string(m.drafts)] = m.composed_ms;
    }
    out["greedy_step_fused_ms"] = fused;
    out["greedy_step_composed_ms"] = composed;
  }
  const cuda::SamplingMeasurement& s = r.sampling;
  out["sampling_ms"] = {
      {"settings", "temperature 0.7, top_p 0.95; per backend call, mean after warm-up"},
      {"trunk_row", {{"greedy_ids", s.row_greedy_ms}, {"device", s.row_device_ms}, {"host", s.row_host_ms}}},
      {"trunk_4_rows",
       {{"greedy_ids", s.verify4_greedy_ms}, {"device", s.verify4_device_ms}, {"host", s.verify4_host_ms}}},
      {"draft", {{"greedy_ids", s.draft_greedy_ms}, {"device", s.draft_device_ms}, {"host", s.draft_host_ms}}},
      {"step_3_drafts",
       {{"greedy_fused", s.step3_greedy_ms},
        {"sampled_fused", s.step3_sampled_fused_ms},
        {"sampled_calls", s.step3_sampled_calls_ms}}}};
  nlohmann::json prefill;
  for (const auto& [length, speed] : r.prefill_tokens_per_second) prefill[std::to_string(length)] = speed;
  out["prefill_tok_s"] = prefill;
  if (!r.expert_cache.is_null()) out["expert_cache"] = r.expert_cache;
  if (!args.trace.empty()) {
    write_trace(args, {{"date", out["date"]}, {"gpu", r.gpu}, {"commit", args.commit}, {"geometry", geometry}}, r);
    out["trace_file"] = args.trace;
  }
  out["notes"] =
      "decode steps at full acceptance (forced: every draft counts as accepted), wall time of the backend calls a "
      "greedy Decoder step makes (greedy ids from the GPU's argmax, no logits download); bytes: weights the step must "
      "read (dense once, "
      "the expected union of uniformly routed experts, every MTP pass); prefill: one forward in a fresh sequence after "
      "an "
      "untimed 64-token prefill";
  const std::string text = out.dump(2) + "\n";
  if (args.out.empty())
    fmt::print("{}", text);
  else
    write_file_atomically(args.out, text.data(), text.size());
}
#else
void run_bench(const BenchArgs&) { fail("bench: this binary was built without CUDA"); }
#endif
}  // namespace

void register_bench(CLI::App& app) {
  auto args = std::make_shared<BenchArgs>();
  CLI::App* command = app.add_subcommand(
      "bench", "GPU decode and prefill speed against the memory-bandwidth limit, and sampling's cost (JSON)");
  command->add_option("--synthetic", args->synthetic,
                      "Seeded random weights made on the GPU at this config's geometry");
  command->add_option("--model", args->model, "Or a model directory (uploaded to the GPU)");
  command->add_option("--layers", args->layers, "Synthetic: only the first N layers (default: all)")
      ->check(CLI::PositiveNumber);
  command->add_option("--seed", args->seed, "Synthetic weights' and token ids' seed");
  command->add_option("--weights", args->weights, "q4 or bf16")->check(CLI::IsMember({"q4", "bf16"}));
  command
      ->add_option("--experts", args->experts,
                   "--model: routed experts at 4, 3 or 2 bits (a packed store's records of that precision)")
      ->check(CLI::IsMember({4, 3, 2}));
  command->add_option("--context", args->context, "Prompt tokens before the decode steps")->check(CLI::PositiveNumber);
  command->add_option("--steps", args->steps, "Timed decode steps per draft count")->check(CLI::PositiveNumber);
  command->add_option("--prefill", args->prefill, "Prefill lengths, comma-separated");
  add_expert_cache_option(command, args->expert_cache_mb);
  command->add_option("--commit", args->commit, "The commit measured (recorded in the JSON)");
  command->add_option("--out", args->out, "JSON output file (default: stdout)");
  command->add_option("--trace", args->trace,
                      "Also trace a 1-row and a 3-draft step kernel by kernel into this JSON file (a build with "
                      "-DVAVILOV_KERNEL_TRACE=ON)");
  command->callback([args] { run_bench(*args); });
}

}  // namespace vavilov::cli
