// The kernel trace's host side (kernel_trace.h); empty unless built with -DVAVILOV_KERNEL_TRACE=ON.
#ifdef VAVILOV_KERNEL_TRACE
#include "cuda/kernel_trace.h"

#include <cxxabi.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "core/error.h"
#include "cuda/device_model.h"
#include "cuda/kernel_trace_hook.cuh"

namespace vavilov::cuda::kernel_trace {

namespace {

struct State {
  std::mutex mutex;
  std::vector<RingSetter> setters;  // one per CUDA translation unit
  bool tracing = false, unknown_graph = false;
  DeviceRing* ring = nullptr;
  DeviceEntry* entries = nullptr;
  size_t capacity = 0;
  std::map<const void*, std::string> names;
  std::map<cudaStream_t, std::vector<LaunchRecord>> capturing;  // launches of the capture under way on a stream
  std::map<cudaGraphExec_t, std::vector<LaunchRecord>> graphs;
  std::vector<LaunchRecord> launches;  // in stream order, as they run
  std::string scope;
  int layer = -1, layers_in_pass = 0;
};

State& state() {
  static State s;  // first used by other translation units' static initialisers (register_ring)
  return s;
}

std::string kernel_name(State& s, const void* kernel) {
  auto [it, inserted] = s.names.try_emplace(kernel);
  if (!inserted) return it->second;
  const char* raw = nullptr;
  if (cudaFuncGetName(&raw, kernel) != cudaSuccess || !raw) {
    cudaGetLastError();
    return it->second = "(unnamed)";
  }
  int status = 0;
  std::unique_ptr<char, decltype(&std::free)> demangled(abi::__cxa_demangle(raw, nullptr, nullptr, &status),
                                                        &std::free);
  return it->second = short_kernel_name(status == 0 && demangled ? demangled.get() : raw);
}

std::vector<LaunchRecord>& log_for(State& s, cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cuda_check(cudaStreamIsCapturing(stream, &capture), "kernel trace");
  return capture == cudaStreamCaptureStatusActive ? s.capturing[stream] : s.launches;
}

void point_modules_at(State& s, DeviceRing* ring) {
  for (RingSetter set : s.setters) cuda_check(set(ring), "kernel trace: setting a module's ring");
}

}  // namespace

bool register_ring(RingSetter setter) {
  State& s = state();
  std::lock_guard lock(s.mutex);
  s.setters.push_back(setter);
  return true;
}

void note_launch(const void* kernel, dim3 grid, dim3 block, cudaStream_t stream) {
  State& s = state();
  std::lock_guard lock(s.mutex);
  if (!s.tracing) return;
  LaunchRecord r;
  r.name = kernel_name(s, kernel);
  r.scope = s.scope;
  r.layer = s.scope.empty() ? -1 : s.layer;
  r.blocks = grid.x * grid.y * grid.z;
  r.threads = block.x * block.y * block.z;
  log_for(s, stream).push_back(std::move(r));
}

LayerScope::LayerScope(const char* type) {
  State& s = state();
  std::lock_guard lock(s.mutex);
  s.scope = type;
  s.layer = s.layers_in_pass++;
}

LayerScope::~LayerScope() {
  State& s = state();
  std::lock_guard lock(s.mutex);
  s.scope.clear();
}

void pass_begin() {
  State& s = state();
  std::lock_guard lock(s.mutex);
  s.layers_in_pass = 0;
}

void pass_end(cudaStream_t stream, int kind, int rows) {
  State& s = state();
  if (!s.tracing) return;
  cuda_check(launch_pass_end_marker(stream), "kernel trace: pass end marker");
  std::lock_guard lock(s.mutex);
  LaunchRecord& marker = log_for(s, stream).back();
  marker.pass_end = true;
  marker.pass_kind = kind;
  marker.pass_rows = rows;
}

void replayed(cudaGraphExec_t graph, cudaStream_t stream) {
  State& s = state();
  std::lock_guard lock(s.mutex);
  if (!s.tracing) return;
  if (auto pending = s.capturing.find(stream); pending != s.capturing.end()) {  // captured for this launch
    s.graphs[graph] = std::move(pending->second);
    s.capturing.erase(pending);
  }
  const auto known = s.graphs.find(graph);
  if (known == s.graphs.end()) {
    s.unknown_graph = true;
    return;
  }
  s.launches.insert(s.launches.end(), known->second.begin(), known->second.end());
}

void start(size_t capacity) {
  State& s = state();
  std::lock_guard lock(s.mutex);
  check(!s.tracing, "kernel trace: already started");
  check(capacity > 0, "kernel trace: the ring needs a capacity");
  cuda_check(cudaMalloc(&s.ring, sizeof(DeviceRing)), "kernel trace ring");
  cuda_check(cudaMalloc(&s.entries, capacity * sizeof(DeviceEntry)), "kernel trace ring");
  const DeviceRing empty{0, capacity, s.entries};
  cuda_check(cudaMemcpy(s.ring, &empty, sizeof empty, cudaMemcpyHostToDevice), "kernel trace ring");
  point_modules_at(s, s.ring);
  s.capacity = capacity;
  s.tracing = true;
  s.unknown_graph = false;
  s.capturing.clear();
  s.graphs.clear();
  s.launches.clear();
  s.layers_in_pass = 0;
}

void clear() {
  State& s = state();
  std::lock_guard lock(s.mutex);
  check(s.tracing, "kernel trace: not started");
  cuda_check(cudaDeviceSynchronize(), "kernel trace");
  cuda_check(cudaMemset(&s.ring->count, 0, sizeof s.ring->count), "kernel trace");
  s.launches.clear();
}

Trace stop() {
  State& s = state();
  std::lock_guard lock(s.mutex);
  check(s.tracing, "kernel trace: not started");
  cuda_check(cudaDeviceSynchronize(), "kernel trace");
  DeviceRing written;
  cuda_check(cudaMemcpy(&written, s.ring, sizeof written, cudaMemcpyDeviceToHost), "kernel trace");
  Trace trace;
  const bool overflowed = written.count > s.capacity;
  std::vector<DeviceEntry> raw(overflowed ? 0 : size_t(written.count));
  if (!raw.empty())
    cuda_check(cudaMemcpy(raw.data(), s.entries, raw.size() * sizeof(DeviceEntry), cudaMemcpyDeviceToHost),
               "kernel trace");
  point_modules_at(s, nullptr);
  cudaFree(s.entries);
  cudaFree(s.ring);
  s.ring = nullptr;
  s.entries = nullptr;
  s.tracing = false;
  check(!overflowed, "kernel trace: {} entries overflowed the ring of {}", written.count, s.capacity);
  check(!s.unknown_graph, "kernel trace: a graph captured before the trace started was replayed");
  for (const DeviceEntry& e : raw)
    trace.entries.push_back({e.grid_id, e.arrived_ns, e.released_ns, e.sm, e.blocks, e.threads, e.pass_end != 0});
  trace.launches = std::move(s.launches);
  s.launches.clear();
  return trace;
}

}  // namespace vavilov::cuda::kernel_trace
#endif
