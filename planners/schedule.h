// Internal to planners/: the chunk schedule of one effective iteration (the Belady demand
// pass, early eviction and fetch hoisting described in planner.h), and the policy that
// executes a planned schedule in the simulated run (also used by the simulator's `planned` policy).
//
// Thread-safety: values and externally synchronized objects.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "planners/divergence.h"
#include "planners/effective.h"
#include "planners/expert_slots.h"
#include "planners/planner.h"
#include "planners/simulated_run.h"

namespace tiermem::planners {

// Per moment of an extended horizon (the iteration, then `repeat` copies of it): for each
// chunk, the position of its next access and whether that access reads it on a tier.
// Answers "when is chunk c next read on tier t after moment i" for Belady decisions.
class NextUse {
 public:
  // `seq` is a list of effective iterations concatenated in order (pointers must outlive).
  NextUse(const std::vector<const EffIteration*>& seq, size_t num_chunks);
  static constexpr uint64_t kDead = UINT64_MAX;
  // Global moment index of the next read of `c` on `tier` strictly after `pos`, or kDead if
  // the next access after `pos` does not read it there (it leaves the tier or is overwritten)
  // or there is none. `*leaves` (optional): the next access is on another tier.
  uint64_t NextRead(ChunkId c, TierKind tier, uint64_t pos, bool* leaves = nullptr) const;
  size_t size() const { return moments_.size(); }
  // The i-th global moment.
  const EffIteration& iter(size_t pos) const { return *moments_[pos].first; }
  size_t local(size_t pos) const { return moments_[pos].second; }

 private:
  struct Use {
    uint64_t pos;
    TierKind tier;
    bool reads;
  };
  std::vector<std::vector<Use>> uses_;  // per chunk, by position
  std::vector<std::pair<const EffIteration*, size_t>> moments_;
};

// Belady victim key (smaller = evict first): dead chunks (clean, then dirty whose write-back
// is due anyway, then dirty), then the farthest next read; ties by larger bytes, then id.
struct VictimKey {
  int cls = 0;
  uint64_t far = 0;    // UINT64_MAX - next read (so smaller = farther)
  uint64_t bytes = 0;  // UINT64_MAX - bytes
  ChunkId id = 0;
  friend bool operator<(const VictimKey& a, const VictimKey& b) {
    if (a.cls != b.cls) return a.cls < b.cls;
    if (a.far != b.far) return a.far < b.far;
    if (a.bytes != b.bytes) return a.bytes < b.bytes;
    return a.id < b.id;
  }
};
VictimKey BeladyKey(const NextUse& nu, ChunkId c, TierKind tier, uint64_t pos, bool dirty,
                    Bytes bytes);

struct ScheduleInput {
  const Trace* trace = nullptr;
  const EffIteration* eff = nullptr;
  std::vector<TierKind> homes;
  StartState start;  // sized to the chunk count
  Bytes device_budget = 0, host_budget = 0;
  // Also prefetch ahead of Belady's fetches: whenever the next chunk to be read can come in
  // without evicting one read before it (Cao et al.'s "aggressive" rule); may fetch more bytes
  // than Belady, to start copies earlier.
  bool aggressive = false;
  // Count a dirty copy's room as taken until its write-back is modelled to end (needs
  // `machine`), so the schedule leaves room for the moments right after a dirty eviction
  // (e.g. a grad chunk written back while the next backward moment needs its temporaries).
  bool writeback_aware = false;
  const MachineModel* machine = nullptr;
};

// Plan actions per moment of `eff` (moments 0..n-1), in issue order. kResourceExhausted if a
// moment's chunks cannot fit next to its non-chunk bytes.
struct Schedule {
  std::vector<std::vector<PlanAction>> actions;  // per moment
  Bytes device_in_bytes = 0;                     // fetched bytes needed in this iteration
};
StatusOr<Schedule> MakeSchedule(const ScheduleInput& in);

// Executes a Plan (its actions) in the simulated run, repairing where the actual sequence
// differs: a moment that is not the planned one (other label, kind or unit: control flow)
// makes it reactive (LRU, clean first) for the rest of the iteration; the planned moments
// with other chunk groups (MoE routing) keep the plan, read through a learned substitution
// of groups, and fetch what is still missing, evicting by the (substituted) predicted next use.
//
// With expert classes (Plan::expert_class) the routing is the class policy's instead: a
// moment is the planned one when its dense accesses are; expert members bind to the plan's
// slots as they are accessed (expert_slots.h) and slot actions apply to them; a member is
// fetched at its use when no action brought it; eviction ranks a bound member by its slot's
// planned next read and an unbound one (beyond the slots) by the next planned read of any
// member of its class — the next visit of its expert set, which is exact for a forward's
// experts (the backward of the unit reuses them). Optimizer steps of a member group are
// matched through the binding of their chunks; an unmatched one is no divergence either.
// None of this counts as a divergence or a repair.
class PlanPolicy : public Policy {
 public:
  // `plan` and `planned` (the plan's own effective sequence) must outlive the policy.
  PlanPolicy(const Plan* plan, const EffIteration* planned);
  Status BeginIteration(SimulatedRun& ex) override;
  Status Before(SimulatedRun& ex, size_t i) override;

