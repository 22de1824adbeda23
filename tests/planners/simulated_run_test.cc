// SimulatedRun and effective sequence, on hand-made cases whose timings are worked out by hand:
// the occupancy profile, demand fetches, a dirty eviction making the next fetch wait for its
// write-back, policies that break the rules refused, activation footprints per policy,
// optimizer placement and overlap reordering.
#include "planners/simulated_run.h"

#include <gtest/gtest.h>

#include "planners/effective.h"
#include "planners/schedule.h"
#include "test_support.h"

namespace tiermem::planners {
namespace {

using testing::StatusIs;
constexpr Bytes kMB = 1000000;  // 1 ms per MB at the test machine's 1 GB/s

TEST(OccupancyProfileTest, AllocWaitsForFreesAndNeverExceedsTheCapacity) {
  OccupancyProfile p(100);
  auto a = p.Alloc(60, 0);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*a, 0u);
  ASSERT_TRUE(p.Free(60, 50).ok());  // freed at t=50 (e.g. when a write-back ends)
  a = p.Alloc(50, 10);               // 60 + 50 > 100 until t=50
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*a, 50u);
  EXPECT_EQ(p.peak(), 60u);
  a = p.Alloc(30, 20);  // fits from t=20 on? occupancy 60 until 50, then 50: 90 and 80: yes
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*a, 20u);
  EXPECT_EQ(p.peak(), 90u);
  EXPECT_THAT(p.Alloc(21, 20).status(), StatusIs(StatusCode::kInternal, "never fit"));
  p.Advance(60);
  a = p.Alloc(20, 60);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*a, 60u);
  EXPECT_EQ(p.peak(), 100u);
}

// LRU, clean first: what the simulator's lru policy does.
class Lru : public Policy {
 public:
  Status Before(SimulatedRun& ex, size_t i) override {
    return EnsureMoment(ex, i, [&ex](ChunkId c, TierKind) {
      return std::make_tuple(ex.Chunk(c).dirty, ex.Chunk(c).last_use, c);
    });
  }
};

Trace TwoChunks(AccessMode second) {
  TraceBuilder b;
  const uint16_t k = b.KindIndex("param");
  b.DeclareChunk(0, TraceChunk{kMB, Category::kParam, 0, k});
  b.DeclareChunk(1, TraceChunk{kMB, Category::kParam, 1, k});
  b.BeginIteration();
  const std::pair<ChunkId, AccessMode> acc[3] = {
      {0, AccessMode::kRead}, {1, second}, {0, AccessMode::kRead}};
  for (int m = 0; m < 3; ++m) {
    b.BeginMoment("m" + std::to_string(m), MomentKind::kOther);
    b.Access(acc[m].first, acc[m].second, TierKind::kDevice);
    b.EndMoment(1000000);
  }
  return *b.Finish();
}

StatusOr<IterationStats> RunOnce(const Trace& t, const MachineModel& m, Policy& p) {
  Placement pl;
  pl.home.assign(t.chunks.size(), TierKind::kHost);
  auto eff = BuildEffective(t, t.iterations[0], pl, m);
  if (!eff.ok()) return eff.status();
  auto ex = SimulatedRun::Create(&t, &m, pl.home);
  if (!ex.ok()) return ex.status();
  return (*ex)->Run(*eff, p, 0);
}

TEST(SimulatedRunTest, DemandFetchesStallForTheirWholeCopy) {
  const Trace t = TwoChunks(AccessMode::kRead);
  const MachineModel m = testing::TestMachine(kMB, 10 * kMB);
  Lru lru;
  auto st = RunOnce(t, m, lru);
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  // Each moment: 1 ms copy in (the only chunk slot is taken), then 1 ms compute.
  EXPECT_EQ(st->iteration_ns, 6000000u);
  EXPECT_EQ(st->compute_ns, 3000000u);
  EXPECT_EQ(st->stall_ns, 3000000u);
  EXPECT_EQ(st->stall_by_cause[static_cast<int>(StallCause::kFetch)], 3000000u);
  EXPECT_EQ(st->DeviceInBytes(), 3 * kMB);
  EXPECT_EQ(st->bytes[0][1], 0u);
  EXPECT_EQ(st->evictions, 2u);
  EXPECT_EQ(st->writebacks, 0u);
}

TEST(SimulatedRunTest, ADirtyVictimsWriteBackDelaysTheNextFetch) {
  const Trace t = TwoChunks(AccessMode::kReadWrite);
  const MachineModel m = testing::TestMachine(kMB, 10 * kMB);
  Lru lru;
  auto st = RunOnce(t, m, lru);
  ASSERT_TRUE(st.ok()) << st.status().ToString();
  // m2 at 4 ms: chunk 1 is written back 4-5 ms, only then chunk 0's region exists: 5-6 ms copy.
  EXPECT_EQ(st->iteration_ns, 7000000u);
  EXPECT_EQ(st->stall_ns, 4000000u);
  EXPECT_EQ(st->stall_by_cause[static_cast<int>(StallCause::kRoom)], 2000000u);
  EXPECT_EQ(st->bytes[0][1], kMB);
  EXPECT_EQ(st->writebacks, 1u);
}

class Greedy : public Policy {  // fetches without making room
 public:
  Status Before(SimulatedRun& ex, size_t i) override {
    const EffIteration& it = ex.iteration();
    for (const EffAccess* a = it.begin(i); a != it.end(i); ++a) {
      TIERMEM_RETURN_IF_ERROR(ex.Fetch(a->chunk, a->tier, true));
    }
    return OkStatus();
  }
};
class Lazy : public Policy {  // fetches nothing
 public:
  Status Before(SimulatedRun&, size_t) override { return OkStatus(); }
};

