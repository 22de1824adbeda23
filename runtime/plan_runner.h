// PlanRunner: executes a planner's plan (planners/planner.h) on the session's engine.
//
// The session feeds it what it already sees — iteration boundaries, moments (with kind) and
// chunk accesses with their tier — and the runner follows the plan with the planner's own
// DivergenceChecker (chunks and tiers; modes are not checked, since the session learns that a
// chunk was modified only at its release). At the start of every planned moment it issues that
// moment's actions in the plan's order: evictions (engine PlanEvict: a dirty copy is written
// home in the background), then prefetches in need order (engine PlanPrefetch). The engine is
// in planned mode while the iteration follows the plan: its own lookahead prefetch and
// write-behind are off (engine.h, "Planned mode").
//
// Divergence (other moments or chunks than planned: dynamic control flow, a different batch
// shape): the runner leaves planned mode for the rest of that iteration — the engine's
// reactive policy (farthest next use in the last recorded order, lookahead prefetch) takes
// over — and reports it; the session decides whether to re-plan. Values never depend on any
// of this: the engine's Acquire makes every chunk resident whatever the plan did.
//
// Activations (a plan made with an activation policy): the binding moves saved activations,
// not the engine, so the runner only tells it what the plan decided — which units' activations
// go to the host after their forward (OffloadsUnit), which units drop theirs and recompute
// them in the backward (RecomputesUnit) and, per moment, whose come back
// (TakeActivationFetches) — while the iteration follows the plan.
//
// A moment the trace recorder split (a chunk accessed on a second tier within one moment
// becomes "<label>+", trace_recorder.h) is split here the same way, so the moments line up.
//
// Thread-safety: externally synchronized (the session's thread).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "planners/divergence.h"
#include "planners/planner.h"
#include "chunks/engine.h"

namespace tiermem::session {

class PlanRunner {
 public:
  struct Stats {
    uint64_t plans = 0;                // plans started
    uint64_t planned_iterations = 0;   // iterations begun under a plan
    uint64_t followed_iterations = 0;  // of those, followed to the end
    uint64_t divergences = 0;
    std::string last_divergence;       // the checker's reason, "" if none
  };

  // Executes `plan` from the next BeginIteration on. The engine must outlive the runner.
  void Start(planners::Plan plan, engine::Engine* engine);
  // Stops executing (the engine goes back to its reactive policy).
  void Stop();
  bool active() const { return plan_ != nullptr; }
  bool in_iteration() const { return in_iteration_; }
  const planners::Plan* plan() const { return plan_.get(); }

  // Closes the iteration that just ended (true when it followed the plan to its end; false
  // if it diverged or no plan was executing) and starts following the plan in the next one.
  bool EndIteration();
  void BeginIteration();
  void Moment(std::string_view label, planners::MomentKind kind);
  void Access(ChunkId chunk, TierKind tier);
  void SetPaused(bool paused) { paused_ = paused; }
  // While following the plan: whether it offloads `unit`'s saved activations after its
  // forward, or recomputes them in its backward; the units whose offloaded activations the
  // moments issued since the last call fetch back (cleared by the call).
  bool OffloadsUnit(uint32_t unit) const;
  bool RecomputesUnit(uint32_t unit) const;
  bool following() const { return active() && in_iteration_ && !diverged_ && !paused_; }
  std::vector<uint32_t> TakeActivationFetches();
  // Whether the current iteration has diverged from the plan.
  bool diverged() const { return diverged_; }
  const Stats& stats() const { return stats_; }

 private:
  void Issue(int64_t planned_moment);
  bool UnitIs(uint32_t unit, planners::ActivationPolicy policy) const;
  void Diverge();
  void Open(std::string_view label, planners::MomentKind kind);

  engine::Engine* engine_ = nullptr;
  std::unique_ptr<planners::Plan> plan_;
  std::unique_ptr<planners::DivergenceChecker> checker_;
  bool in_iteration_ = false;
  bool diverged_ = false;
  bool paused_ = false;
  // Split detection, as the trace recorder does it: per chunk, the moment serial and tier.
  std::vector<uint32_t> tier_in_moment_;
  uint32_t serial_ = 0;
  std::string label_;
  std::vector<uint32_t> fetches_;  // kFetchActivation units issued, not yet taken
  Stats stats_;
};

}  // namespace tiermem::session
