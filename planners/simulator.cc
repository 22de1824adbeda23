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
  Status RunImpl(PolicyKind kind, const SimResult* planned, SimResult* res) {
    const bool plan_like = kind == PolicyKind::kPlanned || kind == PolicyKind::kOpt;
    // Homes.
    std::vector<TierKind> homes;
    Plan first_plan;
    if (kind == PolicyKind::kPlanned) {
      PlanOptions po = opt_.plan;
      po.iteration = 0;
      po.start = nullptr;
      po.homes = nullptr;
      std::vector<TierKind> recorded;
      if (opt_.keep_recorded_homes) {
        for (const TraceChunk& c : trace_.chunks) recorded.push_back(c.home);
        po.homes = &recorded;
      }
      TIERMEM_ASSIGN_OR_RETURN(first_plan, MakePlan(trace_, machine_, po));
      homes = first_plan.home;
    } else if (kind == PolicyKind::kOpt) {
      homes = planned->homes;
    } else {
      TIERMEM_RETURN_IF_ERROR(CheckFeasible(trace_, 0, machine_, true));
      TIERMEM_ASSIGN_OR_RETURN(homes, PlaceHomesInOrder(trace_, machine_, HostWorkingSet(trace_)));
    }
    res->homes = homes;
    TIERMEM_ASSIGN_OR_RETURN(auto ex, SimulatedRun::Create(&trace_, &machine_, homes));

    // Warm-up: reactive, as recorded (baselines) or under the first plan's placement.
    std::vector<EffIteration> recorded_eff;  // per position in seq_, recorded placement
    for (uint32_t k : seq_) {
      TIERMEM_ASSIGN_OR_RETURN(EffIteration e, BuildEffective(trace_, trace_.iterations[k],
                                                              Recorded(trace_, homes), machine_));
      recorded_eff.push_back(std::move(e));
    }
    {
      Placement wp = Recorded(trace_, homes);
      if (kind == PolicyKind::kPlanned) wp = first_plan.ToPlacement();
      if (kind == PolicyKind::kOpt) wp = planned->warmup_placement;
      res->warmup_placement = wp;
      TIERMEM_ASSIGN_OR_RETURN(EffIteration e,
                               BuildEffective(trace_, trace_.iterations[seq_[0]], wp, machine_));
      LruPolicy warm;
      auto st = ex->Run(e, warm, 0);
      if (!st.ok()) return st.status().WithContext("warm-up iteration");
    }
    ex->ResetPeaks();
    ex->set_record_moments(opt_.record_moments);

    // Effective sequences of the measured iterations (opt needs them all up front).
    std::vector<EffIteration> eff(seq_.size());
    std::unique_ptr<NextUse> oracle;
    if (kind == PolicyKind::kOpt) {
      if (planned->plans.size() + 1 != seq_.size()) {
        return FailedPreconditionError("opt: the planned run did not complete");
      }
      std::vector<const EffIteration*> all;
      for (size_t p = 1; p < seq_.size(); ++p) {
        TIERMEM_ASSIGN_OR_RETURN(eff[p],
                                 BuildEffective(trace_, trace_.iterations[seq_[p]],
                                                planned->plans[p - 1].ToPlacement(), machine_));
        all.push_back(&eff[p]);
      }
      oracle = std::make_unique<NextUse>(all, trace_.chunks.size());
    } else if (kind == PolicyKind::kOptRecorded) {
      std::vector<const EffIteration*> all;
      for (size_t p = 1; p < seq_.size(); ++p) all.push_back(&recorded_eff[p]);
      oracle = std::make_unique<NextUse>(all, trace_.chunks.size());
    }
    res->bound_exact = true;
    if (kind == PolicyKind::kOpt || kind == PolicyKind::kOptRecorded) {
      Bytes size = 0;
      for (size_t p = 1; p < seq_.size(); ++p) {
        const EffIteration& e = kind == PolicyKind::kOpt ? eff[p] : recorded_eff[p];
        for (const EffAccess& a : e.accesses) {
          if (a.tier != TierKind::kDevice) continue;
          const Bytes b = trace_.chunks[a.chunk].bytes;
          if (size != 0 && b != size) res->bound_exact = false;
          size = b;
        }
      }
    }

    uint64_t offset = 0;
    for (size_t p = 1; p < seq_.size(); ++p) {
      const uint32_t k = seq_[p];
      StatusOr<IterationStats> st = InternalError("unset");
      bool diverged = false;
      switch (kind) {
        case PolicyKind::kLru: {
          LruPolicy pol;
          st = ex->Run(recorded_eff[p], pol, static_cast<uint32_t>(p));
          break;
        }
        case PolicyKind::kPatrickStar: {
          PatrickStarPolicy pol(&recorded_eff[p - 1]);
          st = ex->Run(recorded_eff[p], pol, static_cast<uint32_t>(p));
          diverged = pol.diverged();
          break;
        }
        case PolicyKind::kEngine: {
          EnginePolicy pol(&recorded_eff[p - 1], opt_.engine_prefetch_depth);
          st = ex->Run(recorded_eff[p], pol, static_cast<uint32_t>(p));
          diverged = pol.diverged();
          break;
        }
        case PolicyKind::kDeepSpeed: {
          const Bytes bucket = opt_.deepspeed_bucket_bytes != 0 ? opt_.deepspeed_bucket_bytes
                                                                : 4 * trace_.MaxChunkBytes();
          DeepSpeedPolicy pol(&recorded_eff[p - 1], bucket);
          st = ex->Run(recorded_eff[p], pol, static_cast<uint32_t>(p));
          diverged = pol.diverged();
          break;
        }
        case PolicyKind::kPlanned: {
          const StartState start = ex->State();
          PlanOptions po = opt_.plan;
          po.iteration = seq_[p - 1];
          if (p >= 2) po.earlier_iteration = seq_[p - 2];
          po.start = &start;
          po.homes = &homes;
          TIERMEM_ASSIGN_OR_RETURN(Plan plan, MakePlan(trace_, machine_, po));
          const Placement pl = plan.ToPlacement();
          TIERMEM_ASSIGN_OR_RETURN(
              EffIteration planned_eff,
              BuildEffective(trace_, trace_.iterations[po.iteration], pl, machine_));
          TIERMEM_ASSIGN_OR_RETURN(eff[p],
                                   BuildEffective(trace_, trace_.iterations[k], pl, machine_));
          PlanPolicy pol(&plan, &planned_eff);
          st = ex->Run(eff[p], pol, static_cast<uint32_t>(p));
          diverged = pol.diverged();
          if (!diverged) res->repairs += pol.repairs();
          res->plans.push_back(std::move(plan));
          break;
        }
        case PolicyKind::kOpt:
        case PolicyKind::kOptRecorded: {
          OptPolicy pol(oracle.get());
          pol.SetOffset(offset);
          const EffIteration& e = kind == PolicyKind::kOpt ? eff[p] : recorded_eff[p];
          st = ex->Run(e, pol, static_cast<uint32_t>(p));
          offset += e.size();
          break;
        }
      }
      if (!st.ok()) {
        return st.status().WithContext(std::string(PolicyName(kind)) + ", iteration " +
                                       std::to_string(p));
      }
      res->divergences += diverged;
      Accumulate(res->total, *st);
      res->per_iteration.push_back(*st);
      ++res->measured_iterations;
    }
    (void)plan_like;
    for (int t = 0; t < kNumTierKinds; ++t) res->peak[t] = ex->Peak(static_cast<TierKind>(t));
    res->unclaimed = ex->Unclaimed();
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
