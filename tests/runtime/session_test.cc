// Session: layout, values, the optimizer step against the kernels' own math (bit for bit),
// gradient accumulation, clipping, fp16 loss scaling, LR changes, checkpoints, bad input.
// Everything runs on SimDevice + the host tier (+ the file-backed NVMe tier where noted).
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
#include "tests/runtime/session_test_support.h"
#include "tests/support/session.h"
#include "tests/support/status_matchers.h"

namespace tiermem::session {
namespace {

using ::tiermem::testing::IsOk;
using ::tiermem::testing::StatusIs;
using nlohmann::json;

std::string TempDir() {
  char tmpl[] = "/tmp/tiermem-session-XXXXXX";
  EXPECT_NE(mkdtemp(tmpl), nullptr);
  return tmpl;
}

std::unique_ptr<Session> Make(json config, std::vector<TensorSpec> specs) {
  config["device_kind"] = "sim";
  return testing::MakeSession(std::move(config), std::move(specs));
}

std::vector<float> Random(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(gen);
  return v;
}

std::vector<float> Param(Session& s, size_t t) {
  std::vector<float> v(s.place(t).numel);
  EXPECT_THAT(s.ReadParam(t, v.data()), IsOk());
  return v;
}

// What AdamW does to one tensor, computed by the kernel itself on plain buffers.
struct RefState {
  std::vector<float> p, m, v;
  int64_t step = 0;
  explicit RefState(std::vector<float> init) : p(std::move(init)), m(p.size()), v(p.size()) {}
  void Step(const std::vector<float>& g, const GroupHyper& h, float clip = 1.0f) {
    kernels::AdamConfig c;
    c.lr = static_cast<float>(h.lr);
    c.beta1 = static_cast<float>(h.beta1);
    c.beta2 = static_cast<float>(h.beta2);
    c.eps = static_cast<float>(h.eps);
    c.weight_decay = static_cast<float>(h.weight_decay);
    c.step = ++step;
    c.clip_factor = clip;
    kernels::AdamSpans sp;
    sp.param = p.data();
    sp.exp_avg = m.data();
    sp.exp_avg_sq = v.data();
    sp.grad = g.data();
    sp.n = p.size();
    kernels::AdamStep(c, sp);
  }
};

const std::vector<TensorSpec> kThree = {{"a", 1000, true, 0}, {"b", 300, true, 0},
                                        {"c", 77, true, 0}};

TEST(SessionLayout, GroupsHoldTheKindsTheirPrecisionNeeds) {
  auto s = Make({{"device", "1MiB"}, {"chunk_size", 2048}},
                {{"w", 1500, true, 0}, {"b", 400, true, 0}, {"frozen", 600, false, 0}});
  ASSERT_TRUE(s);
  EXPECT_EQ(s->chunk_elems(), 2048u);
  ASSERT_EQ(s->num_groups(), 2u);  // trainable tensors in one group, the frozen one in another
  EXPECT_EQ(s->place(0).group, s->place(1).group);
  EXPECT_NE(s->place(2).group, s->place(0).group);
  const size_t tg = s->place(0).group, fg = s->place(2).group;
  for (ChunkKind k : {ChunkKind::kParamFp32, ChunkKind::kGrad, ChunkKind::kExpAvg,
                      ChunkKind::kExpAvgSq}) {
    EXPECT_TRUE(s->has_kind(tg, k)) << chunks::ChunkKindName(k);
  }
  EXPECT_FALSE(s->has_kind(tg, ChunkKind::kParamLowp));
  EXPECT_TRUE(s->has_kind(fg, ChunkKind::kParamFp32));
  EXPECT_FALSE(s->has_kind(fg, ChunkKind::kGrad));
  EXPECT_THAT(s->Acquire(fg, ChunkKind::kGrad, TierKind::kHost),
              StatusIs(StatusCode::kInvalidArgument, "has no grad chunk"));
  EXPECT_EQ(s->ChunkBytes(tg, ChunkKind::kParamFp32), 2048u * 4);

  auto m = Make({{"device", "1MiB"}, {"chunk_size", 2048}, {"precision", "bf16"}},
                {{"w", 1500, true, 0}, {"frozen", 600, false, 0}});
  ASSERT_TRUE(m);
  const size_t mt = m->place(0).group, mf = m->place(1).group;
  EXPECT_EQ(m->compute_kind(), ChunkKind::kParamLowp);
  EXPECT_EQ(m->dtype(ChunkKind::kGrad), kernels::DType::kBF16);
  EXPECT_EQ(m->ChunkBytes(mt, ChunkKind::kParamLowp), 2048u * 2);
  EXPECT_EQ(m->ChunkBytes(mt, ChunkKind::kParamFp32), 2048u * 4);  // the master
  EXPECT_TRUE(m->has_kind(mf, ChunkKind::kParamFp32));  // frozen params keep exact values
  EXPECT_TRUE(m->has_kind(mf, ChunkKind::kParamLowp));
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
  ASSERT_THAT(s->WriteParam(0, w.data()), IsOk());
  EXPECT_EQ(Param(*s, 0), w);
  std::vector<uint16_t> low(100);
  ASSERT_THAT(s->ReadTensor(0, ChunkKind::kParamLowp, low.data()), IsOk());
  std::vector<uint16_t> want(100);
  kernels::CastFromF32(w.data(), want.data(), kernels::DType::kBF16, 100);
  EXPECT_EQ(low, want);
}

TEST(SessionStep, EqualsTheKernelOnEachTensorBitForBit) {
  auto s = Make({{"device", "1MiB"}, {"chunk_size", 1100}}, kThree);  // a, then b+c
  ASSERT_TRUE(s);
  ASSERT_EQ(s->num_groups(), 2u);
  std::vector<RefState> ref;
  for (size_t t = 0; t < 3; ++t) {
    ref.emplace_back(Random(kThree[t].numel, 10 + t));
    ASSERT_THAT(s->WriteParam(t, ref[t].p.data()), IsOk());
  }
  const GroupHyper h{2e-3, 0.9, 0.99, 1e-8, 0.05};
  for (int step = 0; step < 4; ++step) {
    for (size_t t = 0; t < 3; ++t) {
      const std::vector<float> g = Random(kThree[t].numel, 100 * step + t, 0.1f);
      SetGrad(*s, t, g);
      ref[t].Step(g, h);
    }
    auto r = s->Step({h});
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_TRUE(r->applied);
    EXPECT_EQ(r->grad_norm, -1);  // not computed without clipping
    ASSERT_THAT(s->ZeroGrad(), IsOk());
  }
  for (size_t t = 0; t < 3; ++t) {
    EXPECT_EQ(Param(*s, t), ref[t].p) << kThree[t].name;
    std::vector<float> m(kThree[t].numel);
    ASSERT_THAT(s->ReadTensor(t, ChunkKind::kExpAvg, m.data()), IsOk());
    EXPECT_EQ(m, ref[t].m);
    EXPECT_EQ(s->step_count(t), 4);
  }
}

TEST(SessionStep, TensorsWithoutGradientAreNotSteppedAndTheirStaleBytesAreNotRead) {
  auto s = Make({{"device", "1MiB"}, {"gradient_clipping", 0.5}}, kThree);
  ASSERT_TRUE(s);
  std::vector<RefState> ref;
  for (size_t t = 0; t < 3; ++t) {
    ref.emplace_back(Random(kThree[t].numel, 20 + t));
    ASSERT_THAT(s->WriteParam(t, ref[t].p.data()), IsOk());
  }
  // Step 1: every tensor has a gradient; b's is huge.
  std::vector<std::vector<float>> g;
  for (size_t t = 0; t < 3; ++t) g.push_back(Random(kThree[t].numel, 30 + t, t == 1 ? 50.f : 1.f));
  for (size_t t = 0; t < 3; ++t) SetGrad(*s, t, g[t]);
  ASSERT_TRUE(s->Step({GroupHyper{}}).ok());
  double sq = 0;
  for (auto& gt : g) for (float x : gt) sq += double(x) * x;
  float coef = std::min((1.0f / (static_cast<float>(std::sqrt(sq)) + 1e-6f)) * 0.5f, 1.0f);
  for (size_t t = 0; t < 3; ++t) ref[t].Step(g[t], GroupHyper{}, coef);
  // Step 2: b's gradient is dropped (torch's set_to_none) but its bytes stay in the chunk.
  // Neither its value nor the clipping norm may see them.
  s->SetHasGrad(1, false);
  for (size_t t : {0, 2}) {
    g[t] = Random(kThree[t].numel, 40 + t);
    SetGrad(*s, t, g[t]);
  }
  auto r = s->Step({GroupHyper{}});
  ASSERT_TRUE(r.ok());
  sq = 0;
  for (size_t t : {0, 2}) for (float x : g[t]) sq += double(x) * x;
  EXPECT_NEAR(r->grad_norm, std::sqrt(sq), 1e-9 * std::sqrt(sq));
  coef = std::min((1.0f / (static_cast<float>(std::sqrt(sq)) + 1e-6f)) * 0.5f, 1.0f);
  EXPECT_EQ(r->clip_coef, coef);
  for (size_t t : {0, 2}) ref[t].Step(g[t], GroupHyper{}, coef);
  for (size_t t = 0; t < 3; ++t) EXPECT_EQ(Param(*s, t), ref[t].p) << kThree[t].name;
  EXPECT_EQ(s->step_count(1), 1);
  EXPECT_EQ(s->step_count(0), 2);
}

TEST(SessionStep, AccumulationAppliesEveryNthStepAndKeepsGradientsInBetween) {
  auto s = Make({{"device", "1MiB"}, {"gradient_accumulation_steps", 3}}, kThree);
  ASSERT_TRUE(s);
  RefState ref(Random(1000, 5));
  ASSERT_THAT(s->WriteParam(0, ref.p.data()), IsOk());
  for (int micro = 1; micro <= 3; ++micro) {
    SetGrad(*s, 0, std::vector<float>(1000, 0.25f * micro));  // the binding's running sum
    auto r = s->Step({GroupHyper{}});
    ASSERT_TRUE(r.ok());
    EXPECT_EQ(r->applied, micro == 3);
    EXPECT_EQ(s->accumulating(), micro != 3);
    auto z = s->ZeroGrad();
    ASSERT_TRUE(z.ok());
    EXPECT_EQ(*z, micro == 3) << "zero_grad only clears after an applied step";
    EXPECT_EQ(s->has_grad(0), micro != 3);
  }
  ref.Step(std::vector<float>(1000, 0.75f), GroupHyper{});
  EXPECT_EQ(Param(*s, 0), ref.p);
  EXPECT_EQ(s->micro_steps(), 3u);
}

TEST(SessionStep, PerGroupHyperParametersAndLrChangesApply) {
  std::vector<TensorSpec> specs = {{"decay", 500, true, 0}, {"no_decay", 200, true, 1}};
  auto s = Make({{"device", "1MiB"}}, specs);
  ASSERT_TRUE(s);
  RefState a(Random(500, 1)), b(Random(200, 2));
  ASSERT_THAT(s->WriteParam(0, a.p.data()), IsOk());
  ASSERT_THAT(s->WriteParam(1, b.p.data()), IsOk());
  std::vector<GroupHyper> h = {{1e-3, 0.9, 0.999, 1e-8, 0.1}, {3e-3, 0.9, 0.999, 1e-8, 0.0}};
  for (int step = 0; step < 3; ++step) {
    auto ga = Random(500, 50 + step), gb = Random(200, 60 + step);
    SetGrad(*s, 0, ga);
    SetGrad(*s, 1, gb);
    ASSERT_TRUE(s->Step(h).ok());
    a.Step(ga, h[0]);
    b.Step(gb, h[1]);
    h[0].lr *= 0.5;  // a scheduler between steps
    h[1].lr *= 0.5;
  }
  EXPECT_EQ(Param(*s, 0), a.p);
  EXPECT_EQ(Param(*s, 1), b.p);
  EXPECT_THAT(s->Step({h[0]}), StatusIs(StatusCode::kInvalidArgument, "param group 1"));
}

// A step that cannot acquire a group's chunks (here: m pinned on the device by someone else)
// fails naming that group; the groups before it were stepped, that group's step counts and
// values are unchanged, and the next step after the pin is gone steps it normally.
TEST(SessionStep, AGroupThatCannotBeAcquiredIsNotSteppedAndSaysWhich) {
  // Three groups; the device holds two groups' chunks: the step runs on host copies.
  auto s = Make({{"device", "32KiB"}, {"chunk_size", 1024}},
                {{"a", 1000, true, 0}, {"b", 1000, true, 0}, {"c", 1000, true, 0}});
  ASSERT_TRUE(s);
  ASSERT_EQ(s->num_groups(), 3u);
  for (size_t t = 0; t < 3; ++t) {
    ASSERT_THAT(s->WriteParam(t, Random(s->place(t).numel, t).data()), IsOk());
  }
  for (size_t t = 0; t < 3; ++t) SetGrad(*s, t, Random(s->place(t).numel, 10 + t));
  const std::vector<float> b_before = Param(*s, 1);
  ASSERT_TRUE(s->Acquire(1, ChunkKind::kExpAvg, TierKind::kDevice).ok());
  auto r = s->Step({GroupHyper{}});
  EXPECT_THAT(r.status(), StatusIs(StatusCode::kFailedPrecondition, "chunk group 1 of 3"));
  EXPECT_EQ(s->step_count(0), 1);  // group 0 was stepped
  EXPECT_EQ(s->step_count(1), 0);
  EXPECT_EQ(s->step_count(2), 0);
  ASSERT_THAT(s->Release(1, ChunkKind::kExpAvg, false), IsOk());
  EXPECT_EQ(Param(*s, 1), b_before);
  ASSERT_TRUE(s->Step({GroupHyper{}}).ok());
  EXPECT_EQ(s->step_count(1), 1);
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
    ASSERT_EQ(s[k]->num_groups(), 3u);
    for (size_t t = 0; t < specs.size(); ++t) {
      ASSERT_THAT(s[k]->WriteParam(t, Random(specs[t].numel, t).data()), IsOk());
    }
  }
  auto same = [&](const char* when) {
    for (size_t t = 0; t < specs.size(); ++t) {
      EXPECT_EQ(Param(*s[0], t), Param(*s[1], t)) << when << ": " << specs[t].name;
      for (ChunkKind kind : {ChunkKind::kExpAvg, ChunkKind::kExpAvgSq, ChunkKind::kGrad}) {
        std::vector<float> x(specs[t].numel), y(specs[t].numel);
        ASSERT_THAT(s[0]->ReadTensor(t, kind, x.data()), IsOk());
        ASSERT_THAT(s[1]->ReadTensor(t, kind, y.data()), IsOk());
        EXPECT_EQ(x, y) << when << ": " << specs[t].name << " " << chunks::ChunkKindName(kind);
      }
      EXPECT_EQ(s[0]->step_count(t), s[1]->step_count(t));
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
      auto r = s[k]->Step(hyper);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      EXPECT_LT(r->clip_coef, 1.0f);  // the norm is above 0.5: clipped
      EXPECT_EQ(s[k]->pending_steps(), k == 0 ? 0u : 3u);
    }
    switch (step) {
      case 0:  // grads dropped while pending: the update still reads them, then they are zero
        for (int k = 0; k < 2; ++k) ASSERT_THAT(s[k]->ZeroGrad(), IsOk());
        EXPECT_EQ(s[1]->pending_steps(), 3u);
        same("after zero_grad");
        EXPECT_EQ(s[1]->pending_steps(), 0u);
        break;
      case 1:  // one tensor read: only its group is updated
        EXPECT_EQ(Param(*s[0], 2), Param(*s[1], 2));
        EXPECT_EQ(s[1]->pending_steps(), 2u);
        break;
      case 2:  // the binding's announcement, group by group, as a forward would
        for (size_t g = 0; g < 3; ++g) ASSERT_THAT(s[1]->FinishStep(g), IsOk());
        EXPECT_EQ(s[1]->pending_steps(), 0u);
        same("after FinishStep");
        break;
      case 3:  // a value written while pending lands after the update (not overwritten by it)
        for (int k = 0; k < 2; ++k) {
          ASSERT_THAT(s[k]->WriteParam(0, Random(1000, 999).data()), IsOk());
        }
        same("after a write");
        break;
      default:  // nothing in between: the next Step runs them first
        break;
    }
  }
  ASSERT_THAT(s[1]->Flush(), IsOk());
  EXPECT_EQ(s[1]->pending_steps(), 0u);
  same("at the end");
}

// One training iteration as a binding runs it with speculative steps: the hyper-parameters
// announced at the first forward, a forward moment per group, the backward writing each
// group's gradient (group n-1 first) after its pre-backward moment, then step() with `hyper`.
// `rewrite`: group n-1 gets a second gradient at the last backward moment (after its
// speculation); `between`: runs after the backward, before step().
struct SpecIt {
  std::vector<GroupHyper> announced, hyper;
  float grad_scale = 0.3f;
  bool rewrite = false;
  bool overflow = false;  // an Inf in group 0's gradient (fp16: the step is skipped)
  std::function<void(Session&)> between;
};

StepResult SpecIteration(Session& s, int it, const SpecIt& o) {
  using planners::MomentKind;
  s.BeginIteration();
  s.SetStepHyper(o.announced);
  const uint32_t n = static_cast<uint32_t>(s.num_groups());
  for (uint32_t g = 0; g < n; ++g) {
    EXPECT_THAT(s.FinishStep(g), IsOk());
    s.Moment("fwd:" + std::to_string(g), MomentKind::kPreForward, g);
    EXPECT_TRUE(s.Acquire(g, s.compute_kind(), TierKind::kDevice).ok());
    EXPECT_THAT(s.Release(g, s.compute_kind(), false), IsOk());
  }
  auto grad = [&](uint32_t t, int salt) {
    // Scaled by the loss scale (fp16), as a scaled loss's backward gives them.
    std::vector<float> v = Random(s.place(t).numel, 1000 * it + 10 * t + salt,
                                  o.grad_scale * static_cast<float>(s.loss_scale()));
    if (o.overflow && s.place(t).group == 0) v[3] = INFINITY;
    return v;
  };
  for (uint32_t g = n; g-- > 0;) {
    s.Moment("bwd:" + std::to_string(g), MomentKind::kPreBackward, g);
    for (uint32_t t : s.group(g).tensors) SetGrad(s, t, grad(t, 0));
  }
  if (o.rewrite) {
    for (uint32_t t : s.group(n - 1).tensors) SetGrad(s, t, grad(t, 1));
  }
  if (o.between) o.between(s);
  auto r = s.Step(o.hyper);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(s.ZeroGrad().ok());
  return r.ok() ? *r : StepResult{};
}

// Everything the optimizer leaves: fp32 values, m, v and step counts of every tensor.
std::vector<std::vector<float>> TrainingState(Session& s) {
  std::vector<std::vector<float>> out;
  for (size_t t = 0; t < s.num_tensors(); ++t) {
    out.push_back(Param(s, t));
    for (ChunkKind kind : {ChunkKind::kExpAvg, ChunkKind::kExpAvgSq}) {
      std::vector<float> x(s.place(t).numel);
      EXPECT_THAT(s.ReadTensor(t, kind, x.data()), IsOk());
      out.push_back(std::move(x));
    }
    out.push_back({static_cast<float>(s.step_count(t))});
  }
  return out;
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
      ASSERT_EQ(s[k]->num_groups(), 3u);
      for (size_t t = 0; t < specs.size(); ++t) {
        ASSERT_THAT(s[k]->WriteParam(t, Random(specs[t].numel, t).data()), IsOk());
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
      ASSERT_THAT(s[k]->WriteParam(t, Random(4096, t).data()), IsOk());
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
      ASSERT_THAT(x->WriteParam(t, Random(kThree[t].numel, t).data()), IsOk());
      SetGrad(*x, t, Random(kThree[t].numel, 7 + t));
    }
    ASSERT_TRUE(x->Step({GroupHyper{}}).ok());
  }
  ASSERT_GT(s->pending_steps(), 0u);
  ASSERT_THAT(s->SaveCheckpoint(dir + "/ck"), IsOk());
  EXPECT_EQ(s->pending_steps(), 0u);
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
  ASSERT_THAT(s->WriteParam(0, before.data()), IsOk());
  SetGrad(*s, 0, Random(1000, 10));
  GroupHyper bad;
  bad.eps = 0;
  EXPECT_THAT(s->Step({bad}), StatusIs(StatusCode::kInvalidArgument, "eps must be > 0"));
  bad = GroupHyper{};
  bad.beta2 = 1.0;
  EXPECT_THAT(s->Step({bad}), StatusIs(StatusCode::kInvalidArgument, "betas[1]"));
  bad = GroupHyper{};
  bad.lr = -1;
  EXPECT_THAT(s->Step({bad}), StatusIs(StatusCode::kInvalidArgument, "lr"));
  EXPECT_EQ(Param(*s, 0), before);
  EXPECT_EQ(s->step_count(0), 0);
  EXPECT_EQ(s->micro_steps(), 0u);
}

