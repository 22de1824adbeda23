// Every policy over the canonical traces of tests/data/ (labelled slow: see CMakeLists.txt).
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "planners/simulator.h"
#include "test_support.h"
#include "tests/support/paths.h"

namespace tiermem::planners {
namespace {

// Every policy runs every canonical trace (cut to its first iterations, to stay fast) at 50%
// of the model data, and planned also at 25%: planned fits everywhere (it manages
// activations), the Belady bound is a lower bound for planned, and no trace leaves its plan
// (MoE routing changes every iteration, but its experts are a class; unmarked, it leaves). (docs/benchmarks.md has the full runs.)
TEST(CanonicalTracesTest, RunUnderEveryPolicy) {
  for (const char* name : {"gpt", "gpt-ckpt", "gpt-tied", "moe"}) {
    auto t = ReadTraceFile(::tiermem::testing::TestData(std::string(name) + ".tmtrace"));
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
      // The MoE trace routes to other experts every iteration: its experts are a class
      // (expert sets), so that is no divergence either.
      EXPECT_EQ(planned.divergences, 0u);
      EXPECT_EQ(planned.repairs, 0u);
      if (moe) {
        // Not so when the experts are not marked: each iteration leaves its plan.
        Trace u = *t;
        for (TraceChunk& c : u.chunks) c.expert_set = kNoExpertSet;
        auto unmarked = Simulate(u, m, PolicyKind::kPlanned);
        ASSERT_TRUE(unmarked.ok() && unmarked->status.ok());
        EXPECT_GT(unmarked->divergences, 0u);
      }
      for (const SimResult& r : rs) {
        if (!r.status.ok()) {
          EXPECT_EQ(r.status.code(), StatusCode::kResourceExhausted) << PolicyName(r.policy);
        }
      }
    }
  }
}

// A trace recorded by the runtime from the main job (GPT 12 x 768, 85 M params, device
// 128 MiB, host 512 MiB, NVMe 4 GiB; tests/data/README.md): the recorder's output loads,
// and every policy runs it with room for its recorded activations (the SimDevice run kept
// them outside the device budget). On this real trace planned moves no more than the
// Belady bound's sequence needs (equal chunks: exact) and stalls less than the engine's
// reactive policy, the one the run used.
TEST(CanonicalTracesTest, RecordedMainJobTrace) {
  auto t = ReadTraceFile(::tiermem::testing::TestData("main-job.tmtrace"));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_EQ(t->iterations.size(), 2u);
  EXPECT_GT(t->rates.link[1][0].bytes_per_s, 0);  // measured host -> device
  EXPECT_GT(t->rates.link[2][1].bytes_per_s, 0);  // measured nvme -> host
  EXPECT_GT(t->rates.cpu_optim_elems_per_s, 0);
  Bytes act = 0;
  for (const Moment& m : t->iterations[1].moments) act = std::max(act, m.activation_bytes);
  MachineModel m = MachineModel::FromTrace(*t);
  m.budget[0] = t->budgets.device + act;
  auto rs = Compare(*t, m);
  ASSERT_TRUE(rs.ok()) << rs.status().ToString();
  for (const SimResult& r : *rs) {
    ASSERT_TRUE(r.status.ok()) << PolicyName(r.policy) << ": " << r.status.ToString();
  }
  const SimResult& planned = (*rs)[static_cast<int>(PolicyKind::kPlanned)];
  const SimResult& engine = (*rs)[static_cast<int>(PolicyKind::kEngine)];
  const SimResult& opt = (*rs)[static_cast<int>(PolicyKind::kOpt)];
  EXPECT_EQ(planned.total.DeviceInBytes(), opt.total.DeviceInBytes());
  EXPECT_LE(planned.peak[0], m.budget[0]);
  EXPECT_LT(planned.MeanStallNs(), engine.MeanStallNs());
  EXPECT_EQ(planned.divergences, 0u);
}

// Issue 43 §2: on its own trace the planned policy is the best one in `plan compare` — bytes
// into the device, NVMe bytes and stall no higher than any baseline policy's — on the main
// job's host-mode warm-up trace (tests/data/main-job-host.tmtrace, its recorded budgets) and on
// every trace shape tools/plan/benchmarks.py runs, at each of its budgets (whole, as it runs
// them: with one measured iteration the first plan's transition can cost a little more stall). `mimic_baselines = false` (the planner's own schedules only) fails
// it: on the main job's trace it moved 1.14x the engine's NVMe bytes, on gpt-ckpt at 25% more
// than patrickstar into the device.
// `nvme_excess`: policies that planned moves exactly that many more NVMe bytes than (a stated
// exception; every other measure still no higher).
void ExpectPlannedIsBest(const Trace& t, const MachineModel& m, const SimOptions& o = {},
                         const std::map<PolicyKind, Bytes>& nvme_excess = {}) {
  auto rs = Compare(t, m, o);
  ASSERT_TRUE(rs.ok()) << rs.status().ToString();
  const SimResult& planned = (*rs)[static_cast<int>(PolicyKind::kPlanned)];
  ASSERT_TRUE(planned.status.ok()) << planned.status.ToString();
  EXPECT_EQ(planned.divergences, 0u);
  for (PolicyKind p : {PolicyKind::kLru, PolicyKind::kPatrickStar, PolicyKind::kDeepSpeed,
                       PolicyKind::kEngine}) {
    const SimResult& r = (*rs)[static_cast<int>(p)];
    if (!r.status.ok()) continue;  // keeps every activation: does not fit
    SCOPED_TRACE(PolicyName(p));
    EXPECT_LE(planned.total.DeviceInBytes(), r.total.DeviceInBytes());
    if (auto it = nvme_excess.find(p); it != nvme_excess.end()) {
      EXPECT_EQ(planned.total.NvmeBytes(), r.total.NvmeBytes() + it->second);
    } else {
      EXPECT_LE(planned.total.NvmeBytes(), r.total.NvmeBytes());
    }
    EXPECT_LE(planned.total.stall_ns, r.total.stall_ns);
  }
}

TEST(CanonicalTracesTest, PlannedIsTheBestPolicyOnTheMainJobsHostTrace) {
  auto t = ReadTraceFile(::tiermem::testing::TestData("main-job-host.tmtrace"));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_EQ(t->budgets.device, 0u);  // host mode: compute on the host tier, NVMe below
  ExpectPlannedIsBest(*t, MachineModel::FromTrace(*t));
}

// The same with the engine policy's room lookahead (`plan compare --lookahead room`, the
// engine as `prefetch_lookahead: room` runs it; the planner's own candidates mimic the depth
// engine, PlanOptions::engine_lookahead's default).
TEST(CanonicalTracesTest, PlannedIsTheBestPolicyOnTheMainJobsHostTraceWithTheRoomLookahead) {
  auto t = ReadTraceFile(::tiermem::testing::TestData("main-job-host.tmtrace"));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  SimOptions o;
  o.engine_lookahead = EngineLookahead::kRoom;
  ExpectPlannedIsBest(*t, MachineModel::FromTrace(*t), o);
}

// The main job's SimDevice trace (tests/data/main-job.tmtrace: device 128 MiB plus its
// recorded activation room, as RecordedMainJobTrace runs it; host 512 MiB, NVMe 4 GiB).
MachineModel MainJobDeviceMachine(const Trace& t) {
  Bytes act = 0;
  for (const Moment& m : t.iterations[1].moments) act = std::max(act, m.activation_bytes);
  MachineModel m = MachineModel::FromTrace(t);
  m.budget[0] = t.budgets.device + act;
  return m;
}

// With the room lookahead planned is the best policy on the trace as recorded (one measured
// iteration). Before Belady's demand moves were a candidate (planners/ranking.h,
// BeladyMovesSchedule) planned moved 1,845,841,920 NVMe bytes here against the engine's
// 1,618,661,376.
TEST(CanonicalTracesTest, PlannedIsTheBestPolicyOnTheMainJobsDeviceTraceWithTheRoomLookahead) {
  auto t = ReadTraceFile(::tiermem::testing::TestData("main-job.tmtrace"));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  SimOptions o;
  o.engine_lookahead = EngineLookahead::kRoom;
  ExpectPlannedIsBest(*t, MainJobDeviceMachine(*t), o);
}

// With the depth lookahead it is too, but for one chunk: its one measured iteration starts
// from the warm-up's state, which planned ran under its own placement (CPU steps overlapped
// with the backward) and the engine under the recorded one, and planned's begins by writing
// home three chunks that warm-up left dirty where the engine leaves its last steps' state
// dirty past the iteration's end: 1,590,263,808 NVMe bytes against 1,580,797,952, one chunk
// (9,465,856 bytes) more; its bytes into the device (the Belady bound) and its stall are the
// least. From the second measured iteration on it moves fewer than the engine
// (PlannedIsTheBestPolicyOnTheMainJobsDeviceTraceOverMoreSteps). Before: 1,845,841,920.
TEST(CanonicalTracesTest, PlannedIsTheBestPolicyOnTheMainJobsDeviceTraceButOneChunk) {
  auto t = ReadTraceFile(::tiermem::testing::TestData("main-job.tmtrace"));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ExpectPlannedIsBest(*t, MainJobDeviceMachine(*t), {},
                      {{PolicyKind::kEngine, Bytes{9'465'856}}});
}

// The recorded step repeated, so that more measured iterations follow the warm-up: planned
// moves no more NVMe bytes, no more bytes into the device and stalls no longer than any other
// policy over them, with either lookahead.
TEST(CanonicalTracesTest, PlannedIsTheBestPolicyOnTheMainJobsDeviceTraceOverMoreSteps) {
  auto t = ReadTraceFile(::tiermem::testing::TestData("main-job.tmtrace"));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  const MachineModel m = MainJobDeviceMachine(*t);
  for (int measured : {2, 3}) {
    Trace u = *t;
    while (u.iterations.size() < static_cast<size_t>(measured) + 1) {
      u.iterations.push_back(t->iterations[1]);
    }
    for (EngineLookahead la : {EngineLookahead::kDepth, EngineLookahead::kRoom}) {
      SCOPED_TRACE(std::to_string(measured) + " measured, " +
                   std::string(EngineLookaheadName(la)) + " lookahead");
      SimOptions o;
      o.engine_lookahead = la;
      ExpectPlannedIsBest(u, m, o);
    }
  }
}

// On the SimDevice trace the engine's moves are a candidate and part of the bar: its lookahead
// allocates grads ahead of the moment that overwrites them, which MimicSchedule now issues at
// that moment (a plan's allocation-only prefetch is honoured only there), so they replay
// without repairs (they needed 26 and the engine was missing from the bar). The plan is
// Belady's demand moves.
TEST(CanonicalTracesTest, TheEnginesMovesAreACandidateOnTheMainJobsDeviceTrace) {
  auto t = ReadTraceFile(::tiermem::testing::TestData("main-job.tmtrace"));
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  auto plan = MakePlan(*t, MainJobDeviceMachine(*t));
  ASSERT_TRUE(plan.ok()) << plan.status().ToString();
  EXPECT_NE(plan->FindBaseline("engine"), nullptr);
  EXPECT_EQ(plan->baseline, "belady");
}

TEST(CanonicalTracesTest, PlannedIsTheBestPolicyOnEveryBenchmarkTrace) {
  for (const char* name : {"gpt", "gpt-ckpt", "gpt-tied", "moe"}) {
    auto t = ReadTraceFile(::tiermem::testing::TestData(std::string(name) + ".tmtrace"));
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    for (int pct : {25, 50, 75}) {
      SCOPED_TRACE(std::string(name) + " " + std::to_string(pct) + "%");
      MachineModel m = MachineModel::FromTrace(*t);
      m.budget[0] = t->TotalChunkBytes() * pct / 100;
      m.budget[1] = Bytes{64} << 30;  // tools/plan/benchmarks.py's host
      ExpectPlannedIsBest(*t, m);
    }
  }
}

}  // namespace
}  // namespace tiermem::planners
