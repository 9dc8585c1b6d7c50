#pragma once
// The host half of the kernel trace that needs no GPU (built in every configuration, tested on the CPU): the device's
// entries (one per kernel whose block 0 passed its wait, in completion order) matched to the launches the host noted
// in stream order, cut into passes at their end markers, and summarised as each kernel's share of a pass's critical
// path. Kernel i's span is the time from its own release (its producers done) to the next kernel's release (its own
// completion, which the next wait observes): the spans of a pass add up to the pass.
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace vavilov::cuda::kernel_trace {

// One device entry (kernel_trace_hook.cuh's DeviceEntry, read back).
struct Entry {
  uint64_t grid_id = 0, arrived_ns = 0, released_ns = 0;
  uint32_t sm = 0, blocks = 0, threads = 0;
  bool pass_end = false;  // a pass's end marker
};

// One launch as the host made it (or captured it into a graph that was then replayed). A pass-end marker is a tiny
// kernel that each traced pass launches last: its release is the pass's last kernel's completion.
struct LaunchRecord {
  std::string name;   // the kernel's demangled name without its parameters
  std::string scope;  // the layer type the launch belongs to ("gdn", "attention"), empty outside a layer
  int layer = -1;     // the layer's ordinal within its pass
  uint32_t blocks = 0, threads = 0;
  bool pass_end = false;
  int pass_kind = 0, pass_rows = 0;
};

// A launch matched to its entry (or not: `recorded` false where no entry came, e.g. a kernel whose block 0 never
// waits) and entries that no launch explains (a kernel launched around launch.cuh that still waits: `listed` false).
struct MatchedKernel {
  LaunchRecord launch;
  bool recorded = false, listed = true;
  Entry entry;
};

// Entries of one grid within a pass (a kernel that waits more than once, maybe after the next kernel's entry) keep the
// first; a graph's replays may repeat its kernels' grid ids, so the grids seen start afresh after each end marker's
// entry. Each entry goes to the next launch of its shape (blocks, threads, end marker or not); a launch whose shape
// does not match while the entry matches the launch after it is marked unrecorded; an entry that matches neither is
// unlisted.
std::vector<MatchedKernel> match(const std::vector<Entry>& entries, const std::vector<LaunchRecord>& launches);

struct KernelSpan {
  std::string name, scope;
  int layer = -1;
  bool recorded = true, listed = true;
  double start_us = 0;   // release after the pass's first release
  double span_us = 0;    // to the next recorded release in the pass (0 when unrecorded)
  double waited_us = 0;  // block 0 at its wait: time it started ahead of its producers' completion
  uint32_t blocks = 0;
};

struct Pass {
  int kind = 0, rows = 0;
  double total_us = 0;  // first release to the end marker's
  std::vector<KernelSpan> kernels;
};

// Cuts matched kernels into passes at the end markers (kernels after the last marker are dropped: they belong to no
// pass). Throws when the launches and entries cannot be matched (nothing recorded, or a pass without entries).
std::vector<Pass> passes(const std::vector<MatchedKernel>& kernels);

// Passes of the same kind and rows averaged position by position (they run the same graph); `steps`: how many steps
// the trace covers, for the per-step totals. Throws if passes of one shape differ in their kernels.
nlohmann::json summarise(const std::vector<Pass>& passes, int steps);

// The greatest common divisor of the differences between successive releases: the timer's step (0 when they all tie).
uint64_t clock_granularity_ns(const std::vector<Entry>& entries);

const char* pass_kind_name(int kind);  // src/cuda/sequence.cpp's PassKind
// "void vavilov::cuda::(anonymous namespace)::gemv_kernel<4>(Args)" → "gemv_kernel<4>" (our namespaces dropped); the
// kind drops the template
// arguments ("gemv_kernel").
std::string short_kernel_name(const std::string& demangled);
std::string kernel_kind(const std::string& name);

}  // namespace vavilov::cuda::kernel_trace