TEST(SessionStep, Fp16OverflowSkipsTheStepAndLowersTheScaleThenGrows) {
  auto s = Make({{"device", "1MiB"},
                 {"precision", "fp16"},
                 {"loss_scaling", {{"initial_scale", 1024}, {"growth_interval", 2}}}},
                {{"w", 64, true, 0}});
  ASSERT_TRUE(s);
  EXPECT_EQ(s->loss_scale(), 1024);
  std::vector<float> w = Random(64, 3);
  ASSERT_THAT(s->WriteParam(0, w.data()), IsOk());
  std::vector<float> g = Random(64, 4);
  g[7] = INFINITY;
  SetGrad(*s, 0, g);
  auto r = s->Step({GroupHyper{}});
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->skipped);
  EXPECT_FALSE(r->applied);
  EXPECT_EQ(s->loss_scale(), 512);
  EXPECT_EQ(s->scaler().skipped_steps, 1u);
  EXPECT_EQ(Param(*s, 0), w);
  EXPECT_EQ(s->step_count(0), 0);
  // Two good steps at 512: the grads are unscaled (so the update equals the unscaled one),
  // then the scale doubles.
  RefState ref(w);
  for (int i = 0; i < 2; ++i) {
    std::vector<float> gi = Random(64, 70 + i, 0.01f);
    std::vector<float> scaled(64);
    for (int k = 0; k < 64; ++k) scaled[k] = gi[k] * 512.0f;
    SetGrad(*s, 0, scaled);
    r = s->Step({GroupHyper{}});
    ASSERT_TRUE(r.ok() && r->applied);
    // The reference reads the same fp16 values and unscales them in the kernel.
    std::vector<uint16_t> h16(64);
    kernels::CastFromF32(scaled.data(), h16.data(), kernels::DType::kF16, 64);
    std::vector<float> back(64);
    kernels::CastToF32(h16.data(), kernels::DType::kF16, back.data(), 64);
    for (float& x : back) x *= 1.0f / 512.0f;
    ref.Step(back, GroupHyper{});
  }
  EXPECT_EQ(s->loss_scale(), 1024);
  std::vector<float> got = Param(*s, 0);
  EXPECT_EQ(got, ref.p);
}

