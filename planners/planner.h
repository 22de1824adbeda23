// The planner: a pure, deterministic function (trace, machine model) -> plan.
//
// A plan is for one iteration shaped like the trace iteration it was made from. It holds
//   - placement: each chunk's home (host, or NVMe when DRAM is short: the least accessed
//     chunks first, optimizer state before grads before params); per chunk group where its
//     optimizer step runs (device when leftover HBM allows and the modelled time is lower,
//     else CPU) and whether a CPU step overlaps the backward; per unit what happens to its
//     saved activations (keep on the device / offload to host and fetch back before its
//     backward / recompute in the backward);
//   - the expected moments in execution order (an overlapped step right after the moment that
//     completes its grads) with their accesses on the planned tiers: what the runtime checks
//     it follows (divergence.h: FindDivergence, DivergenceChecker);
//   - per moment, the actions to issue at its start, in order: evictions (a dirty copy is
//     written back to its home asynchronously; the room is reusable when that copy ends),
//     then prefetches in the order they are needed, then activation fetch-backs.
//
// Expert classes (a trace with expert sets: MoE layers whose routing picks experts at run
// time). The members of each (expert set, kind) class are planned as *slots*: the recorded
// members stand for "the j-th expert the routing picks", the schedule reserves their room
// and times their moves, and the executor binds each slot to the expert actually picked
// (expert_slots.h). Dense chunks are scheduled exactly. A routing other than the recorded
// one is not a divergence; it changes which chunks fill the slots, and a prefetch for a slot
// whose expert is not chosen yet is left to the fetch at its use. The groups of members are
// volatile (their optimizer steps stay where they ran).
//
// How the chunk schedule is made (per tier, for the device and for NVMe-homed chunks cached
// in DRAM): a demand pass evicts by Belady on the extended horizon (this iteration followed
// by a predicted copy of it) — chunks dead on the tier first (never read there again before
// leaving it; clean ones, then dirty ones whose write-back is due anyway, then the rest),
// then the farthest next read — so the bytes fetched are the Belady optimum for the
// sequence (exact for equal-sized chunks, which a chunk layout gives per kind). Then each
// victim leaves right after its last use, chunks dead on the tier leave right after their
// last use (a grad chunk's write-back overlaps the rest of the backward), and each fetch is
// hoisted to the earliest moment that the budget allows in every moment up to its use, in
// need order per tier (so FIFO copy lanes serve them in need order); fetches for the next
// iteration's first moments are hoisted into this one when room allows. Placement choices
// (activation policy, optimizer placement, overlap) are compared by executing each candidate
// plan in the simulator's SimulatedRun and keeping the lowest modelled iteration time. The
// baseline policies' own moves (baselines.h) are candidates too, plain and with their
// evictions early and fetches hoisted; a candidate no worse than every plain baseline one in
// bytes, stall and time wins over any that is (PlanOptions::mimic_baselines).
//
// Thread-safety: pure functions over values. Determinism: no clock, no randomness, no
// unordered iteration; the same inputs give a byte-identical EncodePlan().
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "planners/effective.h"
#include "planners/machine.h"
#include "planners/simulated_run.h"
#include "planners/trace.h"

