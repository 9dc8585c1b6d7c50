// Gated DeltaNet kernels (cuda/gated_deltanet.cuh) at Qwen3.8-Flash-Next's shape: 48 value heads on 16 key heads,
// dk = dv = 128, fp32 inputs and outputs (the prefill's products on tensor cores as 3×TF32, as one TF32 pass where
// VAVILOV_GEMM_PRECISION=tf32, or with bf16 operands and a bf16 scratch where it is bf16:
// cuda::gdn_prefill_products(); the JSON's "prefill_products" says which).
//
//   gdn_bench time OUT.json
//     Decode with the conv folded in (1, 2, 4 rows; 1–4 rows recording every row's states) and, for comparison, the
//     separate conv and decode kernels (1 row; 4 recorded), and 1 row with the kernel's general body in place of its
//     1-row body ("general body"; VAVILOV_GDN_ONE_ROW=0 makes every case general): 36 launches back to back, one per
//     layer state (113 MB, so
//     L2 holds none), timed together as one CUDA graph (as a step runs them) and divided by 36; and the chunked prefill
//     (prepare, scan, outputs, gated norm) for T = 64, 256, 512, 2048, 8192 from a zero state. Median of the
//     repetitions, CUDA events. Writes JSON.
//   gdn_bench prefill OUT.json
//     The chunked prefill's timings alone (as in `time`).
//   gdn_bench profile
//     A few launches of each kernel for ncu: decode and conv_decode 1 row and 4 rows, prefill T = 512 and 8192.
//   gdn_bench check DIR T
//     Reads DIR/{qkv,b,a,a_log,dt_bias,z,norm}.f32 (float32, little-endian, the layouts of GdnInputs for T rows),
//     runs gdn_prefill from a zero state and writes DIR/ours_out.f32 [T, 48·128] and DIR/ours_state.f32 [48, 128, 128]
//     (bench/cuda/gdn_vs_fla.py compares them with flash-linear-attention and a float64 recurrence).
// GDN_BENCH_PREPARE=value or key forces the prefill's prepare blocks (one value head or a key head's value heads a
// block: cuda::GdnPrepareBlocks) in every mode; unset, the library picks.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "check.cuh"
#include "cuda/gated_deltanet.cuh"
#include "cuda/random_fill.cuh"
#include "event_times.cuh"

namespace {

using vavilov::cuda::GdnInputs;
using vavilov::cuda::GdnShape;

constexpr GdnShape kShape{48, 16, 128, 128, 2 * 16 * 128 + 48 * 128, 16 * 128};
constexpr int kLayers = 36;  // GDN layers of the model: the rotating decode states
constexpr int kConvKernel = 4;

float* device_floats(size_t n) {
  float* p = nullptr;
  CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * 4));
  CHECK(cudaMemset(p, 0, std::max<size_t>(n, 1) * 4));
  return p;
}

float* random_floats(size_t n, uint64_t stream_id, float lo, float hi) {
  float* p = device_floats(n);
  vavilov::cuda::fill_uniform(p, n, 2026, stream_id, lo, hi, nullptr);
  return p;
}

// Random inputs for `rows` rows (the weights' ranges as in the model: β and decays spread over their ranges).
GdnInputs random_inputs(int rows) {
  const size_t r = size_t(rows), heads = size_t(kShape.heads);
  return {random_floats(r * kShape.conv_dim, 1, -1.0f, 1.0f),
          random_floats(r * heads, 2, -3.0f, 3.0f),
          random_floats(r * heads, 3, -3.0f, 3.0f),
          random_floats(heads, 4, -1.0f, 2.5f),
          random_floats(heads, 5, -1.0f, 1.0f),
          random_floats(r * heads * kShape.dv, 6, -2.0f, 2.0f),
          random_floats(size_t(kShape.dv), 7, 0.5f, 1.5f),
          1e-6f,
          true,
          rows};
}

// Median microseconds of `repeats` calls of `body(i)` on `stream`, after `warmup` untimed ones.
double median_us(int warmup, int repeats, const std::function<void(int)>& body, cudaStream_t stream = nullptr) {
  for (int i = 0; i < warmup; ++i) body(i);
  const std::vector<float> times = event_times_ms(stream, repeats, [&](int i) { body(warmup + i); });
  CHECK(cudaGetLastError());
  return double(median(times)) * 1e3;
}