TEST(SessionCheckpoint, RoundTripRestoresValuesStateAndSteps) {
  const std::string dir = TempDir();
  auto s = Make({{"device", "1MiB"}}, kThree);
  ASSERT_TRUE(s);
  for (size_t t = 0; t < 3; ++t) {
    auto w = Random(kThree[t].numel, t);
    ASSERT_THAT(s->WriteParam(t, w.data()), IsOk());
    SetGrad(*s, t, Random(kThree[t].numel, 7 + t));
  }
  ASSERT_TRUE(s->Step({GroupHyper{}}).ok());
  const std::string path = dir + "/ckpt.tmc";
  CheckpointMeta meta_in;
  meta_in.groups.push_back({GroupHyper{5e-4, 0.8, 0.99, 1e-7, 0.1}, {{"amsgrad", false}}});
  meta_in.rng_state = std::string("\0\1\xff", 3);
  meta_in.extra = {{"epoch", 3}};
  ASSERT_THAT(s->SaveCheckpoint(path, meta_in), IsOk());
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  std::vector<std::vector<float>> saved, saved_v;
  for (size_t t = 0; t < 3; ++t) {
    saved.push_back(Param(*s, t));
    std::vector<float> v(kThree[t].numel);
    ASSERT_THAT(s->ReadTensor(t, ChunkKind::kExpAvgSq, v.data()), IsOk());
    saved_v.push_back(v);
  }
  // Train on, then load: back to the saved state; and into a fresh bf16 session too.
  for (size_t t = 0; t < 3; ++t) SetGrad(*s, t, Random(kThree[t].numel, 17 + t));
  ASSERT_TRUE(s->Step({GroupHyper{}}).ok());
  CheckpointMeta meta;
  ASSERT_THAT(s->LoadCheckpoint(path, &meta), IsOk());
  ASSERT_EQ(meta.groups.size(), 1u);
  EXPECT_EQ(meta.groups[0].hyper.lr, 5e-4);
  EXPECT_EQ(meta.groups[0].hyper.beta1, 0.8);
  EXPECT_EQ(meta.groups[0].hyper.beta2, 0.99);
  EXPECT_EQ(meta.groups[0].hyper.eps, 1e-7);
  EXPECT_EQ(meta.groups[0].hyper.weight_decay, 0.1);
  EXPECT_EQ(meta.groups[0].other, json({{"amsgrad", false}}));
  EXPECT_EQ(meta.rng_state, meta_in.rng_state);
  EXPECT_EQ(meta.extra, meta_in.extra);
  for (size_t t = 0; t < 3; ++t) {
    EXPECT_EQ(Param(*s, t), saved[t]);
    EXPECT_EQ(s->step_count(t), 1);
    EXPECT_FALSE(s->has_grad(t));
  }
  auto fresh = Make({{"device", "1MiB"}, {"precision", "bf16"}}, kThree);
  ASSERT_THAT(fresh->LoadCheckpoint(path), IsOk());
  for (size_t t = 0; t < 3; ++t) {
    EXPECT_EQ(Param(*fresh, t), saved[t]);
    std::vector<float> v(kThree[t].numel);
    ASSERT_THAT(fresh->ReadTensor(t, ChunkKind::kExpAvgSq, v.data()), IsOk());
    EXPECT_EQ(v, saved_v[t]);
  }
  EXPECT_EQ(fresh->loss_scale(), 1.0);
  std::filesystem::remove_all(dir);
}

