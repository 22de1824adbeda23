// Divergence: whether an iteration follows the plan it was planned by (planner.h), and where
// and how it left it. The plan runner (runtime/plan_runner.h) feeds the incremental checker
// on its hot path; the simulator's plan policy (schedule.h) reports a DivergenceKind;
// FindDivergence compares a recorded iteration offline.
//
// Thread-safety: FindDivergence is a pure function over values; a DivergenceChecker is
// externally synchronized. Ownership: the checker borrows its plan (which must outlive it).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "planners/planner.h"
#include "planners/trace.h"

namespace tiermem::planners {

enum class DivergenceKind : uint8_t {
  kNone = 0,
  kMoment = 1,   // a different moment (label or kind) than planned: control flow changed
  kAccess = 2,   // the planned moment, but other chunks or modes (e.g. MoE routing)
  kShorter = 3,  // the iteration ended before the planned moments did
  kLonger = 4,   // more moments than planned
};
std::string_view DivergenceKindName(DivergenceKind k);

struct Divergence {
  DivergenceKind kind = DivergenceKind::kNone;
  uint32_t observed_moment = 0;  // index in the observed iteration where it shows
  uint32_t planned_moment = 0;   // the planned moment it was compared with
  std::string reason;            // e.g. "moment 12: expected fwd:blocks.3, got fwd:blocks.4"
  bool diverged() const { return kind != DivergenceKind::kNone; }
};

// Compares an observed iteration (recorded while executing `plan`, or the trace iteration of
// a later step) with the plan. Every moment but the optimizer sub-steps is compared in order,
// with its accesses' tiers; a sub-step is matched by label with a planned one not seen yet,
// without tiers (steps may run on the CPU lane in any order and interleaving with the
// backward, and on the tier the plan put them). A planned sub-step that does not come is not
// a divergence (a deferred update that ran unannounced, a group without gradients).
// Expert classes (Plan::expert_class): accesses of expert-set members are the routing's
// choice, not the plan's — neither an unplanned member nor a planned member that does not
// come is a divergence; an optimizer step the plan does not have is none either when its
// first access is of a member (the step of an expert the routing chose). Only the dense
// accesses are checked.
Divergence FindDivergence(const Plan& plan, const Trace& trace, const TraceIteration& observed);

// The same check, incremental, for the runtime's hot path: feed moments and accesses as they
// happen; each call returns false once the iteration diverged (and keeps returning false until
// Reset). An unexpected chunk is detected at its access; a missing one at the moment's end.
// Externally synchronized; `plan` must outlive the checker.
class DivergenceChecker {
 public:
  // `check_modes` false: a planned access counts as followed whatever its mode (a runtime that
  // learns a chunk was modified only at its release, possibly moments later, checks chunks
  // and tiers only).
  explicit DivergenceChecker(const Plan* plan, bool check_modes = true);
  void Reset();  // start of an iteration
  bool OnMoment(std::string_view label, MomentKind kind);
  // `member`: the caller knows `chunk` to be an expert-set member although the plan does not
  // (an expert the recording never saw routed); treated as the plan's members are.
  bool OnAccess(ChunkId chunk, AccessMode mode, TierKind tier, bool member = false);
  bool EndIteration();
  const Divergence& divergence() const { return div_; }
  // The planned moment being observed (its index in Plan::moments), -1 before the first.
  int64_t current() const { return cur_; }

 private:
  bool CloseMoment();
  bool Fail(DivergenceKind kind, std::string reason);
  bool IsMember(ChunkId c) const {
    return c < plan_->expert_class.size() && plan_->expert_class[c] != kNoExpertSet;
  }
  // cur_ of a step the plan does not have, decided by its first access (a member: a class
  // step, whose accesses are not checked; a dense chunk: the reason in pending_).
  static constexpr int64_t kPendingStep = -2;
  static constexpr int64_t kClassStep = -3;
  std::string pending_;
  DivergenceKind pending_kind_ = DivergenceKind::kNone;
  const Plan* plan_;
  bool check_modes_ = true;
  std::vector<uint32_t> stream_, steps_;  // planned moments of each subsequence
  std::vector<bool> step_seen_;           // per entry of steps_
  size_t next_stream_ = 0, next_step_ = 0;
  int64_t cur_ = -1;                               // planned moment being observed
  uint32_t observed_ = 0;                          // observed moments so far
  std::vector<std::pair<ChunkId, uint8_t>> seen_;  // (chunk, flags) of the current moment
  Divergence div_;
};

}  // namespace tiermem::planners
