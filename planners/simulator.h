// The offline simulator: runs a schedule policy over a trace under a machine model and
// reports bytes moved per tier pair, stall time by cause, peak bytes per tier (chunks and
// activations) and the modelled iteration time. `tiermem plan simulate|compare` are thin
// mains over Simulate / Compare.
//
// Protocol (same for every policy, so the numbers compare): the trace's iterations run in
// order, residency carried over; the first is a warm-up run reactively (LRU, clean first: the
// runtime's first iteration has no trace yet) and is not measured — as recorded for the
// baselines, under the first plan's placement (made from that iteration) for planned and opt,
// since a warm-up that keeps every activation may not fit where the plan does; a one-
// iteration trace is taken to repeat (warm-up + one measured copy). Learning policies see
// each iteration only after it ran: iteration k is scheduled from iteration k-1.
//
// Policies:
//   lru          reactive: fetch on demand, evict the least recently used (clean first);
//                synchronous write-back. The engine's behaviour off its recorded order
//                (its rule, layout/eviction_rank.h).
//   patrickstar  synchronous moves on demand, no prefetch, evict the farthest next use in the
//                previous iteration's moment order (LRU once the iteration diverged).
//   deepspeed    the previous iteration's module order: prefetch upcoming chunks up to a
//                fixed bucket of bytes, release a chunk after use unless it is reused within
//                the bucket, LRU on demand; on divergence the order is discarded (demand
//                fetches for the rest of the iteration) and re-recorded.
//   engine       today's tiermem engine: the previous iteration's acquire order with a
//                lookahead of `engine_prefetch_depth` acquires (evicting only clean chunks
//                needed later), farthest next use (never-used, then clean, first) while
//                following it, LRU once diverged (the engine's own ranking,
//                layout/eviction_rank.h); synchronous write-back. With
//                `engine_lookahead = kRoom` the engine's room lookahead instead (baselines.h:
//                host acquires one lap ahead, dirty copies in the way written home in the
//                background).
//   planned      the planner's plan for iteration k, made from iteration k-1 and the state
//                at k's start (homes fixed by the first plan); on divergence the plan repairs
//                (other chunks at a planned moment) or goes reactive (another moment).
//   opt          the Belady bound on bytes into the device tier for the sequence the planned
//                policy runs (its placement: optimizer tiers, activation policy, homes):
//                demand fetches, evicting the chunk read farthest in the future of the whole
//                measured run (an oracle). Exact minimum for equal-sized chunks.
//   opt-recorded the same bound for the recorded placement (what the baselines run).
// Activations: every policy but planned/opt keeps them on the device (as the systems they
// model do), so at a small budget a baseline may not fit: its result says so (kResourceExhausted).
//
// Thread-safety: pure functions over values.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "planners/baselines.h"
#include "planners/machine.h"
#include "planners/planner.h"
#include "planners/simulated_run.h"
#include "planners/trace.h"

namespace tiermem::planners {

// The baselines first, with BaselineKind's values (PolicyName takes their names from it).
enum class PolicyKind : uint8_t {
  kLru = static_cast<uint8_t>(BaselineKind::kLru),
  kPatrickStar = static_cast<uint8_t>(BaselineKind::kPatrickStar),
  kDeepSpeed = static_cast<uint8_t>(BaselineKind::kDeepSpeed),
  kEngine = static_cast<uint8_t>(BaselineKind::kEngine),
  kPlanned = kNumBaselines,
  kOpt = 5,
  kOptRecorded = 6,
};
inline constexpr int kNumPolicies = 7;
std::string_view PolicyName(PolicyKind p);  // "lru", "patrickstar", ..., "opt-recorded"
StatusOr<PolicyKind> ParsePolicy(std::string_view name);

struct SimOptions {
  uint32_t engine_prefetch_depth = 4;  // acquires of lookahead (EngineConfig default)
  // The engine policy's lookahead (EngineConfig::lookahead). The planner's baseline
  // candidates mimic the depth engine either way (a room engine's background write-backs are
  // no plan action).
  EngineLookahead engine_lookahead = EngineLookahead::kDepth;
  Bytes deepspeed_bucket_bytes = 0;  // 0: 4 x the largest chunk
  PlanOptions plan;                  // for planned / opt (iteration, start, homes ignored)
  bool keep_recorded_homes = false;  // planned: the homes the trace was recorded with
  bool record_moments = false;       // per_iteration[k].moments: every moment's timing
};

struct SimResult {
  PolicyKind policy = PolicyKind::kLru;
  Status status;  // not OK: the policy cannot run this (e.g. does not fit)
  uint32_t measured_iterations = 0;
  IterationStats total;  // summed over the measured iterations
  std::vector<IterationStats> per_iteration;
  std::array<Bytes, kNumTierKinds> peak{};  // over the measured iterations
  PairBytes unclaimed{};                    // prefetched for after the last iteration (not counted)
  uint32_t divergences = 0;    // measured iterations that left the plan / recorded order
  uint32_t repairs = 0;        // planned: moves its plan did not foresee
  bool bound_exact = false;    // opt*: chunks on the device are all the same size
  std::vector<Plan> plans;     // planned: the plan of each measured iteration
  Placement warmup_placement;  // planned: the placement the warm-up ran under
  std::vector<TierKind> homes;

  // Per measured iteration.
  double MeanDeviceInBytes() const;
  double MeanStallNs() const;
  double MeanIterationNs() const;
};

// Simulates one policy. kInvalidArgument for a bad trace or machine; a policy that cannot
// run the trace under the budgets returns OK with `status` saying why.
StatusOr<SimResult> Simulate(const Trace& trace, const MachineModel& machine, PolicyKind policy,
                             const SimOptions& options = {});

// Every policy, in PolicyKind order (opt reuses the planned run's placements).
StatusOr<std::vector<SimResult>> Compare(const Trace& trace, const MachineModel& machine,
                                         const SimOptions& options = {});

}  // namespace tiermem::planners
