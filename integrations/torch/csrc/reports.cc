// The session's reports as Python dicts (reports.h), and the timeline's readers:
// read_timeline(path) (every event, in time order) and timeline_report(path).
#include "integrations/torch/csrc/reports.h"

#include <string>

#include "base/timeline_reader.h"
#include "integrations/torch/csrc/bindings.h"
#include "integrations/torch/csrc/errors.h"
#include "kernels/cpu/optim.h"

namespace py = pybind11;

namespace tiermem::torch_ext {
namespace {

// (ts_ns, type, tier, tier2, bytes, chunk, category, flags, label, id) in time order.
py::list ReadTimeline(const std::string& path) {
  py::list out;
  Check(prof::ForEachOrdered(path, [&](const TimelineEntry& t) {
    const Event& e = t.event;
    out.append(py::make_tuple(e.ts_ns, static_cast<int>(e.type), static_cast<int>(e.tier),
                              static_cast<int>(e.tier2), e.bytes, e.chunk,
                              static_cast<int>(e.category), static_cast<int>(e.flags),
                              std::string(t.label), e.id));
  }));
  return out;
}

// Acquires that waited for bytes from below (chunks/engine.h): in all and by phase.
py::dict AcquireWaitsDict(const chunks::EngineStats& s) {
  auto waits = [](const chunks::AcquireWaits& w) {
    py::dict o;
    o["misses"] = w.misses;
    o["miss_bytes"] = w.miss_bytes;
    o["late"] = w.late;
    o["late_bytes"] = w.late_bytes;
    return o;
  };
  py::dict all = waits(s.waits), by_phase;
  for (const auto& [label, w] : s.waits_by_phase) {
    if (w.misses + w.late > 0) by_phase[py::str(label.empty() ? "none" : label)] = waits(w);
  }
  all["by_phase"] = by_phase;
  return all;
}

}  // namespace

py::dict ReportDict(const prof::Report& r) {
  py::dict d, peak, budget, moved, stalls, categories;
  for (int k = 0; k < kNumTierKinds; ++k) {
    const std::string n(TierKindName(static_cast<TierKind>(k)));
    peak[py::str(n)] = r.tiers[k].peak.bytes;
    budget[py::str(n)] = r.tiers[k].budget_bytes;
    py::dict per;  // peak bytes per category on this tier
    for (int c = 0; c < kNumCategories; ++c) {
      per[py::str(std::string(CategoryName(static_cast<Category>(c))))] =
          r.tiers[k].categories[c].peak.bytes;
    }
    categories[py::str(n)] = per;
  }
  for (const prof::MoveStats& m : r.moves) {
    moved[py::str(std::string(TierKindName(m.src)) + "->" + std::string(TierKindName(m.dst)))] =
        m.bytes;
  }
  for (const prof::StallStats& s : r.stalls) stalls[py::str(s.cause)] = s.ns;
  d["peak"] = peak;
  d["budget"] = budget;
  d["category_peak"] = categories;
  d["copied"] = moved;
  bool over = false;
  for (int k = 0; k < kNumTierKinds; ++k) {
    if (r.tiers[k].budget_bytes != 0 && r.tiers[k].peak.bytes > r.tiers[k].max_budget_bytes) {
      over = true;
    }
  }
  d["over_budget"] = over;
  d["stall_ns"] = r.stall_ns;
  d["stalls"] = r.stall_count;
  d["stall_causes"] = stalls;
  d["events"] = r.events;
  d["iterations"] = r.iterations;
  d["step_mean_ns"] = r.step_mean_ns;
  py::dict coll;  // sharded sessions: {op: (count, bytes, ns)}
  for (const prof::CollectiveStats& c : r.collectives) {
    coll[py::str(c.op)] = py::make_tuple(c.count, c.bytes, c.ns);
  }
  d["collectives"] = coll;
  py::dict io;  // per tier: bytes copied out of / into it and the union of those copies' times
  for (int k = 0; k < kNumTierKinds; ++k) {
    const prof::IoStats& x = r.io[k];
    py::dict t;
    t["read_bytes"] = x.read_bytes;
    t["read_active_ns"] = x.read_active_ns;
    t["write_bytes"] = x.write_bytes;
    t["write_active_ns"] = x.write_active_ns;
    t["active_ns"] = x.active_ns;
    py::dict by_category;
    for (int c = 0; c < kNumCategories; ++c) {
      by_category[py::str(std::string(CategoryName(static_cast<Category>(c))))] =
          x.category_bytes[c];
    }
    t["category_bytes"] = by_category;
    io[py::str(std::string(TierKindName(static_cast<TierKind>(k))))] = t;
  }
  d["io"] = io;
  return d;
}

py::dict StatsDict(const session::Session& session) {
  const chunks::EngineStats s = Check(session.Stats());
  py::dict d, tiers, moved;
  for (int k = 0; k < kNumTierKinds; ++k) {
    py::dict t;
    t["capacity"] = s.tiers[k].capacity;
    t["used"] = s.tiers[k].used;
    t["peak"] = s.tiers[k].peak;
    t["host_overhead"] = s.tiers[k].host_overhead;
    tiers[py::str(std::string(TierKindName(static_cast<TierKind>(k))))] = t;
  }
  for (int a = 0; a < kNumTierKinds; ++a) {
    for (int b = 0; b < kNumTierKinds; ++b) {
      if (s.bytes_moved[a][b] == 0) continue;
      moved[py::str(std::string(TierKindName(static_cast<TierKind>(a))) + "->" +
                    std::string(TierKindName(static_cast<TierKind>(b))))] = s.bytes_moved[a][b];
    }
  }
  d["tiers"] = tiers;
  // Host memory no budget counts (runtime.py adds the saved activations).
  py::dict outside;
  outside["runtime_bytes"] = Check(session.RuntimeHostBytes());
  d["outside_budget"] = outside;
  d["bytes_moved"] = moved;
  d["stall_ns"] = s.stall_ns;
  d["stalls"] = s.stalls;
  d["evictions"] = s.evictions;
  d["clean_evictions"] = s.clean_evictions;
  d["prefetches"] = s.prefetches;
  d["hint_prefetches"] = s.hint_prefetches;
  d["write_behinds"] = s.write_behinds;
  d["acquires"] = s.acquires;
  d["iterations"] = s.iterations;
  d["diverged"] = s.diverged;
  d["resynced"] = s.resynced;
  d["device_waits"] = s.device_waits;
  d["acquire_waits"] = AcquireWaitsDict(s);
  // Where each chunk group's optimizer steps (decided at the first applied step).
  py::dict opt;
  opt["placed"] = session.optimizer().placed();
  py::list on_device;
  for (size_t g = 0; g < session.layout().num_groups(); ++g) {
    if (session.optimizer().OnDevice(g)) on_device.append(g);
  }
  opt["device_groups"] = on_device;
  // The optimizer-state format (optimizer.state_dtype): runtime/session.h's StateTraffic.
  const session::StateTraffic traffic = session.StateTrafficOf(s);
  opt["state_dtype"] =
      std::string(kernels::StateDTypeName(session.config().optimizer_state.format.dtype));
  opt["state_bytes"] = traffic.state_bytes;
  opt["state_bytes_fp32"] = traffic.state_bytes_fp32;
  opt["nvme_state_bytes"] = traffic.nvme_state_bytes;
  opt["nvme_bytes_saved"] = traffic.nvme_bytes_saved;
  d["optimizer"] = opt;
  // Plans (plan: auto): the runner's counters and the engine's planned actions.
  const session::PlanStatus ps = session.plans().plan_status();
  py::dict plan;
  plan["active"] = ps.active;
  plan["plans"] = ps.runner.plans;
  plan["planned_iterations"] = ps.runner.planned_iterations;
  plan["followed_iterations"] = ps.runner.followed_iterations;
  plan["divergences"] = ps.runner.divergences;
  plan["last_divergence"] = ps.runner.last_divergence;
  plan["error"] = ps.error;
  plan["declined"] = ps.declined;
  // plan: auto's bar on the plan it judged (runtime/plan_runner.h, PlanDecision).
  const session::PlanDecision& dec = ps.decision;
  py::dict decision;
  decision["judged"] = dec.judged;
  decision["adopted"] = dec.adopted;
  decision["reason"] = dec.reason;
  decision["plan_bytes"] = dec.plan_bytes;
  decision["plan_stall_ns"] = dec.plan_stall_ns;
  decision["engine_simulated"] = dec.engine_simulated;
  decision["engine_bytes"] = dec.engine_bytes;
  decision["engine_stall_ns"] = dec.engine_stall_ns;
  decision["measured"] = dec.measured;
  decision["engine_measured_bytes"] = dec.engine_measured_bytes;
  plan["decision"] = decision;
  plan["actions"] = ps.actions;
  plan["predicted_iteration_ns"] = ps.estimate.steady_iteration_ns;
  plan["predicted_stall_ns"] = ps.estimate.steady_stall_ns;
  plan["predicted_device_in_bytes"] = ps.estimate.steady_device_in_bytes;
  plan["predicted_nvme_bytes"] = ps.estimate.steady_nvme_bytes;
  plan["prefetches"] = s.plan_prefetches;
  plan["evictions"] = s.plan_evictions;
  plan["skipped"] = s.plan_skipped;
  plan["deferred"] = s.plan_deferred;
  d["plan"] = plan;
  return d;
}

py::dict SpeculationDict(const session::Session& s) {
  const auto& st = s.speculation_stats();
  py::dict d;
  d["speculated"] = st.speculated;
  d["committed"] = st.committed;
  d["dropped"] = st.dropped;
  d["no_room"] = st.no_room;
  d["speculated_host"] = st.speculated_host;
  d["speculated_nvme"] = st.speculated_nvme;
  d["nvme_bytes_in_flight"] = st.nvme_bytes_in_flight;
  d["nvme_bytes_peak"] = st.nvme_bytes_peak;
  d["prefetched"] = st.prefetched;
  return d;
}

void BindReports(py::module_& m) {
  m.def("read_timeline", &ReadTimeline);
  m.def("timeline_report",
        [](const std::string& path) { return ReportDict(Check(prof::AnalyzeFile(path))); });
}

}  // namespace tiermem::torch_ext
