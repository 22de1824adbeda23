// Simulator: the baseline policies and the driver. See simulator.h for the protocol.
#include "planners/simulator.h"

#include <algorithm>
#include <tuple>

#include "planners/baselines.h"
#include "planners/schedule.h"

namespace tiermem::planners {
namespace {

// A baseline policy's kind: PolicyKind's baselines carry BaselineKind's values (simulator.h).
// Called for those four only.
BaselineKind Baseline(PolicyKind p) { return static_cast<BaselineKind>(p); }

// Belady over the whole measured run (an oracle): demand fetches only.
class OptPolicy : public Policy {
 public:
  OptPolicy(const NextUse* nu) : nu_(nu) {}
  void SetOffset(uint64_t offset) { offset_ = offset; }
  Status Before(SimulatedRun& ex, size_t i) override {
    const uint64_t pos = offset_ + i;
    return EnsureMoment(ex, i, [&](ChunkId c, TierKind t) {
      return BeladyKey(*nu_, c, t, pos, ex.Chunk(c).dirty, ex.ChunkBytes(c));
    });
  }

 private:
  const NextUse* nu_;
  uint64_t offset_ = 0;
};

Placement Recorded(const Trace& trace, std::vector<TierKind> homes) {
  Placement p;
  p.home = std::move(homes);
  return p;
}

void Accumulate(IterationStats& into, const IterationStats& s) {
  into.iteration_ns += s.iteration_ns;
  into.compute_ns += s.compute_ns;
  into.recompute_ns += s.recompute_ns;
  into.cpu_overlap_ns += s.cpu_overlap_ns;
  into.stall_ns += s.stall_ns;
  for (int k = 0; k < kNumStallCauses; ++k) into.stall_by_cause[k] += s.stall_by_cause[k];
  for (int a = 0; a < kNumTierKinds; ++a) {
    for (int b = 0; b < kNumTierKinds; ++b) into.bytes[a][b] += s.bytes[a][b];
  }
  into.activation_bytes_in += s.activation_bytes_in;
  into.fetches += s.fetches;
  into.evictions += s.evictions;
  into.writebacks += s.writebacks;
}

class Driver {
 public:
  Driver(const Trace& t, const MachineModel& m, const SimOptions& o)
      : trace_(t), machine_(m), opt_(o) {
    seq_.push_back(0);
    if (t.iterations.size() == 1) {
      seq_.push_back(0);
    } else {
      for (uint32_t k = 1; k < t.iterations.size(); ++k) seq_.push_back(k);
    }
  }

  // `planned` (for opt): the planned run whose placements opt follows.
  StatusOr<SimResult> Run(PolicyKind kind, const SimResult* planned) {
    SimResult res;
    res.policy = kind;
    Status s = RunImpl(kind, planned, &res);
    if (s.code() == StatusCode::kResourceExhausted) {
      res.status = s;
      return res;
    }
    TIERMEM_RETURN_IF_ERROR(s);
    return res;
  }

 private:
  // What the steps of one policy's run share. Positions index seq_: 0 is the warm-up, 1.. the
  // measured iterations.
  struct RunState {
    PolicyKind kind = PolicyKind::kLru;
    const SimResult* planned = nullptr;  // opt: the planned run it follows
    SimResult* res = nullptr;            // the result being filled
    Plan first_plan;                     // planned: made from the warm-up iteration
    std::vector<TierKind> homes;         // fixed for the whole run
    std::unique_ptr<SimulatedRun> ex;
    std::vector<EffIteration> recorded_eff;  // per position, under the recorded placement
    std::vector<EffIteration> eff;           // per position, under the policy's (planned, opt)
    std::unique_ptr<NextUse> oracle;         // opt, opt-recorded: every measured iteration
    uint64_t offset = 0;                     // opt: the oracle's position of this iteration
  };

