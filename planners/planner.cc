// MakePlan: placement search over candidate plans, each scheduled (schedule.cc) and executed
// in the simulated run; homes; feasibility checks; plan encoding (divergence: divergence.cc).
//
// The search is greedy and bounded (at most about 2 x (2 x (3 x units + 1) + groups + 1) + 2
// candidates, fewer since a sweep stops after 3 candidates in a row that do not improve on
// it; each placement is scheduled with Belady's room model and with the write-back aware
// one):
//   1. activation policy: the first k units in forward order (their spans are the longest)
//      offloaded, recomputed, or each the cheaper of the two by modelled copy vs recompute
//      time, the rest kept, for every k;
//   2. optimizer placement: the m groups whose grads complete last on the device, the rest
//      on the CPU (overlapped with the backward when allowed), for every m; then the best
//      with overlap off (decided for every candidate: the sweep starts from the best one's
//      homes and activations even when that is a baseline's, whose steps run as recorded);
//   3. the activation search again under the chosen optimizer placement.
// Before them (PlanOptions::mimic_baselines) the baseline policies' own moves are candidates
// (baselines.h, MimicSchedule: under the recorded placement as they run, with their homes
// too when homes are free), and the same moves with evictions early and fetches hoisted, and
// Belady's demand moves (BeladyMovesSchedule) as issued and hoisted; and with homes free, the
// planner's schedule is tried with the baselines' homes as well (the search goes on with the
// better home rule). The hoisted baselines and Belady's moves are tried again on the chosen
// placement at the end.
// A candidate that does not fit is skipped. Candidates are ranked against the plain baseline
// candidates' bar (ranking.h: in its steady iteration, how many of bytes into the device, NVMe
// bytes, stall and — with PlanObjective::kTime — iteration time are no higher than the least
// of each over them; all of them meets the bar, no worse than any baseline on any measure).
// Since a baseline's plain moves are candidates themselves, the plan is never below the bar
// where one baseline alone meets it.
#include "planners/planner.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <set>

#include "planners/baselines.h"
#include "planners/ranking.h"
#include "planners/schedule.h"

namespace tiermem::planners {
namespace {

int CategoryRank(Category c) {
  switch (c) {
    case Category::kOptimState:
      return 0;
    case Category::kGrad:
      return 1;
    case Category::kParam:
      return 2;
    default:
      return 3;
  }
}

std::string Fmt(Bytes b) { return std::to_string(b) + " bytes (" + FormatBytes(b) + ")"; }

// What a candidate's schedule is and where its homes come from.
struct Variant {
  bool aggressive = false;      // ScheduleInput::aggressive; with `mimic`: fetches hoisted
  bool wb_aware = false;        // ScheduleInput::writeback_aware
  int mimic = -1;               // >= 0: a BaselineKind whose moves are the schedule
  bool in_order_homes = false;  // PlaceHomesInOrder (the baselines' homes), not PlaceHomes
  bool belady_moves = false;    // BeladyMovesSchedule (`aggressive`: hoisted), not MakeSchedule
};

struct Candidate {
  Placement placement;
  Variant variant;
  uint64_t score_ns = 0;  // what candidates are compared on (see Search::Evaluate)
  Plan plan;
  EffIteration eff;
  IterationStats stats;  // the steady iteration (the second)
};

class Search {
 public:
  // `earlier`: an observed iteration that used some groups differently (nullptr: none).
  Search(const Trace& t, const MachineModel& m, const PlanOptions& o, const TraceIteration* earlier)
      : trace_(t),
        machine_(m),
        opt_(o),
        iter_(t.iterations[o.iteration]),
        earlier_(earlier),
        expert_class_(ExpertClasses(t)) {}

