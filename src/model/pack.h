#pragma once
// `vavilov pack`: a checkpoint (or another store) rewritten as a packed store (src/io/packed_store.h). The whole
// store is planned first, so the output's size is known and checked against the free space before anything is
// written; it is written under a temporary name and renamed into place only when complete.
#include <functional>
#include <string>
#include <vector>

#include "core/progress.h"
#include "io/disk_space.h"

namespace vavilov {

struct PackOptions {
  // One expert file per entry: 4, 3 or 2 bits (affine, group 64, quantized from the source) or 0, the source's
  // own float dtype unchanged.
  std::vector<int> expert_bits = {4};
  ProgressMode progress = ProgressMode::Auto;
  FreeSpaceFunction free_space = free_bytes;  // replaceable so tests can pretend a disk is full
  std::function<bool()> interrupted;          // polled between writes; true aborts (default: Ctrl-C/SIGTERM seen)
};

struct PackSummary {
  uint64_t bytes = 0;  // of the whole store
  double seconds = 0;
};

PackSummary pack_model(const std::string& model_path, const std::string& out, const PackOptions& options);

}  // namespace vavilov
