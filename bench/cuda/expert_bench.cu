// Why does the fused MoE gate/up kernel (src/cuda/expert_decode.cu) of a 1-row decode step stream its ~20 MB at
// ~1.7 TB/s? This runs that kernel alone, as a graph of dependent launches, over expert stores laid out as the
// synthetic model's (each projection's codes, scales and biases of all 512 experts in one allocation each: a gate or up
// code store of 420 MB), with the step's 10 experts chosen three ways:
//
//   scattered:  10 distinct random experts a launch, launches cycling over kStores stores (the decode step: each layer
//               a store of its own, picks spread over the whole store);
//   adjacent:   experts 0..9 (their rows one contiguous 8 MB run of codes a projection), cycling over the same stores,
//               so that nothing stays in L2 either;
//   resident:   experts 0..9 of one store every launch (20 MB: in L2 after the first launch), the kernel's own ceiling.
//
// If scattered is much slower than adjacent, address translation or DRAM locality over the scattered experts costs;
// if adjacent is as slow, the kernel itself is the limit. Prints µs a launch and GB/s of weight bytes; writes JSON.
// Usage: expert_bench OUT.json
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
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
constexpr int kStores = 8;     // 8 × 20 MB a cycle: far more than L2
constexpr int kLaunches = 96;  // a graph: 12 cycles over the stores
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
  Projection gate{kExperts, kInner, kHidden}, up{kExperts, kInner, kHidden};
  Projection shared_gate{1, kInner, kHidden}, shared_up{1, kInner, kHidden};
};

GemvMatrix descriptor(const DeviceMatrix& m) {
  GemvMatrix g;
  g.rows = m.rows;
  g.cols = m.cols;
  g.codes = static_cast<const uint32_t*>(m.data);
  g.scales = reinterpret_cast<const __nv_bfloat16*>(m.scales);
  g.biases = reinterpret_cast<const __nv_bfloat16*>(m.biases);
  return g;
}

// µs a launch of kLaunches gate/up launches, launch i over store (i % kStores, or 0) with picks(i).
template <typename Picks>
double time_launches(const std::vector<Store*>& stores, bool cycle, Picks&& picks, float* x, float* h, float* shared_h,
                     cudaStream_t stream) {
  const size_t per_launch = 3 * size_t(kMaxGemvRows) * kTopK;
  std::vector<GemvMatrix> host(per_launch * kLaunches);  // rows = 0 past the 10 slots
  std::vector<ExpertDecode> params(kLaunches);
  for (int i = 0; i < kLaunches; ++i) {
    const Store& s = *stores[size_t(cycle ? i % kStores : 0)];
    const std::vector<int> experts = picks(i);
    for (int j = 0; j < kTopK; ++j) {
      host[per_launch * size_t(i) + 3 * size_t(j)] = descriptor(s.gate.matrix(experts[size_t(j)], kInner, kHidden));
      host[per_launch * size_t(i) + 3 * size_t(j) + 1] = descriptor(s.up.matrix(experts[size_t(j)], kInner, kHidden));
    }
    ExpertDecode& p = params[size_t(i)];
    p.shared_gate = s.shared_gate.matrix(0, kInner, kHidden);
    p.shared_up = s.shared_up.matrix(0, kInner, kHidden);
    p.hidden = kHidden;
    p.inner = p.shared_inner = kInner;
    p.top_k = kTopK;
    p.x = x;
    p.h = h;
    p.shared_h = shared_h;
  }
  GemvMatrix* device = nullptr;
  CHECK(cudaMalloc(&device, host.size() * sizeof(GemvMatrix)));
  CHECK(cudaMemcpy(device, host.data(), host.size() * sizeof(GemvMatrix), cudaMemcpyHostToDevice));
  for (int i = 0; i < kLaunches; ++i) params[size_t(i)].slot_matrices = device + per_launch * size_t(i);

  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
  for (const ExpertDecode& p : params) CHECK(vavilov::cuda::expert_gate_up(p, 1, kTopK, stream));
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const float best = fastest(event_times_ms(stream, kReplays, [&](int) { CHECK(cudaGraphLaunch(exec, stream)); }));
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  CHECK(cudaFree(device));
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
  float *x = nullptr, *h = nullptr, *shared_h = nullptr;
  CHECK(cudaMalloc(&x, kHidden * sizeof(float)));
  CHECK(cudaMemset(x, 0x3c, kHidden * sizeof(float)));
  CHECK(cudaMalloc(&h, size_t(kMaxGemvRows) * kTopK * kInner * sizeof(float)));
  CHECK(cudaMalloc(&shared_h, kInner * sizeof(float)));
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
  // 11 matrices pairs (10 experts and the shared expert) of codes, scales and biases.
  const double bytes = 2.0 * (kTopK + 1) * (double(kInner) * kHidden / 2 + 2.0 * kInner * (kHidden / 64) * 2);
  struct Result {
    std::string mode;
    double us;
  };
  std::vector<Result> results;
  for (int round = 0; round < 2; ++round) {  // twice, interleaved, to see the spread
    results.push_back({"scattered", time_launches(stores, true, random_picks, x, h, shared_h, stream)});
    results.push_back({"adjacent", time_launches(stores, true, first_picks, x, h, shared_h, stream)});
    results.push_back({"resident", time_launches(stores, false, first_picks, x, h, shared_h, stream)});
  }
  FILE* out = std::fopen(argv[1], "w");
  if (!out) {
    std::fprintf(stderr, "expert_bench: cannot write %s\n", argv[1]);
    return 1;
  }
  std::fprintf(out, "{\"kernel\": \"gate_up_kernel<1>\", \"bytes_per_launch\": %.0f, \"launches\": %d, \"runs\": [",
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