  Status RunImpl(PolicyKind kind, const SimResult* planned, SimResult* res) {
    RunState r;
    r.kind = kind;
    r.planned = planned;
    r.res = res;
    TIERMEM_RETURN_IF_ERROR(PlaceHomes(r));
    res->homes = r.homes;
    TIERMEM_ASSIGN_OR_RETURN(r.ex, SimulatedRun::Create(&trace_, &machine_, r.homes));
    TIERMEM_RETURN_IF_ERROR(WarmUp(r));
    r.ex->ResetPeaks();
    r.ex->set_record_moments(opt_.record_moments);
    TIERMEM_RETURN_IF_ERROR(PrepareOracle(r));
    for (size_t p = 1; p < seq_.size(); ++p) {
      bool diverged = false;
      StatusOr<IterationStats> st = InternalError("unset");
      TIERMEM_RETURN_IF_ERROR(RunMeasured(r, p, &st, &diverged));
      if (!st.ok()) {
        return st.status().WithContext(std::string(PolicyName(kind)) + ", iteration " +
                                       std::to_string(p));
      }
      res->divergences += diverged;
      Accumulate(res->total, *st);
      res->per_iteration.push_back(*st);
      ++res->measured_iterations;
    }
    for (int t = 0; t < kNumTierKinds; ++t) res->peak[t] = r.ex->Peak(static_cast<TierKind>(t));
    res->unclaimed = r.ex->Unclaimed();
    return OkStatus();
  }

  // The homes: the first plan's (planned, made from the warm-up iteration), the planned run's
  // (opt), else those the runtime places in order (after checking the warm-up fits).
  Status PlaceHomes(RunState& r) {
    if (r.kind == PolicyKind::kPlanned) {
      PlanOptions po = PlanOpts();
      po.iteration = 0;
      po.start = nullptr;
      po.homes = nullptr;
      std::vector<TierKind> recorded;
      if (opt_.keep_recorded_homes) {
        for (const TraceChunk& c : trace_.chunks) recorded.push_back(c.home);
        po.homes = &recorded;
      }
      TIERMEM_ASSIGN_OR_RETURN(r.first_plan, MakePlan(trace_, machine_, po));
      r.homes = r.first_plan.home;
    } else if (r.kind == PolicyKind::kOpt) {
      r.homes = r.planned->homes;
    } else {
      TIERMEM_RETURN_IF_ERROR(CheckFeasible(trace_, 0, machine_, true));
      TIERMEM_ASSIGN_OR_RETURN(r.homes,
                               PlaceHomesInOrder(trace_, machine_, HostWorkingSet(trace_)));
    }
    return OkStatus();
  }

  // Builds every position's recorded effective iteration and runs the warm-up: reactive, as
  // recorded (baselines) or under the first plan's placement (planned, opt).
  Status WarmUp(RunState& r) {
    for (uint32_t k : seq_) {
      TIERMEM_ASSIGN_OR_RETURN(EffIteration e, BuildEffective(trace_, trace_.iterations[k],
                                                              Recorded(trace_, r.homes), machine_));
      r.recorded_eff.push_back(std::move(e));
    }
    Placement wp = Recorded(trace_, r.homes);
    if (r.kind == PolicyKind::kPlanned) wp = r.first_plan.ToPlacement();
    if (r.kind == PolicyKind::kOpt) wp = r.planned->warmup_placement;
    r.res->warmup_placement = wp;
    TIERMEM_ASSIGN_OR_RETURN(EffIteration e,
                             BuildEffective(trace_, trace_.iterations[seq_[0]], wp, machine_));
    auto warm = MakeBaselinePolicy(BaselineKind::kLru, nullptr, Params(), trace_.MaxChunkBytes());
    auto st = r.ex->Run(e, *warm, 0);
    if (!st.ok()) return st.status().WithContext("warm-up iteration");
    return OkStatus();
  }

