// Eviction policy: which unpinned chunk leaves a full tier when an acquire (or a prefetch, or
// room for external bytes or scratch) needs its room. The session's engine uses the default
// below (Engine::Create without a policy), which ranks the candidates it gathers by the shared
// eviction rule (layout/eviction_rank.h: the recorded order of acquires, clean first); the
// interface lets a test substitute another (tests/chunks/engine_test.cc: LRU only). A
// planner's plan does not plug in here: in planned mode its evictions are engine calls
// (Engine::PlanEvict, driven by runtime/plan_runner.h), and this policy still picks the victims
// of acquires that find the tier full.
//
// Thread-safety: called by the engine under its own synchronization; implementations need none.
#pragma once

#include <memory>
#include <span>

#include "layout/eviction_rank.h"

namespace tiermem::chunks {

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  // Returns an index into `candidates` (non-empty).
  virtual size_t ChooseVictim(std::span<const EvictionCandidate> candidates) = 0;
};

// The smallest RankForEviction, the first of equals: farthest next use when the order is known
// (chunks never used again first, then clean before dirty, then the farthest next use);
// otherwise least recently used, clean before dirty.
std::unique_ptr<EvictionPolicy> NewDefaultEvictionPolicy();

}  // namespace tiermem::chunks
