// How fast do the fused MoE experts of a 1-row decode step (src/cuda/expert_decode.cu: the products kernel, which
// routes the row, computes gate/up, SwiGLU and down's partials, then the combine) stream their ~31 MB? This runs them
// alone, as a graph of dependent launches, over expert stores laid out as the synthetic model's (each projection's
// codes, scales and biases of all 512 experts in one allocation each: a gate, up or down code store of 420 MB), with
// the step's 10 experts (set through the router logits) chosen three ways:
//
//   scattered:  10 distinct random experts a launch, launches cycling over kStores stores (the decode step: each layer
//               a store of its own, picks spread over the whole store);
//   adjacent:   experts 0..9 (their rows one contiguous 8 MB run of codes a projection), cycling over the same stores,
//               so that nothing stays in L2 either;
//   resident:   experts 0..9 of one store every launch (31 MB: in L2 after the first launch), the kernels' own ceiling.
//
// If scattered is much slower than adjacent, address translation or DRAM locality over the scattered experts costs;
// if adjacent is as slow, the kernels themselves are the limit. Prints µs a step and GB/s of weight bytes; writes JSON.
// Usage: expert_bench OUT.json
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "check.cuh"
#include "cuda/expert_decode.cuh"
#include "event_times.cuh"

namespace {

using vavilov::cuda::DeviceMatrix;
using vavilov::cuda::ExpertDecode;
using vavilov::cuda::GemvMatrix;
using vavilov::cuda::kMaxGemvRows;
using vavilov::cuda::WeightFormat;

constexpr int kHidden = 2560, kInner = 640, kExperts = 512, kTopK = 10;
constexpr int kStores = 8;     // 8 × 31 MB a cycle: far more than L2
constexpr int kLaunches = 96;  // steps in a graph: 12 cycles over the stores
constexpr int kReplays = 7;    // the fastest replay counts

// One projection of all experts: codes, scales, biases, each in one allocation (synthetic.cpp's layout).
struct Projection {
  uint32_t* codes = nullptr;
  uint16_t *scales = nullptr, *biases = nullptr;

  Projection(int count, int rows, int cols) {
    const size_t n = size_t(count) * size_t(rows) * size_t(cols);
    CHECK(cudaMalloc(&codes, n / 2));
    CHECK(cudaMalloc(&scales, n / 64 * 2));
    CHECK(cudaMalloc(&biases, n / 64 * 2));
    CHECK(cudaMemset(codes, 0x5a, n / 2));
    CHECK(cudaMemset(scales, 0x3c, n / 64 * 2));  // bf16 0x3c3c ≈ 0.0115: finite
    CHECK(cudaMemset(biases, 0x3c, n / 64 * 2));
  }
  DeviceMatrix matrix(int e, int rows, int cols) const {
    const size_t first = size_t(e) * size_t(rows) * size_t(cols);
    return {WeightFormat::Q4, rows, cols, codes + first / 8, scales + first / 64, biases + first / 64};
  }
};

struct Store {
  Projection gate{kExperts, kInner, kHidden}, up{kExperts, kInner, kHidden}, down{kExperts, kHidden, kInner};
  Projection shared_gate{1, kInner, kHidden}, shared_up{1, kInner, kHidden}, shared_down{1, kHidden, kInner};
  DeviceMatrix *gate_table = nullptr, *up_table = nullptr, *down_table = nullptr;  // per expert, on the device

  Store() {
    for (auto [projection, table, rows, cols] :
         {std::tuple{&gate, &gate_table, kInner, kHidden}, std::tuple{&up, &up_table, kInner, kHidden},
          std::tuple{&down, &down_table, kHidden, kInner}}) {
      std::vector<DeviceMatrix> host;
      for (int e = 0; e < kExperts; ++e) host.push_back(projection->matrix(e, rows, cols));
      CHECK(cudaMalloc(table, host.size() * sizeof(DeviceMatrix)));
      CHECK(cudaMemcpy(*table, host.data(), host.size() * sizeof(DeviceMatrix), cudaMemcpyHostToDevice));
    }
  }
};

// The step's buffers besides the weights.
struct Buffers {
  float *x, *logits, *shared_scale, *route_weights, *slot_weights, *partials, *y;
  int *route_ids, *slot_of;
  GemvMatrix* descriptors;

