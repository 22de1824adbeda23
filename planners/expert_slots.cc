// ExpertSlots (expert_slots.h). Invariants: bound_ and slot_of_ are inverse partial maps
// between slot chunks and members of the same class; next_free_[k] counts the bound slots of
// class k, which are its first next_free_[k] slots (binding takes them in plan order).
#include "planners/expert_slots.h"

#include <algorithm>

namespace tiermem::planners {

ExpertSlots::ExpertSlots(const Plan& plan) : class_of_(plan.expert_class) {
  uint32_t classes = 0;
  for (uint32_t k : class_of_) {
    if (k != kNoExpertSet) classes = std::max(classes, k + 1);
  }
  if (classes == 0) return;
  slots_.resize(classes);
  std::vector<bool> seen(class_of_.size(), false);
  for (const TraceAccess& a : plan.accesses) {
    if (!IsMember(a.chunk) || seen[a.chunk]) continue;
    seen[a.chunk] = true;
    slots_[class_of_[a.chunk]].push_back(a.chunk);
  }
  Reset();
}

void ExpertSlots::Reset() {
  next_free_.assign(slots_.size(), 0);
  bound_.assign(class_of_.size(), kNoChunk);
  slot_of_.assign(class_of_.size(), kNoChunk);
}

ChunkId ExpertSlots::Bind(ChunkId actual) {
  if (!IsMember(actual)) return kNoChunk;
  if (slot_of_[actual] != kNoChunk) return slot_of_[actual];
  const uint32_t k = class_of_[actual];
  if (next_free_[k] >= slots_[k].size()) return kNoChunk;
  const ChunkId slot = slots_[k][next_free_[k]++];
  bound_[slot] = actual;
  slot_of_[actual] = slot;
  return slot;
}

}  // namespace tiermem::planners
