// Internal to planners/: how MakePlan ranks its candidate plans (planner.cc) against the bar
// the baseline policies' own moves set.
//
// Each candidate is judged on its modelled steady iteration (the second from the plan's start
// state). The bar is the least of each measure over the baselines' plain moves (baselines.h,
// MimicSchedule, under the recorded placement): bytes into the device, bytes to and from NVMe,
// stall and iteration time. A candidate reaches the bar on a measure
// when it is no higher than that least; reaching it on all of them is "no worse than any
// baseline on any measure", the issue-43 §2 meaning of the best policy. Order:
//   1. more measures reaching the bar first;
//   2. below the bar, the planner's own schedules before a baseline's moves (those are the
//      net that sets the bar, not a schedule to prefer on time alone);
//   3. PlanObjective::kTime: the least score (modelled time), then the fewest objective
//      bytes; kBytes: the fewest objective bytes, then a stall that reaches the bar before
//      one that does not, then the least score;
//   4. otherwise the earlier candidate (callers keep the incumbent on a tie).
// With kBytes (the runtime's objective off CUDA, where copies use the compute's own cores,
// a recompute's compute counted as bytes: ObjectiveBytes) the bar counts the two byte
// measures, and stall decides between candidates of equal bytes: bytes stay first, so an
// eviction-only plan keeps the Belady optimum of bytes (PlannerPropertyTest), and of the
// plans that move it one that stalls no longer than every baseline's moves is taken (what
// `plan: auto`'s decision asks of a plan besides its bytes).
//
// Thread-safety: values and pure functions.
#pragma once

#include <cstdint>

#include "planners/machine.h"
#include "planners/planner.h"
#include "planners/simulated_run.h"

namespace tiermem::planners {

// The measures of one steady iteration that the bar compares.
struct RankMeasures {
  Bytes device_in = 0;  // into the device tier
  Bytes nvme = 0;       // to and from NVMe, either way
  uint64_t stall_ns = 0;
  uint64_t iteration_ns = 0;
};
RankMeasures MeasuresOf(const IterationStats& steady);

// The least of each measure over the baselines' own moves.
class BaselineBar {
 public:
  static constexpr int kNumMeasures = 4;
  void Add(const RankMeasures& baseline);
  bool set() const { return set_; }
  // How many of the measures `m` reaches (no higher than the bar's), of kNumMeasures; with
  // kBytes stall and iteration time count as reached. Without a baseline (not set): all.
  int Reached(const RankMeasures& m, PlanObjective objective) const;
  // Whether `m`'s stall is no higher than the bar's (not set: true).
  bool StallReached(const RankMeasures& m) const;

 private:
  RankMeasures least_{~Bytes{0}, ~Bytes{0}, UINT64_MAX, UINT64_MAX};
  bool set_ = false;
};

// What a candidate is ranked on.
struct RankedCandidate {
  RankMeasures steady;
  uint64_t score_ns = 0;        // modelled time compared (steady iteration; with an earlier
                                // iteration, the mean of the two: planner.cc)
  Bytes objective_bytes = 0;    // ObjectiveBytes
  bool baseline_moves = false;  // a baseline policy's moves (plain or hoisted)
};

// The bytes PlanObjective::kBytes minimizes in `steady`: on a host-mode machine (no device
// budget) the NVMe bytes; else the bytes into the device plus a recompute's compute counted
// as the bytes a host -> device copy moves in that time (on a device whose copies are
// memcpys on the compute's own cores, a recompute costs those cores too).
Bytes ObjectiveBytes(const IterationStats& steady, const MachineModel& machine);

// True when `a` ranks strictly before `b` (the order above).
bool RanksBefore(const RankedCandidate& a, const RankedCandidate& b, const BaselineBar& bar,
                 PlanObjective objective);

}  // namespace tiermem::planners
