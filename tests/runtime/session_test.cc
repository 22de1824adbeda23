// Session: layout, values, the optimizer step against the kernels' own math (bit for bit),
// gradient accumulation, clipping, fp16 loss scaling, LR changes, deferred and speculative
// updates, bad input. Everything runs on SimDevice + the host tier.
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

TEST(SessionLayout, GroupsHoldTheKindsTheirPrecisionNeeds) {
  auto s = Make({{"device", "1MiB"}, {"chunk_size", 2048}},
                {{"w", 1500, true, 0}, {"b", 400, true, 0}, {"frozen", 600, false, 0}});
  ASSERT_TRUE(s);
  EXPECT_EQ(s->layout().chunk_elems, 2048u);
  ASSERT_EQ(s->layout().num_groups(), 2u);  // trainable tensors in one group, the frozen one in another
  EXPECT_EQ(s->layout().place(0).group, s->layout().place(1).group);
  EXPECT_NE(s->layout().place(2).group, s->layout().place(0).group);
  const size_t tg = s->layout().place(0).group, fg = s->layout().place(2).group;
  for (ChunkKind k : {ChunkKind::kParamFp32, ChunkKind::kGrad, ChunkKind::kExpAvg,
                      ChunkKind::kExpAvgSq}) {
    EXPECT_TRUE(s->layout().has_kind(tg, k)) << chunks::ChunkKindName(k);
  }
  EXPECT_FALSE(s->layout().has_kind(tg, ChunkKind::kParamLowp));
  EXPECT_TRUE(s->layout().has_kind(fg, ChunkKind::kParamFp32));
  EXPECT_FALSE(s->layout().has_kind(fg, ChunkKind::kGrad));
  EXPECT_THAT(s->chunks().Acquire(fg, ChunkKind::kGrad, TierKind::kHost),
              StatusIs(StatusCode::kInvalidArgument, "has no grad chunk"));
  EXPECT_EQ(s->chunks().ChunkBytes(tg, ChunkKind::kParamFp32), 2048u * 4);

  auto m = Make({{"device", "1MiB"}, {"chunk_size", 2048}, {"precision", "bf16"}},
                {{"w", 1500, true, 0}, {"frozen", 600, false, 0}});
  ASSERT_TRUE(m);
  const size_t mt = m->layout().place(0).group, mf = m->layout().place(1).group;
  EXPECT_EQ(m->layout().compute_kind(), ChunkKind::kParamLowp);
  EXPECT_EQ(m->layout().dtype(ChunkKind::kGrad), kernels::DType::kBF16);
  EXPECT_EQ(m->chunks().ChunkBytes(mt, ChunkKind::kParamLowp), 2048u * 2);
  EXPECT_EQ(m->chunks().ChunkBytes(mt, ChunkKind::kParamFp32), 2048u * 4);  // the master
  EXPECT_TRUE(m->layout().has_kind(mf, ChunkKind::kParamFp32));  // frozen params keep exact values
  EXPECT_TRUE(m->layout().has_kind(mf, ChunkKind::kParamLowp));
}

TEST(SessionLayout, BudgetTooSmallNamesTheMinimumAndBadTensorsAreRefused) {
  auto c = ParseConfig({{"device", 4096}, {"device_kind", "sim"}}, MapEnv({}));
  ASSERT_TRUE(c.ok());
  auto s = Session::Create(*c, {{"big", 100000, true, 0}});
  EXPECT_THAT(s, StatusIs(StatusCode::kResourceExhausted, "minimum"));
  EXPECT_THAT(Session::Create(*c, {}), StatusIs(StatusCode::kInvalidArgument, "no parameters"));
  EXPECT_THAT(Session::Create(*c, {{"empty", 0, true, 0}}),
              StatusIs(StatusCode::kInvalidArgument, "empty"));
  auto d = ParseConfig({{"device", "1MiB"}, {"device_kind", "sim"}, {"chunk_size", 1 << 20}},
                       MapEnv({}));
  EXPECT_THAT(Session::Create(*d, {{"w", 10, true, 0}}),
              StatusIs(StatusCode::kResourceExhausted, "for chunk_size=1048576"));
  // With NVMe, a host budget with room for the staging slots but not for one chunk group's
  // NVMe-homed chunks during the optimizer step is refused up front, naming the minimum
  // (it used to fail at the first step, after some groups had stepped).
  const std::string dir = TempDir();
  auto h = ParseConfig({{"device", "1MiB"}, {"host", "600KiB"}, {"device_kind", "sim"},
                        {"chunk_size", 16384}, {"nvme", {{"path", dir}, {"size", "16MiB"}}}},
                       MapEnv({}));
  ASSERT_TRUE(h.ok());
  EXPECT_THAT(Session::Create(*h, {{"w", 16384, true, 0}, {"v", 16384, true, 0}}),
              StatusIs(StatusCode::kResourceExhausted,
                       "below the minimum of 720896 bytes with NVMe"));
  std::filesystem::remove_all(dir);
  auto e = ParseConfig({{"device_kind", "cuda"}}, MapEnv({}));
  if (TierStack::ResolveDeviceKind(DeviceKind::kAuto).value() != DeviceKind::kCuda) {
    EXPECT_THAT(Session::Create(*e, {{"w", 10, true, 0}}),
                StatusIs(StatusCode::kUnavailable, "no CUDA device"));
  }
}

