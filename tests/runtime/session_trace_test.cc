// Session timeline and warm-up trace: temporary and configured timelines, untraced acquires,
// the recorded iterations, moments, accesses, saved bytes and rates, bad arguments.
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

TEST(SessionTimeline, TemporaryTimelineGoesAwayAtCloseAConfiguredOneStays) {
  const std::string dir = TempDir();
  auto s = Make({{"device", "1MiB"}}, kThree);
  ASSERT_TRUE(s);
  const std::string tmp = s->timeline_path();
  EXPECT_TRUE(std::filesystem::exists(tmp));
  auto rep = s->traces().TimelineReport();
  ASSERT_TRUE(rep.ok()) << rep.status().ToString();
  EXPECT_GT(rep->events, 0u);
  s->Close();
  EXPECT_TRUE(s->closed());
  EXPECT_FALSE(std::filesystem::exists(tmp));
  EXPECT_THAT(s->optimizer().Step({GroupHyper{}}), StatusIs(StatusCode::kFailedPrecondition, "closed"));
  EXPECT_EQ(s->layout().num_tensors(), 3u);  // the layout stays readable

  auto k = Make({{"device", "1MiB"}, {"timeline", dir + "/sub/run.tmt"}}, kThree);
  ASSERT_TRUE(k);
  k->Close();
  EXPECT_TRUE(std::filesystem::exists(dir + "/sub/run.tmt"));
  std::filesystem::remove_all(dir);
}

// A session that is never closed (leaked, as a binding's object kept alive by a reference
// cycle can be) removes its temporary timeline when the process exits normally. Held by a
// global, so LeakSanitizer does not report it as a leak.
Session* g_never_closed = nullptr;

TEST(SessionTimelineDeathTest, ANeverClosedSessionsTemporaryTimelineGoesAwayAtExit) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // The threadsafe style runs this test again in a fresh process for the statement: the
  // child takes the parent's directory from the environment instead of making its own.
  const char* given = getenv("TIERMEM_TEST_EXIT_DIR");
  const std::string dir = given != nullptr ? given : TempDir();
  setenv("TIERMEM_TEST_EXIT_DIR", dir.c_str(), 1);
  EXPECT_EXIT(
      {
        setenv("TMPDIR", dir.c_str(), 1);
        auto s = Make({{"device", "1MiB"}}, kThree);
        if (!s || !std::filesystem::exists(s->timeline_path())) std::_Exit(3);
        auto closed = Make({{"device", "1MiB"}}, kThree);  // closed: forgotten by the handler
        closed->Close();
        g_never_closed = s.release();  // never destroyed
        std::exit(0);
      },
      ::testing::ExitedWithCode(0), "");
  unsetenv("TIERMEM_TEST_EXIT_DIR");
  EXPECT_TRUE(std::filesystem::is_empty(dir)) << "a temporary timeline was left in " << dir;
  std::filesystem::remove_all(dir);
}

TEST(SessionTracing, UntracedAcquiresDoNotDisturbTheRecordedOrder) {
  auto s = Make({{"device", "1MiB"}, {"chunk_size", 1100}}, kThree);
  ASSERT_TRUE(s);
  auto iteration = [&] {
    s->iterations().BeginIteration();
    for (size_t g = 0; g < s->layout().num_groups(); ++g) {
      ASSERT_TRUE(s->chunks().Acquire(g, ChunkKind::kParamFp32, TierKind::kDevice).ok());
      ASSERT_THAT(s->chunks().Release(g, ChunkKind::kParamFp32, false), IsOk());
    }
  };
  iteration();
  iteration();
  // An "eval" pass in between, in another order, untraced.
  s->iterations().SetTracing(false);
  for (size_t g = s->layout().num_groups(); g-- > 0;) {
    ASSERT_TRUE(s->chunks().Acquire(g, ChunkKind::kParamFp32, TierKind::kHost).ok());
    ASSERT_THAT(s->chunks().Release(g, ChunkKind::kParamFp32, false), IsOk());
  }
  s->iterations().SetTracing(true);
  iteration();
  iteration();
  auto st = s->Stats();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->diverged, 0u);
  // The same eval pass traced does diverge (the check above can fail).
  for (size_t g = s->layout().num_groups(); g-- > 0;) {
    ASSERT_TRUE(s->chunks().Acquire(g, ChunkKind::kParamFp32, TierKind::kHost).ok());
    ASSERT_THAT(s->chunks().Release(g, ChunkKind::kParamFp32, false), IsOk());
  }
  iteration();
  st = s->Stats();
  EXPECT_GE(st->diverged, 1u);
}

// ---- warm-up trace ------------------------------------------------------------------------------

