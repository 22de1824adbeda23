// Simulator: the measurement protocol, divergence handling (reactive fallback, re-plan, a
// prefetching plan again after a divergent iteration). The canonical traces: canonical_test.cc.
#include "planners/simulator.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace tiermem::planners