TEST(SessionValues, MixedPrecisionWritesTheMasterAndTheRoundedComputeCopy) {
  auto s = Make({{"device", "1MiB"}, {"precision", "bf16"}}, {{"w", 100, true, 0}});
  ASSERT_TRUE(s);
  std::vector<float> w = Random(100, 1);
  w[0] = 1.00390625f;  // between two bf16 values: the copy rounds, the master keeps it
  ASSERT_THAT(s->values().WriteParam(0, w.data()), IsOk());
  EXPECT_EQ(Param(*s, 0), w);
  std::vector<uint16_t> low(100);
  ASSERT_THAT(s->values().ReadTensor(0, ChunkKind::kParamLowp, low.data()), IsOk());
  std::vector<uint16_t> want(100);
  kernels::CastFromF32(w.data(), want.data(), kernels::DType::kBF16, 100);
  EXPECT_EQ(low, want);
}

TEST(SessionStep, EqualsTheKernelOnEachTensorBitForBit) {
  auto s = Make({{"device", "1MiB"}, {"chunk_size", 1100}}, kThree);  // a, then b+c
  ASSERT_TRUE(s);
  ASSERT_EQ(s->layout().num_groups(), 2u);
  std::vector<RefState> ref;
  for (size_t t = 0; t < 3; ++t) {
    ref.emplace_back(Random(kThree[t].numel, 10 + t));
    ASSERT_THAT(s->values().WriteParam(t, ref[t].p.data()), IsOk());
  }
  const GroupHyper h{2e-3, 0.9, 0.99, 1e-8, 0.05};
  for (int step = 0; step < 4; ++step) {
    for (size_t t = 0; t < 3; ++t) {
      const std::vector<float> g = Random(kThree[t].numel, 100 * step + t, 0.1f);
      SetGrad(*s, t, g);
      ref[t].Step(g, h);
    }
    auto r = s->optimizer().Step({h});
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_TRUE(r->applied);
    EXPECT_EQ(r->grad_norm, -1);  // not computed without clipping
    ASSERT_THAT(s->optimizer().ZeroGrad(), IsOk());
  }
  for (size_t t = 0; t < 3; ++t) {
    EXPECT_EQ(Param(*s, t), ref[t].p) << kThree[t].name;
    std::vector<float> m(kThree[t].numel);
    ASSERT_THAT(s->values().ReadTensor(t, ChunkKind::kExpAvg, m.data()), IsOk());
    EXPECT_EQ(m, ref[t].m);
    EXPECT_EQ(s->values().step_count(t), 4);
  }
}