  uint32_t repairs() const { return repairs_; }  // moves the plan did not foresee (follow mode)
  bool diverged() const { return mode_ != Mode::kFollow; }
  DivergenceKind divergence_kind() const { return div_kind_; }
  uint32_t divergence_moment() const { return div_moment_; }

 private:
  enum class Mode { kFollow, kRepair, kReactive };
  ChunkId Map(const Trace& t, ChunkId c) const;
  // Eviction rank of actual chunk `c` on `tier` at planned position `pos` (expert members
  // through their slot or class; see the class comment).
  VictimKey Key(const SimulatedRun& ex, ChunkId c, TierKind tier, uint64_t pos) const;
  // The planned position of the next read of `c` on `tier` after `pos` as Key ranks it.
  uint64_t NextRead(ChunkId c, TierKind tier, uint64_t pos) const;
  // The actual chunk a plan action on `c` applies to now; kNoChunk: skip the action.
  ChunkId Target(const Trace& t, const PlanAction& act) const;
  // Moment i of the actual iteration and planned moment q have the same label, kind and
  // dense accesses (expert members and class steps' chunks not compared).
  bool SameDense(const Trace& t, const EffIteration& actual, size_t i, size_t q) const;
  void Remap(const Trace& t);
  bool Learn(const Trace& t, const EffIteration& actual, size_t i, size_t q);
  Status Issue(SimulatedRun& ex, size_t i, size_t q);  // planned moment q's actions, at moment i

  const Plan* plan_;
  const EffIteration* planned_;
  EffIteration mapped_;                                        // planned_ read through sigma_
  std::unique_ptr<NextUse> next_use_;                          // over mapped_, three times
  std::vector<uint32_t> sigma_;                                // group substitution
  std::map<std::pair<uint32_t, uint16_t>, ChunkId> chunk_of_;  // (group, kind) -> chunk
  size_t next_stream_ = 0;  // next planned non-step moment to match
  size_t issued_ = 0;       // planned moments whose actions are issued
  std::vector<bool> step_matched_;
  std::vector<bool> volatile_;  // per group: Plan::volatile_groups
  std::vector<bool> seen_;      // per group: a matched moment used it this iteration
  ExpertSlots slots_;           // the plan's expert classes (inactive: none)
  // Per class: the planned positions (over three copies of the plan) of its members' reads,
  // with their tiers, in order.
  std::vector<std::vector<std::pair<uint64_t, TierKind>>> class_reads_;
  // Per planned step: the group it steps, through the (substituted) plan; kNoGroup if none.
  std::vector<uint32_t> step_group_;
  // Actual group -> planned group of a class step being issued (chunks of kind k of the
  // planned group act on the actual group's chunk of kind k).
  uint32_t step_from_ = kNoGroup, step_to_ = kNoGroup;
  Mode mode_ = Mode::kFollow;
  DivergenceKind div_kind_ = DivergenceKind::kNone;
  uint32_t div_moment_ = 0;
  uint32_t repairs_ = 0;
};

// Makes room for and fetches every access of moment `i` that is not resident on its tier,
// evicting by `key(chunk, tier)` (smallest first) among chunks the moment does not use.
// Accesses on a chunk's home tier evict the copy above it first. kResourceExhausted naming
// the moment and the bytes when even evicting everything else is not enough. `*fetched`
// (optional) counts the chunks brought in.
template <typename KeyFn>
Status EnsureMoment(SimulatedRun& ex, size_t i, KeyFn key, uint32_t* fetched = nullptr);

// Evicts from tier `t` (smallest key first, skipping chunks moment `i` uses and those `skip`
// rejects) until `need` bytes are free. Returns false if it could not.
template <typename KeyFn, typename SkipFn>
StatusOr<bool> MakeRoom(SimulatedRun& ex, size_t i, TierKind t, Bytes need, KeyFn key, SkipFn skip);

}  // namespace tiermem::planners

#include "planners/schedule_inl.h"
