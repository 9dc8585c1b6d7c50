#include "cuda/expert_cache.h"

#include <fmt/core.h>

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace vavilov::cuda {

HostAllocation host_alloc(size_t bytes, const std::string& what) {
  void* p = nullptr;
  const cudaError_t status = cudaHostAlloc(&p, std::max<size_t>(bytes, 1), cudaHostAllocMapped | cudaHostAllocPortable);
  if (status != cudaSuccess) {
    cudaGetLastError();
    fail("{}: cannot pin {:.2f} GB of host memory: {}", what, double(bytes) / 1e9, cudaGetErrorString(status));
  }
  void* device = nullptr;
  cuda_check(cudaHostGetDevicePointer(&device, p, 0), what.c_str());
  check(device == p, "{}: the GPU sees pinned host memory at another address (no unified addressing)", what);
  return HostAllocation(p);
}

namespace {

constexpr int kGate = 0, kUp = 1, kDown = 2;

// m with every pointer moved from blob `from` to `to` (same offsets).
DeviceMatrix rebased(const DeviceMatrix& m, const std::byte* from, std::byte* to) {
  DeviceMatrix r = m;
  const auto move = [&](auto pointer) {
    using T = decltype(pointer);
    return pointer ? reinterpret_cast<T>(to + (reinterpret_cast<const std::byte*>(pointer) - from)) : pointer;
  };
  r.data = move(m.data);
  r.scales = move(m.scales);
  r.biases = move(m.biases);
  r.block_scales = move(m.block_scales);
  return r;
}

}  // namespace

namespace {
double megabytes(double bytes) { return bytes / (1024.0 * 1024.0); }
}  // namespace

ExpertCache::ExpertCache(int64_t budget_bytes, std::string option)
    : budget_bytes_(budget_bytes), option_(std::move(option)) {
  check(budget_bytes >= 0, "{} {:g}: expected a size in MB ≥ 0", option_, megabytes(double(budget_bytes)));
}

ExpertCache::~ExpertCache() {
  if (side_) {
    cudaStreamSynchronize(side_);
    cudaStreamDestroy(side_);
  }
  if (entries_ready_) cudaEventDestroy(entries_ready_);
  if (round_done_) cudaEventDestroy(round_done_);
}

int ExpertCache::add_layer(HostAllocation host, size_t stride, std::vector<DeviceMatrix> gate,
                           std::vector<DeviceMatrix> up, std::vector<DeviceMatrix> down) {
  check(!gate.empty() && gate.size() == up.size() && gate.size() == down.size(), "expert cache: uneven expert lists");
  check(experts_ == 0 || experts_ == int(gate.size()), "expert cache: layers with different expert counts");
  experts_ = int(gate.size());
  Layer layer;
  layer.host = std::move(host);
  layer.stride = stride;
  layer.entries = device_alloc(3 * gate.size() * sizeof(DeviceMatrix), "expert cache entries");
  std::vector<DeviceMatrix> entries;
  for (const auto* list : {&gate, &up, &down}) entries.insert(entries.end(), list->begin(), list->end());
  cuda_check(
      cudaMemcpy(layer.entries.get(), entries.data(), entries.size() * sizeof(DeviceMatrix), cudaMemcpyHostToDevice),
      "expert cache entries");
  layer.host_gate = std::move(gate);
  layer.host_up = std::move(up);
  layer.host_down = std::move(down);
  layers_.push_back(std::move(layer));
  return int(layers_.size()) - 1;
}

DeviceMatrix* ExpertCache::entry(int layer, int which, int expert) const {
  return static_cast<DeviceMatrix*>(layers_[size_t(layer)].entries.get()) + size_t(which) * size_t(experts_) +
         size_t(expert);
}
const DeviceMatrix* ExpertCache::gate(int layer) const { return entry(layer, kGate, 0); }
const DeviceMatrix* ExpertCache::up(int layer) const { return entry(layer, kUp, 0); }
const DeviceMatrix* ExpertCache::down(int layer) const { return entry(layer, kDown, 0); }

void ExpertCache::finish() {
  for (const Layer& layer : layers_) slot_bytes_ = std::max(slot_bytes_, layer.stride);
  const double expert_mb = megabytes(double(slot_bytes_));
  const int64_t slots = slot_bytes_ ? budget_bytes_ / int64_t(slot_bytes_) : 0;
  check(budget_bytes_ == 0 || slots > 0,
        "{} {:g}: the cache holds no routed expert (one takes {:.2f} MB); give at least {} MB, or 0 to read every "
        "expert from host memory",
        option_, megabytes(double(budget_bytes_)), expert_mb, int64_t(expert_mb) + 1);
  slots_ = int(std::min<int64_t>(slots, int64_t(layers_.size()) * experts_));
  if (slots_ > 0) {
    void* p = nullptr;
    const cudaError_t status = cudaMalloc(&p, size_t(slots_) * slot_bytes_);
    if (status != cudaSuccess) {
      cudaGetLastError();
      size_t free = 0, total = 0;
      cudaMemGetInfo(&free, &total);
      fail("{} {:g}: the GPU has no room for the expert cache of {:.0f} MB ({}; {} MB free after the other weights)",
           option_, megabytes(double(budget_bytes_)), megabytes(double(slots_) * double(slot_bytes_)),
           cudaGetErrorString(status), free / (1024 * 1024));
    }
    slot_memory_.reset(p);
  }
  const size_t keys = layers_.size() * size_t(experts_);
  uses_ = device_alloc(keys * 4, "expert cache counters");
  reads_ = device_alloc(layers_.size() * 2 * 8, "expert cache counters");
  cuda_check(cudaMemset(uses_.get(), 0, keys * 4), "expert cache counters");
  cuda_check(cudaMemset(reads_.get(), 0, layers_.size() * 2 * 8), "expert cache counters");
  host_uses_ = host_alloc(keys * 4, "expert cache counters");
  host_reads_ = host_alloc(layers_.size() * 2 * 8, "expert cache counters");
  staging_ = host_alloc(size_t(2 * 3 * policy_.max_moves) * sizeof(ExpertEntryUpdate), "expert cache staging");
  state_ = experts::empty_cache(int64_t(keys), slots_);
  cuda_check(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking), "expert cache stream");
  cuda_check(cudaEventCreateWithFlags(&entries_ready_, cudaEventDisableTiming), "expert cache event");
  cuda_check(cudaEventCreateWithFlags(&round_done_, cudaEventDisableTiming), "expert cache event");
  cuda_check(cudaEventRecord(entries_ready_, side_), "expert cache event");
  cuda_check(cudaEventRecord(round_done_, side_), "expert cache event");
}