TEST(SessionStep, TensorsWithoutGradientAreNotSteppedAndTheirStaleBytesAreNotRead) {
  auto s = Make({{"device", "1MiB"}, {"gradient_clipping", 0.5}}, kThree);
  ASSERT_TRUE(s);
  std::vector<RefState> ref;
  for (size_t t = 0; t < 3; ++t) {
    ref.emplace_back(Random(kThree[t].numel, 20 + t));
    ASSERT_THAT(s->values().WriteParam(t, ref[t].p.data()), IsOk());
  }
  // Step 1: every tensor has a gradient; b's is huge.
  std::vector<std::vector<float>> g;
  for (size_t t = 0; t < 3; ++t) g.push_back(Random(kThree[t].numel, 30 + t, t == 1 ? 50.f : 1.f));
  for (size_t t = 0; t < 3; ++t) SetGrad(*s, t, g[t]);
  ASSERT_TRUE(s->optimizer().Step({GroupHyper{}}).ok());
  double sq = 0;
  for (auto& gt : g) for (float x : gt) sq += double(x) * x;
  float coef = std::min((1.0f / (static_cast<float>(std::sqrt(sq)) + 1e-6f)) * 0.5f, 1.0f);
  for (size_t t = 0; t < 3; ++t) ref[t].Step(g[t], GroupHyper{}, coef);
  // Step 2: b's gradient is dropped (torch's set_to_none) but its bytes stay in the chunk.
  // Neither its value nor the clipping norm may see them.
  s->optimizer().SetHasGrad(1, false);
  for (size_t t : {0, 2}) {
    g[t] = Random(kThree[t].numel, 40 + t);
    SetGrad(*s, t, g[t]);
  }
  auto r = s->optimizer().Step({GroupHyper{}});
  ASSERT_TRUE(r.ok());
  sq = 0;
  for (size_t t : {0, 2}) for (float x : g[t]) sq += double(x) * x;
  EXPECT_NEAR(r->grad_norm, std::sqrt(sq), 1e-9 * std::sqrt(sq));
  coef = std::min((1.0f / (static_cast<float>(std::sqrt(sq)) + 1e-6f)) * 0.5f, 1.0f);
  EXPECT_EQ(r->clip_coef, coef);
  for (size_t t : {0, 2}) ref[t].Step(g[t], GroupHyper{}, coef);
  for (size_t t = 0; t < 3; ++t) EXPECT_EQ(Param(*s, t), ref[t].p) << kThree[t].name;
  EXPECT_EQ(s->values().step_count(1), 1);
  EXPECT_EQ(s->values().step_count(0), 2);
}

TEST(SessionStep, AccumulationAppliesEveryNthStepAndKeepsGradientsInBetween) {
  auto s = Make({{"device", "1MiB"}, {"gradient_accumulation_steps", 3}}, kThree);
  ASSERT_TRUE(s);
  RefState ref(Random(1000, 5));
  ASSERT_THAT(s->values().WriteParam(0, ref.p.data()), IsOk());
  for (int micro = 1; micro <= 3; ++micro) {
    SetGrad(*s, 0, std::vector<float>(1000, 0.25f * micro));  // the binding's running sum
    auto r = s->optimizer().Step({GroupHyper{}});
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->applied, micro == 3);
    EXPECT_EQ(s->optimizer().accumulating(), micro != 3);
    auto z = s->optimizer().ZeroGrad();
    ASSERT_TRUE(z.ok());
    EXPECT_EQ(*z, micro == 3) << "zero_grad only clears after an applied step";
    EXPECT_EQ(s->optimizer().has_grad(0), micro != 3);
  }
  ref.Step(std::vector<float>(1000, 0.75f), GroupHyper{});
  EXPECT_EQ(Param(*s, 0), ref.p);
  EXPECT_EQ(s->optimizer().micro_steps(), 3u);
}

TEST(SessionStep, PerGroupHyperParametersAndLrChangesApply) {
  std::vector<TensorSpec> specs = {{"decay", 500, true, 0}, {"no_decay", 200, true, 1}};
  auto s = Make({{"device", "1MiB"}}, specs);
  ASSERT_TRUE(s);
  RefState a(Random(500, 1)), b(Random(200, 2));
  ASSERT_THAT(s->values().WriteParam(0, a.p.data()), IsOk());
  ASSERT_THAT(s->values().WriteParam(1, b.p.data()), IsOk());
  std::vector<GroupHyper> h = {{1e-3, 0.9, 0.999, 1e-8, 0.1}, {3e-3, 0.9, 0.999, 1e-8, 0.0}};
  for (int step = 0; step < 3; ++step) {
    auto ga = Random(500, 50 + step), gb = Random(200, 60 + step);
    SetGrad(*s, 0, ga);
    SetGrad(*s, 1, gb);
    ASSERT_TRUE(s->optimizer().Step(h).ok());
    a.Step(ga, h[0]);
    b.Step(gb, h[1]);
    h[0].lr *= 0.5;  // a scheduler between steps
    h[1].lr *= 0.5;
  }
  EXPECT_EQ(Param(*s, 0), a.p);
  EXPECT_EQ(Param(*s, 1), b.p);
  EXPECT_THAT(s->optimizer().Step({h[0]}), StatusIs(StatusCode::kInvalidArgument, "param group 1"));
}

