// PlanRunner (plan_runner.h): following a plan on the engine, and planning at iteration
// boundaries.
//
// Invariants: BeginIteration of a planned iteration puts the engine in planned mode, and
// only Diverge and Stop take it out; a diverged iteration stays diverged until the next
// BeginIteration, and the checker keeps its first reason; Issue runs at the start of every
// planned moment, the split ones ("<label>+") included, so actions fire in the plan's order.
// Planning: a plan is made only from a trace whose chunk table matches the engine's (count
// and bytes per chunk); once making one failed (error_), no later boundary plans again; the
// estimate and action count stay those of the last plan started, also after Stop.
//
// Ownership and threading: the runner owns its plan and checker; the engine is borrowed (the
// session's, outliving it); the trace recorder is only read and drained at a boundary, never
// kept. Everything runs on the session's thread: no locks.
#include "runtime/plan_runner.h"

#include <cstdio>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "base/logging.h"
#include "runtime/trace_recorder.h"

namespace tiermem::session {

using planners::ActionKind;
using planners::MomentKind;

void PlanRunner::Start(planners::Plan plan, chunks::Engine* engine) {
  Stop();
  engine_ = engine;
  plan_ = std::make_unique<planners::Plan>(std::move(plan));
  checker_ = std::make_unique<planners::DivergenceChecker>(plan_.get(), /*check_modes=*/false);
  slots_ = planners::ExpertSlots(*plan_);
  in_iteration_ = false;
  diverged_ = false;
  ++stats_.plans;
}

void PlanRunner::Stop() {
  if (engine_ != nullptr) engine_->SetPlanned(false);
  checker_.reset();
  plan_.reset();
  slots_ = planners::ExpertSlots();
  in_iteration_ = false;
  diverged_ = false;
}

bool PlanRunner::EndIteration() {
  if (!active() || !in_iteration_) return false;
  in_iteration_ = false;
  if (!diverged_ && !checker_->EndIteration()) Diverge();
  if (!diverged_) ++stats_.followed_iterations;
  return !diverged_;
}

void PlanRunner::BeginIteration() {
  if (!active()) return;
  checker_->Reset();
  slots_.Reset();
  diverged_ = false;
  in_iteration_ = true;
  fetches_.clear();
  ++stats_.planned_iterations;
  engine_->SetPlanned(true);
  // The recorder opens every iteration with this moment (trace_recorder.cc).
  Open("iteration-start", MomentKind::kOther);
}

void PlanRunner::Open(std::string_view label, MomentKind kind) {
  label_ = std::string(label);
  serial_ = (serial_ + 1) % 0x3fffffffu;
  if (!checker_->OnMoment(label, kind)) {
    Diverge();
    return;
  }
  Issue(checker_->current());
}

void PlanRunner::Moment(std::string_view label, MomentKind kind) {
  if (!active() || !in_iteration_ || diverged_ || paused_) return;
  Open(label, kind);
}

void PlanRunner::Access(ChunkId chunk, TierKind tier) {
  if (!active() || !in_iteration_ || diverged_ || paused_) return;
  if (chunk >= tier_in_moment_.size()) tier_in_moment_.resize(chunk + 1, ~0u);
  const uint32_t stamp = (serial_ << 2) | static_cast<uint32_t>(tier);
  if ((tier_in_moment_[chunk] >> 2) == serial_ && tier_in_moment_[chunk] != stamp) {
    Open(label_ + "+", MomentKind::kOther);  // the recorder split this moment here
    if (diverged_) return;
  }
  tier_in_moment_[chunk] = (serial_ << 2) | static_cast<uint32_t>(tier);
  const bool member = chunk < members_.size() && members_[chunk];
  if (!checker_->OnAccess(chunk, planners::AccessMode::kRead, tier, member)) Diverge();
}

void PlanRunner::ClassAccess(ChunkId chunk) {
  if (chunk >= members_.size()) members_.resize(chunk + 1, false);
  members_[chunk] = true;
  if (!active() || !in_iteration_ || diverged_ || paused_) return;
  slots_.Bind(chunk);
}

void PlanRunner::Issue(int64_t planned_moment) {
  if (planned_moment < 0) return;
  const planners::PlannedMoment& pm = plan_->moments[static_cast<size_t>(planned_moment)];
  for (uint32_t k = 0; k < pm.num_actions; ++k) {
    const planners::PlanAction& a = plan_->actions[pm.first_action + k];
    ChunkId c = a.chunk;
    if (a.kind != ActionKind::kFetchActivation && slots_.IsMember(c)) {
      // A slot: the expert the routing bound to it; none yet (or the next iteration's
      // routing): the class policy's. An eviction of an unbound slot drops the copy the plan
      // knew of unless that chunk fills another slot now (as the simulator's PlanPolicy).
      const ChunkId bound = slots_.Resolve(c);
      if (a.kind == ActionKind::kPrefetch) {
        c = a.need_moment >= plan_->moments.size() ? kNoChunk : bound;
      } else {
        c = bound != kNoChunk ? bound : (slots_.SlotOf(c) == kNoChunk ? c : kNoChunk);
      }
      if (c == kNoChunk) continue;
    }
    StatusOr<bool> r = true;
    switch (a.kind) {
      case ActionKind::kEvict:
        r = engine_->PlanEvict(c, a.tier);
        break;
      case ActionKind::kPrefetch:
        r = engine_->PlanPrefetch(c, a.tier);
        break;
      case ActionKind::kFetchActivation:
        fetches_.push_back(a.unit);
        break;  // the binding's
    }
    if (!r.ok()) {
      // A move that cannot start is left to the reactive path (the acquire will need it).
      TIERMEM_LOG(kWarn) << "plan: " << planners::ActionKindName(a.kind) << " of chunk " << c
                         << " at " << pm.label << ": " << r.status().message();
    }
  }
}

bool PlanRunner::UnitIs(uint32_t unit, planners::ActivationPolicy policy) const {
  if (!following()) return false;
  for (const planners::UnitPlan& u : plan_->units) {
    if (u.unit == unit) return u.policy == policy;
  }
  return false;
}
bool PlanRunner::OffloadsUnit(uint32_t unit) const {
  return UnitIs(unit, planners::ActivationPolicy::kOffload);
}
bool PlanRunner::RecomputesUnit(uint32_t unit) const {
  return UnitIs(unit, planners::ActivationPolicy::kRecompute);
}

std::vector<uint32_t> PlanRunner::TakeActivationFetches() {
  std::vector<uint32_t> out;
  out.swap(fetches_);
  return out;
}

bool PlanRunner::AtBoundary(bool diverged, TraceRecorder* trace, const PlanContext& ctx) {
  ++train_iterations_;
  if (diverged && !warned_divergence_) {
    warned_divergence_ = true;
    TIERMEM_LOG(kWarn) << "plan: training iteration " << train_iterations_ - 1 << " left the plan ("
                       << stats_.last_divergence
                       << "); it ran on the reactive policy from there (same values). The "
                          "next iteration is recorded and planned again if it diverges too. "
                          "(Warned once.)";
  }
  if (!error_.empty() || !declined_.empty()) return false;
  std::optional<planners::Trace> t = trace->TakeTrace();
  if (t && (!active() || diverged)) {
    // The bar a plan must beat: what the engine moved over the iteration just recorded (the
    // reactive policy's, or the diverged plan's then reactive, bytes).
    std::optional<chunks::EngineStats> reactive;
    if (measuring_) reactive = ctx.engine->Stats();
    measuring_ = false;
    Status s = ExecuteFrom(*t, -1, ctx, /*judge=*/true, reactive ? &*reactive : nullptr);
    if (!s.ok()) {
      error_ = s.message();
      Stop();
      // Info, not a warning: plan: auto is the default, and the reactive engine it keeps is
      // what `off` runs (stats()["plan"]["error"] says why).
      TIERMEM_LOG(kInfo) << "plan: no plan (" << error_ << "); the engine stays reactive";
    }
    return false;
  }
  if (trace->armed()) return false;
  // Nothing moves when every chunk fits the compute tier: nothing to plan.
  // (Counted activations can still push chunks out.)
  if (!CountsActivations(ctx.activations) && ctx.compute_tier_holds_every_chunk) return false;
  if (diverged && active() && stats_.plans >= kMaxPlans) {
    // Iterations that keep leaving their plans (variable shapes, data-dependent branches)
    // would be recorded and planned every other step: stop at the reactive engine.
    Stop();
    declined_ = "the iterations keep leaving their plans (" + std::to_string(stats_.plans) +
                " plans made; the last one left: " + stats_.last_divergence + ")";
    TIERMEM_LOG(kInfo) << "plan: " << declined_ << "; the engine stays reactive";
    return false;
  }
  // The first iterations are cold: lazily zero chunks and first moves in the first; in the
  // second the first optimizer update (run inside it when updates are deferred into the next
  // forward) finds Adam's m and v lazily zero, so it reads none of them. Record the third, the
  // first whose bytes are those of every later one: it is also the reactive bar (above).
  const bool record = diverged || (!active() && train_iterations_ == kRecordedIteration);
  if (record) {
    measuring_ = true;
    measure_start_ = ctx.engine->Stats();
  }
  return record;
}

Bytes PlanObjectiveBytes(const chunks::EngineStats& s, bool host_mode) {
  constexpr int kD = static_cast<int>(TierKind::kDevice);
  constexpr int kH = static_cast<int>(TierKind::kHost);
  constexpr int kN = static_cast<int>(TierKind::kNvme);
  if (host_mode) {
    return s.bytes_moved[kH][kN] + s.bytes_moved[kN][kH] + s.bytes_moved[kD][kN] +
           s.bytes_moved[kN][kD];
  }
  return s.bytes_moved[kH][kD] + s.bytes_moved[kN][kD];
}

namespace {
std::string Ms(uint64_t ns) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f ms", static_cast<double>(ns) / 1e6);
  return buf;
}
}  // namespace

