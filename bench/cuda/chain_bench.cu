// How close can a chain of small dependent products get to the copy bandwidth on this GPU? A decode step is ~570
// dependent kernels of a few MB of weights each; this measures the same shape of work with the arithmetic left out:
// P phases, phase p streaming its own W bytes of "weights" (all phases together far larger than L2) and reading a value
// another block wrote in phase p − 1, so that each phase depends on the whole previous one. Three ways to run it:
//
//   kernels:        one kernel a phase, replayed as a CUDA graph, each a dependent launch (launch.cuh) that waits
//                   first and then streams (a GEMV that loads nothing before its wait);
//   kernels_early:  the same, each thread issuing its first loads before the wait (what the decode GEMVs do);
//   persistent:     one cooperative kernel whose blocks stream phase p's weights, then wait at a grid barrier (an
//                   atomic counter) for phase p − 1, so the weight stream of a phase overlaps the barrier of the last.
//
// All three compute the same values (checked). Prints per phase the time, the copy floor (W / copy bandwidth) and the
// fraction of it, and writes JSON. Then three sweeps of the early-load chain: loads in flight (blocks a multiprocessor
// × loads a thread), an L2 prefetcher on a parallel branch of the graph pulling the next phases' weights into L2, and
// code footprint: each phase also runs ~32 KB of straight-line code after its wait, the phases rotating over 1-16
// kernels whose code differs, so that from some count on the multiprocessors' instruction caches no longer hold the
// chain's code (a decode step runs ~250 KB of distinct kernel code a layer).
// Usage: chain_bench OUT.json [footprint]   (footprint: only the code-footprint sweep)
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "check.cuh"
#include "cuda/launch.cuh"