// A step that cannot acquire a group's chunks (here: m pinned on the device by someone else)
// fails naming that group; the groups before it were stepped, that group's step counts and
// values are unchanged, and the next step after the pin is gone steps it normally.
TEST(SessionStep, AGroupThatCannotBeAcquiredIsNotSteppedAndSaysWhich) {
  // Three groups; the device holds two groups' chunks: the step runs on host copies.
  auto s = Make({{"device", "32KiB"}, {"chunk_size", 1024}},
                {{"a", 1000, true, 0}, {"b", 1000, true, 0}, {"c", 1000, true, 0}});
  ASSERT_TRUE(s);
  ASSERT_EQ(s->layout().num_groups(), 3u);
  for (size_t t = 0; t < 3; ++t) {
    ASSERT_THAT(s->values().WriteParam(t, Random(s->layout().place(t).numel, t).data()), IsOk());
  }
  for (size_t t = 0; t < 3; ++t) SetGrad(*s, t, Random(s->layout().place(t).numel, 10 + t));
  const std::vector<float> b_before = Param(*s, 1);
  ASSERT_TRUE(s->chunks().Acquire(1, ChunkKind::kExpAvg, TierKind::kDevice).ok());
  auto r = s->optimizer().Step({GroupHyper{}});
  EXPECT_THAT(r.status(), StatusIs(StatusCode::kFailedPrecondition, "chunk group 1 of 3"));
  EXPECT_EQ(s->values().step_count(0), 1);  // group 0 was stepped
  EXPECT_EQ(s->values().step_count(1), 0);
  EXPECT_EQ(s->values().step_count(2), 0);
  ASSERT_THAT(s->chunks().Release(1, ChunkKind::kExpAvg, false), IsOk());
  EXPECT_EQ(Param(*s, 1), b_before);
  ASSERT_TRUE(s->optimizer().Step({GroupHyper{}}).ok());
  EXPECT_EQ(s->values().step_count(1), 1);
  EXPECT_NE(Param(*s, 1), b_before);
}