PlanDecision DecidePlan(const planners::Plan& plan, bool host_mode, const Bytes* measured) {
  PlanDecision d;
  d.judged = true;
  const planners::PlanEstimate& e = plan.estimate;
  d.plan_bytes = host_mode ? e.steady_nvme_bytes : e.steady_device_in_bytes;
  d.plan_stall_ns = e.steady_stall_ns;
  if (measured != nullptr) {
    d.measured = true;
    d.engine_measured_bytes = *measured;
  }
  const std::string what = host_mode ? "to and from NVMe" : "into the device";
  if (const planners::BaselineEstimate* eng = plan.FindBaseline("engine")) {
    d.engine_simulated = true;
    d.engine_bytes = host_mode ? eng->nvme_bytes : eng->device_in_bytes;
    d.engine_stall_ns = eng->stall_ns;
    if (d.plan_bytes > d.engine_bytes || d.plan_stall_ns > d.engine_stall_ns) {
      d.reason = "the plan would move " + std::to_string(d.plan_bytes) + " bytes per iteration " +
                 what + " and stall " + Ms(d.plan_stall_ns) +
                 " (simulated), the reactive engine's moves " + std::to_string(d.engine_bytes) +
                 " bytes and " + Ms(d.engine_stall_ns) + " on the same trace";
    }
  } else if (d.measured && d.plan_bytes > d.engine_measured_bytes) {
    // The simulator could not run the engine policy: the engine's measured bytes are the bar.
    d.reason = "the plan would move " + std::to_string(d.plan_bytes) + " bytes per iteration " +
               what + ", the reactive engine moved " + std::to_string(d.engine_measured_bytes) +
               " over the recorded one";
  }
  d.adopted = d.reason.empty();
  return d;
}