namespace {

using vavilov::cuda::allow_dependents;
using vavilov::cuda::launch_dependent;
using vavilov::cuda::wait_for_producers;

constexpr int kThreads = 256;
constexpr int kUnroll = 8;  // 16-byte loads a thread keeps in flight (the sweep varies it)

struct Chain {
  const uint4* weights;  // [phases][words]
  size_t words;          // 16-byte words a phase
  uint32_t* values;      // [phases + 1][blocks]: what each block wrote after each phase
  int blocks;
  uint32_t* progress;  // null, or where block 0 of phase p writes p + 1 once its wait returns (the prefetcher's pace)
};

// A block's share of phase p's weights, folded into one word (grid-stride over the phase, kUnroll loads at a time).
// `first` holds the first kUnroll loads when the caller issued them early.
template <int Unroll = kUnroll>
__device__ uint32_t stream_phase(const Chain& c, int p, const uint4 (&first)[Unroll], bool have_first) {
  const uint4* w = c.weights + size_t(p) * c.words;
  const size_t stride = size_t(c.blocks) * kThreads, start = size_t(blockIdx.x) * kThreads + threadIdx.x;
  uint32_t acc = 0;
  size_t i = start;
  if (have_first) {
#pragma unroll
    for (int u = 0; u < Unroll; ++u) acc ^= first[u].x ^ first[u].y ^ first[u].z ^ first[u].w;
    i += Unroll * stride;
  }
  for (; i < c.words; i += Unroll * stride) {
    uint4 v[Unroll];
#pragma unroll
    for (int u = 0; u < Unroll; ++u)
      v[u] = i + u * stride < c.words ? __ldg(w + i + u * stride) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < Unroll; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  return acc;
}

template <int Unroll = kUnroll>
__device__ void load_first(const Chain& c, int p, uint4 (&first)[Unroll]) {
  const uint4* w = c.weights + size_t(p) * c.words;
  const size_t stride = size_t(c.blocks) * kThreads, start = size_t(blockIdx.x) * kThreads + threadIdx.x;
#pragma unroll
  for (int u = 0; u < Unroll; ++u)
    first[u] = start + u * stride < c.words ? __ldg(w + start + u * stride) : make_uint4(0, 0, 0, 0);
}

// The block's fold of its threads' words, plus the value block (b + 1) % blocks wrote in the previous phase.
__device__ void finish_phase(const Chain& c, int p, uint32_t acc) {
  __shared__ uint32_t folded[kThreads / 32];
  for (int offset = 16; offset > 0; offset >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, offset);
  if (threadIdx.x % 32 == 0) folded[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t block = 0;
    for (int i = 0; i < kThreads / 32; ++i) block ^= folded[i];
    const uint32_t previous =
        *reinterpret_cast<volatile uint32_t*>(c.values + size_t(p) * c.blocks + (blockIdx.x + 1) % unsigned(c.blocks));
    c.values[size_t(p + 1) * c.blocks + blockIdx.x] = block * 2654435761u + previous;
  }
  __syncthreads();
}

template <int Unroll = kUnroll>
__global__ void __launch_bounds__(kThreads) phase_kernel(Chain c, int p, bool early) {
  uint4 first[Unroll];
  if (early) load_first<Unroll>(c, p, first);
  wait_for_producers();
  allow_dependents();
  if (c.progress && blockIdx.x == 0 && threadIdx.x == 0) *reinterpret_cast<volatile uint32_t*>(c.progress) = p + 1;
  finish_phase(c, p, stream_phase<Unroll>(c, p, first, early));
}

__device__ uint32_t load_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Every block waits until all blocks have arrived `target` times in total.
__device__ void grid_barrier(uint32_t* arrivals, uint32_t target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(arrivals, 1u);
    while (load_acquire(arrivals) < target) {
    }
  }
  __syncthreads();
}

// Phase p's weights are streamed before the barrier that makes phase p − 1's values visible.
__global__ void __launch_bounds__(kThreads) persistent_kernel(Chain c, int phases, uint32_t* arrivals) {
  const uint4 none[kUnroll] = {};
  for (int p = 0; p < phases; ++p) {
    const uint32_t acc = stream_phase(c, p, none, false);
    if (p > 0) grid_barrier(arrivals, uint32_t(p) * uint32_t(c.blocks));
    finish_phase(c, p, acc);
  }
}

// Runs beside the chain (a parallel branch of its graph): once phase p − 1 − ahead has started, pulls phase p's weights
// into L2 with bulk prefetches (cp.async.bulk.prefetch.L2, fire and forget), so that the chain's dependent kernels
// find them there and the DRAM keeps streaming while the chain waits on its launches.
// One warp a block, kPrefetchBlocks blocks: one multiprocessor's bulk prefetches reach only ~240 GB/s.
constexpr int kPrefetchBlocks = 32;
__global__ void prefetch_kernel(Chain c, int phases, int ahead) {
  constexpr uint32_t kPiece = 1 << 14;  // bytes a bulk prefetch
  const size_t bytes = c.words * 16;
  for (int p = 0; p < phases; ++p) {
    if (threadIdx.x == 0)
      while (int(*reinterpret_cast<volatile uint32_t*>(c.progress)) < p - ahead) {
      }
    __syncwarp();
    const char* phase = reinterpret_cast<const char*>(c.weights + size_t(p) * c.words);
    for (size_t at = (size_t(blockIdx.x) * blockDim.x + threadIdx.x) * kPiece; at < bytes;
         at += size_t(gridDim.x) * blockDim.x * kPiece) {
      const uint32_t size = uint32_t(bytes - at < kPiece ? bytes - at : kPiece);
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(phase + at), "r"(size) : "memory");
    }
  }
}

// Straight-line code for the footprint sweep: kCodeSteps unrolled rounds of four independent xorshift-multiply chains
// (~12 instructions a round, ~32 KB of code) whose constants depend on V, so every variant is its own code.
constexpr int kCodeSteps = 170;
template <int V>
__device__ uint32_t code_body(uint32_t x) {
  uint32_t a = x, b = x ^ 0x9e3779b9u, c = x + V, d = x * 3u;
#pragma unroll
  for (int i = 0; i < kCodeSteps; ++i) {
    const uint32_t k = 0x9e3779b9u * uint32_t(i + 1) + uint32_t(V) * 0x85ebca6bu;
    a = (a ^ (a >> 13)) * (k | 1u);
    b = (b ^ (b >> 11)) * ((k ^ 0x27d4eb2fu) | 1u);
    c = (c ^ (c >> 7)) * ((k + 0x165667b1u) | 1u);
    d = (d ^ (d >> 17)) * ((k ^ 0xc2b2ae35u) | 1u);
  }
  return a ^ b ^ c ^ d;
}

