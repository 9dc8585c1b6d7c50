// The expert cache's policy (src/experts/cache_policy.*): which experts a bounded device cache holds, round by round.
#include <gtest/gtest.h>

#include <random>
#include <set>
#include <vector>

#include "experts/cache_policy.h"

namespace vavilov::experts {
namespace {

// Every held key is held once, slot_of and key_of_slot agree, and nothing else is marked held.
void expect_consistent(const CacheState& s) {
  std::set<int64_t> held;
  for (size_t slot = 0; slot < s.key_of_slot.size(); ++slot) {
    const int64_t key = s.key_of_slot[slot];
    if (key < 0) continue;
    EXPECT_TRUE(held.insert(key).second) << "key " << key << " held twice";
    EXPECT_EQ(s.slot_of[size_t(key)], int(slot));
  }
  for (size_t key = 0; key < s.slot_of.size(); ++key) {
    if (s.slot_of[key] >= 0) {
      EXPECT_TRUE(held.count(int64_t(key))) << "key " << key << " marked held";
    }
  }
}

TEST(ExpertCachePolicy, FillsEmptySlotsWithTheMostUsedFirstLowerKeyOnTies) {
  CacheState s = empty_cache(6, 3);
  const std::vector<uint32_t> uses = {1, 5, 0, 5, 2, 0};
  const std::vector<CacheMove> moves = plan_round(s, uses, {});
  ASSERT_EQ(moves.size(), 3u);
  EXPECT_EQ(moves[0].promoted, 1);  // 5 uses, the lower key of the tie
  EXPECT_EQ(moves[1].promoted, 3);
  EXPECT_EQ(moves[2].promoted, 4);
  for (const CacheMove& m : moves) EXPECT_EQ(m.evicted, -1);
  EXPECT_EQ(s.slot_of[1], moves[0].slot);
  expect_consistent(s);
}

TEST(ExpertCachePolicy, NeverPromotesUnusedExperts) {
  CacheState s = empty_cache(4, 4);
  EXPECT_TRUE(plan_round(s, std::vector<uint32_t>{0, 0, 0, 0}, {}).empty());
  const std::vector<CacheMove> moves = plan_round(s, std::vector<uint32_t>{0, 3, 0, 0}, {});
  ASSERT_EQ(moves.size(), 1u);
  EXPECT_EQ(moves[0].promoted, 1);
}

TEST(ExpertCachePolicy, EvictsTheLowestScoreFirstHigherKeyOnTiesAndOnlyForAStrictlyHigherScore) {
  CachePolicy policy;
  policy.decay = 0.5;
  CacheState s = empty_cache(6, 3);
  plan_round(s, std::vector<uint32_t>{4, 4, 8, 0, 0, 0}, policy);  // holds 0, 1, 2 (scores 4, 4, 8)
  // Scores now 2, 2, 4 (held) and 3, 2, 1 (not held): 3 replaces the tie 0/1 at the higher key (1); 4 ties with 0
  // (2 vs 2) and does not enter; 5 scores less.
  const std::vector<CacheMove> moves = plan_round(s, std::vector<uint32_t>{0, 0, 0, 3, 2, 1}, policy);
  ASSERT_EQ(moves.size(), 1u);
  EXPECT_EQ(moves[0].promoted, 3);
  EXPECT_EQ(moves[0].evicted, 1);
  EXPECT_EQ(s.slot_of[1], -1);
  EXPECT_EQ(s.slot_of[3], moves[0].slot);
  EXPECT_DOUBLE_EQ(s.score[2], 4.0);  // aged: 0.5 · 8
  EXPECT_DOUBLE_EQ(s.score[3], 3.0);
  expect_consistent(s);
}

TEST(ExpertCachePolicy, AgedScoresLetANewFavouriteIn) {
  CachePolicy policy;
  policy.decay = 0.5;
  CacheState s = empty_cache(2, 1);
  plan_round(s, std::vector<uint32_t>{10, 0}, policy);
  EXPECT_EQ(s.key_of_slot[0], 0);
  EXPECT_TRUE(plan_round(s, std::vector<uint32_t>{0, 2}, policy).empty());                  // scores 5 and 2
  const std::vector<CacheMove> moves = plan_round(s, std::vector<uint32_t>{0, 2}, policy);  // 2.5 and 3
  ASSERT_EQ(moves.size(), 1u);
  EXPECT_EQ(moves[0].promoted, 1);
  EXPECT_EQ(moves[0].evicted, 0);
  EXPECT_EQ(s.key_of_slot[0], 1);
}

TEST(ExpertCachePolicy, BudgetNeverExceededAndMovesBoundedOverRandomRounds) {
  std::mt19937 rng(7);
  for (int slots : {0, 1, 5, 40}) {
    CachePolicy policy;
    policy.max_moves = 7;
    CacheState s = empty_cache(120, slots);
    for (int round = 0; round < 200; ++round) {
      std::vector<uint32_t> uses(120);
      const int picks = int(rng() % 50);
      for (int i = 0; i < picks; ++i) ++uses[rng() % (round % 2 ? 120 : 15)];  // alternate hot sets
      const std::vector<CacheMove> moves = plan_round(s, uses, policy);
      EXPECT_LE(int(moves.size()), policy.max_moves);
      std::set<int> moved;
      for (const CacheMove& m : moves) {
        EXPECT_TRUE(moved.insert(m.slot).second) << "slot " << m.slot << " moved twice in a round";
        EXPECT_GE(m.slot, 0);
        EXPECT_LT(m.slot, slots);
      }
      EXPECT_EQ(int(s.key_of_slot.size()), slots);
      expect_consistent(s);
    }
  }
}

TEST(ExpertCachePolicy, RejectsUseCountsOfAnotherSize) {
  CacheState s = empty_cache(4, 1);
  EXPECT_THROW(plan_round(s, std::vector<uint32_t>{1, 2}, {}), std::exception);
}

}  // namespace
}  // namespace vavilov::experts