Status PlanRunner::ExecuteFrom(const planners::Trace& trace, int64_t iteration,
                               const PlanContext& ctx, bool judge,
                               const chunks::EngineStats* reactive_end) {
  chunks::Engine* eng = ctx.engine;
  if (trace.chunks.size() != eng->num_chunks()) {
    return InvalidArgumentError("plan: the trace has " + std::to_string(trace.chunks.size()) +
                                " chunks, this model " + std::to_string(eng->num_chunks()));
  }
  if (trace.iterations.empty()) return InvalidArgumentError("plan: the trace has no iteration");
  const int64_t last = static_cast<int64_t>(trace.iterations.size()) - 1;
  if (iteration < 0) iteration = last;
  if (iteration > last) {
    return InvalidArgumentError("plan: the trace has no iteration " + std::to_string(iteration));
  }
  planners::Trace t = trace;
  const bool counted = CountsActivations(ctx.activations);
  if (!counted) {
    // Activations and temporaries are not in the engine's device budget (on SimDevice they
    // live in CPU memory; on CUDA in torch's allocator): the chunks get the whole budget.
    for (planners::TraceIteration& it : t.iterations) {
      for (planners::Moment& m : it.moments) m.activation_bytes = m.saved_bytes = 0;
    }
  }
  std::vector<TierKind> homes(eng->num_chunks());
  planners::StartState start;
  start.cache.assign(eng->num_chunks(), TierKind::kNone);
  start.dirty.assign(eng->num_chunks(), false);
  for (ChunkId c = 0; c < eng->num_chunks(); ++c) {
    homes[c] = eng->Home(c);
    t.chunks[c].home = homes[c];
    if (t.chunks[c].bytes != eng->ChunkBytes(c)) {
      return InvalidArgumentError("plan: trace chunk " + std::to_string(c) + " has " +
                                  std::to_string(t.chunks[c].bytes) + " bytes, this model's " +
                                  std::to_string(eng->ChunkBytes(c)));
    }
    const TierKind r = eng->Resident(c);
    if (r != homes[c]) {
      start.cache[c] = r;
      start.dirty[c] = eng->Dirty(c);
    }
  }
  planners::MachineModel m = planners::MachineModel::FromTrace(t);
  const chunks::EngineStats st = eng->Stats();
  for (int k = 0; k < kNumTierKinds; ++k) m.budget[k] = st.tiers[k].capacity;
  // Counted activations are in the trace already; other external bytes (a KV cache) are not.
  const Bytes ext = counted ? 0 : eng->external_device_bytes();
  Bytes& dev = m.budget[static_cast<int>(TierKind::kDevice)];
  dev = dev > ext ? dev - ext : 0;
  // Links the recorded iteration did not use: the reverse direction's rate, else a
  // conservative default (they matter only for moves the recording never needed).
  m.FillMissingLinks();
  planners::PlanOptions o;
  o.iteration = static_cast<uint32_t>(iteration);
  o.start = &start;
  o.homes = &homes;
  o.place_optimizer = false;  // groups step where the session's OptimizerStepper put them
  // Updates run where the trace has them (after the backward, or deferred into the next
  // forward): the runtime does not overlap them with the backward.
  o.overlap_optimizer = false;
  // Offloaded (offload, auto): the binding offloads whole units' activations to the host as
  // the plan says; chosen by the plan (auto): it also recomputes the units the plan
  // recomputes. Otherwise they stay where the binding keeps them (recompute: every unit
  // recomputes, whatever a plan would choose).
  o.activation_policy = OffloadsActivations(ctx.activations);
  o.allow_recompute = PlanChoosesActivations(ctx.activations);
  if (iteration > 0) o.earlier_iteration = iteration - 1;
  // The engine baseline (the bar below) looks ahead as this run's engine does.
  o.engine_prefetch_depth = ctx.engine_prefetch_depth;
  o.engine_lookahead = ctx.engine_lookahead;
  // SimDevice's copies are memcpys on the same CPU cores as the compute, which the machine
  // model (copy lanes concurrent with compute) does not see: fewest bytes is the right goal
  // there; in host mode the bytes are NVMe's (the planner counts those there). On CUDA the
  // copy engines run beside the kernels: least modelled time.
  o.objective = ctx.cuda ? planners::PlanObjective::kTime : planners::PlanObjective::kBytes;
  TIERMEM_ASSIGN_OR_RETURN(planners::Plan p, planners::MakePlan(t, m, o));
  // The bar compares chunk bytes only: a plan that also places activations (offload, auto)
  // trades chunk bytes for activation bytes the engine's counters do not see, so it runs.
  if (judge && !ctx.cuda && ctx.bar && !o.activation_policy) {
    const bool host_mode = m.Budget(TierKind::kDevice) == 0;
    std::optional<Bytes> measured;
    if (reactive_end != nullptr) {
      measured = PlanObjectiveBytes(*reactive_end, host_mode) -
                 PlanObjectiveBytes(measure_start_, host_mode);
    }
    decision_ = DecidePlan(p, host_mode, measured ? &*measured : nullptr);
    declined_ = decision_.reason;
    if (!declined_.empty()) {
      TIERMEM_LOG(kInfo) << "plan: declined (" << declined_ << "); the engine stays reactive";
      return OkStatus();
    }
  }
  estimate_ = p.estimate;
  actions_ = static_cast<uint32_t>(p.actions.size());
  TIERMEM_LOG(kInfo) << "plan: " << p.actions.size() << " actions over " << p.moments.size()
                     << " moments; modelled iteration " << p.estimate.steady_iteration_ns / 1e6
                     << " ms, stall " << p.estimate.steady_stall_ns / 1e6 << " ms";
  Start(std::move(p), eng);
  return OkStatus();
}

void PlanRunner::Diverge() {
  if (diverged_) return;
  diverged_ = true;
  ++stats_.divergences;
  stats_.last_divergence = checker_->divergence().reason;
  engine_->SetPlanned(false);  // reactive for the rest of this iteration
}

}  // namespace tiermem::session
