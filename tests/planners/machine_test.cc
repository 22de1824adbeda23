// Machine model: filled from a trace, device<->NVMe derived, --bw parsing, exact copy times,
// validation naming what is missing.
#include "planners/machine.h"

#include <gtest/gtest.h>

#include "test_support.h"

namespace tiermem::planners {
namespace {

using testing::StatusIs;
constexpr TierKind kD = TierKind::kDevice, kH = TierKind::kHost, kN = TierKind::kNvme;

TEST(MachineModelTest, FromTraceTakesRatesAndBudgetsAndDerivesNvmeLinks) {
  Trace t;
  t.rates.link[1][0] = {20e9, 5000};   // h2d
  t.rates.link[0][1] = {10e9, 6000};   // d2h
  t.rates.link[1][2] = {2e9, 100000};  // h2n
  t.rates.link[2][1] = {3e9, 90000};   // n2h
  t.rates.cpu_optim_elems_per_s = 1e9;
  t.rates.device_optim_elems_per_s = 5e10;
  t.rates.cpu_cores = 16;
  t.budgets = {100, 200, 300};
  const MachineModel m = MachineModel::FromTrace(t);
  EXPECT_EQ(m.Budget(kD), 100u);
  EXPECT_EQ(m.Budget(kN), 300u);
  EXPECT_EQ(m.Link(kD, kN).bytes_per_s, 2e9);  // min(d2h 10, h2n 2)
  EXPECT_EQ(m.Link(kD, kN).latency_ns, 106000u);
  EXPECT_EQ(m.Link(kN, kD).bytes_per_s, 3e9);  // min(n2h 3, h2d 20)
  EXPECT_EQ(m.Link(kN, kD).latency_ns, 95000u);
  EXPECT_EQ(m.cpu_cores, 16u);
  // 1 MB at 20 GB/s = 50 us, + 5 us latency.
  EXPECT_EQ(m.CopyNs(kH, kD, 1000000), 55000u);
  EXPECT_TRUE(m.Validate().ok());
}

TEST(MachineModelTest, LinkSpecParsesPairsRatesAndLatencies) {
  MachineModel m = testing::TestMachine(1, 1);
  ASSERT_TRUE(ApplyLinkSpec("h2d=24GB, d2h=20GB/s@10us,hn=1GiB@2ms", &m).ok());
  EXPECT_EQ(m.Link(kH, kD).bytes_per_s, 24e9);
  EXPECT_EQ(m.Link(kH, kD).latency_ns, 0u);
  EXPECT_EQ(m.Link(kD, kH).bytes_per_s, 20e9);
  EXPECT_EQ(m.Link(kD, kH).latency_ns, 10000u);
  EXPECT_EQ(m.Link(kH, kN).bytes_per_s, static_cast<double>(kGiB));
  EXPECT_EQ(m.Link(kN, kH).latency_ns, 2000000u);
  EXPECT_THAT(ApplyLinkSpec("x2y=1GB", &m), StatusIs(StatusCode::kInvalidArgument, "x2y"));
  EXPECT_THAT(ApplyLinkSpec("h2d", &m), StatusIs(StatusCode::kInvalidArgument, "PAIR=RATE"));
  EXPECT_THAT(ApplyLinkSpec("h2d=fast", &m), StatusIs(StatusCode::kInvalidArgument, "fast"));
  EXPECT_THAT(ApplyLinkSpec("h2d=1GB@3", &m), StatusIs(StatusCode::kInvalidArgument, "unit"));
}

TEST(MachineModelTest, ValidateNamesWhatIsMissing) {
  MachineModel m;
  EXPECT_THAT(m.Validate(), StatusIs(StatusCode::kInvalidArgument, "--host"));
  // No device budget is a host-mode machine: host and NVMe only, no device links needed.
  m.budget = {0, 1, 0};
  EXPECT_TRUE(m.Validate().ok());
  m.budget = {0, 1, 10};
  EXPECT_THAT(m.Validate(), StatusIs(StatusCode::kInvalidArgument, "h2n"));
  m.budget = {1, 1, 0};
  EXPECT_THAT(m.Validate(), StatusIs(StatusCode::kInvalidArgument, "h2d"));
  m = testing::TestMachine(1, 1, 0);
  EXPECT_TRUE(m.Validate().ok());
  m.budget[2] = 10;
  m.link[1][2] = {};
  EXPECT_THAT(m.Validate(), StatusIs(StatusCode::kInvalidArgument, "h2n"));
}

}  // namespace
}  // namespace tiermem::planners
