#pragma once
// Prefix cache over the hybrid state: full SequenceState copies (KV, indexer keys, GDN, PLE, MTP) taken at prompt
// chunk boundaries, keyed by the tokens before them, in an LRU under a byte budget. A recurrent state cannot be
// rewound, so only exact chunk-boundary snapshots are reusable: a new prompt starts from the longest cached prefix.
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "engine/state.h"

namespace vavilov::server {

// Bytes a state holds (its vectors' sizes), for the budget.
size_t state_bytes(const SequenceState& state);

class PrefixCache {
 public:
  struct Entry {
    std::vector<int32_t> tokens;
    SequenceState state;
    size_t bytes = 0;
  };
  struct Stats {
    int64_t hits = 0, misses = 0, entries = 0;
    size_t bytes = 0, budget = 0;
  };

  explicit PrefixCache(size_t budget_bytes) : budget_(budget_bytes) {}

  // The entry with the longest token prefix of `prompt` that is shorter than the prompt (a decoder must still run
  // at least one prompt token), or null. Counts a hit or a miss.
  std::shared_ptr<const Entry> lookup(std::span<const int32_t> prompt);
  // Stores a copy of `state` for `tokens` (its first state.position prompt tokens) unless it is already cached or
  // larger than the whole budget; evicts least recently used entries to stay within it.
  void insert(std::span<const int32_t> tokens, const SequenceState& state);
  Stats stats() const;

 private:
  mutable std::mutex mutex_;
  std::list<std::shared_ptr<const Entry>> entries_;  // most recently used first
  size_t budget_, bytes_ = 0;
  int64_t hits_ = 0, misses_ = 0;
};

}  // namespace vavilov::server
