// plan: auto's bar (runtime/plan_runner.h, "Planning at the iteration boundary"): a plan is
// declined when its modelled steady iteration moves more of the objective's bytes than the
// engine measured over the recorded iteration — device-in bytes with a device, NVMe bytes in
// host mode — and runs on a tie. End to end (a plan that runs, stats()["plan"]) it is tested
// through the bindings (tests/python/test_plan.py, test_host_mode.py).
#include "runtime/plan_runner.h"

#include <gtest/gtest.h>

namespace tiermem::session {
namespace {

constexpr int kD = static_cast<int>(TierKind::kDevice);
constexpr int kH = static_cast<int>(TierKind::kHost);
constexpr int kN = static_cast<int>(TierKind::kNvme);

chunks::EngineStats Moved(Bytes h2d, Bytes n2d, Bytes h2n, Bytes n2h, Bytes d2h) {
  chunks::EngineStats s;
  s.bytes_moved[kH][kD] = h2d;
  s.bytes_moved[kN][kD] = n2d;
  s.bytes_moved[kH][kN] = h2n;
  s.bytes_moved[kN][kH] = n2h;
  s.bytes_moved[kD][kH] = d2h;
  return s;
}

TEST(PlanObjectiveBytes, CountsWhatThePlannerMinimizes) {
  const chunks::EngineStats s = Moved(100, 20, 7, 5, 1000);
  EXPECT_EQ(PlanObjectiveBytes(s, /*host_mode=*/false), 120u);  // into the device
  // To and from NVMe, from and to any tier (as the simulator's IterationStats::NvmeBytes).
  EXPECT_EQ(PlanObjectiveBytes(s, /*host_mode=*/true), 32u);
}

TEST(DeclinePlan, APlanMovingMoreThanTheRecordedIterationIsDeclined) {
  const chunks::EngineStats start = Moved(1000, 0, 500, 500, 0);
  const chunks::EngineStats end = Moved(1600, 0, 800, 900, 300);  // 600 in, 700 NVMe
  planners::PlanEstimate plan;
  plan.steady_device_in_bytes = 601;
  plan.steady_nvme_bytes = 700;
  EXPECT_EQ(DeclinePlan(plan, start, end, /*host_mode=*/false),
            "the plan would move 601 bytes per iteration into the device, the reactive engine "
            "moved 600 over the recorded one");
  EXPECT_EQ(DeclinePlan(plan, start, end, /*host_mode=*/true), "");  // a tie runs
  plan.steady_device_in_bytes = 600;
  EXPECT_EQ(DeclinePlan(plan, start, end, false), "");
  plan.steady_nvme_bytes = 701;
  EXPECT_EQ(DeclinePlan(plan, start, end, true),
            "the plan would move 701 bytes per iteration to and from NVMe, the reactive engine "
            "moved 700 over the recorded one");
}

}  // namespace
}  // namespace tiermem::session
