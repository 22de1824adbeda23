// SimulatedRun implementation. See simulated_run.h for the model. Invariants kept here:
//   - used_[t] equals the occupancy profile of t after all issued events (every program-order
//     allocation or free is also a profile event), and never exceeds the budget;
//   - a chunk has at most one cached copy, on a tier above its home; view_.cache says where;
//   - a region is freed no earlier than the end of the last copy or moment that touches it.
#include "planners/simulated_run.h"

#include <algorithm>

namespace tiermem::planners {

std::string_view StallCauseName(StallCause c) {
  switch (c) {
    case StallCause::kFetch:
      return "fetch";
    case StallCause::kWriteBack:
      return "write-back";
    case StallCause::kRoom:
      return "room";
    case StallCause::kActivation:
      return "activation";
    case StallCause::kOptimizer:
      return "optimizer";
  }
  return "?";
}

Bytes IterationStats::DeviceInBytes() const {
  return bytes[static_cast<int>(TierKind::kHost)][static_cast<int>(TierKind::kDevice)] +
         bytes[static_cast<int>(TierKind::kNvme)][static_cast<int>(TierKind::kDevice)];
}

Bytes IterationStats::NvmeBytes() const {
  Bytes n = 0;
  for (int t = 0; t < kNumTierKinds; ++t) {
    if (t == static_cast<int>(TierKind::kNvme)) continue;
    n += bytes[t][static_cast<int>(TierKind::kNvme)] + bytes[static_cast<int>(TierKind::kNvme)][t];
  }
  return n;
}

// ---- OccupancyProfile --------------------------------------------------------------------
void OccupancyProfile::Advance(uint64_t now) {
  while (!delta_.empty() && delta_.begin()->first <= now) {
    base_ += delta_.begin()->second;
    delta_.erase(delta_.begin());
  }
  base_t_ = std::max(base_t_, now);
}

StatusOr<uint64_t> OccupancyProfile::Alloc(Bytes bytes, uint64_t t) {
  const int64_t b = static_cast<int64_t>(bytes);
  const int64_t cap = static_cast<int64_t>(cap_);
  // occ(τ) for τ in [event k, event k+1) is base_ + sum of deltas up to k. Candidate start
  // times: t itself, then each later event time; the first whose suffix maximum fits wins.
  std::vector<std::pair<uint64_t, int64_t>> pts;  // (time, occupancy from then on)
  pts.reserve(delta_.size() + 1);
  int64_t occ = base_;
  auto it = delta_.begin();
  for (; it != delta_.end() && it->first <= t; ++it) occ += it->second;
  pts.push_back({t, occ});
  for (; it != delta_.end(); ++it) {
    occ += it->second;
    pts.push_back({it->first, occ});
  }
  std::vector<int64_t> suffix_max(pts.size());
  int64_t m = INT64_MIN;
  for (size_t k = pts.size(); k-- > 0;) {
    m = std::max(m, pts[k].second);
    suffix_max[k] = m;
  }
  for (size_t k = 0; k < pts.size(); ++k) {
    if (suffix_max[k] + b <= cap) {
      const uint64_t at = pts[k].first;
      delta_[at] += b;
      if (at <= base_t_) Advance(base_t_);
      peak_ = std::max(peak_, static_cast<Bytes>(suffix_max[k] + b));
      return at;
    }
  }
  return InternalError("occupancy: " + std::to_string(bytes) + " bytes never fit in a budget of " +
                       std::to_string(cap_) + " (occupancy " + std::to_string(occ) +
                       " after every issued event): the program-order check was bypassed");
}

StatusOr<uint64_t> OccupancyProfile::AllocFor(Bytes bytes, uint64_t t, uint64_t duration) {
  if (duration == 0) return t;
  const int64_t b = static_cast<int64_t>(bytes);
  const int64_t cap = static_cast<int64_t>(cap_);
  std::vector<std::pair<uint64_t, int64_t>> pts;  // (time, occupancy from then on)
  int64_t occ = base_;
  auto it = delta_.begin();
  for (; it != delta_.end() && it->first <= t; ++it) occ += it->second;
  pts.push_back({t, occ});
  for (; it != delta_.end(); ++it) {
    occ += it->second;
    pts.push_back({it->first, occ});
  }
  for (size_t k = 0; k < pts.size(); ++k) {
    const uint64_t a = pts[k].first;
    int64_t m = pts[k].second;
    for (size_t j = k + 1; j < pts.size() && pts[j].first < a + duration; ++j) {
      m = std::max(m, pts[j].second);
    }
    if (m + b <= cap) {
      delta_[a] += b;
      delta_[a + duration] -= b;
      if (a <= base_t_) Advance(base_t_);
      peak_ = std::max(peak_, static_cast<Bytes>(m + b));
      return a;
    }
  }
  return InternalError("occupancy: " + std::to_string(bytes) + " bytes never fit in a budget of " +
                       std::to_string(cap_) + ": the program-order check was bypassed");
}

void OccupancyProfile::ResetPeak() {
  int64_t occ = base_, m = base_;
  for (const auto& [t, d] : delta_) {
    occ += d;
    m = std::max(m, occ);
  }
  peak_ = static_cast<Bytes>(std::max<int64_t>(m, 0));
}

Status OccupancyProfile::Free(Bytes bytes, uint64_t t) {
  if (t <= base_t_) {
    base_ -= static_cast<int64_t>(bytes);
    if (base_ < 0) return InternalError("occupancy: freed more than allocated");
    return OkStatus();
  }
  delta_[t] -= static_cast<int64_t>(bytes);
  return OkStatus();
}

// ---- SimulatedRun ----------------------------------------------------------------------------
SimulatedRun::SimulatedRun(const Trace* trace, const MachineModel* machine,
                           std::vector<TierKind> homes)
    : trace_(trace), machine_(machine), homes_(std::move(homes)) {
  view_.resize(trace_->chunks.size());
  times_.resize(trace_->chunks.size());
  for (int t = 0; t < kNumTierKinds; ++t) profile_[t] = OccupancyProfile(machine_->budget[t]);
}

StatusOr<std::unique_ptr<SimulatedRun>> SimulatedRun::Create(const Trace* trace,
                                                             const MachineModel* machine,
                                                             std::vector<TierKind> homes) {
  if (homes.size() != trace->chunks.size()) {
    return InvalidArgumentError("simulated run: " + std::to_string(homes.size()) + " homes for " +
                                std::to_string(trace->chunks.size()) + " chunks");
  }
  TIERMEM_RETURN_IF_ERROR(machine->Validate());
  std::unique_ptr<SimulatedRun> ex(new SimulatedRun(trace, machine, std::move(homes)));
  for (ChunkId c = 0; c < ex->homes_.size(); ++c) {
    const TierKind h = ex->homes_[c];
    if (h != TierKind::kHost && h != TierKind::kNvme) {
      return InvalidArgumentError("simulated run: chunk " + std::to_string(c) +
                                  " must be homed on host or nvme");
    }
    ex->used_[Idx(h)] += trace->chunks[c].bytes;
  }
  for (TierKind h : {TierKind::kHost, TierKind::kNvme}) {
    if (ex->used_[Idx(h)] > machine->Budget(h)) {
      return ResourceExhaustedError(
          std::string(TierKindName(h)) + " tier: the chunks homed there need " +
          std::to_string(ex->used_[Idx(h)]) + " bytes (" + FormatBytes(ex->used_[Idx(h)]) +
          "), the budget is " + std::to_string(machine->Budget(h)) + " bytes (" +
          FormatBytes(machine->Budget(h)) + ")");
    }
    if (ex->used_[Idx(h)] > 0) {
      auto a = ex->profile_[Idx(h)].Alloc(ex->used_[Idx(h)], 0);
      if (!a.ok()) return a.status();
    }
  }
  return ex;
}

StatusOr<uint64_t> SimulatedRun::Alloc(TierKind t, Bytes bytes, uint64_t at) {
  if (used_[Idx(t)] + bytes > Budget(t)) {
    return InternalError(std::string(TierKindName(t)) + " tier: an allocation of " +
                         std::to_string(bytes) + " bytes at moment " + std::to_string(pc_) +
                         " exceeds the budget in program order (" + std::to_string(used_[Idx(t)]) +
                         " of " + std::to_string(Budget(t)) +
                         " bytes in use): the policy did not make room");
  }
  auto a = profile_[Idx(t)].Alloc(bytes, at);
  if (!a.ok()) return a.status();
  used_[Idx(t)] += bytes;
  return *a;
}

StatusOr<uint64_t> SimulatedRun::AllocTransient(TierKind t, Bytes bytes, uint64_t at,
                                                uint64_t duration) {
  if (used_[Idx(t)] + bytes > Budget(t)) {
    return InternalError(std::string(TierKindName(t)) + " tier: " + std::to_string(bytes) +
                         " bytes of a moment's compute at moment " + std::to_string(pc_) +
                         " exceed the budget in program order (" + std::to_string(used_[Idx(t)]) +
                         " of " + std::to_string(Budget(t)) +
                         " bytes in use): the policy did not make room");
  }
  return profile_[Idx(t)].AllocFor(bytes, at, duration);
}

Status SimulatedRun::FreeAt(TierKind t, Bytes bytes, uint64_t at) {
  if (bytes > used_[Idx(t)]) return InternalError("simulated run: free of more than is in use");
  used_[Idx(t)] -= bytes;
  return profile_[Idx(t)].Free(bytes, at);
}

uint64_t SimulatedRun::Copy(TierKind src, TierKind dst, Bytes bytes, uint64_t at, uint32_t tag) {
  const auto [ls, ld] = MachineModel::LaneOf(src, dst);
  Lane& lane = lanes_[ls][ld];
  const uint64_t start = std::max(at, lane.free_at);
  const uint64_t end = start + machine_->CopyNs(src, dst, bytes);
  lane.free_at = end;
  stats_[tag].bytes[Idx(src)][Idx(dst)] += bytes;
  return end;
}

Bytes SimulatedRun::NeedExtra(size_t i, TierKind t) const {
  const EffIteration& it = *it_;
  Bytes n = 0;
  if (t == TierKind::kDevice) {
    n += it.moments[i].temp_bytes;
    for (const ActSpan& s : it.spans) {
      if (s.fwd == i) n += s.bytes;
      if (s.policy == ActivationPolicy::kRecompute && s.bwd == i) n += s.bytes;
      if (s.policy == ActivationPolicy::kOffload && s.prefetch_at == i) n += s.bytes;
    }
  } else if (t == TierKind::kHost) {
    for (const ActSpan& s : it.spans) {
      if (s.policy == ActivationPolicy::kOffload && s.fwd == i) n += s.bytes;
    }
  }
  return n;
}

Status SimulatedRun::Fetch(ChunkId c, TierKind to, bool copy, uint32_t need_tag) {
  const TierKind home = homes_[c];
  if (to == home || (to != TierKind::kDevice && to != TierKind::kHost) ||
      static_cast<int>(to) >= static_cast<int>(home)) {
    return InternalError("simulated run: chunk " + std::to_string(c) + " cannot be fetched to " +
                         std::string(TierKindName(to)) + " (its home is " +
                         std::string(TierKindName(home)) + ")");
  }
  ChunkView& v = view_[c];
  if (v.cache == to) return OkStatus();
  ChunkTimes& tm = times_[c];
  const Bytes bytes = ChunkBytes(c);
  const TierKind src = v.cache != TierKind::kNone ? v.cache : home;
  uint64_t t_req = std::max({issue_t_, tm.writer_end, tm.last_end});
  t_req = std::max(t_req, src == home ? tm.home_ready : tm.ready);
  TIERMEM_ASSIGN_OR_RETURN(const uint64_t a, Alloc(to, bytes, t_req));
  uint64_t end = a;
  if (copy) {
    end = Copy(src, to, bytes, a, need_tag);
    ++stats_[tag_].fetches;
  }
  tm.ready_cause = a > t_req ? StallCause::kRoom : StallCause::kFetch;
  if (v.cache != TierKind::kNone) {
    TIERMEM_RETURN_IF_ERROR(FreeAt(v.cache, bytes, end));
    if (!copy) v.dirty = false;
  } else {
    v.dirty = false;
  }
  tm.valid = copy && (v.cache == TierKind::kNone || tm.valid);
  tm.ready = end;
  v.cache = to;
  if (log_ != nullptr && in_before_) {
    log_->push_back(
        {.moment = static_cast<uint32_t>(cur_moment_), .chunk = c, .tier = to, .copy = copy});
  }
  return OkStatus();
}

Status SimulatedRun::Preload(ChunkId c, TierKind tier, bool dirty) {
  if (c >= view_.size()) return InvalidArgumentError("simulated run: preload of unknown chunk");
  if (tier == TierKind::kNone) return OkStatus();
  if (view_[c].cache != TierKind::kNone || static_cast<int>(tier) >= static_cast<int>(homes_[c])) {
    return InvalidArgumentError("simulated run: chunk " + std::to_string(c) + " cannot start on " +
                                std::string(TierKindName(tier)));
  }
  if (used_[Idx(tier)] + ChunkBytes(c) > Budget(tier)) {
    return ResourceExhaustedError("simulated run: the start state does not fit the " +
                                  std::string(TierKindName(tier)) + " budget");
  }
  TIERMEM_ASSIGN_OR_RETURN(const uint64_t a, Alloc(tier, ChunkBytes(c), 0));
  (void)a;
  view_[c].cache = tier;
  view_[c].dirty = dirty;
  return OkStatus();
}

Status SimulatedRun::Evict(ChunkId c) {
  ChunkView& v = view_[c];
  if (v.cache == TierKind::kNone) return OkStatus();
  ChunkTimes& tm = times_[c];
  const Bytes bytes = ChunkBytes(c);
  const uint64_t t0 = std::max({issue_t_, tm.last_end, tm.ready});
  uint64_t free_at = t0;
  if (v.dirty && tm.valid) {
    free_at = Copy(v.cache, homes_[c], bytes, t0, tag_);
    tm.home_ready = free_at;
    ++stats_[tag_].writebacks;
  }
  TIERMEM_RETURN_IF_ERROR(FreeAt(v.cache, bytes, free_at));
  ++stats_[tag_].evictions;
  if (log_ != nullptr && in_before_) {
    log_->push_back(
        {.moment = static_cast<uint32_t>(cur_moment_), .evict = true, .chunk = c, .tier = v.cache});
  }
  v.cache = TierKind::kNone;
  v.dirty = false;
  tm.valid = true;
  return OkStatus();
}

Status SimulatedRun::WriteBack(ChunkId c) {
  ChunkView& v = view_[c];
  ChunkTimes& tm = times_[c];
  if (v.cache == TierKind::kNone || !v.dirty || !tm.valid) return OkStatus();
  const uint64_t t0 = std::max({issue_t_, tm.last_end, tm.ready, tm.writer_end});
  const uint64_t end = Copy(v.cache, homes_[c], ChunkBytes(c), t0, tag_);
  tm.home_ready = end;
  tm.ready = end;
  tm.ready_cause = StallCause::kWriteBack;
  ++stats_[tag_].writebacks;
  v.dirty = false;
  return OkStatus();
}

Status SimulatedRun::RunMoment(size_t i, Policy& policy) {
  const EffIteration& it = *it_;
  const EffMoment& m = it.moments[i];
  IterationStats& st = stats_[tag_];
  issue_t_ = stream_t_;
  for (OccupancyProfile& p : profile_) p.Advance(issue_t_);
  const uint64_t fetches0 = st.fetches, evictions0 = st.evictions;
  cur_moment_ = i;
  in_before_ = true;
  Status s = policy.Before(*this, i);
  in_before_ = false;
  if (!s.ok())
    return s.WithContext("moment " + std::to_string(i) + " (" + std::string(m.label) + ")");

  uint64_t ready = issue_t_;
  StallCause cause = StallCause::kFetch;
  auto dep = [&](uint64_t t, StallCause c) {
    if (t > ready) {
      ready = t;
      cause = c;
    }
  };
  for (const EffAccess* a = it.begin(i); a != it.end(i); ++a) {
    const ChunkId c = a->chunk;
    ChunkView& v = view_[c];
    ChunkTimes& tm = times_[c];
    if (a->tier == homes_[c]) {
      if (v.cache != TierKind::kNone) TIERMEM_RETURN_IF_ERROR(Evict(c));
      dep(tm.home_ready, StallCause::kWriteBack);
    } else {
      if (v.cache != a->tier) {
        return InternalError(
            "simulated run: moment " + std::to_string(i) + " (" + std::string(m.label) +
            ") needs chunk " + std::to_string(c) + " on the " + std::string(TierKindName(a->tier)) +
            " tier, but the policy left it on " +
            std::string(TierKindName(v.cache != TierKind::kNone ? v.cache : homes_[c])));
      }
      if (a->needs_content && !tm.valid) {
        return InternalError("simulated run: moment " + std::to_string(i) + " reads chunk " +
                             std::to_string(c) + ", fetched without its content");
      }
      dep(tm.ready, tm.ready_cause);
    }
    dep(tm.writer_end, StallCause::kOptimizer);
    dep(tm.last_end, StallCause::kOptimizer);
  }
  // Offloaded activations fetched back at this moment, and those this moment needs back.
  for (size_t k = 0; k < it.spans.size(); ++k) {
    const ActSpan& sp = it.spans[k];
    if (sp.policy != ActivationPolicy::kOffload) continue;
    if (sp.prefetch_at == i) {
      TIERMEM_ASSIGN_OR_RETURN(const uint64_t a, Alloc(TierKind::kDevice, sp.bytes, issue_t_));
      const uint64_t end =
          Copy(TierKind::kHost, TierKind::kDevice, sp.bytes, std::max(a, span_d2h_end_[k]), tag_);
      TIERMEM_RETURN_IF_ERROR(FreeAt(TierKind::kHost, sp.bytes, end));
      span_h2d_end_[k] = end;
      st.activation_bytes_in += sp.bytes;
    }
    if (sp.bwd == i) dep(span_h2d_end_[k], StallCause::kActivation);
  }
  // Device bytes allocated at compute start: saved activations kept past this moment (until
  // a free issued later), and transient ones freed at its end (temporaries, recomputed ones).
  Bytes kept = 0, transient = m.temp_bytes;
  for (const ActSpan& sp : it.spans) {
    if (sp.fwd == i) (sp.policy == ActivationPolicy::kRecompute ? transient : kept) += sp.bytes;
    if (sp.policy == ActivationPolicy::kRecompute && sp.bwd == i) transient += sp.bytes;
  }
  if (m.async) dep(cpu_t_, StallCause::kOptimizer);
  if (kept > 0) {
    TIERMEM_ASSIGN_OR_RETURN(const uint64_t a, Alloc(TierKind::kDevice, kept, ready));
    dep(a, StallCause::kRoom);
  }
  if (transient > 0) {
    TIERMEM_ASSIGN_OR_RETURN(const uint64_t a,
                             AllocTransient(TierKind::kDevice, transient, ready, m.compute_ns));
    dep(a, StallCause::kRoom);
  }

  uint64_t start, end;
  if (!m.async) {
    start = ready;
    const uint64_t stall = start - issue_t_;
    st.stall_ns += stall;
    st.stall_by_cause[static_cast<int>(cause)] += stall;
    end = start + m.compute_ns;
    st.compute_ns += m.compute_ns;
    st.recompute_ns += m.recompute_ns;
    stream_t_ = end;
  } else {
    start = std::max(ready, cpu_t_);
    end = start + m.compute_ns;
    cpu_t_ = end;
    st.cpu_overlap_ns += m.compute_ns;
  }

  if (record_) {
    MomentTiming mt;
    mt.label = std::string(m.label);
    mt.issue_ns = issue_t_ - iter_start_;
    mt.start_ns = start - iter_start_;
    mt.end_ns = end - iter_start_;
    mt.stall_ns = m.async ? 0 : start - issue_t_;
    mt.cause = cause;
    mt.async = m.async;
    mt.fetches = static_cast<uint32_t>(st.fetches - fetches0);
    mt.evictions = static_cast<uint32_t>(st.evictions - evictions0);
    mt.device_bytes = used_[Idx(TierKind::kDevice)];
    st.moments.push_back(std::move(mt));
  }

  // Frees at the end of the compute (the transient bytes were allocated for exactly it);
  // offload copies start.
  Bytes end_free = 0;
  for (size_t k = 0; k < it.spans.size(); ++k) {
    const ActSpan& sp = it.spans[k];
    if (sp.bwd == i && sp.policy != ActivationPolicy::kRecompute) end_free += sp.bytes;
    if (sp.fwd == i && sp.policy == ActivationPolicy::kOffload) {
      TIERMEM_ASSIGN_OR_RETURN(const uint64_t h, Alloc(TierKind::kHost, sp.bytes, end));
      const uint64_t done = Copy(TierKind::kDevice, TierKind::kHost, sp.bytes, h, tag_);
      TIERMEM_RETURN_IF_ERROR(FreeAt(TierKind::kDevice, sp.bytes, done));
      span_d2h_end_[k] = done;
    }
  }
  if (end_free > 0) TIERMEM_RETURN_IF_ERROR(FreeAt(TierKind::kDevice, end_free, end));

  ++pc_;
  for (const EffAccess* a = it.begin(i); a != it.end(i); ++a) {
    ChunkView& v = view_[a->chunk];
    ChunkTimes& tm = times_[a->chunk];
    tm.last_end = std::max(tm.last_end, end);
    v.last_use = pc_;
    if (a->modifies) {
      tm.writer_end = std::max(tm.writer_end, end);
      if (v.cache == a->tier) {
        v.dirty = true;
        tm.valid = true;
      }
    }
  }
  policy.After(*this, i);
  return OkStatus();
}

StartState SimulatedRun::State() const {
  StartState s;
  s.cache.resize(view_.size());
  s.dirty.resize(view_.size());
  for (ChunkId c = 0; c < view_.size(); ++c) {
    s.cache[c] = view_[c].cache;
    s.dirty[c] = view_[c].dirty;
  }
  return s;
}

PairBytes SimulatedRun::Unclaimed() const {
  PairBytes out{};
  for (const auto& [tag, st] : stats_) {
    for (int a = 0; a < kNumTierKinds; ++a) {
      for (int b = 0; b < kNumTierKinds; ++b) out[a][b] += st.bytes[a][b];
    }
  }
  return out;
}

StatusOr<IterationStats> SimulatedRun::Run(const EffIteration& it, Policy& policy, uint32_t tag) {
  it_ = &it;
  tag_ = tag;
  span_d2h_end_.assign(it.spans.size(), 0);
  span_h2d_end_.assign(it.spans.size(), 0);
  const uint64_t start = stream_t_;
  iter_start_ = start;
  issue_t_ = stream_t_;
  stats_[tag];  // exists even if nothing moves
  TIERMEM_RETURN_IF_ERROR(policy.BeginIteration(*this));
  for (size_t i = 0; i < it.size(); ++i) TIERMEM_RETURN_IF_ERROR(RunMoment(i, policy));
  IterationStats& st = stats_[tag];
  if (cpu_t_ > stream_t_) {
    const uint64_t tail = cpu_t_ - stream_t_;
    st.stall_ns += tail;
    st.stall_by_cause[static_cast<int>(StallCause::kOptimizer)] += tail;
    stream_t_ = cpu_t_;
  }
  st.iteration_ns = stream_t_ - start;
  IterationStats out = st;
  stats_.erase(tag);
  it_ = nullptr;
  return out;
}

}  // namespace tiermem::planners
