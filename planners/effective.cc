#include "planners/effective.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <vector>

namespace tiermem::planners {

std::string_view ActivationPolicyName(ActivationPolicy p) {
  switch (p) {
    case ActivationPolicy::kKeep:
      return "keep";
    case ActivationPolicy::kOffload:
      return "offload";
    case ActivationPolicy::kRecompute:
      return "recompute";
  }
  return "?";
}

uint32_t StepGroup(const Trace& trace, const TraceIteration& iter, const Moment& m) {
  if (m.num_accesses == 0) return kNoGroup;
  const uint32_t g = trace.chunks[iter.accesses[m.first_access].chunk].group;
  for (uint32_t a = 1; a < m.num_accesses; ++a) {
    if (trace.chunks[iter.accesses[m.first_access + a].chunk].group != g) return kNoGroup;
  }
  return g;
}

namespace {

// Per raw moment of the trace iteration: what the placement makes of its optimizer steps.
struct StepPlacement {
  std::vector<TierKind> step_tier;  // where a step runs (kNone: not a step, or as recorded)
  std::vector<uint64_t> compute;    // compute ns, re-timed for a step that moved
  std::vector<bool> async;          // an overlapped CPU step (runs beside the stream)
  std::vector<uint32_t> group;      // the group a step updates (kNoGroup: none or several)
};

// A saved-activation span on raw moment indices: a unit's forward and its backward.
struct RawSpan {
  uint32_t unit, fwd, bwd;
  Bytes bytes;
};

// Where each optimizer step runs under `placement`, and its compute time there: re-timed at
// the machine's rate when it moves, scaled when the machine's rate on its recorded tier
// differs from the trace's, kept where it ran when it cannot be re-timed.
StepPlacement PlaceSteps(const Trace& trace, const TraceIteration& iter, const Placement& placement,
                         const MachineModel& machine) {
  const size_t n = iter.moments.size();
  StepPlacement sp{std::vector<TierKind>(n, TierKind::kNone), std::vector<uint64_t>(n),
                   std::vector<bool>(n, false), std::vector<uint32_t>(n, kNoGroup)};
  const auto rate_on = [](TierKind tier, double cpu, double dev) {
    return tier == TierKind::kDevice ? dev : cpu;
  };
  for (size_t j = 0; j < n; ++j) {
    const Moment& m = iter.moments[j];
    sp.compute[j] = m.compute_ns;
    if (m.kind != MomentKind::kOptimizerStep) continue;
    const uint32_t g = StepGroup(trace, iter, m);
    sp.group[j] = g;
    if (g == kNoGroup || g >= placement.groups.size()) continue;
    const GroupChoice& gc = placement.groups[g];
    if (gc.update_on == TierKind::kNone) continue;
    const TierKind recorded = iter.accesses[m.first_access].tier;
    TierKind t = gc.update_on;
    const double rate = rate_on(t, machine.cpu_optim_elems_per_s, machine.device_optim_elems_per_s);
    if (t != recorded) {
      if (rate <= 0 || m.work_elems == 0) {
        t = recorded;  // cannot be re-timed: stays where it ran
      } else {
        sp.compute[j] =
            static_cast<uint64_t>(std::ceil(static_cast<double>(m.work_elems) * 1e9 / rate));
      }
    } else {
      // Where it ran: as measured, scaled if the model's kernel rate differs from the trace's.
      const double traced =
          rate_on(t, trace.rates.cpu_optim_elems_per_s, trace.rates.device_optim_elems_per_s);
      if (rate > 0 && traced > 0 && rate != traced) {
        sp.compute[j] =
            static_cast<uint64_t>(std::ceil(static_cast<double>(m.compute_ns) * traced / rate));
      }
    }
    sp.step_tier[j] = t;
    sp.async[j] = t == TierKind::kHost && gc.overlap;
  }
  return sp;
}

// The effective order of the raw moments: an overlapped step goes right after the last earlier
// moment touching its chunks (the steps moved after one moment in raw order, and recursively
// those moved after them); the others keep their order.
std::vector<uint32_t> EffectiveOrder(const Trace& trace, const TraceIteration& iter,
                                     const std::vector<bool>& async) {
  const size_t n = iter.moments.size();
  std::vector<int64_t> trigger(n, -2);  // -2: not moved
  std::vector<int64_t> last_touch(trace.chunks.size(), -1);
  for (size_t j = 0; j < n; ++j) {
    const Moment& m = iter.moments[j];
    if (async[j]) {
      int64_t t = -1;
      for (uint32_t a = 0; a < m.num_accesses; ++a) {
        t = std::max(t, last_touch[iter.accesses[m.first_access + a].chunk]);
      }
      trigger[j] = t;
    }
    for (uint32_t a = 0; a < m.num_accesses; ++a) {
      last_touch[iter.accesses[m.first_access + a].chunk] = static_cast<int64_t>(j);
    }
  }
  std::vector<std::vector<uint32_t>> after(n + 1);  // after[t+1]: moved moments with trigger t
  for (size_t j = 0; j < n; ++j) {
    if (trigger[j] >= -1) after[trigger[j] + 1].push_back(static_cast<uint32_t>(j));
  }
  std::vector<uint32_t> order;
  order.reserve(n);
  std::vector<uint32_t> stack;
  auto emit_after = [&](int64_t t) {
    // Emits the moments moved after t, and recursively those moved after them, in raw order.
    for (auto it = after[t + 1].rbegin(); it != after[t + 1].rend(); ++it) stack.push_back(*it);
    while (!stack.empty()) {
      const uint32_t j = stack.back();
      stack.pop_back();
      order.push_back(j);
      for (auto it = after[j + 1].rbegin(); it != after[j + 1].rend(); ++it) stack.push_back(*it);
    }
  };
  emit_after(-1);
  for (size_t j = 0; j < n; ++j) {
    if (trigger[j] >= -1) continue;
    order.push_back(static_cast<uint32_t>(j));
    emit_after(static_cast<int64_t>(j));
  }
  return order;
}

// Saved-activation spans: each forward that saved bytes, paired with its unit's next backward.
std::vector<RawSpan> SavedSpans(const TraceIteration& iter) {
  std::vector<RawSpan> spans;
  std::map<uint32_t, std::vector<uint32_t>> open;  // unit -> forwards awaiting a backward
  for (size_t j = 0; j < iter.moments.size(); ++j) {
    const Moment& m = iter.moments[j];
    if (m.kind == MomentKind::kPreForward && m.saved_bytes > 0) {
      open[m.unit].push_back(static_cast<uint32_t>(j));
    } else if (m.kind == MomentKind::kPreBackward && m.unit != kNoUnit) {
      auto it = open.find(m.unit);
      if (it == open.end()) continue;
      for (uint32_t f : it->second) {
        spans.push_back({m.unit, f, static_cast<uint32_t>(j), iter.moments[f].saved_bytes});
      }
      open.erase(it);
    }
  }
  return spans;
}

// Per raw moment: the activation bytes that are not saved spans live under keep (temporaries).
std::vector<Bytes> Temporaries(const TraceIteration& iter, const std::vector<RawSpan>& spans) {
  const size_t n = iter.moments.size();
  std::vector<int64_t> keep_live(n + 1, 0);  // difference array of saved bytes live under keep
  for (const RawSpan& s : spans) {
    keep_live[s.fwd] += static_cast<int64_t>(s.bytes);
    keep_live[s.bwd + 1] -= static_cast<int64_t>(s.bytes);
  }
  std::vector<Bytes> temp(n);
  int64_t live = 0;
  for (size_t j = 0; j < n; ++j) {
    live += keep_live[j];
    const Bytes act = iter.moments[j].activation_bytes;
    temp[j] = act > static_cast<Bytes>(live) ? act - static_cast<Bytes>(live) : 0;
  }
  return temp;
}

// The effective moments in `order`, their accesses (a chunk's repeated accesses in one moment
// merged; a step's on the tier it runs on).
void EmitMoments(const Trace& trace, const TraceIteration& iter, const StepPlacement& sp,
                 const std::vector<uint32_t>& order, const std::vector<Bytes>& temp,
                 EffIteration* out) {
  const size_t n = iter.moments.size();
  out->moments.resize(n);
  out->accesses.reserve(iter.accesses.size());
  std::vector<int64_t> at(trace.chunks.size(), -1);  // index in out->accesses this moment
  for (size_t e = 0; e < n; ++e) {
    const uint32_t j = order[e];
    const Moment& m = iter.moments[j];
    EffMoment& em = out->moments[e];
    em.trace_moment = j;
    em.kind = m.kind;
    em.unit = m.unit;
    em.group = sp.group[j];
    em.label = m.label;
    em.compute_ns = sp.compute[j];
    em.async = sp.async[j];
    em.temp_bytes = temp[j];
    em.first = static_cast<uint32_t>(out->accesses.size());
    for (uint32_t a = 0; a < m.num_accesses; ++a) {
      const TraceAccess& ta = iter.accesses[m.first_access + a];
      if (at[ta.chunk] >= static_cast<int64_t>(em.first)) {  // seen in this moment: merge
        out->accesses[static_cast<size_t>(at[ta.chunk])].modifies |= Writes(ta.mode);
        continue;
      }
      at[ta.chunk] = static_cast<int64_t>(out->accesses.size());
      const TierKind tier = sp.step_tier[j] != TierKind::kNone ? sp.step_tier[j] : ta.tier;
      out->accesses.push_back(EffAccess{ta.chunk, tier, Reads(ta.mode), Writes(ta.mode)});
    }
    em.count = static_cast<uint32_t>(out->accesses.size() - em.first);
  }
}

// The spans under the placement's activation policies, on effective indices: the device and
// host bytes they hold per moment (beside the temporaries) and the recompute they cost.
void PlaceSpans(const std::vector<RawSpan>& raw_spans, const std::vector<uint32_t>& order,
                const std::vector<uint64_t>& compute, const Placement& placement,
                EffIteration* out) {
  const size_t n = out->moments.size();
  std::vector<uint32_t> eff_of(n);
  for (size_t e = 0; e < n; ++e) eff_of[order[e]] = static_cast<uint32_t>(e);
  out->dev_extra.assign(n, 0);
  out->host_extra.assign(n, 0);
  for (size_t e = 0; e < n; ++e) out->dev_extra[e] = out->moments[e].temp_bytes;
  for (const RawSpan& rs : raw_spans) {
    ActSpan s;
    s.unit = rs.unit;
    s.fwd = eff_of[rs.fwd];
    s.bwd = eff_of[rs.bwd];
    s.bytes = rs.bytes;
    auto it = placement.units.find(rs.unit);
    if (it != placement.units.end()) s.policy = it->second.policy;
    if (s.policy == ActivationPolicy::kOffload) {
      // Lead 0: fetched at the backward moment's own start (the least device room; the
      // backward waits for the copy).
      const uint32_t lead = it->second.prefetch_lead;
      s.prefetch_at = s.bwd > lead ? s.bwd - lead : 0;
      s.prefetch_at = std::max(s.prefetch_at, s.fwd + 1);
      if (s.prefetch_at > s.bwd) s.policy = ActivationPolicy::kKeep;  // f + 1 > b: nothing to gain
    }
    switch (s.policy) {
      case ActivationPolicy::kKeep:
        for (uint32_t e = s.fwd; e <= s.bwd; ++e) out->dev_extra[e] += s.bytes;
        break;
      case ActivationPolicy::kOffload:
        out->dev_extra[s.fwd] += s.bytes;
        for (uint32_t e = s.prefetch_at; e <= s.bwd; ++e) out->dev_extra[e] += s.bytes;
        for (uint32_t e = s.fwd; e <= s.prefetch_at; ++e) out->host_extra[e] += s.bytes;
        break;
      case ActivationPolicy::kRecompute:
        out->dev_extra[s.fwd] += s.bytes;
        out->dev_extra[s.bwd] += s.bytes;
        out->moments[s.bwd].compute_ns += compute[rs.fwd];
        out->moments[s.bwd].recompute_ns += compute[rs.fwd];
        break;
    }
    out->spans.push_back(s);
  }
}

}  // namespace

StatusOr<EffIteration> BuildEffective(const Trace& trace, const TraceIteration& iter,
                                      const Placement& placement, const MachineModel& machine) {
  if (placement.home.size() != trace.chunks.size()) {
    return InvalidArgumentError("placement: " + std::to_string(placement.home.size()) +
                                " homes for " + std::to_string(trace.chunks.size()) + " chunks");
  }
  const StepPlacement sp = PlaceSteps(trace, iter, placement, machine);
  const std::vector<uint32_t> order = EffectiveOrder(trace, iter, sp.async);
  const std::vector<RawSpan> spans = SavedSpans(iter);
  EffIteration out;
  EmitMoments(trace, iter, sp, order, Temporaries(iter, spans), &out);
  PlaceSpans(spans, order, sp.compute, placement, &out);
  return out;
}

bool SameMoment(const EffIteration& a, size_t i, const EffIteration& b, size_t j) {
  const EffMoment& x = a.moments[i];
  const EffMoment& y = b.moments[j];
  if (x.kind != y.kind || x.label != y.label || x.count != y.count || x.unit != y.unit) {
    return false;
  }
  const bool step = x.kind == MomentKind::kOptimizerStep;
  for (uint32_t k = 0; k < x.count; ++k) {
    const EffAccess& p = a.accesses[x.first + k];
    bool found = false;
    for (uint32_t l = 0; l < y.count; ++l) {
      const EffAccess& q = b.accesses[y.first + l];
      if (q.chunk != p.chunk) continue;
      found = q.needs_content == p.needs_content && q.modifies == p.modifies &&
              (step || q.tier == p.tier);
      break;
    }
    if (!found) return false;
  }
  return true;
}

}  // namespace tiermem::planners
