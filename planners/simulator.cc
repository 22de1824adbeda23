// Simulator: the baseline policies and the driver. See simulator.h for the protocol.
#include "planners/simulator.h"

#include <algorithm>
#include <tuple>

#include "layout/eviction_rank.h"
#include "planners/schedule.h"

namespace tiermem::planners {
namespace {

// The engine's eviction rule (layout/eviction_rank.h) without a recorded order: the least
// recently used, clean first. Ties go to the lower chunk id, as in the engine (MakeRoom scans
// chunks by id).
chunks::EvictionRank Lru(const SimulatedRun& ex, ChunkId c) {
  return chunks::RankForEviction(chunks::EvictionCandidate{
      .chunk = c, .dirty = ex.Chunk(c).dirty, .last_use = ex.Chunk(c).last_use});
}

// Next access of `c` (any tier, any mode) strictly after moment `i` of `r`, or kNever.
constexpr uint64_t kNever = chunks::kNeverUsed;
class OrderIndex {
 public:
  OrderIndex(const EffIteration& r, size_t num_chunks) : pos_(num_chunks) {
    for (size_t m = 0; m < r.size(); ++m) {
      for (const EffAccess* a = r.begin(m); a != r.end(m); ++a) pos_[a->chunk].push_back(m);
    }
  }
  uint64_t Next(ChunkId c, size_t i) const {
    const auto& p = pos_[c];
    auto it = std::upper_bound(p.begin(), p.end(), static_cast<uint64_t>(i));
    return it == p.end() ? kNever : *it;
  }

 private:
  std::vector<std::vector<uint64_t>> pos_;
};

class LruPolicy : public Policy {
 public:
  Status Before(SimulatedRun& ex, size_t i) override {
    return EnsureMoment(ex, i, [&ex](ChunkId c, TierKind) { return Lru(ex, c); });
  }
};

// Shared by the policies that follow the previous iteration's order.
class Following : public Policy {
 public:
  explicit Following(const EffIteration* recorded) : rec_(recorded) {}
  Status BeginIteration(SimulatedRun& ex) override {
    following_ = rec_ != nullptr;
    if (rec_ != nullptr) index_ = std::make_unique<OrderIndex>(*rec_, ex.NumChunks());
    return OkStatus();
  }
  bool diverged() const { return rec_ != nullptr && !following_; }

 protected:
  void Track(const SimulatedRun& ex, size_t i) {
    if (following_ && (i >= rec_->size() || !SameMoment(ex.iteration(), i, *rec_, i))) {
      following_ = false;
    }
  }
  const EffIteration* rec_;
  std::unique_ptr<OrderIndex> index_;
  bool following_ = false;
};

class PatrickStarPolicy : public Following {
 public:
  using Following::Following;
  Status Before(SimulatedRun& ex, size_t i) override {
    Track(ex, i);
    if (!following_) {
      return EnsureMoment(ex, i, [&ex](ChunkId c, TierKind) { return Lru(ex, c); });
    }
    return EnsureMoment(ex, i, [&](ChunkId c, TierKind) {
      return std::make_tuple(UINT64_MAX - std::min(index_->Next(c, i), kNever - 1), c);
    });
  }
};

class EnginePolicy : public Following {
 public:
  EnginePolicy(const EffIteration* recorded, uint32_t depth) : Following(recorded), depth_(depth) {}
  Status Before(SimulatedRun& ex, size_t i) override {
    Track(ex, i);
    if (!following_) {
      return EnsureMoment(ex, i, [&ex](ChunkId c, TierKind) { return Lru(ex, c); });
    }
    // The engine's eviction rule while it follows the recorded order (ties: the lower id).
    auto key = [&](ChunkId c) {
      return chunks::RankForEviction(chunks::EvictionCandidate{.chunk = c,
                                                               .dirty = ex.Chunk(c).dirty,
                                                               .next_use = index_->Next(c, i),
                                                               .order_known = true});
    };
    TIERMEM_RETURN_IF_ERROR(EnsureMoment(ex, i, [&](ChunkId c, TierKind) { return key(c); }));
    // Lookahead: the next `depth_` acquires of the recorded order after this moment.
    uint32_t seen = 0;
    for (size_t m = i + 1; m < rec_->size() && seen < depth_; ++m) {
      for (const EffAccess* a = rec_->begin(m); a != rec_->end(m) && seen < depth_; ++a, ++seen) {
        const ChunkId c = a->chunk;
        const ChunkView& v = ex.Chunk(c);
        if (a->tier == ex.Home(c) || v.cache != TierKind::kNone) continue;
        const Bytes need = ex.ChunkBytes(c) + ex.NeedExtra(i, a->tier);
        auto r = MakeRoom(ex, i, a->tier, need, key, [&](ChunkId x) {
          if (ex.Chunk(x).dirty) return true;
          const uint64_t next = index_->Next(x, i);
          return next != kNever && next <= m;
        });
        if (!r.ok()) return r.status();
        if (!*r) return OkStatus();  // no room without hurting sooner uses: stop looking
        TIERMEM_RETURN_IF_ERROR(ex.Fetch(c, a->tier, a->needs_content));
      }
    }
    return OkStatus();
  }

