// The baseline schedule policies the simulator compares the planner against (simulator.h
// describes each), and MimicSchedule, which expresses one of them as a plan's actions so the
// planner can score it as a candidate: a plan is then never worse, in the simulator, than the
// baselines it was offered.
//
// Thread-safety: policies are externally synchronized (one simulated run each); MimicSchedule
// is a pure function of its inputs.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>

#include "planners/effective.h"
#include "planners/planner.h"
#include "planners/schedule.h"
#include "planners/simulated_run.h"

namespace tiermem::planners {

enum class BaselineKind : uint8_t {
  kLru = 0,
  kPatrickStar = 1,
  kDeepSpeed = 2,
  kEngine = 3,
};
inline constexpr int kNumBaselines = 4;
std::string_view BaselineName(BaselineKind k);  // "lru", "patrickstar", "deepspeed", "engine"

// EngineLookahead (how far the engine policy looks ahead) is declared in planner.h, whose
// PlanOptions carry it.
std::string_view EngineLookaheadName(EngineLookahead l);  // "depth", "room"
StatusOr<EngineLookahead> ParseEngineLookahead(std::string_view name);

struct BaselineParams {
  uint32_t engine_prefetch_depth = 4;  // acquires of lookahead (EngineConfig default)
  EngineLookahead engine_lookahead = EngineLookahead::kDepth;  // (EngineConfig default)
  Bytes deepspeed_bucket_bytes = 0;                            // 0: 4 x the trace's largest chunk
};

// A baseline policy. `recorded` is the previous iteration under the recorded placement (the
// order the following policies follow; ignored by lru); it must outlive the policy.
class BaselinePolicy : public Policy {
 public:
  // True when the iteration left the order the policy follows (always false for lru).
  virtual bool diverged() const { return false; }
};
std::unique_ptr<BaselinePolicy> MakeBaselinePolicy(BaselineKind kind, const EffIteration* recorded,
                                                   const BaselineParams& params,
                                                   Bytes max_chunk_bytes);

// The moves baseline `kind` makes over `in.eff` from `in.start` (following `in.eff`'s own order
// as the previous iteration's), as plan actions per moment: evictions first, then fetches in
// issue order, each fetch's need moment the moment that next accesses the chunk on its tier.
// `hoist`: each copying fetch is issued as early as the room allows in program order (after
// the chunk's previous access and eviction, in issue order per tier): the same moves and
// bytes, the copies started sooner. Uses in.trace, in.eff, in.homes, in.start, in.machine and
// the budgets. A baseline that cannot run the iteration under the budgets: kResourceExhausted.
StatusOr<Schedule> MimicSchedule(const ScheduleInput& in, BaselineKind kind,
                                 const BaselineParams& params, bool hoist = false);

// Belady's demand moves over `in.eff` from `in.start` (BeladyKey over the iteration and a copy
// of it: the planner's demand pass, without MakeSchedule's early leaving of chunks dead on a
// tier), as MimicSchedule makes a schedule of a baseline's moves (`hoist` likewise). On the
// device tier its fetches are the Belady optimum; a chunk dead on one tier stays cached there
// until its room is needed, so a host copy the device reads next moves host -> device instead
// of going home to NVMe and coming back.
StatusOr<Schedule> BeladyMovesSchedule(const ScheduleInput& in, bool hoist = false);

}  // namespace tiermem::planners
