// Helpers of the session tests split by concern (session_test.cc, session_checkpoint_test.cc,
// session_nvme_test.cc, session_trace_test.cc, session_plan_test.cc, session_inback_test.cc).
// In a namespace of their own, so that argument-dependent lookup never mixes them with another
// test's helpers.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cmath>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/optim.h"
#include "runtime/session.h"
#include "tests/runtime/session_test_support.h"
#include "tests/support/session.h"
#include "tests/support/status_matchers.h"

namespace tiermem::session::session_tests {

inline std::string TempDir() {
  char tmpl[] = "/tmp/tiermem-session-XXXXXX";
  EXPECT_NE(mkdtemp(tmpl), nullptr);
  return tmpl;
}

inline std::unique_ptr<Session> Make(nlohmann::json config, std::vector<TensorSpec> specs) {
  config["device_kind"] = "sim";
  return testing::MakeSession(std::move(config), std::move(specs));
}

inline std::vector<float> Random(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(gen);
  return v;
}

inline std::vector<float> Param(Session& s, size_t t) {
  std::vector<float> v(s.layout().place(t).numel);
  EXPECT_THAT(s.values().ReadParam(t, v.data()), ::tiermem::testing::IsOk());
  return v;
}

// Everything the optimizer leaves: fp32 values, m, v and step counts of every tensor.
inline std::vector<std::vector<float>> TrainingState(Session& s) {
  std::vector<std::vector<float>> out;
  for (size_t t = 0; t < s.layout().num_tensors(); ++t) {
    out.push_back(Param(s, t));
    for (ChunkKind kind : {chunks::ChunkKind::kExpAvg, chunks::ChunkKind::kExpAvgSq}) {
      std::vector<float> x(s.layout().place(t).numel);
      EXPECT_THAT(s.values().ReadTensor(t, kind, x.data()), ::tiermem::testing::IsOk());
      out.push_back(std::move(x));
    }
    out.push_back({static_cast<float>(s.values().step_count(t))});
  }
  return out;
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

inline const std::vector<TensorSpec> kThree = {{"a", 1000, true, 0}, {"b", 300, true, 0},
                                               {"c", 77, true, 0}};

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

inline StepResult SpecIteration(Session& s, int it, const SpecIt& o) {
  using planners::MomentKind;
  using ::tiermem::testing::IsOk;
  s.iterations().BeginIteration();
  s.SetStepHyper(o.announced);
  const uint32_t n = static_cast<uint32_t>(s.layout().num_groups());
  for (uint32_t g = 0; g < n; ++g) {
    EXPECT_THAT(s.optimizer().FinishStep(g), IsOk());
    s.iterations().Moment("fwd:" + std::to_string(g), MomentKind::kPreForward, g);
    EXPECT_TRUE(s.chunks().Acquire(g, s.layout().compute_kind(), TierKind::kDevice).ok());
    EXPECT_THAT(s.chunks().Release(g, s.layout().compute_kind(), false), IsOk());
  }
  auto grad = [&](uint32_t t, int salt) {
    // Scaled by the loss scale (fp16), as a scaled loss's backward gives them.
    std::vector<float> v = Random(s.layout().place(t).numel, 1000 * it + 10 * t + salt,
                                  o.grad_scale * static_cast<float>(s.optimizer().loss_scale()));
    if (o.overflow && s.layout().place(t).group == 0) v[3] = INFINITY;
    return v;
  };
  for (uint32_t g = n; g-- > 0;) {
    s.iterations().Moment("bwd:" + std::to_string(g), MomentKind::kPreBackward, g);
    for (uint32_t t : s.layout().group(g).tensors) SetGrad(s, t, grad(t, 0));
  }
  if (o.rewrite) {
    for (uint32_t t : s.layout().group(n - 1).tensors) SetGrad(s, t, grad(t, 1));
  }
  if (o.between) o.between(s);
  auto r = s.optimizer().Step(o.hyper);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(s.optimizer().ZeroGrad().ok());
  return r.ok() ? *r : StepResult{};
}

}  // namespace tiermem::session::session_tests