// The median of launches of a CUDA graph that holds body(stream), as a decode step runs its kernels: the GPU's time
// without the host's launch cost between them.
double graph_median_us(int warmup, int repeats, const std::function<void(cudaStream_t)>& body) {
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
  body(stream);
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const double us = median_us(
      warmup, repeats, [&](int) { CHECK(cudaGraphLaunch(exec, stream)); }, stream);
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  CHECK(cudaStreamDestroy(stream));
  return us;
}

// What bounds the decode kernel, at its grid: an empty kernel (the cost of a launch in a graph), and a kernel that
// reads and writes each layer's 3.1 MB state in place with the decode kernel's blocks (head, 32-column slice) and
// loads (4 float4 a thread), without clusters and with the fused kernel's 12-block ones.
__global__ void empty_kernel() {}

__global__ void __launch_bounds__(256) state_copy_kernel(float* state) {
  const int column_thread = threadIdx.x % 8, row_group = threadIdx.x / 8;
  float* head = state + size_t(blockIdx.x) * kShape.dk * kShape.dv + blockIdx.y * 32 + column_thread * 4;
  float4 values[4];
#pragma unroll
  for (int m = 0; m < 4; ++m) values[m] = *reinterpret_cast<const float4*>(head + (row_group + 32 * m) * kShape.dv);
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    values[m].x *= 0.999f;
    *reinterpret_cast<float4*>(head + (row_group + 32 * m) * kShape.dv) = values[m];
  }
}

void launch_state_copy(float* state, unsigned cluster_heads, cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(kShape.heads), 4);
  config.blockDim = dim3(256);
  config.stream = stream;
  cudaLaunchAttribute cluster[1];
  cluster[0].id = cudaLaunchAttributeClusterDimension;
  cluster[0].val.clusterDim.x = cluster_heads;
  cluster[0].val.clusterDim.y = 4;
  cluster[0].val.clusterDim.z = 1;
  config.attrs = cluster;
  config.numAttrs = 1;
  CHECK(cudaLaunchKernelEx(&config, state_copy_kernel, state));
}