  Buffers() {
    CHECK(cudaMalloc(&x, kHidden * sizeof(float)));
    CHECK(cudaMemset(x, 0x3c, kHidden * sizeof(float)));
    CHECK(cudaMalloc(&logits, size_t(kLaunches) * kExperts * sizeof(float)));
    CHECK(cudaMalloc(&shared_scale, sizeof(float)));
    CHECK(cudaMemset(shared_scale, 0, sizeof(float)));
    CHECK(cudaMalloc(&route_weights, kTopK * sizeof(float)));
    CHECK(cudaMalloc(&route_ids, kTopK * sizeof(int)));
    CHECK(cudaMalloc(&slot_weights, size_t(kMaxGemvRows) * kTopK * kMaxGemvRows * sizeof(float)));
    CHECK(cudaMalloc(&slot_of, (size_t(kMaxGemvRows) * kTopK + 1) * sizeof(int)));
    CHECK(cudaMalloc(&descriptors, 3 * size_t(kMaxGemvRows) * kTopK * sizeof(GemvMatrix)));
    CHECK(cudaMalloc(&partials, vavilov::cuda::expert_partial_count(kTopK, kInner, kInner, kHidden) * sizeof(float)));
    CHECK(cudaMalloc(&y, kHidden * sizeof(float)));
  }
};

// µs a step of kLaunches steps' experts, step i over store (i % kStores, or 0) with the picks(i) made by its logits.
template <typename Picks>
double time_launches(const std::vector<Store*>& stores, bool cycle, Picks&& picks, const Buffers& b,
                     cudaStream_t stream) {
  std::vector<float> logits(size_t(kLaunches) * kExperts, 0.0f);
  std::vector<ExpertDecode> params(kLaunches);
  for (int i = 0; i < kLaunches; ++i) {
    const Store& s = *stores[size_t(cycle ? i % kStores : 0)];
    const std::vector<int> experts = picks(i);
    for (int j = 0; j < kTopK; ++j) logits[size_t(i) * kExperts + size_t(experts[size_t(j)])] = 8.0f - 0.25f * j;
    ExpertDecode& p = params[size_t(i)];
    p.shared_gate = s.shared_gate.matrix(0, kInner, kHidden);
    p.shared_up = s.shared_up.matrix(0, kInner, kHidden);
    p.shared_down = s.shared_down.matrix(0, kHidden, kInner);
    p.hidden = kHidden;
    p.inner = p.shared_inner = kInner;
    p.route = {kExperts, kTopK, true};
    p.x = b.x;
    p.logits = b.logits + size_t(i) * kExperts;
    p.shared_scale = b.shared_scale;
    p.route_ids = b.route_ids;
    p.route_weights = b.route_weights;
    p.slots = {b.slot_of, b.slot_of + kMaxGemvRows * kTopK, b.slot_weights};
    p.slots.gate = s.gate_table;
    p.slots.up = s.up_table;
    p.slots.down = s.down_table;
    p.slots.matrices = b.descriptors;
    p.partials = b.partials;
    p.y = b.y;
  }
  CHECK(cudaMemcpy(b.logits, logits.data(), logits.size() * sizeof(float), cudaMemcpyHostToDevice));

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
  for (const ExpertDecode& p : params) CHECK(vavilov::cuda::expert_decode(p, 1, stream));
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const float best = fastest(event_times_ms(stream, kReplays, [&](int) { CHECK(cudaGraphLaunch(exec, stream)); }));
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  return 1000.0 * best / kLaunches;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: expert_bench OUT.json\n");
    return 2;
  }
  std::vector<Store*> stores;
  for (int s = 0; s < kStores; ++s) stores.push_back(new Store);
  const Buffers buffers;
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  std::mt19937 rng(7);
  const auto random_picks = [&](int) {
    std::vector<int> all(kExperts);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    return std::vector<int>(all.begin(), all.begin() + kTopK);
  };
  const auto first_picks = [](int) {
    std::vector<int> first(kTopK);
    std::iota(first.begin(), first.end(), 0);
    return first;
  };
  // 11 × 3 matrices (10 experts and the shared expert) of codes, scales and biases.
  const double bytes = 3.0 * (kTopK + 1) * (double(kInner) * kHidden / 2 + 2.0 * kInner * (kHidden / 64) * 2);
  struct Result {
    std::string mode;
    double us;
  };
  std::vector<Result> results;
  for (int round = 0; round < 2; ++round) {  // twice, interleaved, to see the spread
    results.push_back({"scattered", time_launches(stores, true, random_picks, buffers, stream)});
    results.push_back({"adjacent", time_launches(stores, true, first_picks, buffers, stream)});
    results.push_back({"resident", time_launches(stores, false, first_picks, buffers, stream)});
  }
  FILE* out = std::fopen(argv[1], "w");
  if (!out) {
    std::fprintf(stderr, "expert_bench: cannot write %s\n", argv[1]);
    return 1;
  }
  std::fprintf(out,
               "{\"kernels\": \"products_kernel<1, true> + combine_kernel<1>\", \"bytes_per_launch\": %.0f, "
               "\"launches\": %d, \"runs\": [",
               bytes, kLaunches);
  for (size_t i = 0; i < results.size(); ++i) {
    const double gbs = bytes / (results[i].us * 1e3);
    std::printf("%-10s %7.2f us  %6.0f GB/s\n", results[i].mode.c_str(), results[i].us, gbs);
    std::fprintf(out, "%s{\"mode\": \"%s\", \"us\": %.3f, \"gb_s\": %.0f}", i ? ", " : "", results[i].mode.c_str(),
                 results[i].us, gbs);
  }
  std::fprintf(out, "]}\n");
  std::fclose(out);
  return 0;
}
