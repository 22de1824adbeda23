#include "layout/eviction_rank.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

namespace tiermem::chunks {
namespace {

EvictionCandidate Followed(ChunkId id, uint64_t next_use, bool dirty) {
  return EvictionCandidate{id, 4096, dirty, /*last_use=*/100 - id, next_use, true};
}

EvictionCandidate Unordered(ChunkId id, uint64_t last_use, bool dirty) {
  return EvictionCandidate{id, 4096, dirty, last_use, kNeverUsed, false};
}

// Sorts by rank (stable: equal ranks keep their order) and returns the chunk ids.
std::vector<ChunkId> ByRank(std::vector<EvictionCandidate> cs) {
  std::stable_sort(cs.begin(), cs.end(), [](const auto& a, const auto& b) {
    return RankForEviction(a) < RankForEviction(b);
  });
  std::vector<ChunkId> ids;
  for (const auto& c : cs) ids.push_back(c.chunk);
  return ids;
}

// Following a recorded order: never used again (clean, then dirty), then clean before dirty,
// then the farthest next use; the last use plays no part.
TEST(EvictionRank, FollowingTheOrderNeverUsedThenCleanThenFarthest) {
  const std::vector<EvictionCandidate> cs = {
      Followed(0, 5, false),          Followed(1, 50, false), Followed(2, 70, true),
      Followed(3, kNeverUsed, true),  Followed(4, 90, true),  Followed(5, kNeverUsed, false),
      Followed(6, 20, false),
  };
  EXPECT_EQ(ByRank(cs), (std::vector<ChunkId>{5, 3, 1, 6, 0, 4, 2}));
}

// Without an order: the least recently used first, clean before dirty; next_use is ignored.
TEST(EvictionRank, WithoutAnOrderLeastRecentlyUsedCleanFirst) {
  std::vector<EvictionCandidate> cs = {
      Unordered(0, 30, false), Unordered(1, 10, true), Unordered(2, 20, false),
      Unordered(3, 5, true),   Unordered(4, 40, false),
  };
  cs[2].next_use = 1;  // not followed: meaningless
  EXPECT_EQ(ByRank(cs), (std::vector<ChunkId>{2, 0, 4, 3, 1}));
}

// Equal facts rank equal, whatever the chunk and its size (callers take the first).
TEST(EvictionRank, EqualFactsRankEqual) {
  EvictionCandidate a = Followed(1, 7, true), b = Followed(9, 7, true);
  b.bytes = 1;
  b.last_use = 0;
  EXPECT_EQ(RankForEviction(a), RankForEviction(b));
  EXPECT_EQ(RankForEviction(Unordered(1, 3, false)), RankForEviction(Unordered(2, 3, false)));
}

}  // namespace
}  // namespace tiermem::chunks
