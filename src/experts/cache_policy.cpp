#include "experts/cache_policy.h"

#include <algorithm>

#include "core/error.h"

namespace vavilov::experts {

CacheState empty_cache(int64_t keys, int slots) {
  CacheState s;
  s.score.assign(size_t(keys), 0.0);
  s.slot_of.assign(size_t(keys), -1);
  s.key_of_slot.assign(size_t(slots), -1);
  return s;
}

namespace {

// Keys not held with a positive score, best first, at most `limit`.
std::vector<int64_t> candidates(const CacheState& s, int limit) {
  std::vector<int64_t> keys;
  for (size_t k = 0; k < s.score.size(); ++k)
    if (s.slot_of[k] < 0 && s.score[k] > 0) keys.push_back(int64_t(k));
  const auto better = [&](int64_t a, int64_t b) {
    return s.score[size_t(a)] != s.score[size_t(b)] ? s.score[size_t(a)] > s.score[size_t(b)] : a < b;
  };
  const size_t n = std::min(keys.size(), size_t(std::max(limit, 0)));
  std::partial_sort(keys.begin(), keys.begin() + std::ptrdiff_t(n), keys.end(), better);
  keys.resize(n);
  return keys;
}

// Slots in the order they are given up: empty ones, then the held keys from the lowest score.
std::vector<int> victims(const CacheState& s) {
  std::vector<int> slots(s.key_of_slot.size());
  for (size_t i = 0; i < slots.size(); ++i) slots[i] = int(i);
  const auto score = [&](int slot) { return s.score[size_t(s.key_of_slot[size_t(slot)])]; };
  std::stable_sort(slots.begin(), slots.end(), [&](int a, int b) {
    const int64_t ka = s.key_of_slot[size_t(a)], kb = s.key_of_slot[size_t(b)];
    if ((ka < 0) != (kb < 0)) return ka < 0;
    if (ka < 0) return false;
    return score(a) != score(b) ? score(a) < score(b) : ka > kb;
  });
  return slots;
}

}  // namespace

std::vector<CacheMove> plan_round(CacheState& s, std::span<const uint32_t> uses, const CachePolicy& policy) {
  check(uses.size() == s.score.size(), "expert cache: {} use counts for {} experts", uses.size(), s.score.size());
  for (size_t k = 0; k < uses.size(); ++k) s.score[k] = policy.decay * s.score[k] + double(uses[k]);
  std::vector<CacheMove> moves;
  const std::vector<int64_t> wanted = candidates(s, policy.max_moves);
  const std::vector<int> order = victims(s);
  size_t next = 0;
  for (int64_t key : wanted) {
    if (next == order.size()) break;
    const int slot = order[next];
    const int64_t held = s.key_of_slot[size_t(slot)];
    if (held >= 0 && !(s.score[size_t(key)] > s.score[size_t(held)])) break;
    ++next;
    moves.push_back({slot, held, key});
  }
  for (const CacheMove& m : moves) {
    if (m.evicted >= 0) s.slot_of[size_t(m.evicted)] = -1;
    s.slot_of[size_t(m.promoted)] = m.slot;
    s.key_of_slot[size_t(m.slot)] = m.promoted;
  }
  return moves;
}

}  // namespace vavilov::experts
