// AccessOrder (chunks/access_order.h): the recorded order of acquires, the following of it
// (match, resync within the window, divergence), which recording is adopted, NextUse and the
// cyclic order. Exact positions throughout: the engine's eviction and prefetch read them.
#include "chunks/access_order.h"

#include <gtest/gtest.h>

#include <vector>

namespace tiermem::chunks {
namespace {

using Follow = AccessOrder::Follow;
constexpr TierKind kDev = TierKind::kDevice;
constexpr TierKind kHost = TierKind::kHost;

// One iteration of acquires of `chunks` on the device, then BeginIteration.
void Iteration(AccessOrder& o, const std::vector<ChunkId>& chunks) {
  for (ChunkId c : chunks) o.Observe(c, kDev);
  o.BeginIteration();
}

TEST(AccessOrder, TheFirstIterationRecordsAndTheNextFollowsItEntryByEntry) {
  AccessOrder o;
  EXPECT_FALSE(o.following());
  EXPECT_EQ(o.Observe(5, kDev), Follow::kNotFollowing);
  EXPECT_EQ(o.Observe(6, kHost), Follow::kNotFollowing);
  EXPECT_EQ(o.Observe(7, kDev), Follow::kNotFollowing);
  EXPECT_EQ(o.NextUse(5), kNeverUsed);  // nothing followed yet
  o.BeginIteration();
  ASSERT_TRUE(o.following());
  EXPECT_EQ(o.position(), 0u);
  EXPECT_EQ(o.At(0), (AccessOrder::Entry{5, kDev}));
  EXPECT_EQ(o.At(1), (AccessOrder::Entry{6, kHost}));
  EXPECT_EQ(o.At(2), (AccessOrder::Entry{7, kDev}));
  EXPECT_EQ(o.Observe(5, kDev), Follow::kMatched);
  EXPECT_EQ(o.position(), 1u);
  EXPECT_EQ(o.Observe(6, kHost), Follow::kMatched);
  EXPECT_EQ(o.Observe(7, kDev), Follow::kMatched);
  EXPECT_EQ(o.position(), 3u);
  EXPECT_TRUE(o.following());
}

TEST(AccessOrder, TheTierIsPartOfTheEntry) {
  AccessOrder o;
  Iteration(o, {1, 2});
  // Chunk 1 on the host is not the expected (1, device), nor anywhere ahead: diverged.
  EXPECT_EQ(o.Observe(1, kHost), Follow::kDiverged);
  EXPECT_FALSE(o.following());
}

TEST(AccessOrder, AnAcquireFoundWithinTheWindowSkipsTheEntriesBefore) {
  std::vector<ChunkId> order;
  for (ChunkId c = 0; c < 100; ++c) order.push_back(c);
  AccessOrder o;
  Iteration(o, order);
  EXPECT_EQ(o.Observe(0, kDev), Follow::kMatched);
  EXPECT_EQ(o.Observe(3, kDev), Follow::kResynced);  // 1 and 2 did not come
  EXPECT_EQ(o.position(), 4u);
  EXPECT_TRUE(o.following());
  EXPECT_EQ(o.NextUse(2), kNeverUsed);  // skipped: not again this iteration
  EXPECT_EQ(o.NextUse(4), 4u);
  // The farthest entry the window reaches: position + kResyncWindow - 1.
  const ChunkId last = 4 + AccessOrder::kResyncWindow - 1;
  EXPECT_EQ(o.Observe(last, kDev), Follow::kResynced);
  EXPECT_EQ(o.position(), last + 1u);
  // One past it is too far: following ends for the rest of the iteration.
  const ChunkId too_far = last + 1 + AccessOrder::kResyncWindow;
  EXPECT_EQ(o.Observe(too_far, kDev), Follow::kDiverged);
  EXPECT_FALSE(o.following());
  EXPECT_EQ(o.NextUse(too_far + 1), kNeverUsed);
  EXPECT_EQ(o.Observe(too_far + 1, kDev), Follow::kNotFollowing);
}

TEST(AccessOrder, AnIterationThatOnlySkippedKeepsTheOldOrderOnceThenAdoptsTheNext) {
  AccessOrder o;
  Iteration(o, {1, 2, 3, 4});
  Iteration(o, {1, 3, 4});  // 2 ran early elsewhere: followed by skipping
  // The old order is kept: 2 is expected again.
  EXPECT_EQ(o.Observe(1, kDev), Follow::kMatched);
  EXPECT_EQ(o.Observe(2, kDev), Follow::kMatched);
  o.BeginIteration();  // the partial recording {1, 2} is adopted (nothing was skipped)
  EXPECT_EQ(o.NextUse(3), kNeverUsed);
  EXPECT_EQ(o.NextUse(2), 1u);
  // Keeping is one-shot: a second skipping iteration in a row is adopted.
  AccessOrder p;
  Iteration(p, {1, 2, 3, 4});
  Iteration(p, {1, 3, 4});  // kept the old order
  Iteration(p, {1, 3, 4});  // skipped again: adopted
  EXPECT_EQ(p.Observe(1, kDev), Follow::kMatched);
  EXPECT_EQ(p.Observe(3, kDev), Follow::kMatched);
  EXPECT_EQ(p.NextUse(4), 2u);
  EXPECT_EQ(p.NextUse(2), kNeverUsed);
}

TEST(AccessOrder, ADivergedIterationsRecordingIsAdoptedAndAnEmptyOneKeepsTheOrder) {
  AccessOrder o;
  Iteration(o, {1, 2, 3});
  Iteration(o, {9, 8});  // diverged at once
  EXPECT_EQ(o.At(0), (AccessOrder::Entry{9, kDev}));
  EXPECT_EQ(o.NextUse(8), 1u);
  EXPECT_EQ(o.NextUse(1), kNeverUsed);
  o.BeginIteration();  // nothing recorded: the order stays, followed from its start
  EXPECT_TRUE(o.following());
  EXPECT_EQ(o.position(), 0u);
  EXPECT_EQ(o.Observe(9, kDev), Follow::kMatched);
}

TEST(AccessOrder, NextUseIsTheChunksNextPositionAtOrAfterTheCurrentOne) {
  AccessOrder o;
  Iteration(o, {1, 2, 1, 3});
  EXPECT_EQ(o.NextUse(1), 0u);
  EXPECT_EQ(o.NextUse(2), 1u);
  EXPECT_EQ(o.NextUse(3), 3u);
  EXPECT_EQ(o.NextUse(7), kNeverUsed);  // never in the order
  o.Observe(1, kDev);
  EXPECT_EQ(o.NextUse(1), 2u);
  o.Observe(2, kDev);
  o.Observe(1, kDev);
  EXPECT_EQ(o.NextUse(1), kNeverUsed);  // not again this iteration
  EXPECT_EQ(o.NextUse(2), kNeverUsed);
  EXPECT_EQ(o.NextUse(3), 3u);
  EXPECT_EQ(o.WindowEnd(10), 4u);  // cut at the end of the order
  EXPECT_EQ(o.WindowEnd(1), 4u);
}

TEST(AccessOrder, ACyclicOrderRepeatsIntoTheNextIteration) {
  AccessOrder o;
  o.SetCyclic(true);
  Iteration(o, {1, 2, 1, 3});
  o.Observe(1, kDev);
  o.Observe(2, kDev);
  o.Observe(1, kDev);  // position 3
  // A chunk's next use after its last one is its first one in the next iteration.
  EXPECT_EQ(o.NextUse(1), 4u + 0u);
  EXPECT_EQ(o.NextUse(2), 4u + 1u);
  EXPECT_EQ(o.NextUse(3), 3u);
  EXPECT_EQ(o.NextUse(7), kNeverUsed);
  // The window runs past the end, into the next iteration's copy, and no farther.
  EXPECT_EQ(o.WindowEnd(3), 6u);
  EXPECT_EQ(o.WindowEnd(100), 8u);
  EXPECT_EQ(o.At(4), (AccessOrder::Entry{1, kDev}));
  EXPECT_EQ(o.At(5), (AccessOrder::Entry{2, kDev}));
  EXPECT_EQ(o.At(7), (AccessOrder::Entry{3, kDev}));
  // The same order without cyclic: no use after the last, window cut at the end.
  o.SetCyclic(false);
  EXPECT_EQ(o.NextUse(1), kNeverUsed);
  EXPECT_EQ(o.WindowEnd(3), 4u);
}

}  // namespace
}  // namespace tiermem::chunks