// optimizer_overlap: next-forward defers each group's update until something touches the group;
// every access path must see exactly what the immediate step ("off") gives.
TEST(SessionStep, DeferredUpdatesEqualImmediateOnesOnEveryAccessPath) {
  // Three groups (a | b | c+d), host copies for the step (the device holds two groups).
  const std::vector<TensorSpec> specs = {{"a", 1000, true, 0}, {"b", 1000, true, 1},
                                         {"c", 600, true, 0}, {"d", 400, true, 1}};
  std::unique_ptr<Session> s[2];
  for (int k = 0; k < 2; ++k) {
    s[k] = Make({{"device", "32KiB"}, {"chunk_size", 1024}, {"gradient_clipping", 0.5},
                 {"optimizer_overlap", k == 0 ? "off" : "next-forward"}},
                specs);
    ASSERT_TRUE(s[k]);
    ASSERT_EQ(s[k]->layout().num_groups(), 3u);
    for (size_t t = 0; t < specs.size(); ++t) {
      ASSERT_THAT(s[k]->values().WriteParam(t, Random(specs[t].numel, t).data()), IsOk());
    }
  }
  auto same = [&](const char* when) {
    for (size_t t = 0; t < specs.size(); ++t) {
      EXPECT_EQ(Param(*s[0], t), Param(*s[1], t)) << when << ": " << specs[t].name;
      for (ChunkKind kind : {ChunkKind::kExpAvg, ChunkKind::kExpAvgSq, ChunkKind::kGrad}) {
        std::vector<float> x(specs[t].numel), y(specs[t].numel);
        ASSERT_THAT(s[0]->values().ReadTensor(t, kind, x.data()), IsOk());
        ASSERT_THAT(s[1]->values().ReadTensor(t, kind, y.data()), IsOk());
        EXPECT_EQ(x, y) << when << ": " << specs[t].name << " " << chunks::ChunkKindName(kind);
      }
      EXPECT_EQ(s[0]->values().step_count(t), s[1]->values().step_count(t));
    }
  };
  for (int step = 0; step < 5; ++step) {
    // LR changes every step; group 1's decay too (captured at each Step).
    const std::vector<GroupHyper> hyper = {{1e-2 / (step + 1), 0.9, 0.99, 1e-8, 0.01},
                                           {3e-3, 0.8, 0.95, 1e-6, 0.1 * step}};
    for (int k = 0; k < 2; ++k) {
      for (size_t t = 0; t < specs.size(); ++t) {
        if (step == 2 && t == 1) continue;  // b has no gradient in step 2
        SetGrad(*s[k], t, Random(specs[t].numel, 50 * step + t, 0.3f));
      }
      auto r = s[k]->optimizer().Step(hyper);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      EXPECT_LT(r->clip_coef, 1.0f);  // the norm is above 0.5: clipped
      EXPECT_EQ(s[k]->optimizer().pending_steps(), k == 0 ? 0u : 3u);
    }
    switch (step) {
      case 0:  // grads dropped while pending: the update still reads them, then they are zero
        for (int k = 0; k < 2; ++k) ASSERT_THAT(s[k]->optimizer().ZeroGrad(), IsOk());
        EXPECT_EQ(s[1]->optimizer().pending_steps(), 3u);
        same("after zero_grad");
        EXPECT_EQ(s[1]->optimizer().pending_steps(), 0u);
        break;
      case 1:  // one tensor read: only its group is updated
        EXPECT_EQ(Param(*s[0], 2), Param(*s[1], 2));
        EXPECT_EQ(s[1]->optimizer().pending_steps(), 2u);
        break;
      case 2:  // the binding's announcement, group by group, as a forward would
        for (size_t g = 0; g < 3; ++g) ASSERT_THAT(s[1]->optimizer().FinishStep(g), IsOk());
        EXPECT_EQ(s[1]->optimizer().pending_steps(), 0u);
        same("after FinishStep");
        break;
      case 3:  // a value written while pending lands after the update (not overwritten by it)
        for (int k = 0; k < 2; ++k) {
          ASSERT_THAT(s[k]->values().WriteParam(0, Random(1000, 999).data()), IsOk());
        }
        same("after a write");
        break;
      default:  // nothing in between: the next Step runs them first
        break;
    }
  }
  ASSERT_THAT(s[1]->Flush(), IsOk());
  EXPECT_EQ(s[1]->optimizer().pending_steps(), 0u);
  same("at the end");
}