namespace tiermem::planners {

inline constexpr uint32_t kPlanVersion = 2;  // 2: expert classes

// Append-only: the numeric values are part of EncodePlan.
enum class ActionKind : uint8_t {
  kEvict = 0,            // drop the copy of `chunk` on `tier` (write back to home if dirty)
  kPrefetch = 1,         // bring `chunk` to `tier` (copy = false: allocate only)
  kFetchActivation = 2,  // fetch `unit`'s offloaded activations back to the device
};
std::string_view ActionKindName(ActionKind k);

struct PlanAction {
  ActionKind kind = ActionKind::kPrefetch;
  TierKind tier = TierKind::kDevice;
  bool copy = true;
  ChunkId chunk = kNoChunk;  // kEvict, kPrefetch
  uint32_t unit = kNoUnit;   // kFetchActivation
  // kPrefetch / kFetchActivation: the planned moment that needs it; >= moments.size() means
  // moment (need_moment - moments.size()) of the next iteration.
  uint32_t need_moment = 0;
};

struct PlannedMoment {
  std::string label;
  MomentKind kind = MomentKind::kOther;
  uint32_t unit = kNoUnit;
  uint32_t trace_moment = 0;  // index in the trace iteration the plan was made from
  bool async = false;         // CPU optimizer step overlapped with the device stream
  uint64_t compute_ns = 0;    // modelled
  uint32_t first_access = 0, num_accesses = 0;  // into Plan::accesses (planned tiers)
  uint32_t first_action = 0, num_actions = 0;   // into Plan::actions
};

struct GroupPlan {
  uint32_t group = 0;
  TierKind update_on = TierKind::kHost;
  bool overlap = false;
};

struct UnitPlan {
  uint32_t unit = 0;
  ActivationPolicy policy = ActivationPolicy::kKeep;
  uint32_t prefetch_lead = 1;
  Bytes saved_bytes = 0;  // per iteration, over the unit's spans
};

// What the simulated run predicts for the plan on one iteration from the start state it was made
// for, and for the iteration after it planned the same way (the steady state: candidates are
// compared on it, so a one-time move into a placement does not decide against it).
struct PlanEstimate {
  uint64_t iteration_ns = 0, compute_ns = 0, stall_ns = 0;
  Bytes device_in_bytes = 0;
  PairBytes bytes{};
  std::array<Bytes, kNumTierKinds> peak{};
  uint64_t steady_iteration_ns = 0, steady_stall_ns = 0;
  Bytes steady_device_in_bytes = 0;
  Bytes steady_nvme_bytes = 0;  // to and from NVMe, either way, in the steady iteration
};

// How far the engine policy looks ahead (chunks::Lookahead, EngineConfig::lookahead).
enum class EngineLookahead : uint8_t {
  kDepth = 0,  // the next `engine_prefetch_depth` acquires of the iteration, evicting only clean
               // chunks used later
  kRoom = 1,   // host acquires as far as host room can be made, one lap of the order (into
               // the next iteration); device acquires `engine_prefetch_depth` ahead
};

// A baseline policy's own moves (baselines.h: MimicSchedule, not hoisted) under the recorded
// placement, as the planner scored them in their steady iteration: the bar of
// PlanOptions::mimic_baselines. Descriptive (not encoded).
struct BaselineEstimate {
  std::string name;             // BaselineName: "lru", "patrickstar", "deepspeed", "engine"
  bool in_order_homes = false;  // under PlaceHomesInOrder's homes (free homes only)
  uint64_t iteration_ns = 0, stall_ns = 0;
  Bytes device_in_bytes = 0;
  Bytes nvme_bytes = 0;  // to and from NVMe, either way
};

struct Plan {
  uint32_t version = kPlanVersion;
  uint32_t source_iteration = 0;
  std::vector<TierKind> home;             // per chunk
  std::vector<GroupPlan> groups;          // groups with an optimizer step, by group index
  std::vector<uint32_t> volatile_groups;  // sorted; see PlanOptions::earlier_iteration
  // Per chunk: the expert class it is a member of (ExpertClasses), kNoExpertSet for a dense
  // chunk; empty when the trace has no expert sets. Accesses and actions naming a member
  // name a slot of its class (expert_slots.h).
  std::vector<uint32_t> expert_class;
  std::vector<UnitPlan> units;  // units with saved activations, by unit id
  std::vector<PlannedMoment> moments;
  std::vector<TraceAccess> accesses;  // expected; mode from needs_content/modifies
  std::vector<PlanAction> actions;
  PlanEstimate estimate;
  bool aggressive_prefetch = false;  // the schedule prefetches ahead of Belady's fetches
  bool writeback_aware = false;      // its room model waits for dirty evictions' write-backs
  // Not encoded (descriptive): the baseline policy whose moves the schedule is (baselines.h,
  // MimicSchedule; "belady": BeladyMovesSchedule), "" for the planner's own schedule.
  std::string baseline;
  uint32_t candidates_evaluated = 0;
  // Not encoded (descriptive): each baseline policy's own moves as the planner scored them
  // (PlanOptions::mimic_baselines; empty without it), in the order it tried them. A baseline
  // that cannot run the iteration under the budgets is absent.
  std::vector<BaselineEstimate> baselines;
  // The first of `baselines` named `name` (nullptr: none).
  const BaselineEstimate* FindBaseline(std::string_view name) const;