// Tensors larger than the writer's 8 MiB buffer and of odd sizes (the file's tail is not
// block-aligned) round-trip bit for bit, written and read with O_DIRECT and through the page
// cache (checkpoint_io), and across the two.
TEST(SessionCheckpoint, LargeAndOddTensorsRoundTripDirectAndBuffered) {
  const std::vector<TensorSpec> specs = {
      {"big", 2'500'001, true, 0}, {"odd", 1'234'567, true, 0}, {"tiny", 3, false, 0}};
  for (const auto& [save_io, load_io] : std::vector<std::pair<std::string, std::string>>{
           {"direct", "direct"}, {"buffered", "buffered"}, {"direct", "buffered"},
           {"buffered", "direct"}}) {
    SCOPED_TRACE("save " + save_io + ", load " + load_io);
    const std::string dir = TempDir();
    auto s = Make({{"device", "128MiB"}, {"host", "256MiB"}, {"checkpoint_io", save_io}}, specs);
    ASSERT_TRUE(s);
    for (size_t t = 0; t < specs.size(); ++t) {
      auto w = Random(specs[t].numel, 60 + t);
      ASSERT_THAT(s->WriteParam(t, w.data()), IsOk());
      if (specs[t].trainable) SetGrad(*s, t, Random(specs[t].numel, 70 + t));
    }
    ASSERT_TRUE(s->Step({GroupHyper{}}).ok());
    const std::string path = dir + "/big.safetensors";
    ASSERT_THAT(s->SaveCheckpoint(path), IsOk());
    EXPECT_NE(std::filesystem::file_size(path) % 4096, 0u);  // cut back to its true size
    std::vector<std::vector<float>> saved, saved_m;
    for (size_t t = 0; t < specs.size(); ++t) {
      saved.push_back(Param(*s, t));
      std::vector<float> m(specs[t].numel);
      if (specs[t].trainable) {
        ASSERT_THAT(s->ReadTensor(t, ChunkKind::kExpAvg, m.data()), IsOk());
      }
      saved_m.push_back(m);
    }
    auto fresh =
        Make({{"device", "128MiB"}, {"host", "256MiB"}, {"checkpoint_io", load_io}}, specs);
    ASSERT_THAT(fresh->LoadCheckpoint(path), IsOk());
    for (size_t t = 0; t < specs.size(); ++t) {
      EXPECT_EQ(Param(*fresh, t), saved[t]);
      if (!specs[t].trainable) continue;
      std::vector<float> m(specs[t].numel);
      ASSERT_THAT(fresh->ReadTensor(t, ChunkKind::kExpAvg, m.data()), IsOk());
      EXPECT_EQ(m, saved_m[t]);
    }
    std::filesystem::remove_all(dir);
  }
}

TEST(SessionCheckpoint, TornCorruptOrForeignFilesChangeNothing) {
  const std::string dir = TempDir();
  auto s = Make({{"device", "1MiB"}}, kThree);
  ASSERT_TRUE(s);
  for (size_t t = 0; t < 3; ++t) {
    auto w = Random(kThree[t].numel, 40 + t);
    ASSERT_THAT(s->WriteParam(t, w.data()), IsOk());
  }
  const std::string path = dir + "/ckpt.tmc";
  ASSERT_THAT(s->SaveCheckpoint(path), IsOk());
  const auto size = std::filesystem::file_size(path);
  std::vector<char> bytes(size);
  std::ifstream(path, std::ios::binary).read(bytes.data(), size);
  // Change the session, so that a load that went through would be visible.
  const std::vector<float> now = Random(1000, 99);
  ASSERT_THAT(s->WriteParam(0, now.data()), IsOk());
  auto write = [&](const std::string& p, size_t n, long flip) {
    std::vector<char> b(bytes.begin(), bytes.begin() + n);
    if (flip >= 0) b[flip] ^= 0x40;
    std::ofstream(p, std::ios::binary).write(b.data(), b.size());
  };
  write(dir + "/torn.tmc", size - 100, -1);
  EXPECT_THAT(s->LoadCheckpoint(dir + "/torn.tmc"), StatusIs(StatusCode::kDataLoss, "torn"));
  write(dir + "/flip.tmc", size, static_cast<long>(size / 2));
  EXPECT_THAT(s->LoadCheckpoint(dir + "/flip.tmc"),
              StatusIs(StatusCode::kDataLoss, "checksum mismatch"));
  // The header length off by 64: the text read is still JSON (the header is padded with
  // spaces to a block boundary), and its checksum no longer matches.
  write(dir + "/length.tmc", size, 0);
  EXPECT_THAT(s->LoadCheckpoint(dir + "/length.tmc"),
              StatusIs(StatusCode::kDataLoss, "header: checksum mismatch"));
  std::ofstream(dir + "/foreign.tmc", std::ios::binary) << "PK\x03\x04 a zip file, say";
  EXPECT_THAT(s->LoadCheckpoint(dir + "/foreign.tmc"),
              StatusIs(StatusCode::kInvalidArgument, "not a tiermem checkpoint"));
  EXPECT_THAT(s->LoadCheckpoint(dir + "/missing.tmc"), StatusIs(StatusCode::kIOError, "missing"));
  auto other = Make({{"device", "1MiB"}}, {{"a", 1000, true, 0}, {"b", 301, true, 0},
                                           {"c", 77, true, 0}});
  EXPECT_THAT(other->LoadCheckpoint(path),
              StatusIs(StatusCode::kInvalidArgument, "this model has 'b' (301 elements"));
  EXPECT_EQ(Param(*s, 0), now);
  std::filesystem::remove_all(dir);
}