  // Schedules and executes `p` (homes filled in when not fixed). Not OK: infeasible.
  StatusOr<Candidate> Evaluate(Placement p, const Variant& v) {
    ++evaluated_;
    const bool aggressive = v.aggressive, wb_aware = v.wb_aware;
    p.home.assign(trace_.chunks.size(), TierKind::kHost);
    TIERMEM_ASSIGN_OR_RETURN(EffIteration eff, BuildEffective(trace_, iter_, p, machine_));
    if (opt_.homes != nullptr) {
      p.home = *opt_.homes;
    } else {
      Bytes host_act = 0;
      for (Bytes b : eff.host_extra) host_act = std::max(host_act, b);
      const Bytes reserve = HostWorkingSet(trace_) + host_act;
      TIERMEM_ASSIGN_OR_RETURN(p.home, v.in_order_homes
                                           ? PlaceHomesInOrder(trace_, machine_, reserve)
                                           : PlaceHomes(trace_, machine_, reserve));
    }
    ScheduleInput in;
    in.trace = &trace_;
    in.eff = &eff;
    in.homes = p.home;
    if (opt_.start != nullptr) {
      in.start = *opt_.start;
    } else {
      in.start.cache.assign(trace_.chunks.size(), TierKind::kNone);
      in.start.dirty.assign(trace_.chunks.size(), false);
    }
    // A chunk cached on what is now its home tier (homes differ from the run's) is ignored.
    for (ChunkId c = 0; c < trace_.chunks.size(); ++c) {
      if (in.start.cache[c] != TierKind::kNone &&
          static_cast<int>(in.start.cache[c]) >= static_cast<int>(p.home[c])) {
        in.start.cache[c] = TierKind::kNone;
      }
    }
    in.device_budget = machine_.Budget(TierKind::kDevice);
    in.host_budget = machine_.Budget(TierKind::kHost);
    in.aggressive = aggressive;
    in.writeback_aware = wb_aware;
    in.machine = &machine_;
    const BaselineParams params{.engine_prefetch_depth = opt_.engine_prefetch_depth,
                                .engine_lookahead = opt_.engine_lookahead,
                                .deepspeed_bucket_bytes = opt_.deepspeed_bucket_bytes};
    const auto schedule = [&](const ScheduleInput& si) {
      if (v.belady_moves) return BeladyMovesSchedule(si, v.aggressive);
      return v.mimic >= 0
                 ? MimicSchedule(si, static_cast<BaselineKind>(v.mimic), params, v.aggressive)
                 : MakeSchedule(si);
    };
    TIERMEM_ASSIGN_OR_RETURN(Schedule sched, schedule(in));

    Candidate c;
    c.placement = p;
    c.variant = v;
    c.eff = std::move(eff);
    c.plan = BuildPlan(c.placement, c.eff, sched);
    c.plan.aggressive_prefetch = aggressive;
    c.plan.writeback_aware = wb_aware;
    if (v.mimic >= 0)
      c.plan.baseline = std::string(BaselineName(static_cast<BaselineKind>(v.mimic)));
    if (v.belady_moves) c.plan.baseline = "belady";
    TIERMEM_ASSIGN_OR_RETURN(auto ex, SimulatedRun::Create(&trace_, &machine_, p.home));
    for (ChunkId ch = 0; ch < trace_.chunks.size(); ++ch) {
      TIERMEM_RETURN_IF_ERROR(ex->Preload(ch, in.start.cache[ch], in.start.dirty[ch]));
    }
    PlanPolicy policy(&c.plan, &c.eff);
    TIERMEM_ASSIGN_OR_RETURN(const IterationStats first, ex->Run(c.eff, policy, 0));
    // The iteration after: planned the same way from the state this one leaves.
    in.start = ex->State();
    in.eff = &c.eff;
    TIERMEM_ASSIGN_OR_RETURN(Schedule sched2, schedule(in));
    const Plan plan2 = BuildPlan(c.placement, c.eff, sched2);
    PlanPolicy policy2(&plan2, &c.eff);
    TIERMEM_ASSIGN_OR_RETURN(c.stats, ex->Run(c.eff, policy2, 1));
    if (policy.repairs() != 0 || policy2.repairs() != 0) {
      return InternalError("planner: the executed plan needed " +
                           std::to_string(policy.repairs() + policy2.repairs()) +
                           " repairs on its own iteration");
    }
    c.score_ns = c.stats.iteration_ns;
    if (earlier_ != nullptr) {
      // Routing (or another data-dependent choice) varies: also run the plan against the
      // earlier iteration, as a stand-in for an unpredictable next one, and score the mean.
      in.start = ex->State();
      TIERMEM_ASSIGN_OR_RETURN(Schedule sched3, schedule(in));
      const Plan plan3 = BuildPlan(c.placement, c.eff, sched3);
      TIERMEM_ASSIGN_OR_RETURN(EffIteration other, BuildEffective(trace_, *earlier_, p, machine_));
      PlanPolicy policy3(&plan3, &c.eff);
      TIERMEM_ASSIGN_OR_RETURN(const IterationStats third, ex->Run(other, policy3, 2));
      c.score_ns = (c.stats.iteration_ns + third.iteration_ns) / 2;
    }
    PlanEstimate& est = c.plan.estimate;
    est.iteration_ns = first.iteration_ns;
    est.compute_ns = first.compute_ns;
    est.stall_ns = first.stall_ns;
    est.bytes = first.bytes;
    est.device_in_bytes = first.DeviceInBytes();
    for (int t = 0; t < kNumTierKinds; ++t) est.peak[t] = ex->Peak(static_cast<TierKind>(t));
    est.steady_iteration_ns = c.stats.iteration_ns;
    est.steady_stall_ns = c.stats.stall_ns;
    est.steady_device_in_bytes = c.stats.DeviceInBytes();
    est.steady_nvme_bytes = c.stats.NvmeBytes();
    return c;
  }

  // Evaluates `p` with Belady's room model and with the write-back aware one; keeps the better.
  // Returns the better modelled steady-state time (UINT64_MAX: neither fits).
  uint64_t Try(const Placement& p, bool aggressive = false) {
    uint64_t best = UINT64_MAX;
    for (const bool wb : {false, true}) {
      StatusOr<Candidate> c = Evaluate(
          p, Variant{.aggressive = aggressive, .wb_aware = wb, .in_order_homes = in_order_homes_});
      if (c.ok()) best = std::min(best, c->score_ns);
      Offer(std::move(c));
    }
    return best;
  }

  // Keeps `c` if it beats the best so far.
  void Offer(StatusOr<Candidate> c) {
    if (!c.ok()) {
      if (first_error_.ok()) first_error_ = c.status();
      return;
    }
    if (!best_ || Better(*c, *best_)) best_ = std::move(*c);
  }

