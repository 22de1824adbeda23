// The unit protocol (runtime/unit_protocol.h): what a binding's unit calls do to the session —
// the moments with their kind, unit and label, the deferred updates before a unit's moment
// (each its own optimizer moment), the phases, and the refusals.
#include "runtime/unit_protocol.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <string>
#include <vector>

#include "planners/trace.h"
#include "runtime/session.h"
#include "tests/runtime/session_test_support.h"
#include "tests/support/session.h"
#include "tests/support/status_matchers.h"

namespace tiermem::session {
namespace {

using ::tiermem::testing::IsOk;
using ::tiermem::testing::StatusIs;
using planners::MomentKind;

std::unique_ptr<Session> Make() {
  // Three groups of one tensor each (a small chunk); the device holds about one group.
  return testing::MakeSession({{"device_kind", "sim"}, {"device", "16KiB"}, {"chunk_size", 512}},
                              {{"a", 500, true, 0}, {"b", 400, true, 0}, {"c", 300, true, 0}});
}

// One training iteration through the protocol: units 0..2 (unit g computes with group g),
// the backward in reverse, then the step.
void Iteration(Session& s, UnitProtocol& p) {
  p.BeginIteration();
  EXPECT_EQ(s.iterations().phase(), RunPhase::kForward);
  for (uint32_t u = 0; u < 3; ++u) {
    ASSERT_THAT(p.EnterUnit(u, true), IsOk());
    ASSERT_TRUE(s.chunks().Acquire(u, ChunkKind::kParamFp32, TierKind::kDevice).ok());
    ASSERT_THAT(s.chunks().Release(u, ChunkKind::kParamFp32, false), IsOk());
    ASSERT_THAT(p.ExitUnit(u), IsOk());
  }
  p.EnterBackward();
  EXPECT_EQ(s.iterations().phase(), RunPhase::kBackward);
  for (uint32_t u = 3; u-- > 0;) {
    p.BackwardReached(u);
    SetGrad(s, u, std::vector<float>(s.layout().spec(u).numel, 0.5f));
  }
  p.EndIteration();
  ASSERT_TRUE(s.optimizer().Step({GroupHyper{}}).ok());
  ASSERT_TRUE(s.optimizer().ZeroGrad().ok());
}

TEST(UnitProtocol, DeclareChecksNamesGroupsAndNesting) {
  auto s = Make();
  ASSERT_TRUE(s);
  ASSERT_EQ(s->layout().num_groups(), 3u);
  UnitProtocol p(s.get());
  auto a = p.Declare({"embed", {0}});
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*a, 0u);
  auto b = p.Declare({"blocks.0", {1, 2}, 0});
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(*b, 1u);
  EXPECT_THAT(p.Declare({"", {0}}).status(),
              StatusIs(StatusCode::kInvalidArgument, "a unit needs a name"));
  EXPECT_THAT(p.Declare({"x", {3}}).status(),
              StatusIs(StatusCode::kInvalidArgument, "chunk group 3 of 3"));
  EXPECT_THAT(p.Declare({"x", {1, 1}}).status(),
              StatusIs(StatusCode::kInvalidArgument, "ascending and distinct"));
  EXPECT_THAT(p.Declare({"x", {0}, 5}).status(),
              StatusIs(StatusCode::kInvalidArgument, "parent 5 is not declared"));
  EXPECT_EQ(p.num_units(), 2u);
  EXPECT_EQ(p.unit(1).parent, 0u);
  EXPECT_THAT(p.EnterUnit(2, true), StatusIs(StatusCode::kOutOfRange, "unit 2 of 2"));
}

TEST(UnitProtocol, ExitLeavesTheUnitAndTheUnitsEnteredInsideIt) {
  auto s = Make();
  ASSERT_TRUE(s);
  UnitProtocol p(s.get());
  ASSERT_TRUE(p.Declare({"outer", {0}}).ok());
  ASSERT_TRUE(p.Declare({"inner", {1}, 0}).ok());
  p.BeginIteration();
  ASSERT_THAT(p.EnterUnit(0, true), IsOk());
  ASSERT_THAT(p.EnterUnit(1, true), IsOk());
  EXPECT_EQ(p.active(), (std::vector<uint32_t>{0, 1}));
  ASSERT_THAT(p.ExitUnit(1), IsOk());
  EXPECT_EQ(p.active(), (std::vector<uint32_t>{0}));
  ASSERT_THAT(p.ExitUnit(0), IsOk());
  EXPECT_THAT(p.ExitUnit(0), StatusIs(StatusCode::kFailedPrecondition, "without entering"));
  // An inner unit whose forward raised never exits: it leaves with its outer unit.
  ASSERT_THAT(p.EnterUnit(0, true), IsOk());
  ASSERT_THAT(p.EnterUnit(1, true), IsOk());
  ASSERT_THAT(p.ExitUnit(0), IsOk());
  EXPECT_TRUE(p.active().empty());
  // An abandoned iteration's units still leave; the next iteration starts with none.
  ASSERT_THAT(p.EnterUnit(0, true), IsOk());
  p.EndIteration();
  EXPECT_EQ(p.active(), (std::vector<uint32_t>{0}));
  ASSERT_THAT(p.ExitUnit(0), IsOk());
  ASSERT_THAT(p.EnterUnit(1, true), IsOk());  // its forward raised: it never leaves
  p.BeginIteration();
  EXPECT_TRUE(p.active().empty());
  // An eval forward outside the iteration is phase kEval.
  p.EndIteration();
  EXPECT_FALSE(p.in_iteration());
  ASSERT_THAT(p.EnterUnit(0, false), IsOk());
  EXPECT_EQ(s->iterations().phase(), RunPhase::kEval);
}

// The recorded trace: per unit one pre-forward and one pre-backward with its kind, unit and
// label; the second iteration's deferred updates come before each unit's pre-forward, one
// optimizer moment each, and only for that unit's groups.
TEST(UnitProtocol, MarksMomentsWithKindAndUnitAndRunsDeferredStepsFirst) {
  char tmpl[] = "/tmp/tiermem-unit-protocol-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string path = std::string(tmpl) + "/t.tmtrace";
  auto s = Make();
  ASSERT_TRUE(s);
  UnitProtocol p(s.get());
  for (size_t g = 0; g < 3; ++g) {
    ASSERT_TRUE(p.Declare({"u" + std::to_string(g), {g}}).ok());
  }
  ASSERT_THAT(s->traces().RecordTrace(path, 2), IsOk());
  Iteration(*s, p);
  EXPECT_EQ(s->optimizer().pending_steps(), 3u);  // optimizer_overlap: next-forward
  Iteration(*s, p);
  ASSERT_TRUE(s->traces().FinishTrace().ok());
  auto t = planners::ReadTraceFile(path);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_EQ(t->iterations.size(), 2u);
  for (size_t it = 0; it < 2; ++it) {
    std::vector<std::string> seen;
    bool forward = true;  // before the first pre-backward
    for (const planners::Moment& m : t->iterations[it].moments) {
      if (m.kind == MomentKind::kPreBackward) forward = false;
      if (m.kind == MomentKind::kPreForward || m.kind == MomentKind::kPreBackward) {
        ASSERT_NE(m.unit, planners::kNoUnit) << m.label;
        EXPECT_EQ(m.label, "u" + std::to_string(m.unit) + ":" +
                               std::string(planners::MomentKindName(m.kind)));
        seen.push_back(m.label);
      } else if (m.kind == MomentKind::kOptimizerStep && forward) {
        seen.push_back("step");  // a deferred update inside the forward
      }
    }
    const std::vector<std::string> fwd_bwd = {"u0:pre-forward",  "u1:pre-forward",
                                              "u2:pre-forward",  "u2:pre-backward",
                                              "u1:pre-backward", "u0:pre-backward"};
    const std::vector<std::string> deferred = {"step",           "u0:pre-forward", "step",
                                               "u1:pre-forward", "step",           "u2:pre-forward",
                                               "u2:pre-backward", "u1:pre-backward",
                                               "u0:pre-backward"};
    EXPECT_EQ(seen, it == 0 ? fwd_bwd : deferred) << "iteration " << it;
  }
}

}  // namespace
}  // namespace tiermem::session