// The safetensors layout (format 2): u64 header length, a JSON header naming every tensor
// with dtype F32, its shape and contiguous data offsets, tiermem's metadata; values stored
// as written. (tests/python/test_checkpoint.py loads the same kind of file with the
// safetensors library itself.)
TEST(SessionCheckpoint, FileIsSafetensorsWithShapesAndMetadata) {
  const std::string dir = TempDir();
  std::vector<TensorSpec> specs = {{"w", 6, true, 0, {2, 3}}, {"frozen", 4, false, 0, {4}}};
  auto s = Make({{"device", "1MiB"}}, specs);
  ASSERT_TRUE(s);
  const std::vector<float> w = {1, 2, 3, 4, 5, 6};
  ASSERT_THAT(s->WriteParam(0, w.data()), IsOk());
  const std::string path = dir + "/c.safetensors";
  CheckpointMeta meta_in;
  meta_in.groups.push_back({GroupHyper{}});
  meta_in.rng_state = "rng";
  meta_in.extra = "x";
  ASSERT_THAT(s->SaveCheckpoint(path, meta_in), IsOk());
  std::ifstream in(path, std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  ASSERT_EQ(n % 8, 0u);
  ASSERT_EQ((8 + n) % 4096, 0u);  // tensor bytes block-aligned (O_DIRECT)
  std::string text(n, '\0');
  in.read(text.data(), n);
  const json h = json::parse(text);
  EXPECT_EQ(h["w"]["dtype"], "F32");
  EXPECT_EQ(h["w"]["shape"], json::array({2, 3}));
  EXPECT_EQ(h["w"]["data_offsets"], json::array({0, 24}));
  EXPECT_EQ(h["exp_avg/w"]["data_offsets"], json::array({24, 48}));
  EXPECT_EQ(h["exp_avg_sq/w"]["data_offsets"], json::array({48, 72}));
  EXPECT_EQ(h["frozen"]["data_offsets"], json::array({72, 88}));
  EXPECT_FALSE(h.contains("exp_avg/frozen"));
  EXPECT_EQ(h["__metadata__"]["format"], "tiermem-checkpoint");
  EXPECT_EQ(h["__metadata__"]["version"], "3");
  EXPECT_EQ(json::parse(h["__metadata__"]["param_groups"].get<std::string>()),
            json::parse(R"([{"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8,
                             "weight_decay": 0.01}])"));
  EXPECT_EQ(h["__metadata__"]["rng_state"], "cm5n");  // base64 of "rng"
  EXPECT_EQ(h["__metadata__"]["extra"], "\"x\"");
  EXPECT_FALSE(h["__metadata__"].contains("binding"));
  std::vector<float> back(6);
  in.read(reinterpret_cast<char*>(back.data()), 24);
  EXPECT_EQ(back, w);
  in.seekg(0, std::ios::end);
  EXPECT_EQ(static_cast<uint64_t>(in.tellg()), 8 + n + 88);
  auto meta = Session::CheckpointMetadata(path);
  ASSERT_TRUE(meta.ok()) << meta.status().ToString();
  EXPECT_EQ(meta->groups.size(), 1u);
  EXPECT_EQ(meta->rng_state, "rng");
  EXPECT_EQ(meta->extra, "x");
  // A byte of the header changed (a step count: not a tensor): the header checksum catches it.
  std::ifstream whole(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(whole)), std::istreambuf_iterator<char>());
  const size_t at = bytes.find("\\\"w\\\":0");
  ASSERT_NE(at, std::string::npos);
  bytes[at + 6] = '7';  // the step of w: 0 -> 7
  std::ofstream(dir + "/h.safetensors", std::ios::binary) << bytes;
  EXPECT_THAT(s->LoadCheckpoint(dir + "/h.safetensors"),
              StatusIs(StatusCode::kDataLoss, "header: checksum mismatch"));
  std::filesystem::remove_all(dir);
}

// A format-1 file (earlier builds) with one tensor "a" of 3 elements and `meta` as its
// metadata (what ChunkedModel::Save wrote then).
std::string FormatOneFile(const std::string& meta) {
  std::string f;
  auto put = [&](const void* p, size_t n) { f.append(static_cast<const char*>(p), n); };
  auto crc_of = [&](size_t from) { return Crc32c(f.data() + from, f.size() - from); };
  put("TMCKPT01", 8);
  const uint32_t version = 1, meta_bytes = static_cast<uint32_t>(meta.size());
  const uint64_t ntensors = 1, micro = 5, skipped = 0;
  const double scale = 1.0;
  const int32_t good = 0;
  put(&version, 4); put(&ntensors, 8); put(&micro, 8); put(&scale, 8); put(&good, 4);
  put(&skipped, 8); put(&meta_bytes, 4); put(meta.data(), meta.size());
  uint32_t c = crc_of(0);
  put(&c, 4);
  const size_t rec = f.size();
  const uint32_t name_bytes = 1;
  const uint64_t numel = 3;
  const uint8_t trainable = 1;
  const int64_t step = 4;
  put(&name_bytes, 4); put("a", 1); put(&numel, 8); put(&trainable, 1); put(&step, 8);
  const float vals[9] = {1, 2, 3, .1f, .2f, .3f, .01f, .02f, .03f};
  put(vals, sizeof(vals));
  const uint32_t rc = crc_of(rec);
  put(&rc, 4);
  put("TMCKEND1", 8);
  const uint32_t all = Crc32c(&rc, 4);
  put(&all, 4);
  return f;
}

// Files of the earliest format (1) still load, their LibTorch-shaped metadata converted; one
// whose metadata has neither earlier shape is refused before anything changes.
TEST(SessionCheckpoint, ReadsFormatOneFiles) {
  const std::string dir = TempDir();
  std::ofstream(dir + "/v1.tmc", std::ios::binary) << FormatOneFile(
      R"({"param_groups":[{"betas":[0.9,0.999],"eps":1e-08,"lr":0.0005,"weight_decay":0.01}]})");
  std::ofstream(dir + "/bad.tmc", std::ios::binary) << FormatOneFile("old");
  auto s = Make({{"device", "1MiB"}}, {{"a", 3, true, 0}});
  ASSERT_TRUE(s);
  const std::vector<float> before = Param(*s, 0);
  EXPECT_THAT(s->LoadCheckpoint(dir + "/bad.tmc"),
              StatusIs(StatusCode::kInvalidArgument, "no optimizer param groups"));
  EXPECT_EQ(Param(*s, 0), before);
  EXPECT_EQ(s->micro_steps(), 0u);
  CheckpointMeta got;
  ASSERT_THAT(s->LoadCheckpoint(dir + "/v1.tmc", &got), IsOk());
  ASSERT_EQ(got.groups.size(), 1u);
  EXPECT_EQ(got.groups[0].hyper.lr, 5e-4);
  EXPECT_TRUE(got.rng_state.empty());
  EXPECT_TRUE(got.extra.is_null());
  EXPECT_EQ(Param(*s, 0), std::vector<float>({1, 2, 3}));
  EXPECT_EQ(s->step_count(0), 4);
  EXPECT_EQ(s->micro_steps(), 5u);
  std::filesystem::remove_all(dir);
}