  // opt and opt-recorded: the effective sequences of every measured iteration up front (opt:
  // under the planned run's plans) and the oracle over them; whether the bound is exact
  // (every chunk read on the device has one size; true for the other policies).
  Status PrepareOracle(RunState& r) {
    r.eff.resize(seq_.size());
    std::vector<const EffIteration*> all;
    if (r.kind == PolicyKind::kOpt || r.kind == PolicyKind::kOptRecorded) {
      if (r.kind == PolicyKind::kOpt && r.planned->plans.size() + 1 != seq_.size()) {
        return FailedPreconditionError("opt: the planned run did not complete");
      }
      for (size_t p = 1; p < seq_.size(); ++p) {
        if (r.kind == PolicyKind::kOpt) {
          TIERMEM_ASSIGN_OR_RETURN(r.eff[p],
                                   BuildEffective(trace_, trace_.iterations[seq_[p]],
                                                  r.planned->plans[p - 1].ToPlacement(), machine_));
        }
        all.push_back(r.kind == PolicyKind::kOpt ? &r.eff[p] : &r.recorded_eff[p]);
      }
      r.oracle = std::make_unique<NextUse>(all, trace_.chunks.size());
    }
    r.res->bound_exact = true;
    Bytes size = 0;
    for (const EffIteration* e : all) {
      for (const EffAccess& a : e->accesses) {
        if (a.tier != TierKind::kDevice) continue;
        const Bytes b = trace_.chunks[a.chunk].bytes;
        if (size != 0 && b != size) r.res->bound_exact = false;
        size = b;
      }
    }
    return OkStatus();
  }

  // Measured position p under the run's policy: its result in *st (RunImpl names the policy
  // and the iteration of a failure), *diverged when it left the order it followed. Returns a
  // failure to make the iteration's plan (planned) as is.
  Status RunMeasured(RunState& r, size_t p, StatusOr<IterationStats>* st, bool* diverged) {
    SimulatedRun& ex = *r.ex;
    const EffIteration& recorded = r.recorded_eff[p];
    const auto at = static_cast<uint32_t>(p);
    switch (r.kind) {
      case PolicyKind::kLru:
      case PolicyKind::kPatrickStar:
      case PolicyKind::kEngine:
      case PolicyKind::kDeepSpeed: {
        auto pol = MakeBaselinePolicy(Baseline(r.kind), &r.recorded_eff[p - 1], Params(),
                                      trace_.MaxChunkBytes());
        *st = ex.Run(recorded, *pol, at);
        *diverged = pol->diverged();
        break;
      }
      case PolicyKind::kPlanned:
        return RunPlanned(r, p, st, diverged);
      case PolicyKind::kOpt:
      case PolicyKind::kOptRecorded: {
        OptPolicy pol(r.oracle.get());
        pol.SetOffset(r.offset);
        const EffIteration& e = r.kind == PolicyKind::kOpt ? r.eff[p] : recorded;
        *st = ex.Run(e, pol, at);
        r.offset += e.size();
        break;
      }
    }
    return OkStatus();
  }

  // Planned: the plan for position p, made from position p - 1 and the state now, then run.
  Status RunPlanned(RunState& r, size_t p, StatusOr<IterationStats>* st, bool* diverged) {
    const StartState start = r.ex->State();
    PlanOptions po = PlanOpts();
    po.iteration = seq_[p - 1];
    if (p >= 2) po.earlier_iteration = seq_[p - 2];
    po.start = &start;
    po.homes = &r.homes;
    TIERMEM_ASSIGN_OR_RETURN(Plan plan, MakePlan(trace_, machine_, po));
    const Placement pl = plan.ToPlacement();
    TIERMEM_ASSIGN_OR_RETURN(EffIteration planned_eff,
                             BuildEffective(trace_, trace_.iterations[po.iteration], pl, machine_));
    TIERMEM_ASSIGN_OR_RETURN(r.eff[p],
                             BuildEffective(trace_, trace_.iterations[seq_[p]], pl, machine_));
    PlanPolicy pol(&plan, &planned_eff);
    *st = r.ex->Run(r.eff[p], pol, static_cast<uint32_t>(p));
    *diverged = pol.diverged();
    if (!*diverged) r.res->repairs += pol.repairs();
    r.res->plans.push_back(std::move(plan));
    return OkStatus();
  }

  // The plan options, with the baselines' parameters for the planner's baseline candidates.
  PlanOptions PlanOpts() const {
    PlanOptions po = opt_.plan;
    po.engine_prefetch_depth = opt_.engine_prefetch_depth;
    po.deepspeed_bucket_bytes = opt_.deepspeed_bucket_bytes;
    return po;
  }