  // Each baseline's moves under the recorded placement (homes as the planner places them and
  // as the runtime does, when not fixed), offered as candidates; they set the bar (bar_).
  // Then the same moves with evictions early and fetches hoisted (MimicSchedule's `hoist`),
  // and Belady's demand moves, under the recorded placement and under `base`, not part of the
  // bar. Call before any other
  // candidate is offered. A baseline that cannot run is skipped.
  void TryBaselines(const Placement& base) {
    Placement recorded;
    recorded.groups.resize(trace_.NumGroups());
    std::vector<Candidate> plain;
    for (const bool in_order : {false, true}) {
      if (in_order && opt_.homes != nullptr) break;
      for (int k = 0; k < kNumBaselines; ++k) {
        StatusOr<Candidate> c = Evaluate(recorded, Variant{.mimic = k, .in_order_homes = in_order});
        if (!c.ok()) continue;
        const IterationStats& s = c->stats;
        bar_.Add(MeasuresOf(s));
        baselines_.push_back({.name = std::string(BaselineName(static_cast<BaselineKind>(k))),
                              .in_order_homes = in_order,
                              .iteration_ns = s.iteration_ns,
                              .stall_ns = s.stall_ns,
                              .device_in_bytes = s.DeviceInBytes(),
                              .nvme_bytes = s.NvmeBytes()});
        plain.push_back(std::move(*c));
      }
    }
    // Offered once the bar is complete, so that they are ranked against all of it.
    for (Candidate& c : plain) Offer(std::move(c));
    TryHoistedBaselines(recorded);
    TryHoistedBaselines(base);
  }

  // Each baseline's moves, hoisted, under placement `p` (homes by the current rule, and by the
  // other rule too while homes are free and `p` carries none, i.e. before the search chose);
  // then Belady's demand moves under it (TryBeladyMoves).
  void TryHoistedBaselines(const Placement& p) {
    for (int k = 0; k < kNumBaselines; ++k) {
      Offer(
          Evaluate(p, Variant{.aggressive = true, .mimic = k, .in_order_homes = in_order_homes_}));
      if (opt_.homes == nullptr && p.home.empty()) {
        Offer(Evaluate(
            p, Variant{.aggressive = true, .mimic = k, .in_order_homes = !in_order_homes_}));
      }
    }
    TryBeladyMoves(p);
  }

  // Belady's demand moves (baselines.h, BeladyMovesSchedule) under placement `p`, as issued and
  // hoisted, with homes as TryHoistedBaselines takes them. On a device trace with NVMe homes
  // they keep a host copy the device reads next instead of sending it home (MakeSchedule's
  // early leaving does): on the main job's SimDevice trace the candidate that moves the
  // Belady optimum into the device with fewer NVMe bytes than any baseline.
  void TryBeladyMoves(const Placement& p) {
    for (const bool hoist : {false, true}) {
      Offer(Evaluate(
          p,
          Variant{.aggressive = hoist, .in_order_homes = in_order_homes_, .belady_moves = true}));
      if (opt_.homes == nullptr && p.home.empty()) {
        Offer(Evaluate(
            p, Variant{
                   .aggressive = hoist, .in_order_homes = !in_order_homes_, .belady_moves = true}));
      }
    }
  }

  // From now on candidates take their homes by the rule of the best so far.
  void FollowBestHomeRule() {
    if (best_) in_order_homes_ = best_->variant.in_order_homes;
  }
  void set_in_order_homes(bool on) { in_order_homes_ = on; }

  const std::optional<Candidate>& best() const { return best_; }
  const std::vector<BaselineEstimate>& baselines() const { return baselines_; }
  const Status& first_error() const { return first_error_; }
  uint32_t evaluated() const { return evaluated_; }

 private:
  bool Better(const Candidate& a, const Candidate& b) const {
    return RanksBefore(Ranked(a), Ranked(b), bar_, opt_.objective);
  }
  RankedCandidate Ranked(const Candidate& c) const {
    return {.steady = MeasuresOf(c.stats),
            .score_ns = c.score_ns,
            .objective_bytes = ObjectiveBytes(c.stats, machine_),
            .baseline_moves = c.variant.mimic >= 0};
  }

  Plan BuildPlan(const Placement& p, const EffIteration& eff, const Schedule& sched) const {
    Plan plan;
    plan.source_iteration = opt_.iteration;
    plan.home = p.home;
    plan.expert_class = expert_class_;
    for (size_t i = 0; i < eff.size(); ++i) {
      const EffMoment& m = eff.moments[i];
      PlannedMoment pm;
      pm.label = std::string(m.label);
      pm.kind = m.kind;
      pm.unit = m.unit;
      pm.trace_moment = m.trace_moment;
      pm.async = m.async;
      pm.compute_ns = m.compute_ns;
      pm.first_access = static_cast<uint32_t>(plan.accesses.size());
      for (const EffAccess* a = eff.begin(i); a != eff.end(i); ++a) {
        TraceAccess ta;
        ta.chunk = a->chunk;
        ta.tier = a->tier;
        ta.mode = !a->needs_content ? AccessMode::kWrite
                                    : (a->modifies ? AccessMode::kReadWrite : AccessMode::kRead);
        plan.accesses.push_back(ta);
      }
      pm.num_accesses = m.count;
      pm.first_action = static_cast<uint32_t>(plan.actions.size());
      for (const PlanAction& a : sched.actions[i]) plan.actions.push_back(a);
      pm.num_actions = static_cast<uint32_t>(sched.actions[i].size());
      plan.moments.push_back(std::move(pm));
    }
    std::set<uint32_t> step_groups;
    for (const EffMoment& m : eff.moments) {
      if (m.kind == MomentKind::kOptimizerStep && m.group != kNoGroup) step_groups.insert(m.group);
    }
    for (uint32_t g : step_groups) {
      GroupPlan gp;
      gp.group = g;
      gp.update_on = TierKind::kNone;
      for (size_t i = 0; i < eff.size(); ++i) {
        if (eff.moments[i].group == g && eff.moments[i].count > 0) {
          gp.update_on = eff.begin(i)->tier;
          gp.overlap = eff.moments[i].async;
        }
      }
      plan.groups.push_back(gp);
    }
    std::map<uint32_t, UnitPlan> units;
    for (const ActSpan& s : eff.spans) {
      UnitPlan& u = units[s.unit];
      u.unit = s.unit;
      u.policy = s.policy;
      u.saved_bytes += s.bytes;
      auto it = p.units.find(s.unit);
      u.prefetch_lead = it != p.units.end() && s.policy == ActivationPolicy::kOffload
                            ? it->second.prefetch_lead
                            : 0;
    }
    for (auto& [id, u] : units) plan.units.push_back(u);
    return plan;
  }