// An early-load phase whose first warp runs code_body<V> after the wait (on the chain's critical path, as a real
// kernel's code after its wait), its result folded into the block's value.
template <int V>
__global__ void __launch_bounds__(kThreads) code_phase_kernel(Chain c, int p) {
  uint4 first[kUnroll];
  load_first(c, p, first);
  wait_for_producers();
  allow_dependents();
  uint32_t acc = stream_phase(c, p, first, true);
  if (threadIdx.x < 32) acc ^= code_body<V>(acc + threadIdx.x);
  finish_phase(c, p, acc);
}

__global__ void fill(uint4* p, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = make_uint4(uint32_t(i), uint32_t(i * 7 + 1), uint32_t(i * 13 + 5), uint32_t(i >> 3));
}

float elapsed_ms(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  return ms;
}

double copy_bandwidth_gbs() {
  const size_t bytes = size_t(1) << 30;
  void *a, *b;
  CHECK(cudaMalloc(&a, bytes));
  CHECK(cudaMalloc(&b, bytes));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  CHECK(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice));
  CHECK(cudaEventRecord(start));
  for (int i = 0; i < 10; ++i) CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
  CHECK(cudaEventRecord(stop));
  CHECK(cudaEventSynchronize(stop));
  const double gbs = 2.0 * bytes * 10 / (elapsed_ms(start, stop) * 1e-3) / 1e9;
  CHECK(cudaFree(a));
  CHECK(cudaFree(b));
  return gbs;
}

struct Result {
  double kernels_us, kernels_early_us, persistent_us;
  bool same;
};

// A chain's weights (filled) and zeroed values on the device; free_chain releases them.
Chain make_chain(size_t phase_bytes, int phases, int blocks) {
  Chain c{};
  c.words = phase_bytes / 16;
  c.blocks = blocks;
  uint4* weights;
  CHECK(cudaMalloc(&weights, c.words * 16 * phases));
  fill<<<1024, 256>>>(weights, c.words * phases);
  c.weights = weights;
  CHECK(cudaMalloc(&c.values, sizeof(uint32_t) * size_t(phases + 1) * blocks));
  CHECK(cudaMemset(c.values, 0, sizeof(uint32_t) * size_t(phases + 1) * blocks));
  CHECK(cudaDeviceSynchronize());  // the chains run on a non-blocking stream, which does not wait for these
  return c;
}

void free_chain(Chain& c) {
  CHECK(cudaFree(const_cast<uint4*>(c.weights)));
  CHECK(cudaFree(c.values));
}

Result run(size_t phase_bytes, int phases, int blocks, int repeats) {
  Chain c = make_chain(phase_bytes, phases, blocks);
  uint32_t* arrivals;
  CHECK(cudaMalloc(&arrivals, sizeof(uint32_t)));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  const size_t value_bytes = sizeof(uint32_t) * size_t(phases + 1) * blocks;
  std::vector<uint32_t> reference(size_t(phases + 1) * blocks), got(reference.size());

  auto graph_of = [&](bool early) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    for (int p = 0; p < phases; ++p)
      CHECK(launch_dependent(phase_kernel<>, dim3(blocks), dim3(kThreads), 0, stream, c, p, early));
    CHECK(cudaStreamEndCapture(stream, &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    CHECK(cudaGraphDestroy(graph));
    return exec;
  };
  auto time_graph = [&](cudaGraphExec_t exec) {
    CHECK(cudaGraphLaunch(exec, stream));  // warm-up
    CHECK(cudaEventRecord(start, stream));
    for (int r = 0; r < repeats; ++r) CHECK(cudaGraphLaunch(exec, stream));
    CHECK(cudaEventRecord(stop, stream));
    CHECK(cudaEventSynchronize(stop));
    return elapsed_ms(start, stop) * 1e3 / repeats / phases;
  };
  Result result{};
  CHECK(cudaMemsetAsync(c.values, 0, value_bytes, stream));
  const cudaGraphExec_t plain = graph_of(false), early = graph_of(true);
  result.kernels_us = time_graph(plain);
  CHECK(cudaMemcpy(reference.data(), c.values, value_bytes, cudaMemcpyDeviceToHost));
  result.kernels_early_us = time_graph(early);
  CHECK(cudaMemcpy(got.data(), c.values, value_bytes, cudaMemcpyDeviceToHost));
  result.same = got == reference;

  int phases_arg = phases;
  void* args[] = {&c, &phases_arg, &arrivals};
  auto persistent = [&] {
    CHECK(cudaMemsetAsync(arrivals, 0, sizeof(uint32_t), stream));
    CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<void*>(persistent_kernel), dim3(blocks), dim3(kThreads), args, 0,
                                      stream));
  };
  persistent();  // warm-up
  CHECK(cudaEventRecord(start, stream));
  for (int r = 0; r < repeats; ++r) persistent();
  CHECK(cudaEventRecord(stop, stream));
  CHECK(cudaEventSynchronize(stop));
  result.persistent_us = elapsed_ms(start, stop) * 1e3 / repeats / phases;
  CHECK(cudaMemcpy(got.data(), c.values, value_bytes, cudaMemcpyDeviceToHost));
  result.same = result.same && got == reference;

  CHECK(cudaGraphExecDestroy(plain));
  CHECK(cudaGraphExecDestroy(early));
  CHECK(cudaStreamDestroy(stream));
  free_chain(c);
  CHECK(cudaFree(arrivals));
  return result;
}

