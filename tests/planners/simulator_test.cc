// Simulator: the measurement protocol, divergence handling (reactive fallback, re-plan, a
// prefetching plan again after a divergent iteration), and every policy over the canonical
// traces at 25/50/75% of the model data.
#include <gtest/gtest.h>

#include "planners/simulator.h"
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

// Every policy runs every canonical trace (cut to its first iterations, to stay fast) at 50%
// of the model data, and planned also at 25%: planned fits everywhere (it manages
// activations), the Belady bound is a lower bound for planned, the dense traces never leave
// their plan and MoE routing always does. (docs/benchmarks.md has the full runs.)
TEST(SimulatorTest, CanonicalTracesUnderEveryPolicy) {
  for (const char* name : {"gpt", "gpt-ckpt", "gpt-tied", "moe"}) {
    auto t = ReadTraceFile(std::string(TIERMEM_TEST_DATA_DIR) + "/" + name + ".tmtrace");
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    const bool moe = std::string(name) == "moe";
    t->iterations.resize(moe ? 3 : 2);
    for (int pct : {25, 50}) {
      SCOPED_TRACE(std::string(name) + " " + std::to_string(pct) + "%");
      MachineModel m = MachineModel::FromTrace(*t);
      m.budget[0] = t->TotalChunkBytes() * pct / 100;
      m.budget[1] = 2 * t->TotalChunkBytes();
      std::vector<SimResult> rs;
      if (pct == 50) {
        auto all = Compare(*t, m);
        ASSERT_TRUE(all.ok()) << all.status().ToString();
        rs = *all;
      } else {
        rs.resize(kNumPolicies);
        auto planned = Simulate(*t, m, PolicyKind::kPlanned);
        auto opt = Simulate(*t, m, PolicyKind::kOpt);
        ASSERT_TRUE(planned.ok() && opt.ok());
        rs[static_cast<int>(PolicyKind::kPlanned)] = *planned;
        rs[static_cast<int>(PolicyKind::kOpt)] = *opt;
      }
      const SimResult& planned = rs[static_cast<int>(PolicyKind::kPlanned)];
      const SimResult& opt = rs[static_cast<int>(PolicyKind::kOpt)];
      ASSERT_TRUE(planned.status.ok()) << planned.status.ToString();
      ASSERT_TRUE(opt.status.ok()) << opt.status.ToString();
      EXPECT_GE(planned.total.DeviceInBytes(), opt.total.DeviceInBytes());
      EXPECT_LE(planned.peak[0], m.budget[0]);
      if (!moe) {
        EXPECT_EQ(planned.divergences, 0u);
        EXPECT_EQ(planned.repairs, 0u);
      } else {
        EXPECT_GT(planned.divergences, 0u);  // routing differs every iteration
      }
      for (const SimResult& r : rs) {
        if (!r.status.ok()) {
          EXPECT_EQ(r.status.code(), StatusCode::kResourceExhausted) << PolicyName(r.policy);
        }
      }
    }
  }
}

}  // namespace
}  // namespace tiermem::planners