  Placement ToPlacement() const;
};

// What candidate plans are compared on (their modelled steady-state iteration).
enum class PlanObjective : uint8_t {
  kTime = 0,   // least iteration time, then fewest bytes into the device
  kBytes = 1,  // fewest bytes into the device (a recompute counted as the bytes a host->device
               // copy moves in its compute time), then least time (eviction-only problems;
               // SimDevice, whose copies use the compute's cores)
};

struct PlanOptions {
  uint32_t iteration = 0;                        // which trace iteration to plan from
  const StartState* start = nullptr;             // nullptr: nothing cached
  const std::vector<TierKind>* homes = nullptr;  // fixed homes; nullptr: choose
  bool place_optimizer = true;                   // may move optimizer steps between CPU and device
  bool overlap_optimizer = true;                 // may overlap CPU steps with the backward
  bool activation_policy = true;                 // may offload / recompute activations
  bool allow_recompute = true;                   // with it: recompute too (else offload only)
  bool aggressive_prefetch = true;  // may also try prefetching ahead of Belady's fetches
  PlanObjective objective = PlanObjective::kTime;
  // An earlier observed iteration (-1: none). Chunk groups that moments of it and of
  // `iteration` use differently (MoE experts) are volatile: their optimizer steps stay where
  // they ran and their chunks are prefetched only once this iteration has shown its group.
  int64_t earlier_iteration = -1;
  // Also candidates: each baseline policy's moves (baselines.h: lru, patrickstar, deepspeed,
  // engine) under the recorded placement, as plans — with the homes the runtime places too,
  // when homes are not fixed. They set a bar: a candidate with bytes into the device, NVMe
  // bytes, stall and iteration time each no higher than every baseline candidate's beats any
  // that misses it, so a plan that can match them all does; of those that miss it, one that
  // reaches the bar on more of the four measures comes first.
  bool mimic_baselines = true;
  uint32_t engine_prefetch_depth = 4;  // the engine baseline's lookahead (acquires)
  EngineLookahead engine_lookahead = EngineLookahead::kDepth;  // and its kind
  Bytes deepspeed_bucket_bytes = 0;  // the deepspeed baseline's bucket; 0: 4 x largest chunk
};

// Per chunk the expert class — a dense index of its (TraceChunk::expert_set, kind) pair, in
// order of the pair's first chunk — or kNoExpertSet for a dense chunk; empty when the trace
// has no expert sets. A class's members are interchangeable in a plan (expert_slots.h).
std::vector<uint32_t> ExpertClasses(const Trace& trace);

// Makes the plan. Errors name what is needed:
//   kInvalidArgument: a bad trace (ValidateTrace), machine model or iteration index;
//   kResourceExhausted: a budget smaller than the largest chunk, than one moment's working
//   set (its chunks plus the least non-chunk bytes any activation policy leaves), or homes
//   that fit neither DRAM nor NVMe — with the bytes needed and the budget.
StatusOr<Plan> MakePlan(const Trace& trace, const MachineModel& machine,
                        const PlanOptions& options = {});

// Homes: host while DRAM holds them with `host_reserve` bytes left, else NVMe, moving the
// least accessed chunks first (per iteration; ties: optimizer state, then grads, then params,
// then higher chunk id). kResourceExhausted if DRAM + NVMe cannot hold them.
StatusOr<std::vector<TierKind>> PlaceHomes(const Trace& trace, const MachineModel& machine,
                                           Bytes host_reserve);

// The runtime's fallback/baseline home rule (Engine::AddChunk): chunk by chunk in id order,
// host while it fits with `host_reserve` bytes left, else NVMe.
StatusOr<std::vector<TierKind>> PlaceHomesInOrder(const Trace& trace, const MachineModel& machine,
                                                  Bytes host_reserve);

// Host bytes to keep free of homes: the largest set of distinct chunks any moment of the
// trace accesses on the host (so NVMe-homed ones can be cached there).
Bytes HostWorkingSet(const Trace& trace);

// Checks the budgets against every moment of `iter` with the least non-chunk bytes (every
// other unit's activations recomputed, or offloaded with `offload_only`): kResourceExhausted
// naming the moment, the bytes it needs and the budget. `keep_activations`: with every unit's
// activations kept.
Status CheckFeasible(const Trace& trace, uint32_t iteration, const MachineModel& machine,
                     bool keep_activations, bool offload_only = false);

// Byte-exact, deterministic encoding of a plan (for equality checks and for storing it).
std::string EncodePlan(const Plan& plan);
std::string DescribePlan(const Plan& plan, const Trace& trace);  // human-readable summary

}  // namespace tiermem::planners