TEST(SessionStep, SpeculativeStepsInTheBackwardAreBitIdenticalWithClippingOn) {
  // Three groups (a | b | c+d), two optimizer param groups, clipping at 1.0: gradients of
  // scale 0.1 clip (norm ~ 5), of 0.003 do not (~ 0.16). In every precision (bf16: the rounded
  // compute copy is speculated too; fp16: an overflowing step drops every speculation).
  const std::vector<TensorSpec> specs = {{"a", 1000, true, 0}, {"b", 1000, true, 1},
                                         {"c", 600, true, 0}, {"d", 400, true, 1}};
  for (const char* precision : {"fp32", "bf16", "fp16"}) {
    SCOPED_TRACE(precision);
    std::unique_ptr<Session> s[2];
    for (int k = 0; k < 2; ++k) {
      s[k] = Make({{"device", "32KiB"}, {"chunk_size", 1024}, {"gradient_clipping", 1.0},
                   {"precision", precision}, {"optimizer_placement", "host"},
                   {"optimizer_overlap", k == 0 ? "off" : "backward"}},
                  specs);
      ASSERT_TRUE(s[k]);
      ASSERT_EQ(s[k]->layout().num_groups(), 3u);
      for (size_t t = 0; t < specs.size(); ++t) {
        ASSERT_THAT(s[k]->values().WriteParam(t, Random(specs[t].numel, t).data()), IsOk());
      }
    }
    const bool fp16 = std::string(precision) == "fp16";
    for (int it = 0; it < 9; ++it) {
      SCOPED_TRACE("iteration " + std::to_string(it));
      SpecIt o;
      // The LR schedule moves every step; the announcement is what step() gets.
      o.hyper = {{1e-2 / (it + 1), 0.9, 0.99, 1e-8, 0.01}, {3e-3, 0.8, 0.95, 1e-6, 0.1}};
      o.announced = o.hyper;
      o.grad_scale = it % 3 == 1 ? 0.1f : 0.003f;  // clipped at 1, 4, 7
      if (it == 5) o.announced[1].lr = 1.0;  // the user changed it after the forward
      o.rewrite = it == 6;                   // a later gradient for the speculated group
      o.overflow = fp16 && it == 8;
      std::vector<std::vector<float>> seen[2];
      if (it == 3) {  // reads between backward and step see the values before the step
        for (int k = 0; k < 2; ++k) {
          o.between = [&seen, k](Session& x) { seen[k] = TrainingState(x); };
          StepResult r = SpecIteration(*s[k], it, o);
          EXPECT_TRUE(r.applied);
        }
        EXPECT_EQ(seen[0], seen[1]);
      } else {
        StepResult r[2];
        for (int k = 0; k < 2; ++k) r[k] = SpecIteration(*s[k], it, o);
        EXPECT_EQ(r[0].clip_coef, r[1].clip_coef);
        EXPECT_EQ(r[0].skipped, r[1].skipped);
        EXPECT_EQ(r[0].clip_coef < 1.0f, it % 3 == 1) << r[0].grad_norm;
      }
      EXPECT_EQ(TrainingState(*s[0]), TrainingState(*s[1]));
    }
    const Session::SpeculationStats& st = s[1]->speculation_stats();
    // Two of three groups per backward (group 0's gradient completes at the last moment)
    // from the second iteration, less group 2 after its rewrite (its last gradient came at
    // the last moment then): 8 x 2 - 1. Dropped: the clipped steps (2 + 2 + 1), the changed
    // LR (param group 1 has tensors in groups 1 and 2), the rewrite, the fp16 overflow.
    EXPECT_EQ(st.speculated, 15u);
    EXPECT_EQ(st.no_room, 0u);
    EXPECT_EQ(st.dropped, 5u + 2u + 1u + (fp16 ? 2u : 0u));
    EXPECT_EQ(st.committed + st.dropped, st.speculated);
    EXPECT_EQ(s[0]->speculation_stats().speculated, 0u);
  }
}

TEST(SessionStep, SpeculativeStepsTakeOnlyFreeHostRoom) {
  // A host budget the homes almost fill: nothing is speculated (nor evicted for it); the
  // steps run deferred, with the same values.
  const std::vector<TensorSpec> specs = {{"a", 4096, true, 0}, {"b", 4096, true, 0}};
  std::unique_ptr<Session> s[2];
  for (int k = 0; k < 2; ++k) {
    s[k] = Make({{"device", "256KiB"}, {"host", "160KiB"}, {"chunk_size", 4096},
                 {"optimizer_placement", "host"},
                 {"optimizer_overlap", k == 0 ? "off" : "backward"}},
                specs);
    ASSERT_TRUE(s[k]);
    for (size_t t = 0; t < specs.size(); ++t) {
      ASSERT_THAT(s[k]->values().WriteParam(t, Random(4096, t).data()), IsOk());
    }
  }
  for (int it = 0; it < 4; ++it) {
    SpecIt o;
    o.hyper = o.announced = {GroupHyper{}};
    for (int k = 0; k < 2; ++k) SpecIteration(*s[k], it, o);
    EXPECT_EQ(TrainingState(*s[0]), TrainingState(*s[1]));
  }
  EXPECT_EQ(s[1]->speculation_stats().speculated, 0u);
  EXPECT_GT(s[1]->speculation_stats().no_room, 0u);
}