void ExpertCache::record_use(int layer, const int* ids, int count, cudaStream_t stream) {
  const char* slots = static_cast<const char*>(slot_memory_.get());
  cuda_check(count_expert_use(ids, count, experts_, static_cast<uint32_t*>(uses_.get()) + size_t(layer) * experts_,
                              static_cast<unsigned long long*>(reads_.get()) + 2 * size_t(layer), gate(layer), slots,
                              slots ? slots + size_t(slots_) * slot_bytes_ : slots, stream),
             "expert cache counters");
}

void ExpertCache::before_call(cudaStream_t stream) {
  cuda_check(cudaStreamWaitEvent(stream, entries_ready_, 0), "expert cache order");
}

void ExpertCache::between_calls(cudaStream_t stream) {
  if (slots_ == 0) return;
  const cudaError_t busy = cudaEventQuery(round_done_);
  if (busy == cudaErrorNotReady) {  // the last round's copies still run: its counts keep adding up on the device
    cudaGetLastError();             // not an error: keep it from the next cudaGetLastError check
    ++rounds_busy_;
    return;
  }
  cuda_check(busy, "expert cache round");
  const size_t keys = layers_.size() * size_t(experts_);
  cuda_check(cudaMemcpyAsync(host_uses_.get(), uses_.get(), keys * 4, cudaMemcpyDeviceToHost, stream),
             "expert cache counters");
  cuda_check(cudaMemsetAsync(uses_.get(), 0, keys * 4, stream), "expert cache counters");
  cuda_check(cudaStreamSynchronize(stream), "expert cache counters");
  ++rounds_;
  const auto* uses = static_cast<const uint32_t*>(host_uses_.get());
  apply(experts::plan_round(state_, {uses, keys}, policy_));
}