 private:
  uint32_t depth_;
};

class DeepSpeedPolicy : public Following {
 public:
  DeepSpeedPolicy(const EffIteration* recorded, Bytes bucket)
      : Following(recorded), bucket_(bucket) {}
  Status Before(SimulatedRun& ex, size_t i) override {
    Track(ex, i);
    const EffIteration& it = ex.iteration();
    // The window: recorded moments after this one while their new chunks fit the bucket.
    size_t window_end = i;
    if (following_) {
      Bytes acc = 0;
      for (size_t m = i + 1; m < rec_->size(); ++m) {
        for (const EffAccess* a = rec_->begin(m); a != rec_->end(m); ++a) {
          if (a->tier != ex.Home(a->chunk)) acc += ex.ChunkBytes(a->chunk);
        }
        if (acc > bucket_) break;
        window_end = m;
      }
    }
    // Release what the previous moment used unless it is reused within the window.
    if (i > 0) {
      for (const EffAccess* a = it.begin(i - 1); a != it.end(i - 1); ++a) {
        const ChunkId c = a->chunk;
        if (ex.Chunk(c).cache == TierKind::kNone || UsedBy(it, i, c)) continue;
        if (following_) {
          const uint64_t next = index_->Next(c, i - 1);
          if (next != kNever && next <= window_end) continue;
        }
        TIERMEM_RETURN_IF_ERROR(ex.Evict(c));
      }
    }
    TIERMEM_RETURN_IF_ERROR(EnsureMoment(ex, i, [&ex](ChunkId c, TierKind) { return Lru(ex, c); }));
    if (!following_) return OkStatus();
    for (size_t m = i + 1; m <= window_end; ++m) {
      for (const EffAccess* a = rec_->begin(m); a != rec_->end(m); ++a) {
        const ChunkId c = a->chunk;
        if (a->tier == ex.Home(c) || ex.Chunk(c).cache != TierKind::kNone || !a->needs_content) {
          continue;
        }
        const Bytes need = ex.ChunkBytes(c) + ex.NeedExtra(i, a->tier);
        auto r = MakeRoom(
            ex, i, a->tier, need, [&ex](ChunkId x) { return Lru(ex, x); },
            [&](ChunkId x) {
              const uint64_t next = index_->Next(x, i);
              return next != kNever && next <= window_end;
            });
        if (!r.ok()) return r.status();
        if (!*r) return OkStatus();
        TIERMEM_RETURN_IF_ERROR(ex.Fetch(c, a->tier, true));
      }
    }
    return OkStatus();
  }

 private:
  Bytes bucket_;
};

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
      PlanOptions po = opt_.plan;
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
    LruPolicy warm;
    auto st = r.ex->Run(e, warm, 0);
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
      case PolicyKind::kLru: {
        LruPolicy pol;
        *st = ex.Run(recorded, pol, at);
        break;
      }
      case PolicyKind::kPatrickStar: {
        PatrickStarPolicy pol(&r.recorded_eff[p - 1]);
        *st = ex.Run(recorded, pol, at);
        *diverged = pol.diverged();
        break;
      }
      case PolicyKind::kEngine: {
        EnginePolicy pol(&r.recorded_eff[p - 1], opt_.engine_prefetch_depth);
        *st = ex.Run(recorded, pol, at);
        *diverged = pol.diverged();
        break;
      }
      case PolicyKind::kDeepSpeed: {
        const Bytes bucket = opt_.deepspeed_bucket_bytes != 0 ? opt_.deepspeed_bucket_bytes
                                                              : 4 * trace_.MaxChunkBytes();
        DeepSpeedPolicy pol(&r.recorded_eff[p - 1], bucket);
        *st = ex.Run(recorded, pol, at);
        *diverged = pol.diverged();
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
    PlanOptions po = opt_.plan;
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

  const Trace& trace_;
  const MachineModel& machine_;
  const SimOptions& opt_;
  std::vector<uint32_t> seq_;  // trace iteration per position; position 0 is the warm-up
};

}  // namespace

std::string_view PolicyName(PolicyKind p) {
  switch (p) {
    case PolicyKind::kLru:
      return "lru";
    case PolicyKind::kPatrickStar:
      return "patrickstar";
    case PolicyKind::kDeepSpeed:
      return "deepspeed";
    case PolicyKind::kEngine:
      return "engine";
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
