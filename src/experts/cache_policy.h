#pragma once
// Which routed experts a bounded device cache holds: pure host logic, run between decode steps (src/cuda/expert_cache.*
// applies its moves). An expert is a key (layer · experts_per_layer + expert); the cache has a fixed number of slots,
// each holding one key, so the device bytes never exceed slots · slot size.
#include <cstdint>
#include <span>
#include <vector>

namespace vavilov::experts {

struct CachePolicy {
  double decay = 0.75;  // each round: score = decay · score + uses since the last round
  int max_moves = 128;  // promotions per round (bounds the bytes copied beside one step: 338 MB at Flash-Next's Q4)
};

struct CacheState {
  std::vector<double> score;         // per key
  std::vector<int> slot_of;          // per key: its slot, or -1 when only host memory holds it
  std::vector<int64_t> key_of_slot;  // per slot: its key, or -1 when empty
};

CacheState empty_cache(int64_t keys, int slots);

struct CacheMove {
  int slot = 0;
  int64_t evicted = -1;  // the key the slot held (-1: it was empty)
  int64_t promoted = 0;  // the key it will hold
};

// Ages the scores by `uses` (one count per key), then picks the round's moves: the highest-scoring keys not held
// (equal scores: the lower key first; a score of 0 never enters) go to the empty slots first, then each replaces the
// lowest-scoring key held (equal scores: the higher key leaves first) while it scores strictly more. At most
// policy.max_moves moves; no slot appears twice. The state's slots are updated as if the moves were done.
std::vector<CacheMove> plan_round(CacheState& state, std::span<const uint32_t> uses, const CachePolicy& policy);

}  // namespace vavilov::experts
