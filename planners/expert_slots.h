// Expert classes in an executed plan: the binding of run-time expert choices to the plan's
// slots.
//
// A plan is made from one recorded iteration, whose expert-set members (TraceChunk::
// expert_set) are a sample of the routing, not the future. So the plan schedules a *class*,
// not its members: per class — an (expert set, chunk kind) pair, Plan::expert_class — the
// j-th distinct member the planned iteration accesses is *slot j*, and the plan names slot j
// by that recorded member's chunk id (in its accesses and actions). The slots are the room
// the plan reserves for the class, at the moments the plan needs it; the dense chunks are
// scheduled exactly around them.
//
// Executing the plan, the j-th distinct member of a class that the iteration accesses is
// bound to slot j (Bind: the routing has chosen it); an action on a member chunk is an action
// on its slot, applied to the member bound to it (Resolve) — or skipped while none is: a
// prefetch before the routing has spoken cannot know its expert, so the member is fetched at
// its use into the room the plan kept free for it. Members beyond the planned slots (a
// routing that picks more experts than the recording) are served by the class policy alone
// (the executor's eviction by expected next visit of the set). Binding is per iteration
// (Reset): each forward's routing is new. Within an iteration the backward of a unit
// acquires the experts its forward did, so the slots the forward bound carry the plan's
// exact schedule (evict after the forward, prefetch before the backward) for the experts the
// routing chose.
//
// Used by the simulator's plan policy (schedule.h) and by the runtime's plan runner; both
// bind in access order, so they execute a plan alike.
//
// Thread-safety: externally synchronized. Ownership: a value; built from a plan it does not
// keep.
#pragma once

#include <cstdint>
#include <vector>

#include "base/units.h"
#include "planners/planner.h"

namespace tiermem::planners {

class ExpertSlots {
 public:
  ExpertSlots() = default;
  // The classes and slots of `plan` (Plan::expert_class and its accesses, in order).
  explicit ExpertSlots(const Plan& plan);

  bool active() const { return !slots_.empty(); }  // the plan has expert classes
  bool IsMember(ChunkId c) const { return c < class_of_.size() && class_of_[c] != kNoExpertSet; }
  uint32_t ClassOf(ChunkId c) const { return IsMember(c) ? class_of_[c] : kNoExpertSet; }

  // Start of an iteration: no member bound.
  void Reset();
  // An access of member `actual`: binds it to its class's next free slot if it has none.
  // Returns its slot (a planned member chunk), or kNoChunk if the class's slots are all
  // bound (served by the class policy alone). kNoChunk for a dense chunk.
  ChunkId Bind(ChunkId actual);
  // The member bound to slot `slot` (a chunk the plan names), kNoChunk if none (yet).
  ChunkId Resolve(ChunkId slot) const { return slot < bound_.size() ? bound_[slot] : kNoChunk; }
  // The slot `actual` is bound to, kNoChunk if none.
  ChunkId SlotOf(ChunkId actual) const {
    return actual < slot_of_.size() ? slot_of_[actual] : kNoChunk;
  }

 private:
  std::vector<uint32_t> class_of_;           // per chunk (kNoExpertSet: dense)
  std::vector<std::vector<ChunkId>> slots_;  // per class: the slot chunks, in plan order
  std::vector<uint32_t> next_free_;          // per class: slots bound so far
  std::vector<ChunkId> bound_;               // per slot chunk: the member bound to it
  std::vector<ChunkId> slot_of_;             // per member: its slot
};

}  // namespace tiermem::planners