TEST(SessionCheckpoint, SavingInsideAnAccumulationWindowIsRefused) {
  const std::string dir = TempDir();
  auto s = Make({{"device", "1MiB"}, {"gradient_accumulation_steps", 2}}, kThree);
  ASSERT_TRUE(s);
  SetGrad(*s, 0, Random(1000, 1));
  ASSERT_TRUE(s->Step({GroupHyper{}}).ok());
  EXPECT_THAT(s->SaveCheckpoint(dir + "/c.tmc"),
              StatusIs(StatusCode::kFailedPrecondition, "accumulation"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/c.tmc"));
  std::filesystem::remove_all(dir);
}

// 8 trainable tensors of one 16 Ki-element chunk each; host room for the params and grads (and
// the reserve) but not for m and v, which go to NVMe in `dir`.
std::unique_ptr<Session> MakeNvmeSpill(const std::string& dir) {
  std::vector<TensorSpec> specs;
  for (int i = 0; i < 8; ++i) specs.push_back({"t" + std::to_string(i), 16384, true, 0});
  return Make({{"device", "1MiB"},
               {"host", "2MiB"},
               {"chunk_size", 16384},
               {"prefetch_depth", 1},
               {"nvme", {{"path", dir}, {"size", "16MiB"}}}},
              specs);
}

// The host memory NVMe moves go to and from (homes, caches, staging slots) is registered with
// the NVMe tier as io_uring fixed buffers, as fio's --fixedbufs; none is left registered once
// the host tiers are gone.
TEST(SessionNvme, HostMemoryIsRegisteredAsFixedBuffersWithIoUring) {
  const std::string dir = TempDir();
  auto s = MakeNvmeSpill(dir);
  ASSERT_TRUE(s);
  if (s->io_backend() != "io_uring") GTEST_SKIP() << "io_uring refused here: " << s->io_backend();
  // Staging slots and the host homes: at least the host budget's slabs mapped so far.
  EXPECT_GT(s->nvme_registered_bytes(), 0u);
  EXPECT_LE(s->nvme_registered_bytes(), 2 * kMiB);
  for (size_t t = 0; t < 8; ++t) SetGrad(*s, t, Random(16384, t));
  ASSERT_TRUE(s->Step({GroupHyper{}}).ok());  // m and v move through NVMe
  EXPECT_GT(s->nvme_registered_bytes(), 0u);
  s->Close();
  EXPECT_EQ(s->nvme_registered_bytes(), 0u);
  s.reset();
  std::filesystem::remove_all(dir);
}

TEST(SessionNvme, OptimizerStateSpillsToNvmeFirstAndTrainingMatches) {
  const std::string dir = TempDir();
  auto s = MakeNvmeSpill(dir);
  ASSERT_TRUE(s);
  int nvme_optim = 0, host_params = 0;
  for (size_t g = 0; g < s->num_groups(); ++g) {
    host_params += s->Home(g, ChunkKind::kParamFp32) == TierKind::kHost;
    nvme_optim += s->Home(g, ChunkKind::kExpAvgSq) == TierKind::kNvme;
  }
  EXPECT_EQ(host_params, 8);
  EXPECT_EQ(nvme_optim, 8);
  std::vector<RefState> ref;
  for (size_t t = 0; t < 8; ++t) {
    ref.emplace_back(Random(16384, t));
    ASSERT_THAT(s->WriteParam(t, ref[t].p.data()), IsOk());
  }
  for (int step = 0; step < 2; ++step) {
    for (size_t t = 0; t < 8; ++t) {
      auto g = Random(16384, 200 + 10 * step + t);
      SetGrad(*s, t, g);
      ref[t].Step(g, GroupHyper{});
    }
    ASSERT_TRUE(s->Step({GroupHyper{}}).ok());
    ASSERT_THAT(s->ZeroGrad(), IsOk());
  }
  for (size_t t = 0; t < 8; ++t) EXPECT_EQ(Param(*s, t), ref[t].p);
  s.reset();
  std::filesystem::remove_all(dir);
}

// Overwrites the first 16 MiB of every NVMe file of a session under `dir` with junk, as a
// failing disk or another process would, and syncs; returns how many files. The tier's files
// are unnamed (O_TMPFILE): they are reached through this process's descriptors.
int OverwriteNvmeFiles(const std::string& dir) {
  int overwritten = 0;
  for (const auto& f : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    const std::string target = std::filesystem::read_symlink(f.path(), ec).string();
    if (ec || target.rfind(dir + "/", 0) != 0) continue;
    std::fstream io(f.path(), std::ios::in | std::ios::out | std::ios::binary);
    const std::string junk(16 << 20, '\x5a');
    io.write(junk.data(), static_cast<std::streamsize>(junk.size()));
    overwritten += io.good();
  }
  sync();
  return overwritten;
}

// A deferred update that meets a failing disk (here: the NVMe file overwritten behind the
// session's back, so the chunk checksums fail) returns the error from the call that ran it,
// naming the group and the deferral; the group is not stepped (its step counts stay).
TEST(SessionNvme, ADeferredUpdateThatFailsSaysSoAndLeavesTheGroupUnstepped) {
  const std::string dir = TempDir();
  auto s = MakeNvmeSpill(dir);
  ASSERT_TRUE(s);
  for (size_t t = 0; t < 8; ++t) {
    ASSERT_THAT(s->WriteParam(t, Random(16384, t).data()), IsOk());
  }
  for (int step = 0; step < 2; ++step) {
    for (size_t t = 0; t < 8; ++t) SetGrad(*s, t, Random(16384, 300 + 10 * step + t));
    ASSERT_TRUE(s->Step({GroupHyper{}}).ok());
    EXPECT_EQ(s->pending_steps(), 8u);
    if (step == 0) {
      ASSERT_THAT(s->FinishSteps(), IsOk());
    }
  }
  ASSERT_EQ(s->Home(0, ChunkKind::kExpAvgSq), TierKind::kNvme);
  ASSERT_NE(s->Resident(0, ChunkKind::kExpAvgSq), TierKind::kHost);  // must be read from disk
  ASSERT_GT(OverwriteNvmeFiles(dir), 0);
  const Status st = s->FinishStep(0);
  EXPECT_EQ(st.code(), StatusCode::kDataLoss) << st.ToString();  // the chunk's checksum
  EXPECT_NE(st.message().find("chunk group 0"), std::string::npos) << st.ToString();
  EXPECT_NE(st.message().find("deferred"), std::string::npos) << st.ToString();
  EXPECT_EQ(s->step_count(0), 1);  // step 2 did not happen for it
  EXPECT_EQ(s->pending_steps(), 7u);
  s.reset();
  std::filesystem::remove_all(dir);
}

// Activations spilled to NVMe (the binding's offload when the host budget is short): bytes
// copied through host scratch into an NVMe region come back as written, in pieces at any
// offset; the region counts in the NVMe budget (too much is kResourceExhausted and changes
// nothing); bytes that read back other than written (the file overwritten behind the
// session's back) are kDataLoss, never other bytes.
TEST(SessionNvme, SpilledBytesComeBackAsWrittenAndACorruptedSpillIsDataLoss) {
  const std::string dir = TempDir();
  auto s = MakeNvmeSpill(dir);
  ASSERT_TRUE(s);
  const Bytes n = 64 * kKiB + 100;  // not a whole number of NVMe blocks
  StatusOr<Region> host = s->AllocateScratch(TierKind::kHost, 64 * kKiB);
  ASSERT_THAT(host.status(), IsOk());
  StatusOr<Region> spill = s->AllocateSpill(n);
  ASSERT_THAT(spill.status(), IsOk());
  std::vector<char> want(n);
  for (size_t i = 0; i < n; ++i) want[i] = static_cast<char>((i * 131 + 7) % 251);
  char* bounce = static_cast<char*>(host->addr);
  for (Bytes lo = 0; lo < n; lo += 64 * kKiB) {
    const Bytes k = std::min<Bytes>(64 * kKiB, n - lo);
    std::memcpy(bounce, want.data() + lo, k);
    ASSERT_THAT(s->SpillCopy(*spill, lo, *host, 0, k, true), IsOk());
  }
  // Read back with both pieces in flight at once (StartSpillCopy), into two host regions.
  StatusOr<Region> host2 = s->AllocateScratch(TierKind::kHost, 64 * kKiB);
  ASSERT_THAT(host2.status(), IsOk());
  std::memset(bounce, 0, 64 * kKiB);
  std::memset(host2->addr, 0, 64 * kKiB);
  auto first = s->StartSpillCopy(*spill, 0, *host, 0, 64 * kKiB, false);
  auto second = s->StartSpillCopy(*spill, 64 * kKiB, *host2, 0, 100, false);
  ASSERT_THAT(first.status(), IsOk());
  ASSERT_THAT(second.status(), IsOk());
  ASSERT_THAT((*first)->Wait(), IsOk());
  ASSERT_THAT((*second)->Wait(), IsOk());
  std::vector<char> got(n, 0);
  std::memcpy(got.data(), bounce, 64 * kKiB);
  std::memcpy(got.data() + 64 * kKiB, host2->addr, 100);
  EXPECT_EQ(got, want);
  EXPECT_THAT(s->FreeScratch(TierKind::kHost, *host2), IsOk());
  EXPECT_THAT(s->SpillCopy(*spill, 0, *host, 4, 64 * kKiB, true),
              StatusIs(StatusCode::kOutOfRange, "host region"));
  // The NVMe budget (16 MiB, the homes in it): a spill larger than its free room.
  EXPECT_THAT(s->AllocateSpill(16 * kMiB), StatusIs(StatusCode::kResourceExhausted, "need"));
  ASSERT_GT(OverwriteNvmeFiles(dir), 0);
  EXPECT_THAT(s->SpillCopy(*spill, 0, *host, 0, 64 * kKiB, false),
              StatusIs(StatusCode::kDataLoss, ""));
  EXPECT_THAT(s->FreeSpill(*spill), IsOk());
  EXPECT_THAT(s->FreeScratch(TierKind::kHost, *host), IsOk());
  s.reset();
  std::filesystem::remove_all(dir);
}

TEST(SessionNvme, NoSpillWithoutAnNvmeTier) {
  auto s = Make({{"device", "1MiB"}}, kThree);
  ASSERT_TRUE(s);
  EXPECT_THAT(s->AllocateSpill(4096), StatusIs(StatusCode::kFailedPrecondition, "no NVMe"));
}

TEST(SessionTimeline, TemporaryTimelineGoesAwayAtCloseAConfiguredOneStays) {
  const std::string dir = TempDir();
  auto s = Make({{"device", "1MiB"}}, kThree);
  ASSERT_TRUE(s);
  const std::string tmp = s->timeline_path();
  EXPECT_TRUE(std::filesystem::exists(tmp));
  auto rep = s->TimelineReport();
  ASSERT_TRUE(rep.ok()) << rep.status().ToString();
  EXPECT_GT(rep->events, 0u);
  s->Close();
  EXPECT_TRUE(s->closed());
  EXPECT_FALSE(std::filesystem::exists(tmp));
  EXPECT_THAT(s->Step({GroupHyper{}}), StatusIs(StatusCode::kFailedPrecondition, "closed"));
  EXPECT_EQ(s->num_tensors(), 3u);  // the layout stays readable

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
    s->BeginIteration();
    for (size_t g = 0; g < s->num_groups(); ++g) {
      ASSERT_TRUE(s->Acquire(g, ChunkKind::kParamFp32, TierKind::kDevice).ok());
      ASSERT_THAT(s->Release(g, ChunkKind::kParamFp32, false), IsOk());
    }
  };
  iteration();
  iteration();
  // An "eval" pass in between, in another order, untraced.
  s->SetTracing(false);
  for (size_t g = s->num_groups(); g-- > 0;) {
    ASSERT_TRUE(s->Acquire(g, ChunkKind::kParamFp32, TierKind::kHost).ok());
    ASSERT_THAT(s->Release(g, ChunkKind::kParamFp32, false), IsOk());
  }
  s->SetTracing(true);
  iteration();
  iteration();
  auto st = s->Stats();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->diverged, 0u);
  // The same eval pass traced does diverge (the check above can fail).
  for (size_t g = s->num_groups(); g-- > 0;) {
    ASSERT_TRUE(s->Acquire(g, ChunkKind::kParamFp32, TierKind::kHost).ok());
    ASSERT_THAT(s->Release(g, ChunkKind::kParamFp32, false), IsOk());
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
  s.BeginIteration();
  const uint32_t n = static_cast<uint32_t>(s.num_groups());
  for (uint32_t g = 0; g < n; ++g) {
    ASSERT_THAT(s.FinishStep(g), IsOk());  // as the bindings do before a unit's moment
    s.Moment("fwd:" + std::to_string(g), MomentKind::kPreForward, g);
    ASSERT_TRUE(s.Acquire(g, ChunkKind::kParamFp32, TierKind::kDevice).ok());
    s.AddSavedBytes(1000 * (g + 1));
    ASSERT_THAT(s.Release(g, ChunkKind::kParamFp32, write_param_in_forward && g == 0), IsOk());
  }
  for (uint32_t g = n; g-- > 0;) {
    s.Moment("bwd:" + std::to_string(g), MomentKind::kPreBackward, g);
    bool must_zero = false;
    auto p = s.AcquireForWrite(g, ChunkKind::kGrad, TierKind::kDevice, &must_zero);
    ASSERT_TRUE(p.ok());
    if (must_zero) std::memset(*p, 0, s.ChunkBytes(g, ChunkKind::kGrad));
    ASSERT_THAT(s.Release(g, ChunkKind::kGrad, true), IsOk());
    for (uint32_t t : s.group(g).tensors) s.SetHasGrad(t, true);
  }
  ASSERT_TRUE(s.Step({GroupHyper{}}).ok());
  ASSERT_TRUE(s.ZeroGrad().ok());
}

TEST(SessionTrace, RecordsTheIterationsMomentsAccessesSavedBytesAndRates) {
  const std::string dir = TempDir();
  const std::string path = dir + "/warmup.tmtrace";
  // The device holds about one group's chunks: forward acquires are host->device copies.
  auto s = Make({{"device", "16KiB"}, {"chunk_size", 512}, {"gradient_clipping", 1.0}},
                {{"a", 500, true, 0}, {"b", 400, true, 0}, {"c", 300, true, 0}});
  ASSERT_TRUE(s);
  const uint32_t groups = static_cast<uint32_t>(s->num_groups());
  ASSERT_EQ(groups, 3u);
  ScriptedIteration(*s);  // before arming: not recorded
  ASSERT_THAT(s->RecordTrace(path, 2), IsOk());
  EXPECT_TRUE(s->trace_armed());
  EXPECT_FALSE(s->recording_trace());
  ScriptedIteration(*s, /*write_param_in_forward=*/true);
  EXPECT_TRUE(s->recording_trace());
  ScriptedIteration(*s);
  EXPECT_FALSE(std::filesystem::exists(path));  // the 2nd iteration's step is still open
  s->BeginIteration();                           // ends it: the file is written
  EXPECT_TRUE(std::filesystem::exists(path));
  EXPECT_EQ(s->written_trace(), path);
  EXPECT_FALSE(s->trace_armed());

  auto t = planners::ReadTraceFile(path);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ASSERT_EQ(t->iterations.size(), 2u);
  // Every chunk of the session, with its kind name, group and home.
  size_t chunks = 0;
  for (size_t g = 0; g < s->num_groups(); ++g) {
    for (int k = 0; k < chunks::kNumChunkKinds; ++k) {
      if (!s->has_kind(g, static_cast<ChunkKind>(k))) continue;
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
      EXPECT_EQ(a.chunk, s->group(g).chunks[static_cast<int>(ChunkKind::kParamFp32)]);
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
  EXPECT_THAT(s->RecordTrace("", 1), StatusIs(StatusCode::kInvalidArgument, "path is empty"));
  EXPECT_THAT(s->RecordTrace(dir + "/a.tmtrace", 0),
              StatusIs(StatusCode::kInvalidArgument, "iterations must be >= 1"));
  EXPECT_FALSE(s->trace_armed());
  auto none = s->FinishTrace();
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(*none);  // nothing armed: nothing written

  ASSERT_THAT(s->RecordTrace(dir + "/a.tmtrace", 5), IsOk());
  EXPECT_THAT(s->RecordTrace(dir + "/b.tmtrace", 1),
              StatusIs(StatusCode::kFailedPrecondition, "already being recorded"));
  ScriptedIteration(*s);
  // An eval pass, untraced: not in the trace.
  s->SetTracing(false);
  for (size_t g = 0; g < s->num_groups(); ++g) {
    s->Moment("eval", planners::MomentKind::kPreForward, 0);
    ASSERT_TRUE(s->Acquire(g, ChunkKind::kParamFp32, TierKind::kHost).ok());
    ASSERT_THAT(s->Release(g, ChunkKind::kParamFp32, false), IsOk());
  }
  s->SetTracing(true);
  // Finish after one of the five iterations writes what was recorded.
  auto w = s->FinishTrace();
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
  ASSERT_THAT(s->RecordTrace(dir + "/c.tmtrace", 3), IsOk());
  ScriptedIteration(*s);
  s->Close();
  auto c = planners::ReadTraceFile(dir + "/c.tmtrace");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->iterations.size(), 1u);

  // A path that cannot be written: the error reaches FinishTrace, training goes on.
  auto u = Make({{"device", "64KiB"}, {"chunk_size", 1024}}, kThree);
  ASSERT_TRUE(u);
  ASSERT_THAT(u->RecordTrace(dir + "/no/such/dir/x.tmtrace", 1), IsOk());
  ScriptedIteration(*u);
  ScriptedIteration(*u);  // its BeginIteration tries to write
  EXPECT_FALSE(u->FinishTrace().ok());
  ScriptedIteration(*u);
  std::filesystem::remove_all(dir);
}

// ---- plans (plan: auto) --------------------------------------------------------------------

// One training iteration with values that depend on every earlier step: each group's forward
// reads its params on the device; its backward reads them again and writes grads computed from
// them; then the optimizer step. `branch`: this iteration's forward skips group 1 (dynamic
// control flow), so its moments differ from every other iteration's.
void TrainIteration(Session& s, int it, bool branch = false) {
  using planners::MomentKind;
  s.BeginIteration();
  const uint32_t n = static_cast<uint32_t>(s.num_groups());
  for (uint32_t g = 0; g < n; ++g) {
    if (branch && g == 1) continue;
    ASSERT_THAT(s.FinishStep(g), IsOk());  // as the bindings do before a unit's moment
    s.Moment("fwd:" + std::to_string(g), MomentKind::kPreForward, g);
    ASSERT_TRUE(s.Acquire(g, ChunkKind::kParamFp32, TierKind::kDevice).ok());
    ASSERT_THAT(s.Release(g, ChunkKind::kParamFp32, false), IsOk());
  }
  for (uint32_t g = n; g-- > 0;) {
    if (branch && g == 1) continue;
    s.Moment("bwd:" + std::to_string(g), MomentKind::kPreBackward, g);
    auto p = s.Acquire(g, ChunkKind::kParamFp32, TierKind::kDevice);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    bool must_zero = false;
    auto gp = s.AcquireForWrite(g, ChunkKind::kGrad, TierKind::kDevice, &must_zero);
    ASSERT_TRUE(gp.ok()) << gp.status().ToString();
    const float* w = static_cast<const float*>(*p);
    float* gr = static_cast<float*>(*gp);
    const uint64_t elems = s.ChunkBytes(g, ChunkKind::kGrad) / 4;
    for (uint64_t i = 0; i < elems; ++i) {
      gr[i] = 0.5f * w[i] + 0.01f * std::sin(static_cast<float>(i + 31 * g + 7 * it));
    }
    ASSERT_THAT(s.Release(g, ChunkKind::kGrad, true), IsOk());
    ASSERT_THAT(s.Release(g, ChunkKind::kParamFp32, false), IsOk());
    for (uint32_t t : s.group(g).tensors) s.SetHasGrad(t, true);
  }
  ASSERT_TRUE(s.Step({GroupHyper{}}).ok());
  ASSERT_TRUE(s.ZeroGrad().ok());
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
  s.BeginIteration();
  const std::vector<uint32_t> experts = Routed(it);
  auto backward = [&](uint32_t g, uint32_t cls) {
    auto p = s.Acquire(g, ChunkKind::kParamFp32, TierKind::kDevice, cls);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    bool must_zero = false;
    auto gp = s.AcquireForWrite(g, ChunkKind::kGrad, TierKind::kDevice, &must_zero, cls);
    ASSERT_TRUE(gp.ok()) << gp.status().ToString();
    const float* w = static_cast<const float*>(*p);
    float* gr = static_cast<float*>(*gp);
    const uint64_t elems = s.ChunkBytes(g, ChunkKind::kGrad) / 4;
    for (uint64_t i = 0; i < elems; ++i) {
      gr[i] = 0.5f * w[i] + 0.01f * std::sin(static_cast<float>(i + 31 * g + 7 * it));
    }
    ASSERT_THAT(s.Release(g, ChunkKind::kGrad, true), IsOk());
    ASSERT_THAT(s.Release(g, ChunkKind::kParamFp32, false), IsOk());
    for (uint32_t t : s.group(g).tensors) s.SetHasGrad(t, true);
  };
  for (uint32_t g = 0; g < 6; ++g) {
    ASSERT_THAT(s.FinishStep(g), IsOk());
    s.Moment("fwd:" + std::to_string(g), MomentKind::kPreForward, g);
    ASSERT_TRUE(s.Acquire(g, ChunkKind::kParamFp32, TierKind::kDevice).ok());
    ASSERT_THAT(s.Release(g, ChunkKind::kParamFp32, false), IsOk());
  }
  for (uint32_t e : experts) ASSERT_THAT(s.FinishStep(e), IsOk());
  s.Moment("fwd:moe", MomentKind::kPreForward, 6);
  for (uint32_t e : experts) {
    ASSERT_TRUE(s.Acquire(e, ChunkKind::kParamFp32, TierKind::kDevice, /*cls=*/0).ok());
    ASSERT_THAT(s.Release(e, ChunkKind::kParamFp32, false), IsOk());
  }
  s.Moment("bwd:moe", MomentKind::kPreBackward, 6);
  for (uint32_t e : experts) backward(e, 0);
  for (uint32_t g = 6; g-- > 0;) {
    s.Moment("bwd:" + std::to_string(g), MomentKind::kPreBackward, g);
    backward(g, chunks::kNoClass);
  }
  ASSERT_TRUE(s.Step({GroupHyper{}}).ok());
  ASSERT_TRUE(s.ZeroGrad().ok());
}

struct PlanRun {
  std::vector<std::vector<float>> params;
  Session::PlanStatus plan;
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
    EXPECT_THAT(s->WriteParam(t, v.data()), IsOk());
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
  out.plan = s->plan_status();
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