// One scripted training iteration over kThree with a small chunk size (several groups): a
// forward moment per unit (= group here) reading its params, the backward writing grads
// (lazily zero: pure writes), then the optimizer step and ZeroGrad.
void ScriptedIteration(Session& s, bool write_param_in_forward = false) {
  using planners::MomentKind;
  s.iterations().BeginIteration();
  const uint32_t n = static_cast<uint32_t>(s.layout().num_groups());
  for (uint32_t g = 0; g < n; ++g) {
    ASSERT_THAT(s.optimizer().FinishStep(g), IsOk());  // as the bindings do before a unit's moment
    s.iterations().Moment("fwd:" + std::to_string(g), MomentKind::kPreForward, g);
    ASSERT_TRUE(s.chunks().Acquire(g, ChunkKind::kParamFp32, TierKind::kDevice).ok());
    s.traces().AddSavedBytes(1000 * (g + 1));
    ASSERT_THAT(s.chunks().Release(g, ChunkKind::kParamFp32, write_param_in_forward && g == 0), IsOk());
  }
  for (uint32_t g = n; g-- > 0;) {
    s.iterations().Moment("bwd:" + std::to_string(g), MomentKind::kPreBackward, g);
    bool must_zero = false;
    auto p = s.chunks().AcquireForWrite(g, ChunkKind::kGrad, TierKind::kDevice, &must_zero);
    ASSERT_TRUE(p.ok());
    if (must_zero) std::memset(*p, 0, s.chunks().ChunkBytes(g, ChunkKind::kGrad));
    ASSERT_THAT(s.chunks().Release(g, ChunkKind::kGrad, true), IsOk());
    for (uint32_t t : s.layout().group(g).tensors) s.optimizer().SetHasGrad(t, true);
  }
  ASSERT_TRUE(s.optimizer().Step({GroupHyper{}}).ok());
  ASSERT_TRUE(s.optimizer().ZeroGrad().ok());
}

TEST(SessionTrace, RecordsTheIterationsMomentsAccessesSavedBytesAndRates) {
  const std::string dir = TempDir();
  const std::string path = dir + "/warmup.tmtrace";
  // The device holds about one group's chunks: forward acquires are host->device copies.
  auto s = Make({{"device", "16KiB"}, {"chunk_size", 512}, {"gradient_clipping", 1.0}},
                {{"a", 500, true, 0}, {"b", 400, true, 0}, {"c", 300, true, 0}});
  ASSERT_TRUE(s);
  const uint32_t groups = static_cast<uint32_t>(s->layout().num_groups());
  ASSERT_EQ(groups, 3u);
  ScriptedIteration(*s);  // before arming: not recorded
  ASSERT_THAT(s->traces().RecordTrace(path, 2), IsOk());
  EXPECT_TRUE(s->traces().trace_armed());
  EXPECT_FALSE(s->traces().recording_trace());
  ScriptedIteration(*s, /*write_param_in_forward=*/true);
  EXPECT_TRUE(s->traces().recording_trace());
  ScriptedIteration(*s);
  EXPECT_FALSE(std::filesystem::exists(path));  // the 2nd iteration's step is still open
  s->iterations().BeginIteration();                           // ends it: the file is written
  EXPECT_TRUE(std::filesystem::exists(path));
  EXPECT_EQ(s->traces().written_trace(), path);
  EXPECT_FALSE(s->traces().trace_armed());

  auto t = planners::ReadTraceFile(path);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_EQ(t->iterations.size(), 2u);
  // Every chunk of the session, with its kind name, group and home.
  size_t chunks = 0;
  for (size_t g = 0; g < s->layout().num_groups(); ++g) {
    for (int k = 0; k < chunks::kNumChunkKinds; ++k) {
      if (!s->layout().has_kind(g, static_cast<ChunkKind>(k))) continue;
      ++chunks;
    }
  }
  ASSERT_EQ(t->chunks.size(), chunks);
  for (const planners::TraceIteration& it : t->iterations) {
    std::vector<const planners::Moment*> fwd, bwd, opt;
    for (const planners::Moment& m : it.moments) {
      if (m.kind == planners::MomentKind::kPreForward) fwd.push_back(&m);
      if (m.kind == planners::MomentKind::kPreBackward) bwd.push_back(&m);
      if (m.kind == planners::MomentKind::kOptimizerStep) opt.push_back(&m);
    }
    ASSERT_EQ(fwd.size(), groups);
    ASSERT_EQ(bwd.size(), groups);
    ASSERT_EQ(opt.size(), groups);
    Bytes in_flight = 0;
    for (uint32_t g = 0; g < groups; ++g) {
      const planners::Moment& m = *fwd[g];
      EXPECT_EQ(m.unit, g);
      EXPECT_EQ(m.saved_bytes, 1000u * (g + 1));
      // Saved bytes of the units before it are still live (their backward has not begun).
      in_flight += m.saved_bytes;
      EXPECT_EQ(m.activation_bytes, in_flight) << m.label;
      ASSERT_EQ(m.num_accesses, 1u);
      const planners::TraceAccess& a = it.accesses[m.first_access];
      EXPECT_EQ(a.chunk, s->layout().group(g).chunks[static_cast<int>(ChunkKind::kParamFp32)]);
      EXPECT_EQ(a.tier, TierKind::kDevice);
      EXPECT_EQ(t->KindName(a.chunk), "param_fp32");
    }
    for (uint32_t i = 0; i < groups; ++i) {
      const planners::Moment& m = *bwd[i];
      EXPECT_EQ(m.unit, groups - 1 - i);
      ASSERT_EQ(m.num_accesses, 1u);
      // Grads are lazily zero at the start of each iteration: written, not read.
      EXPECT_EQ(it.accesses[m.first_access].mode, planners::AccessMode::kWrite);
      EXPECT_EQ(t->KindName(it.accesses[m.first_access].chunk), "grad");
    }
    uint64_t work = 0;
    for (const planners::Moment* m : opt) {
      work += m->work_elems;
      EXPECT_EQ(m->num_accesses, 4u);  // param, grad, m, v
    }
    EXPECT_EQ(work, 500u + 400u + 300u);
  }
  // Released modified after a read acquire: read-write (first recorded iteration only).
  const auto& first = t->iterations[0];
  const auto& second = t->iterations[1];
  auto fwd0_mode = [](const planners::TraceIteration& it) {
    for (const planners::Moment& m : it.moments) {
      if (m.label == "fwd:0") return it.accesses[m.first_access].mode;
    }
    return planners::AccessMode::kWrite;
  };
  EXPECT_EQ(fwd0_mode(first), planners::AccessMode::kReadWrite);
  EXPECT_EQ(fwd0_mode(second), planners::AccessMode::kRead);
  // Measured rates and the budgets the run had.
  EXPECT_GT(t->rates.link[1][0].bytes_per_s, 0);  // host -> device
  EXPECT_GT(t->rates.cpu_optim_elems_per_s + t->rates.device_optim_elems_per_s, 0);
  EXPECT_GE(t->rates.cpu_cores, 1u);
  EXPECT_EQ(t->budgets.device, 16 * kKiB);
  EXPECT_EQ(t->budgets.host, 64 * kMiB);
  std::filesystem::remove_all(dir);
}

