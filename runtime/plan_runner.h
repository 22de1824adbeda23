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
// Expert classes (a plan made from a trace with expert sets, planners/expert_slots.h): the
// session tells the runner of every acquire of an expert as a class member (ClassAccess),
// which binds it to the plan's next slot of its class; the plan's actions on a slot apply to
// the expert bound to it and are skipped while none is (the engine's class policy fetches a
// routed expert at the router or its acquire). Expert acquires are not checked against the
// plan: a routing other than the recorded one is the class policy's business, not a
// divergence (planners/divergence.h); only the dense acquires are.
//
// A moment the trace recorder split (a chunk accessed on a second tier within one moment
// becomes "<label>+", trace_recorder.h) is split here the same way, so the moments line up.
//
// Planning at the iteration boundary (config `plan: auto`; the session calls AtBoundary from its
// BeginIteration, between EndIteration and BeginIteration here): the session records its third
// training iteration in memory (kRecordedIteration: the first two are cold — lazily zero chunks,
// first moves, a first optimizer update that reads no Adam state) — or uses the user's own
// recording when one completes — and the runner makes a plan from it (ExecuteFrom:
// planners::MakePlan with this run's homes, residency, budgets and measured rates) and executes it
// from the next iteration on — unless it loses to the engine (DecidePlan): the planner also
// simulates the reactive engine's own moves on the same trace, homes and start state (with this
// run's lookahead), and a plan whose simulated steady iteration moves more of the objective's
// bytes (into the device, or to and from NVMe in host mode) or stalls longer than the engine's
// is declined (declined(), decision(); planning then stops and the engine stays reactive; a tie
// runs) — the bar the planner ranks its candidates by. The engine's bytes measured over the
// recorded iteration are reported beside them, and are the bar only where the simulator could
// not run the engine policy (a plan from the user's own recording is judged too, with nothing
// measured). On CUDA, where the objective is modelled time, the bar is not
// applied, nor under `plan: always`, nor when the plan places activations
// (offload, auto: it trades chunk bytes for activation bytes the bar does not see). An iteration
// that diverges from the plan runs reactive from there (warned once); the next one is recorded, and
// if it diverges too, the plan is remade from it — up to kMaxPlans plans: iterations that keep
// diverging (variable shapes, data-dependent branches) then run reactive for good (declined()).
// Nothing is planned when every chunk fits the compute tier (the device; in host mode the host,
// every chunk homed there) and activations are outside its budget (nothing would move). A plan that
// cannot be made is logged and planning stops for good (error()): the engine stays reactive. Plans
// move copies only: every value is the same without them.
//
// Thread-safety: externally synchronized (the session's thread).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "chunks/engine.h"
#include "planners/divergence.h"
#include "planners/expert_slots.h"
#include "planners/planner.h"
#include "runtime/modes.h"

namespace tiermem::session {

class TraceRecorder;

// The bytes the planner's kBytes objective counts (planners/planner.cc) in the engine's
// counters: into the device, or to and from NVMe on a machine without a device (host mode).
Bytes PlanObjectiveBytes(const chunks::EngineStats& stats, bool host_mode);

// plan: auto's decision on a plan it made (see the file comment): the plan's simulated steady
// iteration against the reactive engine's on the same trace, homes and start state (the engine
// policy's own moves as the planner scored them: Plan::FindBaseline("engine")), on the
// objective's bytes (into the device; to and from NVMe in host mode) and on stall — the bar the
// planner ranks its candidates by. Beside them, what the engine measured over the recorded
// iteration (reported; the bar only where the simulator could not run the engine policy).
struct PlanDecision {
  bool judged = false;   // a plan was made and the bar applied (auto, not on CUDA, ...)
  bool adopted = false;  // it runs
  std::string reason;    // why it was declined, "" when adopted
  Bytes plan_bytes = 0;  // simulated, per steady iteration
  uint64_t plan_stall_ns = 0;
  bool engine_simulated = false;  // the engine policy ran the trace in the simulator
  Bytes engine_bytes = 0;         // simulated, per steady iteration (engine_simulated)
  uint64_t engine_stall_ns = 0;
  bool measured = false;            // the recorded iteration was measured
  Bytes engine_measured_bytes = 0;  // the engine's counters over it (measured)
};
// Judges `plan` (`measured`: the engine's objective bytes over the recorded iteration, nullptr
// when not measured). Adopts when the simulated engine exists and the plan moves no more bytes
// and stalls no longer than it (ties adopt); without it, when the plan moves no more than the
// measured bytes (or nothing was measured).
PlanDecision DecidePlan(const planners::Plan& plan, bool host_mode, const Bytes* measured);

class PlanRunner {
 public:
  // Plans made (the first and re-plans after divergences) before plan: auto gives up.
  static constexpr uint64_t kMaxPlans = 4;
  // The training iteration (1-based) plan: auto records and plans; the plan runs from the next.
  static constexpr uint64_t kRecordedIteration = 3;
  struct Stats {
    uint64_t plans = 0;                // plans started
    uint64_t planned_iterations = 0;   // iterations begun under a plan
    uint64_t followed_iterations = 0;  // of those, followed to the end
    uint64_t divergences = 0;
    std::string last_divergence;  // the checker's reason, "" if none
  };