  const Trace& trace_;
  const MachineModel& machine_;
  const PlanOptions& opt_;
  const TraceIteration& iter_;
  const TraceIteration* earlier_;
  const std::vector<uint32_t> expert_class_;  // Plan::expert_class
  std::optional<Candidate> best_;
  std::vector<BaselineEstimate> baselines_;  // TryBaselines' plain candidates, as tried
  Status first_error_;
  uint32_t evaluated_ = 0;
  bool in_order_homes_ = false;  // Variant::in_order_homes of Try and TryHoistedBaselines
  BaselineBar bar_;              // over TryBaselines' plain candidates (ranking.h)
};

}  // namespace

std::vector<uint32_t> ExpertClasses(const Trace& t) {
  if (!t.HasExpertSets()) return {};
  std::map<std::pair<uint32_t, uint16_t>, uint32_t> index;  // (set, kind) -> class
  std::vector<uint32_t> out(t.chunks.size(), kNoExpertSet);
  for (ChunkId c = 0; c < t.chunks.size(); ++c) {
    const TraceChunk& ch = t.chunks[c];
    if (ch.expert_set == kNoExpertSet) continue;
    auto it =
        index.try_emplace({ch.expert_set, ch.kind}, static_cast<uint32_t>(index.size())).first;
    out[c] = it->second;
  }
  return out;
}

namespace {

// Groups some non-step moment (by label) uses in one iteration and not in the other.
std::vector<uint32_t> VolatileGroups(const Trace& t, const TraceIteration& a,
                                     const TraceIteration& b) {
  auto uses = [&t](const TraceIteration& it) {
    std::set<std::pair<std::string, uint32_t>> out;  // (moment label, group)
    for (const Moment& m : it.moments) {
      if (m.kind == MomentKind::kOptimizerStep) continue;
      for (uint32_t k = 0; k < m.num_accesses; ++k) {
        out.insert({m.label, t.chunks[it.accesses[m.first_access + k].chunk].group});
      }
    }
    return out;
  };
  const auto ua = uses(a), ub = uses(b);
  std::set<uint32_t> v;
  for (const auto& x : ua) {
    if (!ub.count(x)) v.insert(x.second);
  }
  for (const auto& x : ub) {
    if (!ua.count(x)) v.insert(x.second);
  }
  return std::vector<uint32_t>(v.begin(), v.end());
}

// Early stop of a one-parameter sweep: after the first candidate that fits, stop once
// kLimit in a row did not improve on the sweep's best.
class Patience {
 public:
  static constexpr int kLimit = 3;
  void Observe(uint64_t time_ns) {
    if (time_ns == UINT64_MAX && best_ == UINT64_MAX) return;  // nothing fits yet
    if (time_ns < best_) {
      best_ = time_ns;
      misses_ = 0;
    } else {
      ++misses_;
    }
  }
  bool exhausted() const { return misses_ >= kLimit; }

