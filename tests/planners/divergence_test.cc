// Divergence: where and how an observed iteration leaves its plan (FindDivergence), the
// incremental checker the plan runner uses, and optimizer steps matched in any order.
#include "planners/divergence.h"

#include <gtest/gtest.h>

#include "test_support.h"

namespace tiermem::planners {
namespace {

TEST(DivergenceTest, FindsWhereAndHowAnIterationLeftThePlan) {
  const Trace t = testing::RandomTrace(11, {.iterations = 1, .training = true, .units = 4});
  const MachineModel m = testing::TestMachine(t.TotalChunkBytes(), 2 * t.TotalChunkBytes());
  auto plan = MakePlan(t, m);
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  const TraceIteration& same = t.iterations[0];
  EXPECT_FALSE(FindDivergence(*plan, t, same).diverged());

  TraceIteration other = same;
  other.moments[2].label = "fwd:surprise";
  Divergence d = FindDivergence(*plan, t, other);
  EXPECT_EQ(d.kind, DivergenceKind::kMoment);
  EXPECT_EQ(d.observed_moment, 2u);
  EXPECT_NE(d.reason.find("fwd:surprise"), std::string::npos) << d.reason;

  other = same;
  other.accesses[other.moments[1].first_access].chunk ^= 4;  // another group's param chunk
  d = FindDivergence(*plan, t, other);
  EXPECT_EQ(d.kind, DivergenceKind::kAccess);
  EXPECT_EQ(d.observed_moment, 1u);

  other = same;
  other.accesses[other.moments[1].first_access].mode = AccessMode::kReadWrite;
  d = FindDivergence(*plan, t, other);
  EXPECT_EQ(d.kind, DivergenceKind::kAccess);
  EXPECT_EQ(d.observed_moment, 1u);

  // Optimizer sub-steps that do not come are no divergence (a deferred update that ran
  // unannounced); a missing moment of the stream is.
  other = same;
  ASSERT_EQ(other.moments.back().kind, MomentKind::kOptimizerStep);
  while (other.moments.back().kind == MomentKind::kOptimizerStep) other.moments.pop_back();
  other.accesses.resize(other.moments.back().first_access + other.moments.back().num_accesses);
  EXPECT_EQ(FindDivergence(*plan, t, other).kind, DivergenceKind::kNone);
  other.moments.pop_back();
  other.accesses.resize(other.moments.back().first_access + other.moments.back().num_accesses);
  EXPECT_EQ(FindDivergence(*plan, t, other).kind, DivergenceKind::kShorter);

  other = same;
  Moment extra = other.moments[0];
  extra.first_access = static_cast<uint32_t>(other.accesses.size());
  extra.num_accesses = 0;
  other.moments.push_back(extra);
  d = FindDivergence(*plan, t, other);
  EXPECT_EQ(d.kind, DivergenceKind::kLonger);
  EXPECT_EQ(d.observed_moment, other.moments.size() - 1);

  // Incremental: an unexpected chunk is caught at its access.
  DivergenceChecker ck(&*plan);
  EXPECT_TRUE(ck.OnMoment(same.moments[0].label, same.moments[0].kind));
  const TraceAccess& a0 = same.accesses[same.moments[0].first_access];
  EXPECT_TRUE(ck.OnAccess(a0.chunk, a0.mode, a0.tier));
  EXPECT_FALSE(
      ck.OnAccess(static_cast<ChunkId>(t.chunks.size() - 1), AccessMode::kRead, TierKind::kDevice));
  EXPECT_EQ(ck.divergence().kind, DivergenceKind::kAccess);
  EXPECT_FALSE(ck.OnMoment(same.moments[1].label, same.moments[1].kind));  // stays diverged
  ck.Reset();
  EXPECT_TRUE(ck.OnMoment(same.moments[0].label, same.moments[0].kind));
}

TEST(DivergenceTest, OptimizerStepsMayInterleaveWithTheBackward) {
  const Trace t = testing::RandomTrace(13, {.iterations = 1, .training = true, .units = 3});
  const MachineModel m = testing::TestMachine(t.TotalChunkBytes() / 2, 2 * t.TotalChunkBytes());
  auto plan = MakePlan(t, m);
  ASSERT_TRUE(plan.ok());
  // The plan's own execution order (steps moved into the backward) is not a divergence, and
  // neither is the recorded order.
  TraceIteration planned;
  for (const PlannedMoment& pm : plan->moments) {
    Moment mo;
    mo.label = pm.label;
    mo.kind = pm.kind;
    mo.unit = pm.unit;
    mo.first_access = static_cast<uint32_t>(planned.accesses.size());
    mo.num_accesses = pm.num_accesses;
    for (uint32_t k = 0; k < pm.num_accesses; ++k) {
      planned.accesses.push_back(plan->accesses[pm.first_access + k]);
    }
    planned.moments.push_back(mo);
  }
  EXPECT_FALSE(FindDivergence(*plan, t, planned).diverged())
      << FindDivergence(*plan, t, planned).reason;
  EXPECT_FALSE(FindDivergence(*plan, t, t.iterations[0]).diverged());
}

}  // namespace
}  // namespace tiermem::planners