TEST(SimulatedRunTest, RefusesPoliciesThatBreakTheBudgetOrSkipAFetch) {
  const Trace t = TwoChunks(AccessMode::kRead);
  const MachineModel m = testing::TestMachine(kMB, 10 * kMB);
  Greedy greedy;
  EXPECT_THAT(RunOnce(t, m, greedy).status(), StatusIs(StatusCode::kInternal, "did not make room"));
  Lazy lazy;
  EXPECT_THAT(RunOnce(t, m, lazy).status(), StatusIs(StatusCode::kInternal, "needs chunk 0"));
}

TEST(SimulatedRunTest, HomesThatDoNotFitAreResourceExhausted) {
  const Trace t = TwoChunks(AccessMode::kRead);
  const MachineModel m = testing::TestMachine(kMB, kMB);
  EXPECT_THAT(SimulatedRun::Create(&t, &m, {TierKind::kHost, TierKind::kHost}).status(),
              StatusIs(StatusCode::kResourceExhausted, "host tier: the chunks homed there need"));
}

// fwd:0 (saves 100), fwd:1 (saves 40), other, bwd:1, bwd:0; temporaries 10 each.
Trace Spans() {
  TraceBuilder b;
  b.DeclareChunk(0, TraceChunk{kMB, Category::kParam, 0, b.KindIndex("param")});
  b.BeginIteration();
  auto moment = [&](const char* l, MomentKind k, uint32_t u, Bytes saved, Bytes live) {
    b.BeginMoment(l, k, u);
    b.Access(0, AccessMode::kRead, TierKind::kDevice);
    b.SetSavedBytes(saved);
    b.SetActivationBytes(live);
    b.EndMoment(1000);
  };
  moment("fwd:0", MomentKind::kPreForward, 0, 100, 110);
  moment("fwd:1", MomentKind::kPreForward, 1, 40, 150);
  moment("x", MomentKind::kOther, kNoUnit, 0, 150);
  moment("bwd:1", MomentKind::kPreBackward, 1, 0, 150);
  moment("bwd:0", MomentKind::kPreBackward, 0, 0, 110);
  return *b.Finish();
}

TEST(EffectiveTest, ActivationFootprintsPerPolicy) {
  const Trace t = Spans();
  const MachineModel m = testing::TestMachine(kMB, kMB);
  Placement p;
  p.home = {TierKind::kHost};
  auto keep = BuildEffective(t, t.iterations[0], p, m);
  ASSERT_TRUE(keep.ok());
  EXPECT_EQ(keep->dev_extra, (std::vector<Bytes>{110, 150, 150, 150, 110}));
  EXPECT_EQ(keep->moments[2].temp_bytes, 10u);
  p.units[0] = {ActivationPolicy::kOffload, 1};  // fetched back at bwd:0 - 1 = moment 3
  p.units[1] = {ActivationPolicy::kRecompute, 1};
  auto mixed = BuildEffective(t, t.iterations[0], p, m);
  ASSERT_TRUE(mixed.ok());
  EXPECT_EQ(mixed->dev_extra, (std::vector<Bytes>{110, 50, 10, 150, 110}));
  EXPECT_EQ(mixed->host_extra, (std::vector<Bytes>{100, 100, 100, 100, 0}));
  EXPECT_EQ(mixed->moments[3].compute_ns, 2000u);  // bwd:1 recomputes fwd:1
  EXPECT_EQ(mixed->moments[3].recompute_ns, 1000u);
  ASSERT_EQ(mixed->spans.size(), 2u);
  EXPECT_EQ(mixed->spans[1].prefetch_at, 3u);
}

TEST(EffectiveTest, OptimizerPlacementRetimesAndOverlapReorders) {
  const Trace t = testing::RandomTrace(3, {.training = true, .units = 3});
  const MachineModel m = testing::TestMachine(64 * kMB, 64 * kMB);
  const TraceIteration& it = t.iterations[0];
  Placement p;
  p.home.assign(t.chunks.size(), TierKind::kHost);
  p.groups.resize(t.NumGroups());
  p.groups[0] = {TierKind::kDevice, false};
  for (size_t g = 1; g < p.groups.size(); ++g) p.groups[g] = {TierKind::kHost, true};
  auto eff = BuildEffective(t, it, p, m);
  ASSERT_TRUE(eff.ok());
  ASSERT_EQ(eff->size(), it.moments.size());
  std::vector<int64_t> last_touch(t.chunks.size(), -1);
  for (size_t i = 0; i < eff->size(); ++i) {
    const EffMoment& em = eff->moments[i];
    if (em.kind == MomentKind::kOptimizerStep) {
      const Moment& raw = it.moments[em.trace_moment];
      if (em.group == 0) {
        EXPECT_FALSE(em.async);
        EXPECT_EQ(eff->begin(i)->tier, TierKind::kDevice);
        EXPECT_EQ(em.compute_ns, (raw.work_elems + 9) / 10);  // 1e10 elements/s, rounded up
      } else {
        EXPECT_TRUE(em.async);
        EXPECT_EQ(em.compute_ns, raw.compute_ns);
        // Right after the last moment touching its chunks.
        int64_t trig = -1;
        for (const EffAccess* a = eff->begin(i); a != eff->end(i); ++a) {
          trig = std::max(trig, last_touch[a->chunk]);
        }
        EXPECT_GE(static_cast<int64_t>(i), trig + 1);
        EXPECT_TRUE(i == 0 || trig == static_cast<int64_t>(i) - 1 || eff->moments[i - 1].async);
      }
    }
    for (const EffAccess* a = eff->begin(i); a != eff->end(i); ++a) {
      last_touch[a->chunk] = static_cast<int64_t>(i);
    }
  }
}

}  // namespace
}  // namespace tiermem::planners