int ExpertCache::stage_entries(int64_t key, int slot, int used) {
  const Layer& layer = layers_[size_t(key / experts_)];
  const int expert = int(key % experts_);
  auto* blob = static_cast<std::byte*>(layer.host.get()) + size_t(expert) * layer.stride;
  std::byte* to = slot < 0 ? blob : static_cast<std::byte*>(slot_memory_.get()) + size_t(slot) * slot_bytes_;
  auto* staging = static_cast<ExpertEntryUpdate*>(staging_.get());
  const DeviceMatrix* matrices[3] = {&layer.host_gate[size_t(expert)], &layer.host_up[size_t(expert)],
                                     &layer.host_down[size_t(expert)]};
  for (int which = 0; which < 3; ++which)
    staging[used++] = {entry(int(key / experts_), which, expert), rebased(*matrices[which], blob, to)};
  return used;
}

void ExpertCache::apply(const std::vector<experts::CacheMove>& moves) {
  if (moves.empty()) return;
  auto* staging = static_cast<ExpertEntryUpdate*>(staging_.get());
  int evicted = 0;
  for (const experts::CacheMove& move : moves)
    if (move.evicted >= 0) evicted = stage_entries(move.evicted, -1, evicted);
  cuda_check(write_expert_entries(staging, evicted, side_), "expert cache eviction");
  cuda_check(cudaEventRecord(entries_ready_, side_), "expert cache eviction");
  int promoted = evicted;
  for (const experts::CacheMove& move : moves) {
    const Layer& layer = layers_[size_t(move.promoted / experts_)];
    const auto* blob =
        static_cast<const std::byte*>(layer.host.get()) + size_t(move.promoted % experts_) * layer.stride;
    auto* slot = static_cast<std::byte*>(slot_memory_.get()) + size_t(move.slot) * slot_bytes_;
    cuda_check(cudaMemcpyAsync(slot, blob, layer.stride, cudaMemcpyHostToDevice, side_), "expert cache promotion");
    promoted = stage_entries(move.promoted, move.slot, promoted);
    promoted_bytes_ += double(layer.stride);
    evictions_ += move.evicted >= 0;
  }
  promotions_ += moves.size();
  cuda_check(write_expert_entries(staging + evicted, promoted - evicted, side_), "expert cache promotion");
  cuda_check(cudaEventRecord(round_done_, side_), "expert cache promotion");
}

ExpertCacheStats ExpertCache::stats() {
  ExpertCacheStats s;
  s.budget_bytes = budget_bytes_;
  s.slot_bytes = int64_t(slot_bytes_);
  s.slots = slots_;
  for (const Layer& layer : layers_) s.host_bytes += double(layer.stride) * experts_;
  for (int64_t key : state_.key_of_slot)
    if (key >= 0) {
      ++s.resident;
      s.resident_bytes += double(layers_[size_t(key / experts_)].stride);
    }
  cuda_check(cudaDeviceSynchronize(), "expert cache statistics");
  cuda_check(cudaMemcpy(host_reads_.get(), reads_.get(), layers_.size() * 2 * 8, cudaMemcpyDeviceToHost),
             "expert cache statistics");
  const auto* reads = static_cast<const unsigned long long*>(host_reads_.get());
  for (size_t l = 0; l < layers_.size(); ++l) {
    s.expert_reads += reads[2 * l];
    s.hits += reads[2 * l + 1];
    s.missed_bytes += double(reads[2 * l] - reads[2 * l + 1]) * double(layers_[l].stride);
  }
  s.promotions = promotions_;
  s.evictions = evictions_;
  s.rounds = rounds_;
  s.rounds_busy = rounds_busy_;
  s.promoted_bytes = promoted_bytes_;
  return s;
}

std::string ExpertCache::stats_line() {
  const ExpertCacheStats s = stats();
  return fmt::format(
      "expert cache: {:g} MB, {} of {} slots held ({:.0f} MB); hit rate {:.1f} % of {} expert reads; {:.1f} MB read "
      "from host memory; {} promotions ({:.1f} MB), {} evictions",
      megabytes(double(s.budget_bytes)), s.resident, s.slots, s.resident_bytes / (1024.0 * 1024.0),
      100.0 * s.hit_rate(), s.expert_reads, s.missed_bytes / 1e6, s.promotions, s.promoted_bytes / 1e6, s.evictions);
}

}  // namespace vavilov::cuda