std::string time_floors(float* states, size_t state_floats) {
  CHECK(cudaFuncSetAttribute(state_copy_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  const double empty_us = graph_median_us(3, 30,
                                          [&](cudaStream_t stream) {
                                            for (int layer = 0; layer < kLayers; ++layer)
                                              empty_kernel<<<1, 32, 0, stream>>>();
                                          }) /
                          kLayers;
  double copy_us[2];
  const unsigned cluster_heads[2] = {1, 3};
  for (int n = 0; n < 2; ++n)
    copy_us[n] = graph_median_us(3, 30,
                                 [&](cudaStream_t stream) {
                                   for (int layer = 0; layer < kLayers; ++layer)
                                     launch_state_copy(states + layer * state_floats, cluster_heads[n], stream);
                                 }) /
                 kLayers;
  const double bytes = 2.0 * double(state_floats) * 4;
  std::printf("floors: empty kernel %.2f us; state read+write %.2f us (%.0f GB/s), with 12-block clusters %.2f us\n",
              empty_us, copy_us[0], bytes / copy_us[0] * 1e-3, copy_us[1]);
  return "  \"floors\": {\"empty_kernel_us\": " + std::to_string(empty_us) +
         ", \"state_copy_us\": " + std::to_string(copy_us[0]) +
         ", \"state_copy_cluster12_us\": " + std::to_string(copy_us[1]) +
         ", \"note\": \"per launch, 36 in one CUDA graph; state_copy: the decode grid (48 x 4 blocks of 256) reads "
         "and writes one layer's 3.1 MB state, no arithmetic\"},\n";
}

// GDN_BENCH_PREPARE: the prefill's prepare blocks (see the top).
vavilov::cuda::GdnPrepareBlocks prepare_blocks() {
  const char* value = std::getenv("GDN_BENCH_PREPARE");
  const std::string choice = value ? value : "";
  if (choice == "value") return vavilov::cuda::GdnPrepareBlocks::PerValueHead;
  if (choice == "key") return vavilov::cuda::GdnPrepareBlocks::PerKeyHead;
  return vavilov::cuda::GdnPrepareBlocks::Auto;
}

void prefill(const GdnInputs& in, float* state, float* scratch, float* out) {
  vavilov::cuda::gdn_prefill(kShape, in, state, scratch, out, nullptr, vavilov::cuda::gdn_prefill_products(),
                             prepare_blocks());
}

// The chunked prefill for T = 64, 256, 512, 2048, 8192 from a zero state (the state is rewritten each call; its values
// do not change the work): the "prefill" array and its note, as JSON members.
std::string prefill_json(float* states, float* out) {
  const size_t state_bytes = size_t(kShape.heads) * kShape.dk * kShape.dv * 4;
  std::string json = "  \"prefill\": [\n";
  const std::vector<int> lengths = {64, 256, 512, 2048, 8192};
  float* scratch = device_floats(vavilov::cuda::gdn_chunk_scratch_floats(kShape, lengths.back()));
  for (size_t n = 0; n < lengths.size(); ++n) {
    const int rows = lengths[n];
    const GdnInputs in = random_inputs(rows);
    const double us = median_us(3, 20, [&](int) {
      CHECK(cudaMemsetAsync(states, 0, state_bytes));
      prefill(in, states, scratch, out);
    });
    std::printf("prefill T %d: %.1f us (%.0f tokens/ms)\n", rows, us, rows / us * 1e3);
    json += "    {\"T\": " + std::to_string(rows) + ", \"us\": " + std::to_string(us) + "}" +
            (n + 1 < lengths.size() ? ",\n" : "\n");
  }
  const vavilov::cuda::GdnProducts products = vavilov::cuda::gdn_prefill_products();
  const char* name = products == vavilov::cuda::GdnProducts::Tf32   ? "tf32"
                     : products == vavilov::cuda::GdnProducts::Bf16 ? "bf16"
                                                                    : "3xtf32";
  std::printf("prefill products: %s\n", name);
  return json + "  ],\n  \"prefill_products\": \"" + name +
         "\",\n  \"prefill_note\": \"gdn_prefill: l2 norms, gates, chunk prepare, state scan, outputs and the gated "
         "RMS norm; each timing includes a 3.1 MB memset of the state\"\n";
}

int write_text(const char* path, const std::string& text) {
  FILE* f = std::fopen(path, "w");
  if (!f) {
    std::fprintf(stderr, "cannot write %s\n", path);
    return 1;
  }
  std::fputs(text.c_str(), f);
  std::fclose(f);
  return 0;
}

int time_kernels(const char* out_path) {
  const size_t state_floats = size_t(kShape.heads) * kShape.dk * kShape.dv, state_bytes = state_floats * 4;
  float* states = random_floats(state_floats * kLayers, 8, -0.5f, 0.5f);
  float* row_states = device_floats(state_floats * 4 * kLayers);
  float* out = device_floats(size_t(8192) * kShape.heads * kShape.dv);
  std::string json =
      "{\n  \"shape\": {\"heads\": 48, \"key_heads\": 16, \"dk\": 128, \"dv\": 128, \"dtype\": \"float32\"},\n";

  // Decode: one call per layer, each on its own recurrent and conv state and taps (as in a step), so the state comes
  // from HBM. "conv_decode": the conv folded in (gdn_conv_decode, rows 1–4 recording every row's states as a verify
  // step does, and 1 row without); "separate": gdn_conv then gdn_decode, as before.
  const size_t conv_floats = size_t(kShape.conv_dim) * (kConvKernel - 1);
  float* conv_states = random_floats(conv_floats * kLayers, 9, -1.0f, 1.0f);
  float* conv_rows = device_floats(conv_floats * 4 * kLayers);
  float* taps = random_floats(size_t(kShape.conv_dim) * kConvKernel * kLayers, 10, -0.5f, 0.5f);
  auto conv_of = [&](int layer, bool record) {
    return vavilov::cuda::GdnConvState{taps + size_t(layer) * kShape.conv_dim * kConvKernel, kConvKernel,
                                       conv_states + layer * conv_floats,
                                       record ? conv_rows + size_t(layer) * 4 * conv_floats : nullptr};
  };
  // path: "conv_decode" (gdn_conv_decode; "dependent": as a programmatic dependent launch, whose state loads overlap
  // the kernel before — here the previous layer's) or "separate" (gdn_conv, then gdn_decode).
  // general: the kernel's general body at 1 row too (gdn_decode_one_row_body() otherwise picks the 1-row body).
  struct DecodeCase {
    int rows;
    bool record, fused, dependent, general = false;
  };
  // 2 and 4 rows without recording: what the rows cost without what a rollback needs (the state before the pass and
  // each row's update).
  const std::vector<DecodeCase> cases = {
      {1, false, true, false},      {1, true, true, false},        {2, true, true, false},
      {3, true, true, false},       {4, true, true, false},        {2, false, true, false},
      {4, false, true, false},      {1, false, true, true},        {4, true, true, true},
      {1, false, false, false},     {4, true, false, false},       {1, false, true, false, true},
      {1, false, true, true, true}, {1, false, false, false, true}};
  const int resident = vavilov::cuda::gdn_conv_decode_resident_clusters(kShape);
  std::printf("conv_decode: %d clusters resident at once (cudaOccupancyMaxActiveClusters)\n", resident);
  json += "  \"decode_fused\": " +
          std::string(vavilov::cuda::gdn_conv_decode_fused(kShape, kConvKernel) ? "true" : "false") +
          ",\n  \"decode_resident_clusters\": " + std::to_string(resident) + ",\n  \"decode\": [\n";
  for (size_t n = 0; n < cases.size(); ++n) {
    const DecodeCase& c = cases[n];
    const GdnInputs in = random_inputs(c.rows);
    float* raw = random_floats(size_t(c.rows) * kShape.conv_dim, 11, -1.0f, 1.0f);  // the projections before the conv
    auto layers = [&](cudaStream_t stream) {
      for (int layer = 0; layer < kLayers; ++layer) {
        float* state = states + layer * state_floats;
        float* recorded = c.record ? row_states + size_t(layer) * 4 * state_floats : nullptr;
        const vavilov::cuda::GdnConvState conv = conv_of(layer, c.record);
        if (c.fused) {
          vavilov::cuda::gdn_conv_decode(kShape, conv, raw, in, state, recorded, out, c.dependent, stream,
                                         !c.general && vavilov::cuda::gdn_decode_one_row_body());
        } else {
          vavilov::cuda::gdn_conv(conv.taps, kShape.conv_dim, kConvKernel, conv.state, raw, c.rows, conv.row_states,
                                  stream);
          vavilov::cuda::gdn_decode(kShape, in, state, recorded, out, stream,
                                    !c.general && vavilov::cuda::gdn_decode_one_row_body());
        }
      }
    };
    const double us = graph_median_us(3, 30, layers) / kLayers;
    const double bytes = double(state_bytes) * (2 + (c.record ? c.rows : 0));
    const std::string path =
        std::string(c.fused ? (c.dependent ? "conv_decode dependent" : "conv_decode") : "separate") +
        (c.general ? " general body" : "");
    std::printf("%s rows %d%s: %.2f us, %.0f GB/s of state\n", path.c_str(), c.rows, c.record ? " (recording)" : "", us,
                bytes / us * 1e-3);
    json += "    {\"path\": \"" + path + "\", \"rows\": " + std::to_string(c.rows) +
            ", \"recorded\": " + (c.record ? "true" : "false") + ", \"us\": " + std::to_string(us) +
            ", \"state_bytes\": " + std::to_string(bytes) + ", \"gb_per_s\": " + std::to_string(bytes / us * 1e-3) +
            "}" + (n + 1 < cases.size() ? ",\n" : "\n");
  }
  json +=
      "  ],\n  \"decode_note\": \"per layer, 36 layers back to back in one CUDA graph; state_bytes: the recurrent "
      "state read and written plus each recorded row's copy (conv state, taps and inputs, ~0.5 MB, not counted)\",\n";
  json += time_floors(states, state_floats);

  json += prefill_json(states, out) + "}\n";
  return write_text(out_path, json);
}

// The prefill alone (no decode cases): "prefill OUT.json".
int time_prefill(const char* out_path) {
  float* states = device_floats(size_t(kShape.heads) * kShape.dk * kShape.dv);
  float* out = device_floats(size_t(8192) * kShape.heads * kShape.dv);
  return write_text(out_path,
                    "{\n  \"shape\": {\"heads\": 48, \"key_heads\": 16, \"dk\": 128, \"dv\": 128, "
                    "\"dtype\": \"float32\"},\n" +
                        prefill_json(states, out) + "}\n");
}

int profile() {
  const size_t state_floats = size_t(kShape.heads) * kShape.dk * kShape.dv;
  float* state = random_floats(state_floats, 8, -0.5f, 0.5f);
  float* row_states = device_floats(state_floats * 4);
  float* out = device_floats(size_t(8192) * kShape.heads * kShape.dv);
  float* scratch = device_floats(vavilov::cuda::gdn_chunk_scratch_floats(kShape, 8192));
  const size_t conv_floats = size_t(kShape.conv_dim) * (kConvKernel - 1);
  const vavilov::cuda::GdnConvState conv{random_floats(size_t(kShape.conv_dim) * kConvKernel, 10, -0.5f, 0.5f),
                                         kConvKernel, random_floats(conv_floats, 9, -1.0f, 1.0f),
                                         device_floats(conv_floats * 4)};
  for (int rows : {1, 4}) {
    const GdnInputs in = random_inputs(rows);
    float* raw = random_floats(size_t(rows) * kShape.conv_dim, 11, -1.0f, 1.0f);
    for (int i = 0; i < 3; ++i) {
      vavilov::cuda::gdn_decode(kShape, in, state, rows > 1 ? row_states : nullptr, out, nullptr);
      vavilov::cuda::GdnConvState recorded = conv;
      if (rows == 1) recorded.row_states = nullptr;
      vavilov::cuda::gdn_conv_decode(kShape, recorded, raw, in, state, rows > 1 ? row_states : nullptr, out, false,
                                     nullptr);
    }
  }
  for (int rows : {512, 8192}) {
    const GdnInputs in = random_inputs(rows);
    for (int i = 0; i < 2; ++i) prefill(in, state, scratch, out);
  }
  CHECK(cudaDeviceSynchronize());
  return 0;
}

std::vector<float> read_floats(const std::string& path, size_t n) {
  std::vector<float> v(n);
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f || std::fread(v.data(), 4, n, f) != n) {
    std::fprintf(stderr, "%s: cannot read %zu float32 values\n", path.c_str(), n);
    std::exit(1);
  }
  std::fclose(f);
  return v;
}

float* upload(const std::vector<float>& host) {
  float* p = device_floats(host.size());
  CHECK(cudaMemcpy(p, host.data(), host.size() * 4, cudaMemcpyHostToDevice));
  return p;
}

void write_floats(const std::string& path, const float* device, size_t n) {
  std::vector<float> host(n);
  CHECK(cudaMemcpy(host.data(), device, n * 4, cudaMemcpyDeviceToHost));
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || std::fwrite(host.data(), 4, n, f) != n) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    std::exit(1);
  }
  std::fclose(f);
}