  // Executes `plan` from the next BeginIteration on. The engine must outlive the runner.
  void Start(planners::Plan plan, chunks::Engine* engine);
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
  // An acquire of `chunk` as a member of an expert set's class (not checked: see above).
  void ClassAccess(ChunkId chunk);
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

  // ---- planning (see the file comment) ----
  // What making a plan reads from the session.
  struct PlanContext {
    chunks::Engine* engine = nullptr;  // homes, residency, budgets; must outlive the runner
    ActivationMode activations = ActivationMode::kOutside;  // config `activations`
    bool cuda = false;  // least modelled time on CUDA, fewest bytes elsewhere
    bool bar = true;    // plan: auto declines a plan that loses to the engine (always: no)
    // The engine's lookahead (EngineConfig), which the planner's engine baseline mimics.
    uint32_t engine_prefetch_depth = 4;
    planners::EngineLookahead engine_lookahead = planners::EngineLookahead::kDepth;
    // Placement::compute_tier_holds_every_chunk(): nothing moves but for counted activations.
    bool compute_tier_holds_every_chunk = false;
  };
  // Makes a plan from iteration `iteration` of `trace` (-1: its last) and executes it from
  // the next BeginIteration (Start). kInvalidArgument for a trace of another layout; the
  // planner's errors otherwise (nothing changes then). With `judge` (plan: auto at a boundary)
  // and ctx.bar, a plan that loses to the engine is declined (DecidePlan, see the file
  // comment; OK); `reactive_end`, the engine's stats at the end of the recorded iteration
  // (which began at measure_start_; nullptr: not measured, e.g. the user's own recording),
  // gives the measured bytes beside the simulated ones.
  Status ExecuteFrom(const planners::Trace& trace, int64_t iteration, const PlanContext& ctx,
                     bool judge = false, const chunks::EngineStats* reactive_end = nullptr);
  // plan: auto at an iteration boundary (`diverged`: the iteration that ended left its plan).
  // Plans from a recording `trace` completed (TraceRecorder::TakeTrace) when no plan executes
  // or the last one diverged. True when the session should record the iteration beginning
  // now, in memory, for a plan (TraceRecorder::ArmInMemory(1)).
  bool AtBoundary(bool diverged, TraceRecorder* trace, const PlanContext& ctx);
  // Why planning stopped ("" if it did not).
  const std::string& error() const { return error_; }
  // Why plan: auto kept the reactive engine although it could plan ("" if it did not): the
  // plan's simulated bytes and stall against the engine's (decision()), or the iterations
  // leaving their plans.
  const std::string& declined() const { return declined_; }
  // plan: auto's last decision on a plan it made (judged false: none judged).
  const PlanDecision& decision() const { return decision_; }
  // The plan executing (or the last one): its estimate and its actions per iteration.
  const planners::PlanEstimate& estimate() const { return estimate_; }
  uint32_t actions() const { return actions_; }

 private:
  void Issue(int64_t planned_moment);
  bool UnitIs(uint32_t unit, planners::ActivationPolicy policy) const;
  void Diverge();
  void Open(std::string_view label, planners::MomentKind kind);

  chunks::Engine* engine_ = nullptr;
  std::unique_ptr<planners::Plan> plan_;
  std::unique_ptr<planners::DivergenceChecker> checker_;
  planners::ExpertSlots slots_;  // the plan's expert classes; bound per iteration
  // Per chunk: ever acquired as an expert (ClassAccess), whether or not the plan knows it —
  // e.g. the optimizer step of an expert the recorded iteration never routed to.
  std::vector<bool> members_;
  bool in_iteration_ = false;
  bool diverged_ = false;
  bool paused_ = false;
  // Split detection, as the trace recorder does it: per chunk, the moment serial and tier.
  std::vector<uint32_t> tier_in_moment_;
  uint32_t serial_ = 0;
  std::string label_;
  std::vector<uint32_t> fetches_;  // kFetchActivation units issued, not yet taken
  Stats stats_;
  // Planning.
  uint64_t train_iterations_ = 0;  // boundaries seen (AtBoundary calls)
  std::string error_;
  std::string declined_;
  PlanDecision decision_;
  // The engine's bytes moved when the in-memory recording began (AtBoundary returned true),
  // so that the recorded iteration's reactive bytes are known when its trace comes back.
  bool measuring_ = false;
  chunks::EngineStats measure_start_;
  planners::PlanEstimate estimate_;
  uint32_t actions_ = 0;
  bool warned_divergence_ = false;
};

}  // namespace tiermem::session