  BaselineParams Params() const {
    return {.engine_prefetch_depth = opt_.engine_prefetch_depth,
            .engine_lookahead = opt_.engine_lookahead,
            .deepspeed_bucket_bytes = opt_.deepspeed_bucket_bytes};
  }

  const Trace& trace_;
  const MachineModel& machine_;
  const SimOptions& opt_;
  std::vector<uint32_t> seq_;  // trace iteration per position; position 0 is the warm-up
};

}  // namespace

std::string_view PolicyName(PolicyKind p) {
  switch (p) {
    case PolicyKind::kLru:
    case PolicyKind::kPatrickStar:
    case PolicyKind::kDeepSpeed:
    case PolicyKind::kEngine:
      return BaselineName(static_cast<BaselineKind>(p));
    case PolicyKind::kPlanned:
      return "planned";
    case PolicyKind::kOpt:
      return "opt";
    case PolicyKind::kOptRecorded:
      return "opt-recorded";
  }
  return "?";
}

StatusOr<PolicyKind> ParsePolicy(std::string_view name) {
  for (int k = 0; k < kNumPolicies; ++k) {
    if (PolicyName(static_cast<PolicyKind>(k)) == name) return static_cast<PolicyKind>(k);
  }
  return InvalidArgumentError("unknown policy '" + std::string(name) +
                              "' (lru, patrickstar, deepspeed, engine, planned, opt, "
                              "opt-recorded)");
}

double SimResult::MeanDeviceInBytes() const {
  return measured_iterations == 0
             ? 0.0
             : static_cast<double>(total.DeviceInBytes()) / measured_iterations;
}
double SimResult::MeanStallNs() const {
  return measured_iterations == 0 ? 0.0 : static_cast<double>(total.stall_ns) / measured_iterations;
}
double SimResult::MeanIterationNs() const {
  return measured_iterations == 0 ? 0.0
                                  : static_cast<double>(total.iteration_ns) / measured_iterations;
}

StatusOr<SimResult> Simulate(const Trace& trace, const MachineModel& machine, PolicyKind policy,
                             const SimOptions& options) {
  TIERMEM_RETURN_IF_ERROR(ValidateTrace(trace));
  TIERMEM_RETURN_IF_ERROR(machine.Validate());
  if (trace.iterations.empty())
    return InvalidArgumentError("simulate: the trace has no iterations");
  Driver d(trace, machine, options);
  if (policy == PolicyKind::kOpt) {
    TIERMEM_ASSIGN_OR_RETURN(SimResult planned, d.Run(PolicyKind::kPlanned, nullptr));
    if (!planned.status.ok()) {
      SimResult r;
      r.policy = policy;
      r.status = planned.status;
      return r;
    }
    return d.Run(policy, &planned);
  }
  return d.Run(policy, nullptr);
}

StatusOr<std::vector<SimResult>> Compare(const Trace& trace, const MachineModel& machine,
                                         const SimOptions& options) {
  TIERMEM_RETURN_IF_ERROR(ValidateTrace(trace));
  TIERMEM_RETURN_IF_ERROR(machine.Validate());
  if (trace.iterations.empty()) return InvalidArgumentError("compare: the trace has no iterations");
  Driver d(trace, machine, options);
  std::vector<SimResult> out;
  for (int k = 0; k < kNumPolicies; ++k) {
    const PolicyKind p = static_cast<PolicyKind>(k);
    if (p == PolicyKind::kOpt) {
      const SimResult& planned = out[static_cast<int>(PolicyKind::kPlanned)];
      if (!planned.status.ok()) {
        SimResult r;
        r.policy = p;
        r.status = planned.status;
        out.push_back(r);
        continue;
      }
      TIERMEM_ASSIGN_OR_RETURN(SimResult r, d.Run(p, &planned));
      out.push_back(std::move(r));
    } else {
      TIERMEM_ASSIGN_OR_RETURN(SimResult r, d.Run(p, nullptr));
      out.push_back(std::move(r));
    }
  }
  return out;
}

}  // namespace tiermem::planners
