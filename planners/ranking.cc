// The candidate ranking of MakePlan (ranking.h).
#include "planners/ranking.h"

#include <algorithm>

namespace tiermem::planners {
namespace {

// Bytes of the copy whose modelled time gives the host -> device rate (the latency
// negligible).
constexpr Bytes kRecomputeProbe = Bytes{1} << 30;

}  // namespace

RankMeasures MeasuresOf(const IterationStats& s) {
  return {.device_in = s.DeviceInBytes(),
          .nvme = s.NvmeBytes(),
          .stall_ns = s.stall_ns,
          .iteration_ns = s.iteration_ns};
}

void BaselineBar::Add(const RankMeasures& b) {
  least_.device_in = std::min(least_.device_in, b.device_in);
  least_.nvme = std::min(least_.nvme, b.nvme);
  least_.stall_ns = std::min(least_.stall_ns, b.stall_ns);
  least_.iteration_ns = std::min(least_.iteration_ns, b.iteration_ns);
  set_ = true;
}

int BaselineBar::Reached(const RankMeasures& m, PlanObjective objective) const {
  if (!set_) return kNumMeasures;
  // kBytes: stall and time count as reached here (StallReached breaks ties of bytes).
  const bool timed = objective == PlanObjective::kTime;
  return (m.device_in <= least_.device_in) + (m.nvme <= least_.nvme) +
         (!timed || m.stall_ns <= least_.stall_ns) +
         (!timed || m.iteration_ns <= least_.iteration_ns);
}

bool BaselineBar::StallReached(const RankMeasures& m) const {
  return !set_ || m.stall_ns <= least_.stall_ns;
}

Bytes ObjectiveBytes(const IterationStats& s, const MachineModel& machine) {
  if (machine.Budget(TierKind::kDevice) == 0) return s.NvmeBytes();
  const double per_ns =
      static_cast<double>(kRecomputeProbe) /
      static_cast<double>(std::max<uint64_t>(
          1, machine.CopyNs(TierKind::kHost, TierKind::kDevice, kRecomputeProbe)));
  return s.DeviceInBytes() + static_cast<Bytes>(per_ns * static_cast<double>(s.recompute_ns));
}

bool RanksBefore(const RankedCandidate& a, const RankedCandidate& b, const BaselineBar& bar,
                 PlanObjective objective) {
  const int ra = bar.Reached(a.steady, objective), rb = bar.Reached(b.steady, objective);
  if (ra != rb) return ra > rb;
  if (ra < BaselineBar::kNumMeasures && a.baseline_moves != b.baseline_moves) {
    return !a.baseline_moves;
  }
  if (objective == PlanObjective::kBytes) {
    if (a.objective_bytes != b.objective_bytes) return a.objective_bytes < b.objective_bytes;
    const bool sa = bar.StallReached(a.steady), sb = bar.StallReached(b.steady);
    if (sa != sb) return sa;
    return a.score_ns < b.score_ns;
  }
  if (a.score_ns != b.score_ns) return a.score_ns < b.score_ns;
  return a.objective_bytes < b.objective_bytes;
}

}  // namespace tiermem::planners
