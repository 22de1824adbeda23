// Simulator: the measurement protocol, divergence handling (reactive fallback, re-plan, a
// prefetching plan again after a divergent iteration), expert classes (a routing other than
// the recorded one is no divergence). The canonical traces: canonical_test.cc.
#include "planners/simulator.h"

#include <gtest/gtest.h>

#include <array>

#include "planners/divergence.h"
#include "test_support.h"

namespace tiermem::planners {
namespace {

using testing::StatusIs;
constexpr Bytes kMB = 1000000;

TEST(SimulatorTest, ParsesPolicyNames) {
  for (int k = 0; k < kNumPolicies; ++k) {
    auto p = ParsePolicy(PolicyName(static_cast<PolicyKind>(k)));
    ASSERT_TRUE(p.ok());
    EXPECT_EQ(static_cast<int>(*p), k);
  }
  EXPECT_THAT(ParsePolicy("belady").status(), StatusIs(StatusCode::kInvalidArgument, "belady"));
}

TEST(SimulatorTest, AOneIterationTraceRepeatsAndTheFirstIterationIsAWarmup) {
  const Trace one = testing::ReadOnlyTrace(2, kMB, {{{0}, {1}}});
  auto r = Simulate(one, testing::TestMachine(2 * kMB, 10 * kMB), PolicyKind::kLru);
  ASSERT_TRUE(r.ok() && r->status.ok());
  EXPECT_EQ(r->measured_iterations, 1u);
  EXPECT_EQ(r->total.DeviceInBytes(), 0u);  // both chunks stay from the warm-up
  const Trace three = testing::ReadOnlyTrace(2, kMB, {{{0}}, {{1}}, {{0}}});
  r = Simulate(three, testing::TestMachine(kMB, 10 * kMB), PolicyKind::kLru);
  ASSERT_TRUE(r.ok() && r->status.ok());
  EXPECT_EQ(r->measured_iterations, 2u);
  EXPECT_EQ(r->total.DeviceInBytes(), 2 * kMB);
}

TEST(SimulatorTest, DivergenceFallsBackThenReplans) {
  // Iterations 0, 1 alike; 2 takes another path from moment 3 on; 3 repeats 2.
  std::vector<std::vector<ChunkId>> a, b;
  for (int k = 0; k < 10; ++k) a.push_back({static_cast<ChunkId>(k % 5)});
  b = a;
  for (int k = 3; k < 10; ++k) b[k] = {static_cast<ChunkId>((k * 3) % 5)};
  Trace t = testing::ReadOnlyTrace(5, kMB, {a, a, b, b}, 2000000);
  t.iterations[2].moments[3].label = "other";  // control flow: a different moment
  t.iterations[3].moments[3].label = "other";
  const MachineModel m = testing::TestMachine(3 * kMB, 10 * kMB);
  auto r = Simulate(t, m, PolicyKind::kPlanned);
  ASSERT_TRUE(r.ok() && r->status.ok()) << (r.ok() ? r->status.ToString() : r.status().ToString());
  EXPECT_EQ(r->divergences, 1u);  // iteration 2 only: 3 is planned from 2
  ASSERT_EQ(r->plans.size(), 3u);
  EXPECT_EQ(r->repairs, 0u);
  size_t prefetches = 0;
  for (const PlanAction& x : r->plans[2].actions) prefetches += x.kind == ActionKind::kPrefetch;
  EXPECT_GT(prefetches, 0u);  // the iteration after the divergence prefetches again
  // Reactive after the divergence: iteration 2 stalls; planned again, iteration 3 less.
  EXPECT_GT(r->per_iteration[1].stall_ns, r->per_iteration[2].stall_ns);
  // DeepSpeed discards its order on divergence too.
  auto ds = Simulate(t, m, PolicyKind::kDeepSpeed);
  ASSERT_TRUE(ds.ok() && ds->status.ok());
  EXPECT_EQ(ds->divergences, 1u);
}

// A unit with one expert set: dense chunks 0 and 1 (1 MB each, groups 0 and 1) and experts
// 2..5 of set 0, each its own group. Per iteration: fwd:a reads chunk 0 and the routed
// experts, fwd:b reads chunk 1, bwd:a reads chunk 0 and the same experts, then one CPU
// optimizer step per routed expert (read-write on the host, so its device copy is stale
// after it). `routing[k]`: the experts of iteration k. `marked`: the experts are marked as
// members of set 0 (else the trace is a dense, version-1 one).
Trace ExpertTrace(const std::vector<std::vector<ChunkId>>& routing, bool marked) {
  TraceBuilder b;
  const uint16_t k = b.KindIndex("param");
  for (ChunkId c = 0; c < 6; ++c) {
    b.DeclareChunk(c, TraceChunk{kMB, Category::kParam, c, k, TierKind::kHost});
    if (marked && c >= 2) b.MarkExpertSet(c, 0);
  }
  for (const std::vector<ChunkId>& experts : routing) {
    b.BeginIteration();
    b.BeginMoment("fwd:a", MomentKind::kPreForward, 0);
    b.Access(0, AccessMode::kRead, TierKind::kDevice);
    for (ChunkId e : experts) b.Access(e, AccessMode::kRead, TierKind::kDevice);
    b.EndMoment(2000000);
    b.BeginMoment("fwd:b", MomentKind::kPreForward, 1);
    b.Access(1, AccessMode::kRead, TierKind::kDevice);
    b.EndMoment(2000000);
    b.BeginMoment("bwd:a", MomentKind::kPreBackward, 0);
    b.Access(0, AccessMode::kRead, TierKind::kDevice);
    for (ChunkId e : experts) b.Access(e, AccessMode::kRead, TierKind::kDevice);
    b.EndMoment(2000000);
    for (ChunkId e : experts) {
      b.BeginMoment("opt:g" + std::to_string(e), MomentKind::kOptimizerStep);
      b.Access(e, AccessMode::kReadWrite, TierKind::kHost);
      b.SetWorkElems(1000);
      b.EndMoment(100000);
    }
  }
  auto t = b.Finish();
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return *t;
}

// The planner plans expert chunks as a class: every iteration routes to other experts than
// the one the plan was made from (the last, two of them), and none of that is a divergence
// or a repair — the executed plan binds the routed experts to its slots. Bytes are what the
// class policy implies, here also the Belady bound's: each measured iteration fetches its
// routed experts once (dense chunks 0 and 1 stay on the device, 4 MB of room): 1, 1 and 2 MB.
// The same trace without the marks diverges at every measured iteration.
TEST(SimulatorTest, ExpertClassesFollowAnyRoutingWithoutDivergence) {
  const std::vector<std::vector<ChunkId>> routing = {{2}, {3}, {4}, {5, 2}};
  const MachineModel m = testing::TestMachine(4 * kMB, 20 * kMB);
  SimOptions o;
  o.plan.place_optimizer = false;  // keep the steps on the host, as recorded
  o.plan.activation_policy = false;
  const Trace marked = ExpertTrace(routing, true);
  auto r = Simulate(marked, m, PolicyKind::kPlanned, o);
  ASSERT_TRUE(r.ok() && r->status.ok()) << (r.ok() ? r->status.ToString() : r.status().ToString());
  ASSERT_EQ(r->measured_iterations, 3u);
  EXPECT_EQ(r->divergences, 0u);
  EXPECT_EQ(r->repairs, 0u);
  ASSERT_EQ(r->per_iteration.size(), 3u);
  EXPECT_EQ(r->per_iteration[0].DeviceInBytes(), 1 * kMB);
  EXPECT_EQ(r->per_iteration[1].DeviceInBytes(), 1 * kMB);
  EXPECT_EQ(r->per_iteration[2].DeviceInBytes(), 2 * kMB);
  auto opt = Simulate(marked, m, PolicyKind::kOpt, o);
  ASSERT_TRUE(opt.ok() && opt->status.ok());
  EXPECT_EQ(opt->total.DeviceInBytes(), r->total.DeviceInBytes());
  // The plan of the last iteration was made from {4}: its member accesses name chunk 4, its
  // slot; the routed 5 and 2 are the class's.
  ASSERT_EQ(r->plans.size(), 3u);
  const Plan& last = r->plans[2];
  ASSERT_EQ(last.expert_class.size(), 6u);
  EXPECT_EQ(last.expert_class[0], kNoExpertSet);
  EXPECT_EQ(last.expert_class[4], 0u);
  // Checked offline, the routed iteration follows that plan; dense divergence still shows.
  EXPECT_FALSE(FindDivergence(last, marked, marked.iterations[3]).diverged());
  Trace other = marked;
  other.iterations[3].moments[1].label = "fwd:c";
  EXPECT_EQ(FindDivergence(last, other, other.iterations[3]).kind, DivergenceKind::kMoment);

  const Trace dense = ExpertTrace(routing, false);
  auto d = Simulate(dense, m, PolicyKind::kPlanned, o);
  ASSERT_TRUE(d.ok() && d->status.ok());
  EXPECT_EQ(d->divergences, 3u);
  EXPECT_TRUE(FindDivergence(d->plans[2], dense, dense.iterations[3]).diverged());
}

// The engine policy's room lookahead (EngineConfig::lookahead = room) against its depth one, in
// host mode: chunks 0-2 homed on the host, 3-5 on NVMe (PlaceHomesInOrder with the 1 MB working
// set kept free: 1 MB of host room for NVMe chunks), one moment each in the order 3 4 5 0 1 2,
// 1 ms of compute each, moment 2 writing chunk 5; 1 MB takes 2 ms to or from NVMe.
//   depth: every NVMe chunk is fetched at its own moment (the lookahead finds no room: the one
//   cached chunk is the pinned current one): m0 writes the dirty 5 home (2 ms) and reads 3
//   (2 ms), m1 and m2 read 4 and 5 — 8 ms of stall, 4 MB to and from NVMe per iteration.
//   room: the lookahead runs past the iteration's end. At m3 the chunk in the way (5, used
//   farthest) is dirty: it is written home in the background; at m4 it is clean and evicted,
//   and 3 is read for the next iteration once the write-back frees its room (the copy ends 1 ms
//   into it): the next iteration stalls 1 + 2 + 2 ms. The first measured iteration starts from the reactive warm-up (no
//   prefetch: 8 ms, the warm-up's dirty 5 written at m0, its own at m3: 5 MB); the second reads
//   3 that the first prefetched (4 MB: its own prefetch of 3 is past the run, unclaimed).
TEST(SimulatorTest, EngineRoomLookaheadPrefetchesAcrossTheIterationEndAndCleansDirtyChunks) {
  TraceBuilder b;
  const uint16_t kind = b.KindIndex("param");
  for (ChunkId c = 0; c < 6; ++c) b.DeclareChunk(c, TraceChunk{kMB, Category::kParam, c, kind});
  const ChunkId order[] = {3, 4, 5, 0, 1, 2};
  for (int it = 0; it < 3; ++it) {
    b.BeginIteration();
    for (int k = 0; k < 6; ++k) {
      b.BeginMoment("m" + std::to_string(k), MomentKind::kPreForward, k);
      b.Access(order[k], k == 2 ? AccessMode::kReadWrite : AccessMode::kRead, TierKind::kHost);
      b.EndMoment(1000000);
    }
  }
  auto t = b.Finish();
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  const MachineModel m = testing::TestMachine(0, 4 * kMB, 100 * kMB);
  SimOptions depth, room;
  room.engine_lookahead = EngineLookahead::kRoom;
  auto d = Simulate(*t, m, PolicyKind::kEngine, depth);
  auto r = Simulate(*t, m, PolicyKind::kEngine, room);
  ASSERT_TRUE(d.ok() && d->status.ok()) << (d.ok() ? d->status : d.status()).ToString();
  ASSERT_TRUE(r.ok() && r->status.ok()) << (r.ok() ? r->status : r.status()).ToString();
  ASSERT_EQ(d->homes, (std::vector<TierKind>{TierKind::kHost, TierKind::kHost, TierKind::kHost,
                                             TierKind::kNvme, TierKind::kNvme, TierKind::kNvme}));
  ASSERT_EQ(d->per_iteration.size(), 2u);
  ASSERT_EQ(r->per_iteration.size(), 2u);
  for (const IterationStats& s : d->per_iteration) {
    EXPECT_EQ(s.stall_ns, 8000000u);
    EXPECT_EQ(s.NvmeBytes(), 4 * kMB);
  }
  EXPECT_EQ(r->per_iteration[0].stall_ns, 8000000u);
  EXPECT_EQ(r->per_iteration[0].NvmeBytes(), 5 * kMB);
  EXPECT_EQ(r->per_iteration[1].stall_ns, 5000000u);
  EXPECT_EQ(r->per_iteration[1].NvmeBytes(), 4 * kMB);
  // m0 waits 1 ms for 3, whose copy waited for the room 5's write-back held: cause room.
  EXPECT_EQ(r->per_iteration[1].stall_by_cause[static_cast<int>(StallCause::kRoom)], 1000000u);
  EXPECT_EQ(r->per_iteration[1].stall_by_cause[static_cast<int>(StallCause::kFetch)], 4000000u);
  EXPECT_EQ(r->unclaimed[static_cast<int>(TierKind::kNvme)][static_cast<int>(TierKind::kHost)],
            kMB);
  EXPECT_EQ(ParseEngineLookahead("room").value(), EngineLookahead::kRoom);
  EXPECT_THAT(ParseEngineLookahead("wide").status(), StatusIs(StatusCode::kInvalidArgument, "wide"));
}

// Issue 43 §2, when no candidate meets the baselines' bar (no worse than each of them on
// every count): a random eviction-only trace with NVMe homes where the bar is out of reach.
// The plan must still not be beaten on every count by one baseline: ranking the candidates
// that miss the bar by how many counts reach it, the plan is the engine's moves (its counts
// exactly). Fails with the binary bar (the planner's own schedule came first below it: the
// engine and deepspeed then beat it on every count) and with ranking by dominance alone.
TEST(SimulatorTest, BelowTheBarNoBaselineBeatsThePlanOnEveryCount) {
  const Trace t =
      testing::RandomTrace(18, {.chunks = 8, .moments = 20, .iterations = 2, .uniform = false});
  const Bytes total = t.TotalChunkBytes();
  const MachineModel m =
      testing::TestMachine(total * 60 / 100, total * 70 / 100 + HostWorkingSet(t), 2 * total);
  auto rs = Compare(t, m);
  ASSERT_TRUE(rs.ok()) << rs.status().ToString();
  const SimResult& p = (*rs)[static_cast<int>(PolicyKind::kPlanned)];
  ASSERT_TRUE(p.status.ok()) << p.status.ToString();
  const auto counts = [](const SimResult& r) {
    return std::array<uint64_t, 4>{r.total.DeviceInBytes(), r.total.NvmeBytes(), r.total.stall_ns,
                                   r.total.iteration_ns};
  };
  for (PolicyKind k : {PolicyKind::kLru, PolicyKind::kPatrickStar, PolicyKind::kDeepSpeed,
                       PolicyKind::kEngine}) {
    const SimResult& b = (*rs)[static_cast<int>(k)];
    ASSERT_TRUE(b.status.ok()) << PolicyName(k);
    bool no_worse = true, better = false;
    for (size_t j = 0; j < 4; ++j) {
      no_worse = no_worse && counts(b)[j] <= counts(p)[j];
      better = better || counts(b)[j] < counts(p)[j];
    }
    EXPECT_FALSE(no_worse && better) << PolicyName(k) << " beats the plan on every count";
  }
  EXPECT_EQ(counts(p), counts((*rs)[static_cast<int>(PolicyKind::kEngine)]));
}

}  // namespace
}  // namespace tiermem::planners