// Per-phase time of a captured chain: the mean of 5 replays after a warm-up; destroys `exec`.
double replay_us(cudaGraphExec_t exec, cudaStream_t stream, int phases) {
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  CHECK(cudaGraphLaunch(exec, stream));
  CHECK(cudaEventRecord(start, stream));
  constexpr int kRepeats = 5;
  for (int r = 0; r < kRepeats; ++r) CHECK(cudaGraphLaunch(exec, stream));
  CHECK(cudaEventRecord(stop, stream));
  CHECK(cudaEventSynchronize(stop));
  const double us = elapsed_ms(start, stop) * 1e3 / kRepeats / phases;
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(stop));
  CHECK(cudaGraphExecDestroy(exec));
  return us;
}

// A chain of `phases` launches captured into one graph, `launch(c, p, stream)` making phase p's: per-phase time.
template <typename LaunchPhase>
double captured_chain_us(size_t phase_bytes, int phases, int blocks, LaunchPhase&& launch) {
  Chain c = make_chain(phase_bytes, phases, blocks);
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int p = 0; p < phases; ++p) launch(c, p, stream);
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const double us = replay_us(exec, stream, phases);
  CHECK(cudaGraphDestroy(graph));
  CHECK(cudaStreamDestroy(stream));
  free_chain(c);
  return us;
}

// The early-load chain alone at one shape: per-phase time with `Unroll` loads in flight a thread and `blocks` blocks
// (memory-level parallelism against the fixed cost of a launch).
template <int Unroll>
double early_chain_us(size_t phase_bytes, int phases, int blocks) {
  return captured_chain_us(phase_bytes, phases, blocks, [&](const Chain& c, int p, cudaStream_t stream) {
    CHECK(launch_dependent(phase_kernel<Unroll>, dim3(blocks), dim3(kThreads), 0, stream, c, p, true));
  });
}

// The early-load chain with prefetch_kernel running `ahead` phases in front of it (ahead < 0: no prefetcher), in one
// graph: per-phase time.
double prefetched_chain_us(size_t phase_bytes, int phases, int blocks, int ahead) {
  Chain c = make_chain(phase_bytes, phases, blocks);
  CHECK(cudaMalloc(&c.progress, sizeof(uint32_t)));
  cudaStream_t stream, side;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  cudaEvent_t fork, join;
  CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
  CHECK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  CHECK(cudaMemsetAsync(c.progress, 0, sizeof(uint32_t), stream));
  if (ahead >= 0) {
    CHECK(cudaEventRecord(fork, stream));
    CHECK(cudaStreamWaitEvent(side, fork));
    prefetch_kernel<<<kPrefetchBlocks, 32, 0, side>>>(c, phases, ahead);
    CHECK(cudaGetLastError());
    CHECK(cudaEventRecord(join, side));
  }
  for (int p = 0; p < phases; ++p)
    CHECK(launch_dependent(phase_kernel<>, dim3(blocks), dim3(kThreads), 0, stream, c, p, true));
  if (ahead >= 0) CHECK(cudaStreamWaitEvent(stream, join));
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  const double us = replay_us(exec, stream, phases);
  CHECK(cudaGraphDestroy(graph));
  CHECK(cudaStreamDestroy(stream));
  CHECK(cudaStreamDestroy(side));
  CHECK(cudaFree(c.progress));
  free_chain(c);
  return us;
}

