// Session plans (plan_runner.h): executing a plan from a recorded iteration with the same
// values, branches and routings that diverge, changed control flow planned again.
#include "runtime/session.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>

#include "planners/trace.h"
#include "base/crc32c.h"
#include "runtime/tier_stack.h"
#include "tests/runtime/session_test_common.h"
#include "tests/runtime/session_test_support.h"
#include "tests/support/session.h"
#include "tests/support/status_matchers.h"

namespace tiermem::session {
namespace {

using ::tiermem::testing::IsOk;
using ::tiermem::testing::StatusIs;
using nlohmann::json;

using namespace session_tests;  // NOLINT: the split files' shared helpers

// One training iteration with values that depend on every earlier step: each group's forward
// reads its params on the device; its backward reads them again and writes grads computed from
// them; then the optimizer step. `branch`: this iteration's forward skips group 1 (dynamic
// control flow), so its moments differ from every other iteration's.
void TrainIteration(Session& s, int it, bool branch = false) {
  using planners::MomentKind;
  s.iterations().BeginIteration();
  const uint32_t n = static_cast<uint32_t>(s.layout().num_groups());
  for (uint32_t g = 0; g < n; ++g) {
    if (branch && g == 1) continue;
    ASSERT_THAT(s.optimizer().FinishStep(g), IsOk());  // as the bindings do before a unit's moment
    s.iterations().Moment("fwd:" + std::to_string(g), MomentKind::kPreForward, g);
    ASSERT_TRUE(s.chunks().Acquire(g, ChunkKind::kParamFp32, TierKind::kDevice).ok());
    ASSERT_THAT(s.chunks().Release(g, ChunkKind::kParamFp32, false), IsOk());
  }
  for (uint32_t g = n; g-- > 0;) {
    if (branch && g == 1) continue;
    s.iterations().Moment("bwd:" + std::to_string(g), MomentKind::kPreBackward, g);
    auto p = s.chunks().Acquire(g, ChunkKind::kParamFp32, TierKind::kDevice);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    bool must_zero = false;
    auto gp = s.chunks().AcquireForWrite(g, ChunkKind::kGrad, TierKind::kDevice, &must_zero);
    ASSERT_TRUE(gp.ok()) << gp.status().ToString();
    const float* w = static_cast<const float*>(*p);
    float* gr = static_cast<float*>(*gp);
    const uint64_t elems = s.chunks().ChunkBytes(g, ChunkKind::kGrad) / 4;
    for (uint64_t i = 0; i < elems; ++i) {
      gr[i] = 0.5f * w[i] + 0.01f * std::sin(static_cast<float>(i + 31 * g + 7 * it));
    }
    ASSERT_THAT(s.chunks().Release(g, ChunkKind::kGrad, true), IsOk());
    ASSERT_THAT(s.chunks().Release(g, ChunkKind::kParamFp32, false), IsOk());
    for (uint32_t t : s.layout().group(g).tensors) s.optimizer().SetHasGrad(t, true);
  }
  ASSERT_TRUE(s.optimizer().Step({GroupHyper{}}).ok());
  ASSERT_TRUE(s.optimizer().ZeroGrad().ok());
}

// The experts of iteration `it` in MoeIteration: groups 6..9 are the experts of one layer,
// routed to one or two of them, other ones from iteration to iteration.
std::vector<uint32_t> Routed(int it) {
  std::vector<uint32_t> e = {6u + static_cast<uint32_t>(it % 4)};
  if (it % 3 == 0) e.push_back(6u + static_cast<uint32_t>((it + 2) % 4));
  return e;
}

// As TrainIteration, with groups 6..9 the experts of an MoE unit "moe" (expert set 0), as the
// bindings acquire them: only the routed ones (Routed), as class members, in its forward and
// backward; their grads and steps as any group's.
void MoeIteration(Session& s, int it) {
  using planners::MomentKind;
  s.iterations().BeginIteration();
  const std::vector<uint32_t> experts = Routed(it);
  auto backward = [&](uint32_t g, uint32_t cls) {
    auto p = s.chunks().Acquire(g, ChunkKind::kParamFp32, TierKind::kDevice, cls);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    bool must_zero = false;
    auto gp = s.chunks().AcquireForWrite(g, ChunkKind::kGrad, TierKind::kDevice, &must_zero, cls);
    ASSERT_TRUE(gp.ok()) << gp.status().ToString();
    const float* w = static_cast<const float*>(*p);
    float* gr = static_cast<float*>(*gp);
    const uint64_t elems = s.chunks().ChunkBytes(g, ChunkKind::kGrad) / 4;
    for (uint64_t i = 0; i < elems; ++i) {
      gr[i] = 0.5f * w[i] + 0.01f * std::sin(static_cast<float>(i + 31 * g + 7 * it));
    }
    ASSERT_THAT(s.chunks().Release(g, ChunkKind::kGrad, true), IsOk());
    ASSERT_THAT(s.chunks().Release(g, ChunkKind::kParamFp32, false), IsOk());
    for (uint32_t t : s.layout().group(g).tensors) s.optimizer().SetHasGrad(t, true);
  };
  for (uint32_t g = 0; g < 6; ++g) {
    ASSERT_THAT(s.optimizer().FinishStep(g), IsOk());
    s.iterations().Moment("fwd:" + std::to_string(g), MomentKind::kPreForward, g);
    ASSERT_TRUE(s.chunks().Acquire(g, ChunkKind::kParamFp32, TierKind::kDevice).ok());
    ASSERT_THAT(s.chunks().Release(g, ChunkKind::kParamFp32, false), IsOk());
  }
  for (uint32_t e : experts) ASSERT_THAT(s.optimizer().FinishStep(e), IsOk());
  s.iterations().Moment("fwd:moe", MomentKind::kPreForward, 6);
  for (uint32_t e : experts) {
    ASSERT_TRUE(s.chunks().Acquire(e, ChunkKind::kParamFp32, TierKind::kDevice, /*cls=*/0).ok());
    ASSERT_THAT(s.chunks().Release(e, ChunkKind::kParamFp32, false), IsOk());
  }
  s.iterations().Moment("bwd:moe", MomentKind::kPreBackward, 6);
  for (uint32_t e : experts) backward(e, 0);
  for (uint32_t g = 6; g-- > 0;) {
    s.iterations().Moment("bwd:" + std::to_string(g), MomentKind::kPreBackward, g);
    backward(g, chunks::kNoClass);
  }
  ASSERT_TRUE(s.optimizer().Step({GroupHyper{}}).ok());
  ASSERT_TRUE(s.optimizer().ZeroGrad().ok());
}

struct PlanRun {
  std::vector<std::vector<float>> params;
  PlanStatus plan;
  chunks::EngineStats engine;
  std::vector<chunks::EngineStats> per_iteration;  // engine counters at each iteration's end
};

// 10 groups of 16 KiB chunks (param, grad, m, v), a device for 10 chunks; with `nvme`, a host
// too small for m and v (they spill to NVMe).
PlanRun TrainPlanned(const std::string& plan, bool nvme, int iterations,
                     std::function<bool(int)> branch = nullptr, bool moe = false) {
  const std::string dir = TempDir();
  std::vector<TensorSpec> specs;
  for (int i = 0; i < 10; ++i) specs.push_back({"t" + std::to_string(i), 4096, true, 0});
  json cfg = {{"device", "160KiB"}, {"chunk_size", 4096}, {"plan", plan}};
  if (nvme) {
    cfg["host"] = "512KiB";
    cfg["nvme"] = {{"path", dir}, {"size", "8MiB"}};
  }
  PlanRun out;
  auto s = Make(cfg, specs);
  if (!s) return out;
  for (size_t t = 0; t < specs.size(); ++t) {
    auto v = Random(4096, 100 + t);
    EXPECT_THAT(s->values().WriteParam(t, v.data()), IsOk());
  }
  for (int it = 0; it < iterations; ++it) {
    if (moe) {
      MoeIteration(*s, it);
    } else {
      TrainIteration(*s, it, branch && branch(it));
    }
    out.per_iteration.push_back(*s->Stats());
  }
  for (size_t t = 0; t < specs.size(); ++t) out.params.push_back(Param(*s, t));
  out.plan = s->plans().plan_status();
  out.engine = *s->Stats();
  s.reset();
  std::filesystem::remove_all(dir);
  return out;
}

Bytes DeviceIn(const chunks::EngineStats& s) {
  return s.bytes_moved[static_cast<int>(TierKind::kHost)][static_cast<int>(TierKind::kDevice)] +
         s.bytes_moved[static_cast<int>(TierKind::kNvme)][static_cast<int>(TierKind::kDevice)];
}

TEST(SessionPlan, ExecutesAPlanFromTheFourthIterationWithTheSameValues) {
  for (bool nvme : {false, true}) {
    SCOPED_TRACE(nvme ? "m and v on NVMe" : "host homes");
    const PlanRun off = TrainPlanned("off", nvme, 8);
    const PlanRun on = TrainPlanned("auto", nvme, 8);
    ASSERT_EQ(off.params.size(), 10u);
    ASSERT_EQ(on.params.size(), 10u);
    for (size_t t = 0; t < off.params.size(); ++t) {
      EXPECT_EQ(on.params[t], off.params[t]) << "tensor " << t;  // bit for bit
    }
    EXPECT_EQ(off.plan.runner.plans, 0u);
    EXPECT_EQ(off.engine.plan_prefetches, 0u);
    // Recorded iteration 3 (index 2), planned and executed from iteration 4 on: 5 iterations.
    EXPECT_TRUE(on.plan.active) << on.plan.error;
    EXPECT_EQ(on.plan.runner.plans, 1u);
    EXPECT_EQ(on.plan.runner.divergences, 0u) << on.plan.runner.last_divergence;
    EXPECT_EQ(on.plan.runner.planned_iterations, 5u);
    EXPECT_EQ(on.plan.runner.followed_iterations, 4u);  // the last one is still open
    EXPECT_GT(on.engine.plan_prefetches, 5u * 5);
    // Every planned iteration prefetched, and the engine's own lookahead was off.
    for (int it = 3; it < 8; ++it) {
      EXPECT_GT(on.per_iteration[it].plan_prefetches, on.per_iteration[it - 1].plan_prefetches)
          << "iteration " << it;
    }
    // Bytes into the device per planned iteration: what the planner predicted (its
    // steady-state estimate), within 2%; never more than the reactive run's.
    const Bytes measured = DeviceIn(on.per_iteration[6]) - DeviceIn(on.per_iteration[5]);
    const Bytes predicted = on.plan.estimate.steady_device_in_bytes;
    EXPECT_NEAR(static_cast<double>(measured), static_cast<double>(predicted),
                0.02 * static_cast<double>(predicted))
        << "measured " << measured << " predicted " << predicted;
    EXPECT_LE(measured, DeviceIn(off.per_iteration[6]) - DeviceIn(off.per_iteration[5]));
  }
}

TEST(SessionPlan, AnIterationThatBranchesRunsReactiveWithTheSameValuesAndThePlanHolds) {
  auto branch = [](int it) { return it % 4 == 3; };  // iterations 3 and 7
  const PlanRun off = TrainPlanned("off", false, 9, branch);
  const PlanRun on = TrainPlanned("auto", false, 9, branch);
  ASSERT_EQ(on.params.size(), 10u);
  for (size_t t = 0; t < off.params.size(); ++t) EXPECT_EQ(on.params[t], off.params[t]);
  EXPECT_EQ(on.plan.runner.divergences, 2u);
  EXPECT_NE(on.plan.runner.last_divergence.find("fwd"), std::string::npos)
      << on.plan.runner.last_divergence;
  // The iteration after each branch was recorded, followed the plan, so the plan was kept.
  EXPECT_EQ(on.plan.runner.plans, 1u);
  EXPECT_TRUE(on.plan.active);
  EXPECT_EQ(on.plan.runner.followed_iterations, 3u);  // 4, 5, 6 (8 still open)
}

// Issue 33: an MoE unit's experts are acquired as class members, and the routing differs
// from the recorded one in every iteration (other experts, one or two of them, including
// experts the recorded iteration never routed to). The plan made from the recording treats
// them as a class: no planned iteration diverges (no fall-back to the reactive policy) and
// the values are those of the reactive run.
TEST(SessionPlan, ARoutingOtherThanTheRecordedOneIsNoDivergence) {
  const PlanRun off = TrainPlanned("off", false, 10, nullptr, /*moe=*/true);
  const PlanRun on = TrainPlanned("always", false, 10, nullptr, /*moe=*/true);
  ASSERT_EQ(on.params.size(), 10u);
  for (size_t t = 0; t < off.params.size(); ++t) {
    EXPECT_EQ(on.params[t], off.params[t]) << "tensor " << t;  // bit for bit
  }
  EXPECT_TRUE(on.plan.active) << on.plan.error;
  EXPECT_EQ(on.plan.runner.plans, 1u);
  EXPECT_EQ(on.plan.runner.divergences, 0u) << on.plan.runner.last_divergence;
  EXPECT_EQ(on.plan.runner.planned_iterations, 7u);   // 4..10, recorded 3
  EXPECT_EQ(on.plan.runner.followed_iterations, 6u);  // the last one is still open
  EXPECT_GT(on.engine.plan_prefetches, 0u);
}

TEST(SessionPlan, ChangedControlFlowIsPlannedAgain) {
  // From iteration 4 on every forward branches: the old plan diverges, the next iteration is
  // recorded, diverges too, and is planned; the new plan is followed.
  auto branch = [](int it) { return it >= 4; };
  const PlanRun off = TrainPlanned("off", true, 10, branch);
  const PlanRun on = TrainPlanned("auto", true, 10, branch);
  ASSERT_EQ(on.params.size(), 10u);
  for (size_t t = 0; t < off.params.size(); ++t) EXPECT_EQ(on.params[t], off.params[t]);
  EXPECT_EQ(on.plan.runner.plans, 2u);
  EXPECT_EQ(on.plan.runner.divergences, 2u);  // iterations 4 and 5
  EXPECT_TRUE(on.plan.active);
  EXPECT_EQ(on.plan.runner.followed_iterations, 1u + 3u);  // 3 and 6, 7, 8
}

}  // namespace
}  // namespace tiermem::session