TEST(SessionTrace, BadArgumentsUntracedPassesFinishAndClose) {
  const std::string dir = TempDir();
  auto s = Make({{"device", "64KiB"}, {"chunk_size", 1024}}, kThree);
  ASSERT_TRUE(s);
  EXPECT_THAT(s->traces().RecordTrace("", 1), StatusIs(StatusCode::kInvalidArgument, "path is empty"));
  EXPECT_THAT(s->traces().RecordTrace(dir + "/a.tmtrace", 0),
              StatusIs(StatusCode::kInvalidArgument, "iterations must be >= 1"));
  EXPECT_FALSE(s->traces().trace_armed());
  auto none = s->traces().FinishTrace();
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(*none);  // nothing armed: nothing written

  ASSERT_THAT(s->traces().RecordTrace(dir + "/a.tmtrace", 5), IsOk());
  EXPECT_THAT(s->traces().RecordTrace(dir + "/b.tmtrace", 1),
              StatusIs(StatusCode::kFailedPrecondition, "already being recorded"));
  ScriptedIteration(*s);
  // An eval pass, untraced: not in the trace.
  s->iterations().SetTracing(false);
  for (size_t g = 0; g < s->layout().num_groups(); ++g) {
    s->iterations().Moment("eval", planners::MomentKind::kPreForward, 0);
    ASSERT_TRUE(s->chunks().Acquire(g, ChunkKind::kParamFp32, TierKind::kHost).ok());
    ASSERT_THAT(s->chunks().Release(g, ChunkKind::kParamFp32, false), IsOk());
  }
  s->iterations().SetTracing(true);
  // Finish after one of the five iterations writes what was recorded.
  auto w = s->traces().FinishTrace();
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  EXPECT_TRUE(*w);
  auto t = planners::ReadTraceFile(dir + "/a.tmtrace");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_EQ(t->iterations.size(), 1u);
  for (const planners::Moment& m : t->iterations[0].moments) EXPECT_NE(m.label, "eval");
  for (const planners::TraceAccess& a : t->iterations[0].accesses) {
    EXPECT_NE(a.tier, TierKind::kHost) << "the untraced host acquires were recorded";
  }

  // A second recording on the same session; Close writes it.
  ASSERT_THAT(s->traces().RecordTrace(dir + "/c.tmtrace", 3), IsOk());
  ScriptedIteration(*s);
  s->Close();
  auto c = planners::ReadTraceFile(dir + "/c.tmtrace");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->iterations.size(), 1u);

  // A path that cannot be written: the error reaches FinishTrace, training goes on.
  auto u = Make({{"device", "64KiB"}, {"chunk_size", 1024}}, kThree);
  ASSERT_TRUE(u);
  ASSERT_THAT(u->traces().RecordTrace(dir + "/no/such/dir/x.tmtrace", 1), IsOk());
  ScriptedIteration(*u);
  ScriptedIteration(*u);  // its BeginIteration tries to write
  EXPECT_FALSE(u->traces().FinishTrace().ok());
  ScriptedIteration(*u);
  std::filesystem::remove_all(dir);
}

// ---- plans (plan: auto) --------------------------------------------------------------------

}  // namespace
}  // namespace tiermem::session