int check(const std::string& dir, int rows) {
  const size_t r = size_t(rows), heads = size_t(kShape.heads), dv = size_t(kShape.dv);
  const GdnInputs in{upload(read_floats(dir + "/qkv.f32", r * kShape.conv_dim)),
                     upload(read_floats(dir + "/b.f32", r * heads)),
                     upload(read_floats(dir + "/a.f32", r * heads)),
                     upload(read_floats(dir + "/a_log.f32", heads)),
                     upload(read_floats(dir + "/dt_bias.f32", heads)),
                     upload(read_floats(dir + "/z.f32", r * heads * dv)),
                     upload(read_floats(dir + "/norm.f32", dv)),
                     1e-6f,
                     true,
                     rows};
  const size_t state_floats = heads * kShape.dk * dv;
  float* state = device_floats(state_floats);
  float* scratch = device_floats(vavilov::cuda::gdn_chunk_scratch_floats(kShape, rows));
  float* out = device_floats(r * heads * dv);
  prefill(in, state, scratch, out);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  write_floats(dir + "/ours_out.f32", out, r * heads * dv);
  write_floats(dir + "/ours_state.f32", state, state_floats);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "time" && argc == 3) return time_kernels(argv[2]);
  if (mode == "prefill" && argc == 3) return time_prefill(argv[2]);
  if (mode == "profile" && argc == 2) return profile();
  if (mode == "check" && argc == 4) {
    const int rows = std::atoi(argv[3]);
    if (rows > 0) return check(argv[2], rows);
  }
  std::fprintf(stderr,
               "usage: gdn_bench time OUT.json | gdn_bench prefill OUT.json | gdn_bench profile | gdn_bench check DIR "
               "T\n");
  return 2;
}
