// Property tests over random traces with fixed seeds:
//   - no policy's simulated schedule ever exceeds a budget;
//   - for eviction-only problems (equal chunks read or overwritten on the device, the
//     device's room per moment fixed by its temporaries, the plan judged on bytes) the planned
//     bytes into the device equal the Belady optimum, which equals the true optimum found by
//     exhaustive search;
//   - the planned stall is at most every reactive policy's;
//   - planning and simulating are deterministic.
#include <gtest/gtest.h>

#include <map>

#include "planners/planner.h"
#include "planners/schedule.h"
#include "planners/simulator.h"
#include "test_support.h"

namespace tiermem::planners {
namespace {

constexpr Bytes kU = 1 << 20;

struct Access {
  ChunkId chunk;
  AccessMode mode;
};

// Eviction-only: `chunks` equal chunks, iterations of random moments reading or overwriting
// 1..3 of them on the device, random temporaries (so the room left for chunks varies).
Trace EvictionOnly(uint64_t seed, uint32_t chunks, uint32_t moments, uint32_t iterations,
                   bool identical, bool writes, bool temps) {
  std::mt19937_64 g(seed);
  TraceBuilder b;
  const uint16_t k = b.KindIndex("param");
  for (ChunkId c = 0; c < chunks; ++c) b.DeclareChunk(c, TraceChunk{kU, Category::kParam, c, k});
  std::vector<std::vector<std::vector<Access>>> its;
  std::vector<std::vector<Bytes>> tmp;
  for (uint32_t it = 0; it < iterations; ++it) {
    if (it > 0 && identical) {
      its.push_back(its[0]);
      tmp.push_back(tmp[0]);
      continue;
    }
    std::vector<std::vector<Access>> ms;
    std::vector<Bytes> ts;
    for (uint32_t m = 0; m < moments; ++m) {
      std::vector<Access> acc;
      const uint32_t n = 1 + static_cast<uint32_t>(g() % 3);
      while (acc.size() < n) {
        const ChunkId c = static_cast<ChunkId>(g() % chunks);
        bool dup = false;
        for (const Access& a : acc) dup |= a.chunk == c;
        if (dup) continue;
        AccessMode mode = AccessMode::kRead;
        if (writes) mode = static_cast<AccessMode>(g() % 3);
        acc.push_back({c, mode});
      }
      ms.push_back(acc);
      ts.push_back(temps ? kU * (g() % 2) : 0);  // 0 or one chunk's worth
    }
    its.push_back(ms);
    tmp.push_back(ts);
  }
  for (size_t it = 0; it < its.size(); ++it) {
    b.BeginIteration();
    for (size_t m = 0; m < its[it].size(); ++m) {
      b.BeginMoment("m" + std::to_string(m), MomentKind::kOther);
      for (const Access& a : its[it][m]) b.Access(a.chunk, a.mode, TierKind::kDevice);
      b.SetActivationBytes(tmp[it][m]);
      b.EndMoment(100000 + g() % 3000000);
    }
  }
  return *b.Finish();
}

// Exhaustive minimum number of fetches over `seq` from `start` (bitmask of cached chunks):
// every moment's chunks must be cached, at most cap[m] at once; reading a chunk that is not
// cached costs one fetch, overwriting it none.
uint64_t BruteForceFetches(const std::vector<const EffIteration*>& seq, uint32_t start,
                           const std::vector<uint32_t>& cap) {
  std::map<uint32_t, uint64_t> cost{{start, 0}};
  size_t pos = 0;
  for (const EffIteration* it : seq) {
    for (size_t m = 0; m < it->size(); ++m, ++pos) {
      uint32_t need = 0, reads = 0;
      for (const EffAccess* a = it->begin(m); a != it->end(m); ++a) {
        need |= 1u << a->chunk;
        if (a->needs_content) reads |= 1u << a->chunk;
      }
      std::map<uint32_t, uint64_t> next;
      for (const auto& [s, c] : cost) {
        const uint64_t fetch = static_cast<uint64_t>(__builtin_popcount(reads & ~s));
        const uint32_t keepable = s & ~need;
        // Every subset of the cached chunks the moment does not need may stay.
        for (uint32_t sub = keepable;; sub = (sub - 1) & keepable) {
          const uint32_t ns = need | sub;
          if (static_cast<uint32_t>(__builtin_popcount(ns)) <= cap[pos]) {
            auto it2 = next.find(ns);
            if (it2 == next.end() || it2->second > c + fetch) next[ns] = c + fetch;
          }
          if (sub == 0) break;
        }
      }
      cost = std::move(next);
    }
  }
  uint64_t best = UINT64_MAX;
  for (const auto& [s, c] : cost) best = std::min(best, c);
  return best;
}

class LruWarmup : public Policy {
 public:
  Status Before(SimulatedRun& ex, size_t i) override {
    return EnsureMoment(ex, i, [&ex](ChunkId c, TierKind) {
      return std::make_tuple(ex.Chunk(c).dirty, ex.Chunk(c).last_use, c);
    });
  }
};

TEST(PlannerPropertyTest, EvictionOnlyPlannedBytesEqualTheBeladyOptimum) {
  int checked = 0;
  for (uint64_t seed = 1; seed <= 60; ++seed) {
    SCOPED_TRACE(seed);
    const bool writes = seed % 2 == 0, temps = seed % 3 == 0;
    const uint32_t chunks = 4 + seed % 4;
    const Trace t = EvictionOnly(seed, chunks, 10 + seed % 7, 3, /*identical=*/true, writes, temps);
    const uint32_t slots = 3 + static_cast<uint32_t>(seed % 3);  // room for 3..5 chunks
    const MachineModel m = testing::TestMachine(slots * kU, 64 * kU);
    SimOptions so;
    so.plan.objective = PlanObjective::kBytes;
    auto planned = Simulate(t, m, PolicyKind::kPlanned, so);
    auto opt = Simulate(t, m, PolicyKind::kOpt, so);
    ASSERT_TRUE(planned.ok() && opt.ok()) << planned.status().ToString();
    if (!planned->status.ok()) {
      // Only when a moment's chunks + temporaries exceed the room (then opt cannot run either).
      EXPECT_EQ(planned->status.code(), StatusCode::kResourceExhausted);
      continue;
    }
    ASSERT_TRUE(opt->status.ok()) << opt->status.ToString();
    EXPECT_TRUE(opt->bound_exact);
    EXPECT_EQ(planned->repairs, 0u);
    EXPECT_EQ(planned->total.DeviceInBytes(), opt->total.DeviceInBytes());

    // The exhaustive optimum from the state the warm-up leaves.
    Placement p;
    p.home.assign(t.chunks.size(), TierKind::kHost);
    std::vector<EffIteration> eff;
    for (const TraceIteration& it : t.iterations) eff.push_back(*BuildEffective(t, it, p, m));
    auto ex = SimulatedRun::Create(&t, &m, p.home);
    ASSERT_TRUE(ex.ok());
    LruWarmup warm;
    ASSERT_TRUE((*ex)->Run(eff[0], warm, 0).ok());
    uint32_t start = 0;
    for (ChunkId c = 0; c < t.chunks.size(); ++c) {
      if ((*ex)->Chunk(c).cache == TierKind::kDevice) start |= 1u << c;
    }
    std::vector<const EffIteration*> seq = {&eff[1], &eff[2]};
    std::vector<uint32_t> cap;
    for (const EffIteration* e : seq) {
      for (Bytes x : e->dev_extra) cap.push_back(static_cast<uint32_t>((slots * kU - x) / kU));
    }
    EXPECT_EQ(opt->total.DeviceInBytes(), BruteForceFetches(seq, start, cap) * kU);
    ++checked;
  }
  EXPECT_GE(checked, 40);
}

TEST(PlannerPropertyTest, NoScheduleEverExceedsABudget) {
  for (uint64_t seed = 1; seed <= 24; ++seed) {
    SCOPED_TRACE(seed);
    const bool training = seed % 2 == 0;
    const Trace t = training
                        ? testing::RandomTrace(seed, {.iterations = 3,
                                                      .uniform = seed % 4 != 0,
                                                      .training = true,
                                                      .units = 3 + static_cast<uint32_t>(seed % 4)})
                        : EvictionOnly(seed, 8, 20, 3, seed % 3 != 0, true, true);
    const Bytes total = t.TotalChunkBytes();
    const Bytes device = total * (20 + 15 * (seed % 5)) / 100;
    MachineModel m = testing::TestMachine(device, total / 2, 2 * total);
    auto rs = Compare(t, m);
    ASSERT_TRUE(rs.ok()) << rs.status().ToString();
    for (const SimResult& r : *rs) {
      SCOPED_TRACE(PolicyName(r.policy));
      if (!r.status.ok()) {
        EXPECT_EQ(r.status.code(), StatusCode::kResourceExhausted) << r.status.ToString();
        continue;
      }
      for (int tier = 0; tier < kNumTierKinds; ++tier) {
        EXPECT_LE(r.peak[tier], m.budget[tier]) << TierKindName(static_cast<TierKind>(tier));
      }
      EXPECT_GT(r.peak[0], 0u);
    }
  }
}

TEST(PlannerPropertyTest, PlannedStallIsAtMostEveryReactivePolicys) {
  int compared = 0;
  for (uint64_t seed = 1; seed <= 30; ++seed) {
    SCOPED_TRACE(seed);
    const bool training = seed % 3 != 0;
    const Trace t = training
                        ? testing::RandomTrace(seed, {.iterations = 2,
                                                      .training = true,
                                                      .units = 3 + static_cast<uint32_t>(seed % 5)})
                        : EvictionOnly(seed, 7, 18, 2, true, seed % 2 == 0, false);
    const Bytes total = t.TotalChunkBytes();
    const MachineModel m = testing::TestMachine(total * (30 + 10 * (seed % 6)) / 100, 2 * total);
    if (!CheckFeasible(t, 0, m, false).ok()) continue;  // no schedule fits this budget
    auto rs = Compare(t, m);
    ASSERT_TRUE(rs.ok()) << rs.status().ToString();
    const SimResult& planned = (*rs)[static_cast<int>(PolicyKind::kPlanned)];
    ASSERT_TRUE(planned.status.ok()) << planned.status.ToString();
    for (PolicyKind p : {PolicyKind::kLru, PolicyKind::kPatrickStar, PolicyKind::kEngine}) {
      const SimResult& r = (*rs)[static_cast<int>(p)];
      if (!r.status.ok()) continue;
      EXPECT_LE(planned.total.stall_ns, r.total.stall_ns) << PolicyName(p);
      ++compared;
    }
  }
  EXPECT_GE(compared, 60);
}

// The runtime offloads activations but does not recompute (activations: offload): plans made
// with allow_recompute = false never recompute, fit the budgets the offload-only feasibility
// check accepts, and do offload where keeping everything would not fit.
TEST(PlannerPropertyTest, OffloadOnlyPlansNeverRecompute) {
  int planned = 0, offloading = 0;
  for (uint64_t seed = 1; seed <= 24; ++seed) {
    SCOPED_TRACE(seed);
    const Trace t = testing::RandomTrace(
        seed, {.iterations = 1, .training = true, .units = 3 + static_cast<uint32_t>(seed % 4)});
    const Bytes total = t.TotalChunkBytes();
    const MachineModel m = testing::TestMachine(total * (25 + 10 * (seed % 5)) / 100, 4 * total);
    PlanOptions o;
    o.allow_recompute = false;
    if (!CheckFeasible(t, 0, m, false, true).ok()) {
      EXPECT_FALSE(MakePlan(t, m, o).ok());
      continue;
    }
    auto p = MakePlan(t, m, o);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    ++planned;
    bool offloads = false;
    for (const UnitPlan& u : p->units) {
      EXPECT_NE(u.policy, ActivationPolicy::kRecompute) << u.unit;
      offloads |= u.policy == ActivationPolicy::kOffload;
    }
    EXPECT_LE(p->estimate.peak[static_cast<int>(TierKind::kDevice)],
              m.Budget(TierKind::kDevice));
    if (!CheckFeasible(t, 0, m, true).ok()) {
      EXPECT_TRUE(offloads);
    }
    offloading += offloads;
  }
  EXPECT_GE(planned, 8);
  EXPECT_GE(offloading, 3);
}

TEST(PlannerPropertyTest, PlansAndSimulationsAreDeterministic) {
  for (uint64_t seed = 1; seed <= 4; ++seed) {
    SCOPED_TRACE(seed);
    const Trace t = testing::RandomTrace(
        seed, {.iterations = 2, .uniform = seed % 2 == 0, .training = true, .units = 4});
    const Trace copy = t;
    const MachineModel m = testing::TestMachine(t.TotalChunkBytes() / 2, 2 * t.TotalChunkBytes());
    auto a = MakePlan(t, m);
    auto b = MakePlan(copy, m);
    ASSERT_TRUE(a.ok() && b.ok()) << a.status().ToString();
    EXPECT_EQ(EncodePlan(*a), EncodePlan(*b));
    EXPECT_GT(a->actions.size(), 0u);
    auto s1 = Simulate(t, m, PolicyKind::kPlanned);
    auto s2 = Simulate(copy, m, PolicyKind::kPlanned);
    ASSERT_TRUE(s1.ok() && s2.ok());
    EXPECT_EQ(s1->total.iteration_ns, s2->total.iteration_ns);
    EXPECT_EQ(s1->total.stall_ns, s2->total.stall_ns);
    EXPECT_EQ(s1->total.bytes, s2->total.bytes);
    ASSERT_EQ(s1->plans.size(), s2->plans.size());
    for (size_t i = 0; i < s1->plans.size(); ++i) {
      EXPECT_EQ(EncodePlan(s1->plans[i]), EncodePlan(s2->plans[i]));
    }
  }
}

}  // namespace
}  // namespace tiermem::planners