TEST(SessionStep, ADeferredUpdateIsAlsoInTheCheckpoint) {
  const std::string dir = TempDir();
  auto s = Make({{"device", "32KiB"}, {"chunk_size", 1024}}, kThree);
  auto ref = Make({{"device", "32KiB"}, {"chunk_size", 1024}, {"optimizer_overlap", "off"}},
                  kThree);
  ASSERT_TRUE(s && ref);
  for (Session* x : {s.get(), ref.get()}) {
    for (size_t t = 0; t < 3; ++t) {
      ASSERT_THAT(x->values().WriteParam(t, Random(kThree[t].numel, t).data()), IsOk());
      SetGrad(*x, t, Random(kThree[t].numel, 7 + t));
    }
    ASSERT_TRUE(x->optimizer().Step({GroupHyper{}}).ok());
  }
  ASSERT_GT(s->optimizer().pending_steps(), 0u);
  ASSERT_THAT(s->SaveCheckpoint(dir + "/ck"), IsOk());
  EXPECT_EQ(s->optimizer().pending_steps(), 0u);
  auto loaded = Make({{"device", "32KiB"}, {"chunk_size", 1024}}, kThree);
  ASSERT_TRUE(loaded);
  ASSERT_THAT(loaded->LoadCheckpoint(dir + "/ck"), IsOk());
  for (size_t t = 0; t < 3; ++t) EXPECT_EQ(Param(*loaded, t), Param(*ref, t)) << t;
  std::filesystem::remove_all(dir);
}

TEST(SessionStep, BadHyperParametersChangeNothing) {
  auto s = Make({{"device", "1MiB"}}, kThree);
  ASSERT_TRUE(s);
  const std::vector<float> before = Random(1000, 9);
  ASSERT_THAT(s->values().WriteParam(0, before.data()), IsOk());
  SetGrad(*s, 0, Random(1000, 10));
  GroupHyper bad;
  bad.eps = 0;
  EXPECT_THAT(s->optimizer().Step({bad}), StatusIs(StatusCode::kInvalidArgument, "eps must be > 0"));
  bad = GroupHyper{};
  bad.beta2 = 1.0;
  EXPECT_THAT(s->optimizer().Step({bad}), StatusIs(StatusCode::kInvalidArgument, "betas[1]"));
  bad = GroupHyper{};
  bad.lr = -1;
  EXPECT_THAT(s->optimizer().Step({bad}), StatusIs(StatusCode::kInvalidArgument, "lr"));
  EXPECT_EQ(Param(*s, 0), before);
  EXPECT_EQ(s->values().step_count(0), 0);
  EXPECT_EQ(s->optimizer().micro_steps(), 0u);
}

TEST(SessionStep, Fp16OverflowSkipsTheStepAndLowersTheScaleThenGrows) {
  auto s = Make({{"device", "1MiB"},
                 {"precision", "fp16"},
                 {"loss_scaling", {{"initial_scale", 1024}, {"growth_interval", 2}}}},
                {{"w", 64, true, 0}});
  ASSERT_TRUE(s);
  EXPECT_EQ(s->optimizer().loss_scale(), 1024);
  std::vector<float> w = Random(64, 3);
  ASSERT_THAT(s->values().WriteParam(0, w.data()), IsOk());
  std::vector<float> g = Random(64, 4);
  g[7] = INFINITY;
  SetGrad(*s, 0, g);
  auto r = s->optimizer().Step({GroupHyper{}});
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->skipped);
  EXPECT_FALSE(r->applied);
  EXPECT_EQ(s->optimizer().loss_scale(), 512);
  EXPECT_EQ(s->optimizer().scaler().skipped_steps, 1u);
  EXPECT_EQ(Param(*s, 0), w);
  EXPECT_EQ(s->values().step_count(0), 0);
  // Two good steps at 512: the grads are unscaled (so the update equals the unscaled one),
  // then the scale doubles.
  RefState ref(w);
  for (int i = 0; i < 2; ++i) {
    std::vector<float> gi = Random(64, 70 + i, 0.01f);
    std::vector<float> scaled(64);
    for (int k = 0; k < 64; ++k) scaled[k] = gi[k] * 512.0f;
    SetGrad(*s, 0, scaled);
    r = s->optimizer().Step({GroupHyper{}});
    ASSERT_TRUE(r.ok() && r->applied);
    // The reference reads the same fp16 values and unscales them in the kernel.
    std::vector<uint16_t> h16(64);
    kernels::CastFromF32(scaled.data(), h16.data(), kernels::DType::kF16, 64);
    std::vector<float> back(64);
    kernels::CastToF32(h16.data(), kernels::DType::kF16, back.data(), 64);
    for (float& x : back) x *= 1.0f / 512.0f;
    ref.Step(back, GroupHyper{});
  }
  EXPECT_EQ(s->optimizer().loss_scale(), 1024);
  std::vector<float> got = Param(*s, 0);
  EXPECT_EQ(got, ref.p);
}

}  // namespace
}  // namespace tiermem::session
