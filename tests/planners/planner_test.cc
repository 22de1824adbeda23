// Planner: errors naming what is needed, plan contents (placement decisions follow the
// modelled costs), prefetch timing, NVMe placement. Divergence: divergence_test.cc.
#include "planners/planner.h"

#include <gtest/gtest.h>

#include "planners/ranking.h"
#include "planners/simulator.h"
#include "test_support.h"

namespace tiermem::planners {
namespace {

using testing::StatusIs;
constexpr Bytes kMB = 1000000;

TEST(PlannerTest, BudgetsTooSmallNameWhatIsNeeded) {
  const Trace t = testing::ReadOnlyTrace(3, 4 * kMB, {{{0, 1}, {2}}});
  EXPECT_THAT(MakePlan(t, testing::TestMachine(3 * kMB, 100 * kMB)).status(),
              StatusIs(StatusCode::kResourceExhausted,
                       "device budget 3000000 bytes (2.86 MiB) is smaller than chunk 0"));
  EXPECT_THAT(MakePlan(t, testing::TestMachine(6 * kMB, 100 * kMB)).status(),
              StatusIs(StatusCode::kResourceExhausted,
                       "too small for moment 0 (m0) of iteration 0: it needs 8000000 bytes"));
  EXPECT_THAT(MakePlan(t, testing::TestMachine(8 * kMB, 10 * kMB)).status(),
              StatusIs(StatusCode::kResourceExhausted, "homes: the chunks need 12000000 bytes"));
  EXPECT_TRUE(MakePlan(t, testing::TestMachine(8 * kMB, 10 * kMB, 4 * kMB)).ok());
  EXPECT_THAT(MakePlan(t, testing::TestMachine(8 * kMB, 100 * kMB), {.iteration = 1}).status(),
              StatusIs(StatusCode::kInvalidArgument, "no iteration 1"));
  Trace bad = t;
  bad.iterations[0].accesses[0].chunk = 7;
  EXPECT_THAT(MakePlan(bad, testing::TestMachine(8 * kMB, 100 * kMB)).status(),
              StatusIs(StatusCode::kInvalidArgument, "unknown chunk 7"));
  // The simulator reports the same for the baselines (which keep activations) per policy.
  auto r = Simulate(t, testing::TestMachine(6 * kMB, 100 * kMB), PolicyKind::kLru);
  ASSERT_TRUE(r.ok());
  EXPECT_THAT(r->status, StatusIs(StatusCode::kResourceExhausted, "too small for moment 0"));
}

TEST(PlannerTest, PrefetchesAreIssuedEarlyEnoughAndEvictionsFollowBelady) {
  // Chunks 0..5 read forward then backward (as params are), room for 3: a copy (1 ms) fits
  // under a moment's compute (2 ms). Belady evicts the chunk used longest ago in the forward
  // (its next use is the farthest), right after its last use, so every fetch gets a moment
  // of lead: no stall in the steady state, and the bytes of the Belady optimum.
  std::vector<std::vector<ChunkId>> it;
  for (ChunkId c = 0; c < 6; ++c) it.push_back({c});
  for (ChunkId c = 6; c-- > 0;) it.push_back({c});
  const Trace t = testing::ReadOnlyTrace(6, kMB, {it, it, it}, 2000000);
  const MachineModel m = testing::TestMachine(3 * kMB, 10 * kMB);
  auto plan = MakePlan(t, m);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  size_t prefetches = 0;
  for (size_t i = 0; i < plan->moments.size(); ++i) {
    const PlannedMoment& pm = plan->moments[i];
    for (uint32_t k = 0; k < pm.num_actions; ++k) {
      const PlanAction& a = plan->actions[pm.first_action + k];
      if (a.kind != ActionKind::kPrefetch) continue;
      ++prefetches;
      if (i > 0) {
        EXPECT_GT(a.need_moment, i) << "a prefetch at its own moment";
      }
    }
  }
  EXPECT_GT(prefetches, 0u);
  EXPECT_EQ(plan->estimate.steady_stall_ns, 0u);
  auto sim = Simulate(t, m, PolicyKind::kPlanned);
  auto opt = Simulate(t, m, PolicyKind::kOpt);
  auto lru = Simulate(t, m, PolicyKind::kLru);
  ASSERT_TRUE(sim.ok() && opt.ok() && lru.ok());
  EXPECT_EQ(sim->total.DeviceInBytes(), opt->total.DeviceInBytes());
  EXPECT_EQ(sim->total.stall_ns, 0u);
  // Per iteration Belady fetches 6 (3 in each direction), LRU the same 6 but synchronously.
  EXPECT_EQ(opt->total.DeviceInBytes(), 2 * 6 * kMB);
  EXPECT_EQ(lru->total.DeviceInBytes(), 2 * 6 * kMB);
  EXPECT_EQ(lru->total.stall_ns, 2 * 6 * 1000000u);
}

TEST(PlannerTest, OptimizerGoesToTheDeviceWhenLeftoverMemoryAllowsAndToTheCpuOtherwise) {
  const Trace t = testing::RandomTrace(5, {.iterations = 2, .training = true, .units = 3});
  const Bytes total = t.TotalChunkBytes();
  // A CPU step of a group (262144 elements) takes 26 ms at 1e7 elements/s: far longer than
  // the backward it could hide under; on the device it takes 26 us and, with room for all
  // optimizer state, moves nothing.
  MachineModel roomy_m = testing::TestMachine(2 * total, 2 * total);
  roomy_m.cpu_optim_elems_per_s = 1e7;
  auto roomy = MakePlan(t, roomy_m);
  ASSERT_TRUE(roomy.ok()) << roomy.status().ToString();
  for (const GroupPlan& g : roomy->groups) EXPECT_EQ(g.update_on, TierKind::kDevice) << g.group;
  // With a fast CPU whose steps hide under the backward, in-stream device steps cost more
  // than they save, and the planner says so.
  auto fast_cpu = MakePlan(t, testing::TestMachine(2 * total, 2 * total));
  ASSERT_TRUE(fast_cpu.ok());
  EXPECT_LE(fast_cpu->estimate.steady_iteration_ns, roomy->estimate.steady_iteration_ns);
  // Room for about the params and grads only: the optimizer state stays on the host.
  auto tight = MakePlan(t, testing::TestMachine(total * 45 / 100, 2 * total));
  ASSERT_TRUE(tight.ok()) << tight.status().ToString();
  size_t host = 0;
  for (const GroupPlan& g : tight->groups) host += g.update_on == TierKind::kHost;
  EXPECT_GT(host, 0u);
  // Without a device optimizer rate nothing moves to the device.
  MachineModel no_rate = testing::TestMachine(2 * total, 2 * total);
  no_rate.device_optim_elems_per_s = 0;
  auto kept = MakePlan(t, no_rate);
  ASSERT_TRUE(kept.ok());
  for (const GroupPlan& g : kept->groups) EXPECT_EQ(g.update_on, TierKind::kHost);
}

TEST(PlannerTest, NvmeHoldsTheLeastAccessedChunksOptimizerStateFirst) {
  const Trace t = testing::RandomTrace(7, {.iterations = 2, .training = true, .units = 3});
  const Bytes total = t.TotalChunkBytes();
  MachineModel m = testing::TestMachine(total / 2, total / 2 + HostWorkingSet(t), total);
  auto homes = PlaceHomes(t, m, HostWorkingSet(t));
  ASSERT_TRUE(homes.ok()) << homes.status().ToString();
  Bytes nvme = 0;
  for (ChunkId c = 0; c < t.chunks.size(); ++c) {
    if ((*homes)[c] != TierKind::kNvme) continue;
    nvme += t.chunks[c].bytes;
    EXPECT_EQ(t.chunks[c].category, Category::kOptimState) << c;
  }
  EXPECT_GE(nvme, total / 2);
  // Between chunks accessed as often, optimizer state goes first, then grads.
  {
    TraceBuilder b;
    b.DeclareChunk(0, TraceChunk{kMB, Category::kParam, 0, b.KindIndex("param")});
    b.DeclareChunk(1, TraceChunk{kMB, Category::kGrad, 0, b.KindIndex("grad")});
    b.DeclareChunk(2, TraceChunk{kMB, Category::kOptimState, 0, b.KindIndex("exp_avg")});
    b.BeginIteration();
    b.BeginMoment("opt:g0", MomentKind::kOptimizerStep);
    for (ChunkId c = 0; c < 3; ++c) b.Access(c, AccessMode::kReadWrite, TierKind::kHost);
    b.EndMoment(1000);
    const Trace tie = *b.Finish();
    auto h = PlaceHomes(tie, testing::TestMachine(kMB, 2 * kMB, 4 * kMB), 0);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    EXPECT_EQ(*h, (std::vector<TierKind>{TierKind::kHost, TierKind::kHost, TierKind::kNvme}));
    h = PlaceHomes(tie, testing::TestMachine(kMB, kMB, 4 * kMB), 0);
    ASSERT_TRUE(h.ok());
    EXPECT_EQ(*h, (std::vector<TierKind>{TierKind::kHost, TierKind::kNvme, TierKind::kNvme}));
  }
  // The engine's rule fills the host in id order instead.
  auto in_order = PlaceHomesInOrder(t, m, HostWorkingSet(t));
  ASSERT_TRUE(in_order.ok());
  EXPECT_EQ((*in_order)[0], TierKind::kHost);
  EXPECT_EQ(in_order->back(), TierKind::kNvme);
  auto plan = MakePlan(t, m);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  auto r = Simulate(t, m, PolicyKind::kPlanned);
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(r->status.ok()) << r->status.ToString();
  // Optimizer state read from NVMe (into DRAM, or straight to the device where the plan
  // updates the group there) and written back.
  EXPECT_GT(r->total.bytes[2][1] + r->total.bytes[2][0], 0u);
  EXPECT_GT(r->total.bytes[1][2] + r->total.bytes[0][2], 0u);
}

// The ranking against the baselines' bar (planners/ranking.h). With the byte objective bytes
// come first (an eviction-only plan keeps the Belady optimum), and of equal bytes the one whose
// stall reaches the bar wins even at a longer modelled time; with the time objective stall is
// one of the counted measures.
TEST(RankingTest, TheBytesObjectiveTakesTheStallThatReachesTheBarAmongEqualBytes) {
  BaselineBar bar;
  bar.Add({.device_in = 100, .nvme = 200, .stall_ns = 80, .iteration_ns = 1000});
  bar.Add({.device_in = 120, .nvme = 180, .stall_ns = 50, .iteration_ns = 1100});
  const RankedCandidate stalls{.steady = {.device_in = 100, .nvme = 180, .stall_ns = 60,
                                          .iteration_ns = 900},
                               .score_ns = 900,
                               .objective_bytes = 100};
  const RankedCandidate calm{.steady = {.device_in = 100, .nvme = 180, .stall_ns = 50,
                                        .iteration_ns = 950},
                             .score_ns = 950,
                             .objective_bytes = 100};
  EXPECT_TRUE(RanksBefore(calm, stalls, bar, PlanObjective::kBytes));
  EXPECT_FALSE(RanksBefore(stalls, calm, bar, PlanObjective::kBytes));
  RankedCandidate fewer = stalls;
  fewer.objective_bytes = 99;
  EXPECT_TRUE(RanksBefore(fewer, calm, bar, PlanObjective::kBytes));
  // Time: calm reaches all four measures, the other misses stall.
  EXPECT_EQ(bar.Reached(calm.steady, PlanObjective::kTime), 4);
  EXPECT_EQ(bar.Reached(stalls.steady, PlanObjective::kTime), 3);
  EXPECT_TRUE(RanksBefore(calm, stalls, bar, PlanObjective::kTime));
  // Bytes: stall and time count as reached, so both reach all four.
  EXPECT_EQ(bar.Reached(stalls.steady, PlanObjective::kBytes), 4);
}

// Below the bar the planner's own schedules come before a baseline's moves; at it, the
// objective decides.
TEST(RankingTest, BelowTheBarTheOwnScheduleComesFirst) {
  BaselineBar bar;
  bar.Add({.device_in = 100, .nvme = 100, .stall_ns = 10, .iteration_ns = 100});
  const RankedCandidate own{.steady = {.device_in = 100, .nvme = 100, .stall_ns = 20,
                                       .iteration_ns = 200},
                            .score_ns = 200,
                            .objective_bytes = 100};
  RankedCandidate moves = own;
  moves.score_ns = 150;
  moves.baseline_moves = true;
  EXPECT_TRUE(RanksBefore(own, moves, bar, PlanObjective::kTime));
  EXPECT_FALSE(RanksBefore(moves, own, bar, PlanObjective::kTime));
  BaselineBar none;  // no baseline: every candidate meets it; the faster wins
  EXPECT_TRUE(RanksBefore(moves, own, none, PlanObjective::kTime));
}

}  // namespace
}  // namespace tiermem::planners