 private:
  uint64_t best_ = UINT64_MAX;
  int misses_ = 0;
};

// Units with activation spans worth a decision, in order of their first forward.
std::vector<uint32_t> SpanUnits(const EffIteration& eff) {
  std::vector<std::pair<uint32_t, uint32_t>> first;  // (fwd, unit)
  std::set<uint32_t> seen;
  for (const ActSpan& s : eff.spans) {
    if (s.bwd <= s.fwd || seen.count(s.unit)) continue;
    seen.insert(s.unit);
    first.push_back({s.fwd, s.unit});
  }
  std::sort(first.begin(), first.end());
  std::vector<uint32_t> out;
  for (auto [f, u] : first) out.push_back(u);
  return out;
}

// Moments of lead an offloaded span needs for its fetch back to finish under compute.
uint32_t PrefetchLead(const EffIteration& eff, const ActSpan& s, const MachineModel& m) {
  const uint64_t copy = m.CopyNs(TierKind::kHost, TierKind::kDevice, s.bytes);
  uint64_t covered = 0;
  uint32_t lead = 1;
  for (uint32_t q = s.bwd; q > s.fwd + 1; --q) {
    if (!eff.moments[q - 1].async) covered += eff.moments[q - 1].compute_ns;
    if (covered >= copy) break;
    ++lead;
  }
  return std::min(lead, s.bwd - s.fwd);
}

void ActivationSearch(Search& search, const Trace& trace, const TraceIteration& iter,
                      const MachineModel& machine, const Placement& base, bool allow_recompute) {
  Placement probe = base;
  probe.home.assign(trace.chunks.size(), TierKind::kHost);
  auto eff = BuildEffective(trace, iter, probe, machine);
  if (!eff.ok()) return;
  const std::vector<uint32_t> units = SpanUnits(*eff);
  if (units.empty()) return;
  std::map<uint32_t, UnitChoice> offload, recompute, cheaper, late;
  for (uint32_t u : units) {
    uint32_t lead = 1;
    uint64_t copy = 0, fwd = 0;
    for (const ActSpan& s : eff->spans) {
      if (s.unit != u) continue;
      lead = std::max(lead, PrefetchLead(*eff, s, machine));
      copy += std::max(machine.CopyNs(TierKind::kDevice, TierKind::kHost, s.bytes),
                       machine.CopyNs(TierKind::kHost, TierKind::kDevice, s.bytes));
      fwd += iter.moments[eff->moments[s.fwd].trace_moment].compute_ns;
    }
    offload[u] = {ActivationPolicy::kOffload, lead};
    late[u] = {ActivationPolicy::kOffload, 0};  // fetched just in time: the least room
    recompute[u] = {ActivationPolicy::kRecompute, 1};
    cheaper[u] = copy <= fwd ? offload[u] : recompute[u];
  }
  for (const auto* family : {&offload, &recompute, &cheaper, &late}) {
    if (allow_recompute ? family == &late : family != &offload && family != &late) continue;
    if (family == &cheaper && (cheaper == offload || cheaper == recompute)) continue;
    Patience patience;
    for (size_t k = 1; k <= units.size() && !patience.exhausted(); ++k) {
      Placement p = base;
      for (size_t j = 0; j < k; ++j) p.units[units[j]] = family->at(units[j]);
      patience.Observe(search.Try(p));
    }
  }
}

}  // namespace

std::string_view ActionKindName(ActionKind k) {
  switch (k) {
    case ActionKind::kEvict:
      return "evict";
    case ActionKind::kPrefetch:
      return "prefetch";
    case ActionKind::kFetchActivation:
      return "fetch-activation";
  }
  return "?";
}

Placement Plan::ToPlacement() const {
  Placement p;
  p.home = home;
  uint32_t ng = 0;
  for (const GroupPlan& g : groups) ng = std::max(ng, g.group + 1);
  p.groups.resize(ng);
  for (const GroupPlan& g : groups) p.groups[g.group] = {g.update_on, g.overlap};
  for (const UnitPlan& u : units) p.units[u.unit] = {u.policy, u.prefetch_lead};
  return p;
}

Bytes HostWorkingSet(const Trace& trace) {
  Bytes best = 0;
  std::vector<uint32_t> mark(trace.chunks.size(), UINT32_MAX);
  uint32_t stamp = 0;
  for (const TraceIteration& it : trace.iterations) {
    for (const Moment& m : it.moments) {
      ++stamp;
      Bytes b = 0;
      for (uint32_t a = 0; a < m.num_accesses; ++a) {
        const TraceAccess& ta = it.accesses[m.first_access + a];
        if (ta.tier != TierKind::kHost || mark[ta.chunk] == stamp) continue;
        mark[ta.chunk] = stamp;
        b += trace.chunks[ta.chunk].bytes;
      }
      best = std::max(best, b);
    }
  }
  return best;
}

namespace {

Status HomesFit(const Trace& trace, const MachineModel& machine, const std::vector<TierKind>& homes,
                Bytes host_reserve) {
  Bytes nvme = 0;
  for (ChunkId c = 0; c < homes.size(); ++c) {
    if (homes[c] == TierKind::kNvme) nvme += trace.chunks[c].bytes;
  }
  if (nvme > machine.Budget(TierKind::kNvme)) {
    const Bytes host_room =
        machine.Budget(TierKind::kHost) - std::min(machine.Budget(TierKind::kHost), host_reserve);
    return ResourceExhaustedError(
        "homes: the chunks need " + Fmt(trace.TotalChunkBytes()) + "; the host budget holds " +
        Fmt(host_room) + " of them (keeping " + Fmt(host_reserve) +
        " free as working space) and the NVMe budget is " + Fmt(machine.Budget(TierKind::kNvme)) +
        ", short of the " + Fmt(nvme) + " that must live on NVMe");
  }
  return OkStatus();
}

}  // namespace

StatusOr<std::vector<TierKind>> PlaceHomes(const Trace& trace, const MachineModel& machine,
                                           Bytes host_reserve) {
  const Bytes host = machine.Budget(TierKind::kHost);
  const Bytes room = host - std::min(host, host_reserve);
  std::vector<TierKind> homes(trace.chunks.size(), TierKind::kHost);
  const Bytes total = trace.TotalChunkBytes();
  if (total <= room) return homes;
  std::vector<uint64_t> count(trace.chunks.size(), 0);
  for (const TraceIteration& it : trace.iterations) {
    for (const TraceAccess& a : it.accesses) ++count[a.chunk];
  }
  std::vector<ChunkId> order(trace.chunks.size());
  for (ChunkId c = 0; c < order.size(); ++c) order[c] = c;
  std::sort(order.begin(), order.end(), [&](ChunkId a, ChunkId b) {
    if (count[a] != count[b]) return count[a] < count[b];
    const int ra = CategoryRank(trace.chunks[a].category);
    const int rb = CategoryRank(trace.chunks[b].category);
    if (ra != rb) return ra < rb;
    return a > b;
  });
  Bytes on_host = total;
  for (ChunkId c : order) {
    if (on_host <= room) break;
    homes[c] = TierKind::kNvme;
    on_host -= trace.chunks[c].bytes;
  }
  TIERMEM_RETURN_IF_ERROR(HomesFit(trace, machine, homes, host_reserve));
  return homes;
}

StatusOr<std::vector<TierKind>> PlaceHomesInOrder(const Trace& trace, const MachineModel& machine,
                                                  Bytes host_reserve) {
  const Bytes host = machine.Budget(TierKind::kHost);
  std::vector<TierKind> homes(trace.chunks.size(), TierKind::kHost);
  Bytes used = 0;
  for (ChunkId c = 0; c < homes.size(); ++c) {
    const Bytes b = trace.chunks[c].bytes;
    if (used + b + host_reserve <= host) {
      used += b;
    } else {
      homes[c] = TierKind::kNvme;
    }
  }
  TIERMEM_RETURN_IF_ERROR(HomesFit(trace, machine, homes, host_reserve));
  return homes;
}

Status CheckFeasible(const Trace& trace, uint32_t iteration, const MachineModel& machine,
                     bool keep_activations, bool offload_only) {
  if (iteration >= trace.iterations.size()) {
    return InvalidArgumentError("trace has " + std::to_string(trace.iterations.size()) +
                                " iterations, no iteration " + std::to_string(iteration));
  }
  const TraceIteration& iter = trace.iterations[iteration];
  const Bytes dev = machine.Budget(TierKind::kDevice);
  const Bytes host = machine.Budget(TierKind::kHost);
  Placement p;
  p.home.assign(trace.chunks.size(), TierKind::kHost);
  if (!keep_activations) {
    for (const Moment& m : iter.moments) {
      if (m.unit == kNoUnit) continue;
      // Offload with lead 0 leaves a backward moment only its own unit's activations.
      p.units[m.unit] = offload_only ? UnitChoice{ActivationPolicy::kOffload, 0}
                                     : UnitChoice{ActivationPolicy::kRecompute, 1};
    }
  }
  TIERMEM_ASSIGN_OR_RETURN(EffIteration eff, BuildEffective(trace, iter, p, machine));
  for (size_t i = 0; i < eff.size(); ++i) {
    Bytes chunks_dev = 0, chunks_host = 0;
    uint32_t n_dev = 0;
    for (const EffAccess* a = eff.begin(i); a != eff.end(i); ++a) {
      const Bytes b = trace.chunks[a->chunk].bytes;
      if (a->tier == TierKind::kDevice) {
        if (b > dev) {
          return ResourceExhaustedError(
              "device budget " + Fmt(dev) + " is smaller than chunk " + std::to_string(a->chunk) +
              " (" + std::string(trace.KindName(a->chunk)) + ", " + Fmt(b) + "), which moment " +
              std::to_string(eff.moments[i].trace_moment) + " (" +
              std::string(eff.moments[i].label) + ") accesses on the device");
        }
        chunks_dev += b;
        ++n_dev;
      } else {
        chunks_host += b;
      }
    }
    const Bytes extra = eff.dev_extra[i];
    if (chunks_dev + extra > dev) {
      return ResourceExhaustedError(
          "device budget " + Fmt(dev) + " is too small for moment " +
          std::to_string(eff.moments[i].trace_moment) + " (" + std::string(eff.moments[i].label) +
          ") of iteration " + std::to_string(iteration) + ": it needs " + Fmt(chunks_dev + extra) +
          " = " + std::to_string(chunks_dev) + " bytes of the " + std::to_string(n_dev) +
          " chunks it uses on the device + " + std::to_string(extra) +
          (keep_activations ? " non-chunk bytes with every activation kept"
                            : " non-chunk bytes (temporaries and the activations of the moment "
                              "itself: the least any activation policy leaves)"));
    }
    if (chunks_host > host) {
      return ResourceExhaustedError("host budget " + Fmt(host) + " is too small for moment " +
                                    std::to_string(eff.moments[i].trace_moment) + " (" +
                                    std::string(eff.moments[i].label) +
                                    "): the chunks it uses on the host need " + Fmt(chunks_host));
    }
  }
  return OkStatus();
}

StatusOr<Plan> MakePlan(const Trace& trace, const MachineModel& machine,
                        const PlanOptions& options) {
  TIERMEM_RETURN_IF_ERROR(ValidateTrace(trace));
  TIERMEM_RETURN_IF_ERROR(machine.Validate());
  if (options.iteration >= trace.iterations.size()) {
    return InvalidArgumentError(
        "planner: the trace has " + std::to_string(trace.iterations.size()) +
        " iterations, there is no iteration " + std::to_string(options.iteration));
  }
  if (machine.Budget(TierKind::kDevice) == 0) {
    for (const TraceAccess& a : trace.iterations[options.iteration].accesses) {
      if (a.tier == TierKind::kDevice) {
        return InvalidArgumentError(
            "planner: the trace accesses chunks on the device, but the machine has no device "
            "budget (a host-mode machine; give --device)");
      }
    }
  }
  if (options.homes != nullptr && options.homes->size() != trace.chunks.size()) {
    return InvalidArgumentError("planner: the fixed homes do not cover the chunks");
  }
  if (options.start != nullptr && (options.start->cache.size() != trace.chunks.size() ||
                                   options.start->dirty.size() != trace.chunks.size())) {
    return InvalidArgumentError("planner: the start state does not cover the chunks");
  }
  TIERMEM_RETURN_IF_ERROR(CheckFeasible(trace, options.iteration, machine,
                                        !options.activation_policy, !options.allow_recompute));
  const TraceIteration& iter = trace.iterations[options.iteration];
  if (options.earlier_iteration >= static_cast<int64_t>(trace.iterations.size())) {
    return InvalidArgumentError("planner: no earlier iteration " +
                                std::to_string(options.earlier_iteration));
  }
  std::vector<uint32_t> volatile_groups =
      options.earlier_iteration < 0
          ? std::vector<uint32_t>{}
          : VolatileGroups(trace, trace.iterations[options.earlier_iteration], iter);
  // The groups of expert-set members are volatile whatever two iterations showed: the
  // routing picks them at run time.
  for (const TraceChunk& c : trace.chunks) {
    if (c.expert_set != kNoExpertSet) volatile_groups.push_back(c.group);
  }
  std::sort(volatile_groups.begin(), volatile_groups.end());
  volatile_groups.erase(std::unique(volatile_groups.begin(), volatile_groups.end()),
                        volatile_groups.end());
  std::vector<bool> is_volatile(trace.chunks.size(), false);
  for (uint32_t g : volatile_groups) is_volatile[g] = true;
  Search search(trace, machine, options,
                volatile_groups.empty() || options.earlier_iteration < 0
                    ? nullptr
                    : &trace.iterations[options.earlier_iteration]);

  // Base: optimizer steps where they ran, overlapped on the CPU when allowed.
  Placement base;
  base.groups.resize(trace.NumGroups());
  for (const Moment& m : iter.moments) {
    if (m.kind != MomentKind::kOptimizerStep) continue;
    const uint32_t g = StepGroup(trace, iter, m);
    if (g == kNoGroup) continue;
    base.groups[g].update_on = iter.accesses[m.first_access].tier;
    base.groups[g].overlap = options.overlap_optimizer;
  }
  if (options.mimic_baselines) search.TryBaselines(base);
  search.Try(base);
  if (options.homes == nullptr) {
    // The baselines' homes with the planner's schedule; the search goes on with the better
    // home rule.
    search.set_in_order_homes(true);
    search.Try(base);
    search.FollowBestHomeRule();
  }
  if (options.activation_policy) {
    ActivationSearch(search, trace, iter, machine, base, options.allow_recompute);
  }

  // With volatile groups (routing that changes between iterations) optimizer steps stay
  // where they ran: HBM given to resident optimizer state is then missing for the chunks no
  // plan can predict (measured on the canonical MoE trace, docs/benchmarks.md).
  const bool can_place = options.place_optimizer && machine.cpu_optim_elems_per_s > 0 &&
                         machine.device_optim_elems_per_s > 0 &&
                         (volatile_groups.empty() || trace.HasExpertSets());
  if (can_place && search.best()) {
    // The sweep starts from the best candidate's homes and activations, not its optimizer
    // placement: a baseline's moves run the steps where the trace ran them (kNone), and the
    // planner decides every group's tier itself.
    Placement start = search.best()->placement;
    for (uint32_t g = 0; g < start.groups.size() && g < base.groups.size(); ++g) {
      if (start.groups[g].update_on == TierKind::kNone) start.groups[g] = base.groups[g];
    }
    // Groups by the position their grads complete at, latest first.
    std::vector<std::pair<int64_t, uint32_t>> order;
    {
      Placement all_host = start;
      for (GroupChoice& g : all_host.groups) {
        if (g.update_on != TierKind::kNone) g = {TierKind::kHost, true};
      }
      auto eff = BuildEffective(trace, iter, all_host, machine);
      if (eff.ok()) {
        std::vector<int64_t> pos(base.groups.size(), -1);
        for (size_t i = 0; i < eff->size(); ++i) {
          const EffMoment& m = eff->moments[i];
          if (m.async && m.group < pos.size()) pos[m.group] = static_cast<int64_t>(i);
        }
        for (uint32_t g = 0; g < pos.size(); ++g) {
          if (pos[g] >= 0 && !is_volatile[g]) order.push_back({-pos[g], g});
        }
        std::sort(order.begin(), order.end());
      }
    }
    Patience patience;
    for (size_t m = 1; m <= order.size() && !patience.exhausted(); ++m) {
      Placement p = start;
      for (GroupChoice& g : p.groups) {
        if (g.update_on != TierKind::kNone) g = {TierKind::kHost, options.overlap_optimizer};
      }
      for (size_t j = 0; j < m; ++j) p.groups[order[j].second] = {TierKind::kDevice, false};
      patience.Observe(search.Try(p));
    }
  }
  if (options.overlap_optimizer && search.best()) {
    Placement p = search.best()->placement;
    for (GroupChoice& g : p.groups) g.overlap = false;
    search.Try(p);
  }
  if (options.activation_policy && can_place && search.best()) {
    Placement p = search.best()->placement;
    p.units.clear();
    ActivationSearch(search, trace, iter, machine, p, options.allow_recompute);
  }
  if (search.best()) {
    // Schedule variants on the best placement.
    const Placement p = search.best()->placement;
    // (Not when judged on bytes: Belady's fetches are then the optimum by construction.)
    if (options.aggressive_prefetch && options.objective == PlanObjective::kTime) {
      search.Try(p, /*aggressive=*/true);
    }
    if (options.mimic_baselines) search.TryHoistedBaselines(p);
  }
  if (!search.best()) return search.first_error();
  Plan plan = search.best()->plan;
  plan.volatile_groups = volatile_groups;
  plan.candidates_evaluated = search.evaluated();
  plan.baselines = search.baselines();
  return plan;
}

const BaselineEstimate* Plan::FindBaseline(std::string_view name) const {
  for (const BaselineEstimate& b : baselines) {
    if (b.name == name) return &b;
  }
  return nullptr;
}

// ---- encoding and description ------------------------------------------------------------
std::string EncodePlan(const Plan& p) {
  std::string out;
  auto raw = [&out](const void* v, size_t n) { out.append(static_cast<const char*>(v), n); };
  auto u8 = [&](uint8_t v) { raw(&v, 1); };
  auto u32 = [&](uint32_t v) { raw(&v, 4); };
  auto u64 = [&](uint64_t v) { raw(&v, 8); };
  out.append("TMPLAN\x1a\x00", 8);
  u32(p.version);
  u32(p.source_iteration);
  u8(p.aggressive_prefetch);
  u8(p.writeback_aware);
  u32(static_cast<uint32_t>(p.home.size()));
  for (TierKind t : p.home) u8(static_cast<uint8_t>(t));
  u32(static_cast<uint32_t>(p.groups.size()));
  for (const GroupPlan& g : p.groups) {
    u32(g.group);
    u8(static_cast<uint8_t>(g.update_on));
    u8(g.overlap);
  }
  u32(static_cast<uint32_t>(p.volatile_groups.size()));
  for (uint32_t g : p.volatile_groups) u32(g);
  u32(static_cast<uint32_t>(p.expert_class.size()));
  for (uint32_t k : p.expert_class) u32(k);
  u32(static_cast<uint32_t>(p.units.size()));
  for (const UnitPlan& u : p.units) {
    u32(u.unit);
    u8(static_cast<uint8_t>(u.policy));
    u32(u.prefetch_lead);
    u64(u.saved_bytes);
  }
  u32(static_cast<uint32_t>(p.moments.size()));
  for (const PlannedMoment& m : p.moments) {
    u32(static_cast<uint32_t>(m.label.size()));
    out.append(m.label);
    u8(static_cast<uint8_t>(m.kind));
    u32(m.unit);
    u32(m.trace_moment);
    u8(m.async);
    u64(m.compute_ns);
    u32(m.first_access);
    u32(m.num_accesses);
    u32(m.first_action);
    u32(m.num_actions);
  }
  u32(static_cast<uint32_t>(p.accesses.size()));
  for (const TraceAccess& a : p.accesses) {
    u32(a.chunk);
    u8(static_cast<uint8_t>(a.mode));
    u8(static_cast<uint8_t>(a.tier));
  }
  u32(static_cast<uint32_t>(p.actions.size()));
  for (const PlanAction& a : p.actions) {
    u8(static_cast<uint8_t>(a.kind));
    u8(static_cast<uint8_t>(a.tier));
    u8(a.copy);
    u32(a.chunk);
    u32(a.unit);
    u32(a.need_moment);
  }
  const PlanEstimate& e = p.estimate;
  u64(e.iteration_ns);
  u64(e.compute_ns);
  u64(e.stall_ns);
  u64(e.device_in_bytes);
  for (const auto& row : e.bytes) {
    for (Bytes b : row) u64(b);
  }
  for (Bytes b : e.peak) u64(b);
  u64(e.steady_iteration_ns);
  u64(e.steady_stall_ns);
  u64(e.steady_device_in_bytes);
  u64(e.steady_nvme_bytes);
  return out;
}

std::string DescribePlan(const Plan& p, const Trace& trace) {
  std::string s;
  Bytes nvme = 0;
  size_t nvme_chunks = 0;
  for (ChunkId c = 0; c < p.home.size(); ++c) {
    if (p.home[c] == TierKind::kNvme) {
      nvme += trace.chunks[c].bytes;
      ++nvme_chunks;
    }
  }
  s += "homes: " + std::to_string(p.home.size() - nvme_chunks) + " chunks on host, " +
       std::to_string(nvme_chunks) + " on nvme (" + FormatBytes(nvme) + ")\n";
  size_t on_dev = 0, overlapped = 0;
  for (const GroupPlan& g : p.groups) {
    on_dev += g.update_on == TierKind::kDevice;
    overlapped += g.overlap;
  }
  s += "optimizer: " + std::to_string(on_dev) + " of " + std::to_string(p.groups.size()) +
       " groups on the device, " + std::to_string(overlapped) +
       " CPU groups overlapped with the backward\n";
  if (!p.expert_class.empty()) {
    uint32_t classes = 0, members = 0;
    for (uint32_t k : p.expert_class) {
      if (k == kNoExpertSet) continue;
      classes = std::max(classes, k + 1);
      ++members;
    }
    s += "experts: " + std::to_string(members) + " member chunks in " + std::to_string(classes) +
         " classes (slots bound to the routed experts at run time)\n";
  }
  if (!p.volatile_groups.empty()) {
    s += "volatile: " + std::to_string(p.volatile_groups.size()) +
         " groups used differently by the last two iterations or of experts (prefetched once "
         "seen)\n";
  }
  std::array<size_t, 3> pol{};
  for (const UnitPlan& u : p.units) ++pol[static_cast<int>(u.policy)];
  s += "activations: " + std::to_string(pol[0]) + " units keep, " + std::to_string(pol[1]) +
       " offload, " + std::to_string(pol[2]) + " recompute\n";
  std::array<size_t, 3> acts{};
  for (const PlanAction& a : p.actions) ++acts[static_cast<int>(a.kind)];
  s += "actions: " + std::to_string(acts[1]) + " prefetches, " + std::to_string(acts[0]) +
       " evictions, " + std::to_string(acts[2]) + " activation fetches over " +
       std::to_string(p.moments.size()) + " moments" +
       (!p.baseline.empty()
            ? (p.baseline == "belady" ? ", Belady's demand moves"
                                      : ", the " + p.baseline + " policy's moves") +
                  (p.aggressive_prefetch ? ", evictions and fetches as early as room allows" : "")
        : p.aggressive_prefetch ? ", prefetching ahead of Belady"
                                : ", Belady fetches") +
       (p.writeback_aware ? ", room of dirty evictions counted until written back" : "") + " (" +
       std::to_string(p.candidates_evaluated) + " candidate plans evaluated)\n";
  return s;
}

}  // namespace tiermem::planners