// The early-load chain whose phases run code_phase_kernel<p % variants>: per-phase time.
template <int... V>
double code_chain_us(size_t phase_bytes, int phases, int blocks, int variants, std::integer_sequence<int, V...>) {
  using Kernel = void (*)(Chain, int);
  const Kernel kernels[] = {code_phase_kernel<V>...};
  return captured_chain_us(phase_bytes, phases, blocks, [&](const Chain& c, int p, cudaStream_t stream) {
    CHECK(launch_dependent(kernels[p % variants], dim3(blocks), dim3(kThreads), 0, stream, c, p));
  });
}

// Code footprint: 2 MB phases (launch-bound), phases rotating over 1-16 kernels of ~37 KB of code each (sm_90a); prints
// the sweep and returns its JSON entries.
std::string footprint_sweep(int blocks) {
  std::printf("2 MB phases with ~37 KB of code after the wait: us a phase by kernels the phases rotate over\n");
  std::string json;
  const int variant_counts[] = {1, 2, 4, 8, 16};
  for (int i = 0; i < 5; ++i) {
    const double us =
        code_chain_us(size_t(2) << 20, 512, blocks, variant_counts[i], std::make_integer_sequence<int, 16>());
    std::printf("%3d kernels: %7.2f\n", variant_counts[i], us);
    json += "    {\"kernels\": " + std::to_string(variant_counts[i]) + ", \"us\": " + std::to_string(us) + "}" +
            (i < 4 ? ",\n" : "\n");
  }
  return json;
}

