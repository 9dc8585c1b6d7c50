#pragma once
// Routed experts streamed from host memory through a bounded device cache (--expert-cache-mb).
//
// Every routed expert (gate, up and down, MTP layer included) lives in pinned, device-mapped host memory, one blob per
// expert (its matrices' codes, scales and biases back to back). The DeviceMoe arrays the kernels read point each
// expert at its host blob, or at a device slot holding a copy of it: a miss is a slower read over PCIe of the same
// bytes, so results never depend on what the cache holds. The routing's picks are counted on the device (one small
// launch per MoE layer, in the captured pass); between backend calls the host ages those counts, plans moves
// (src/experts/cache_policy.*) and applies them on a side stream beside the next step's compute.
//
// The invariant (why no step ever reads a slot while it is overwritten):
//   1. A round runs only between backend calls, after the calling sequence's stream was synchronised; every sequence
//      of the model is driven from one thread and every backend call ends synchronised, so no step is in flight.
//   2. An evicted expert's entries are pointed back at its host blob on the side stream (entries_ready_), and every
//      backend call first makes its stream wait for entries_ready_ (before_call): no later step sees the old slot.
//   3. Only after that write, in side-stream order, does the slot receive the promoted expert's bytes, and only after
//      that copy are the promoted expert's entries pointed at the slot (round_done_). A step running meanwhile reads
//      the entry either before (host blob) or after (complete device copy); the entry is written in 8-byte words and
//      every word other than the pointers is unchanged, so even a half-updated entry names two copies of the same
//      bytes.
//   4. A round starts only when the previous round's copies are done (round_done_ queried, never waited on): the
//      staging memory of the entry writes is reused only then, and promotions never queue up behind a slow bus.
// Tests: tests/gpu/test_cuda_expert_cache.cpp (bit-identical to all-resident weights under churn), the policy alone
// in tests/test_expert_cache_policy.cpp.
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cuda/device_matrix.h"
#include "cuda/device_model.h"
#include "cuda/expert_cache_kernels.cuh"
#include "experts/cache_policy.h"

namespace vavilov::cuda {

struct ExpertCacheStats {
  int64_t budget_bytes = 0, slot_bytes = 0;
  int slots = 0, resident = 0;
  double resident_bytes = 0, host_bytes = 0;  // device copies held; all routed expert bytes in host memory
  uint64_t expert_reads = 0, hits = 0;        // each pass's distinct experts per layer; those read from a device copy
  double missed_bytes = 0;                    // bytes of the reads that went to host memory
  uint64_t promotions = 0, evictions = 0, rounds = 0, rounds_busy = 0;
  double promoted_bytes = 0;
  double hit_rate() const { return expert_reads ? double(hits) / double(expert_reads) : 0.0; }
};

class ExpertCache {
 public:
  // budget_bytes: device memory for copies (0: every expert is read from host memory). `option` names the setting
  // in errors (the CLI's --expert-cache-mb; sizes are given in MB there).
  ExpertCache(int64_t budget_bytes, std::string option);
  ~ExpertCache();
  ExpertCache(const ExpertCache&) = delete;
  ExpertCache& operator=(const ExpertCache&) = delete;

  // One MoE layer's experts: `host` holds `count` blobs of `stride` bytes, expert e's matrices pointing into blob e.
  // Returns the layer's index for record_use; the device arrays are gate(), up(), down().
  int add_layer(HostAllocation host, size_t stride, std::vector<DeviceMatrix> gate, std::vector<DeviceMatrix> up,
                std::vector<DeviceMatrix> down);
  const DeviceMatrix* gate(int layer) const;
  const DeviceMatrix* up(int layer) const;
  const DeviceMatrix* down(int layer) const;
  // After the last add_layer: the device slots (an error naming the option when the budget holds no expert or the
  // GPU has no room), counters, side stream.
  void finish();

  // In a pass (graph-capturable): counts the `count` picks `ids` of `layer` (route_ids after the routing).
  void record_use(int layer, const int* ids, int count, cudaStream_t stream);
  // Before a backend call's first launch on `stream`: ordered after the last round's eviction writes.
  void before_call(cudaStream_t stream);
  // After a backend call, `stream` synchronised: one policy round (see the invariant above).
  void between_calls(cudaStream_t stream);

  ExpertCacheStats stats();  // waits for the device's counters
  std::string stats_line();  // for the CLI

 private:
  struct Layer {
    HostAllocation host;
    size_t stride = 0;
    std::vector<DeviceMatrix> host_gate, host_up, host_down;  // pointing at the host blobs
    DeviceAllocation entries;                                 // device: gate, up, down arrays back to back
  };
  void apply(const std::vector<experts::CacheMove>& moves);
  // The three entries of `key` pointed at `slot`'s copy (slot < 0: at the host blob), appended to staging_ at `used`.
  int stage_entries(int64_t key, int slot, int used);
  DeviceMatrix* entry(int layer, int which, int expert) const;

  int64_t budget_bytes_;
  std::string option_;
  std::vector<Layer> layers_;
  int experts_ = 0;
  size_t slot_bytes_ = 0;
  int slots_ = 0;
  DeviceAllocation slot_memory_;                     // slots_ · slot_bytes_
  DeviceAllocation uses_;                            // uint32 [layers, experts]: picks since the last round
  DeviceAllocation reads_;                           // unsigned long long [layers, 2]: distinct reads, hits
  HostAllocation host_uses_, host_reads_, staging_;  // staging_: ExpertEntryUpdate [2 · 3 · max_moves]
  experts::CacheState state_;
  experts::CachePolicy policy_;
  cudaStream_t side_ = nullptr;
  cudaEvent_t entries_ready_ = nullptr, round_done_ = nullptr;
  uint64_t promotions_ = 0, evictions_ = 0, rounds_ = 0, rounds_busy_ = 0;
  double promoted_bytes_ = 0;
};

}  // namespace vavilov::cuda