// The first three sweeps (phase sizes × launch modes, loads in flight, the L2 prefetcher): prints them and returns
// their JSON members.
std::string chain_sweeps(const cudaDeviceProp& properties, int blocks, double gbs) {
  std::string json = "  \"phases\": [\n";
  std::printf("%10s %8s %12s %12s %12s %10s %6s\n", "phase MB", "floor us", "kernels us", "early us", "persist us",
              "persist %", "same");
  const std::vector<double> megabytes = {0.5, 2, 4, 8, 16};
  for (size_t i = 0; i < megabytes.size(); ++i) {
    const size_t bytes = size_t(megabytes[i] * (1 << 20));
    const int phases = int(std::clamp<size_t>((size_t(1) << 30) / bytes, 64, 1024));  // ≥ 1 GB in all, > L2
    const Result r = run(bytes, phases, blocks, 5);
    const double floor_us = double(bytes) / (gbs * 1e3);
    std::printf("%10.1f %8.2f %12.2f %12.2f %12.2f %9.0f%% %6s\n", megabytes[i], floor_us, r.kernels_us,
                r.kernels_early_us, r.persistent_us, 100 * floor_us / r.persistent_us, r.same ? "yes" : "NO");
    json += "    {\"phase_mb\": " + std::to_string(megabytes[i]) + ", \"phases\": " + std::to_string(phases) +
            ", \"copy_floor_us\": " + std::to_string(floor_us) + ", \"kernels_us\": " + std::to_string(r.kernels_us) +
            ", \"kernels_early_us\": " + std::to_string(r.kernels_early_us) +
            ", \"persistent_us\": " + std::to_string(r.persistent_us) +
            ", \"same_values\": " + (r.same ? "true" : "false") + "}" + (i + 1 < megabytes.size() ? ",\n" : "\n");
  }
  // Loads in flight: 8 MB phases (the step's average size is 6.6 MB) at 1-4 blocks of 256 threads a multiprocessor and
  // 1-16 16-byte loads a thread, i.e. 4-256 KB in flight a multiprocessor.
  json += "  ],\n  \"in_flight_8mb\": [\n";
  std::printf("8 MB phases, early loads: us a phase by blocks a multiprocessor (rows) and loads a thread (columns)\n");
  const size_t sweep_bytes = size_t(8) << 20;
  const int sweep_phases = 128;
  for (int per = 1; per <= 4; per *= 2) {
    const int b = properties.multiProcessorCount * per;
    const double us[5] = {
        early_chain_us<1>(sweep_bytes, sweep_phases, b), early_chain_us<2>(sweep_bytes, sweep_phases, b),
        early_chain_us<4>(sweep_bytes, sweep_phases, b), early_chain_us<8>(sweep_bytes, sweep_phases, b),
        early_chain_us<16>(sweep_bytes, sweep_phases, b)};
    std::printf("%d blocks/SM: %7.2f %7.2f %7.2f %7.2f %7.2f\n", per, us[0], us[1], us[2], us[3], us[4]);
    const int loads[5] = {1, 2, 4, 8, 16};
    for (int i = 0; i < 5; ++i)
      json += "    {\"blocks_per_sm\": " + std::to_string(per) + ", \"loads_per_thread\": " + std::to_string(loads[i]) +
              ", \"kb_in_flight_per_sm\": " + std::to_string(per * kThreads * loads[i] * 16 / 1024) +
              ", \"us\": " + std::to_string(us[i]) + "}" + (per == 4 && i == 4 ? "\n" : ",\n");
  }
  // An L2 prefetcher beside the chain: us a phase without it (-1) and with it 0-4 phases ahead.
  json += "  ],\n  \"l2_prefetch\": [\n";
  std::printf(
      "early-load chain with an L2 prefetcher: us a phase by phase size (rows) and phases ahead (none, 0, 1, 2, 4)\n");
  const std::vector<double> prefetch_mb = {1, 2, 4, 8, 16};
  const int aheads[5] = {-1, 0, 1, 2, 4};
  const char* separator = "";
  for (size_t i = 0; i < prefetch_mb.size(); ++i) {
    const size_t bytes = size_t(prefetch_mb[i] * (1 << 20));
    const int phases = int(std::clamp<size_t>((size_t(1) << 30) / bytes, 64, 1024));
    std::printf("%6.1f MB:", prefetch_mb[i]);
    for (int a = 0; a < 5; ++a) {
      if (double(aheads[a] + 2) * prefetch_mb[i] > 40) continue;  // more than L2 holds
      const double us = prefetched_chain_us(bytes, phases, blocks, aheads[a]);
      std::printf(" %7.2f", us);
      json += std::string(separator) + "    {\"phase_mb\": " + std::to_string(prefetch_mb[i]) +
              ", \"ahead\": " + std::to_string(aheads[a]) +
              ", \"copy_floor_us\": " + std::to_string(double(bytes) / (gbs * 1e3)) +
              ", \"us\": " + std::to_string(us) + "}";
      separator = ",\n";
    }
    std::printf("\n");
  }
  json += "\n  ],\n";
  return json;
}

}  // namespace

int main(int argc, char** argv) {
  const bool footprint_only = argc == 3 && std::string(argv[2]) == "footprint";
  if (argc != 2 && !footprint_only) {
    std::fprintf(stderr, "usage: chain_bench OUT.json [footprint]\n");
    return 2;
  }
  cudaDeviceProp properties{};
  CHECK(cudaGetDeviceProperties(&properties, 0));
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, persistent_kernel, kThreads, 0));
  const int blocks = properties.multiProcessorCount * std::min(per_sm, 4);
  const double gbs = copy_bandwidth_gbs();
  std::string json =
      "{\n  \"gpu\": \"" + std::string(properties.name) + "\",\n  \"copy_bandwidth_gbs\": " + std::to_string(gbs) +
      ",\n  \"blocks\": " + std::to_string(blocks) + ",\n  \"threads\": " + std::to_string(kThreads) + ",\n";
  std::printf("%s, copy %.0f GB/s, %d blocks of %d threads\n", properties.name, gbs, blocks, kThreads);
  if (!footprint_only) json += chain_sweeps(properties, blocks, gbs);
  json += "  \"code_footprint_2mb\": [\n" + footprint_sweep(blocks);
  json += "  ]\n}\n";
  FILE* out = std::fopen(argv[1], "w");
  if (!out) {
    std::fprintf(stderr, "chain_bench: cannot write %s\n", argv[1]);
    return 1;
  }
  std::fputs(json.c_str(), out);
  std::fclose(out);
  return 0;
}
