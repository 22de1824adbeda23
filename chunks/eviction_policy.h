// Eviction policy: which unpinned chunk leaves a full tier when an acquire (or a prefetch, or
// room for external bytes or scratch) needs its room. The session's engine uses the default
// below (Engine::Create without a policy), which ranks by the recorded order of acquires; the
// interface lets a test substitute another (tests/chunks/engine_test.cc: LRU only). A
// planner's plan does not plug in here: in planned mode its evictions are engine calls
// (Engine::PlanEvict, driven by runtime/plan_runner.h), and this policy still picks the victims
// of acquires that find the tier full.
//
// Thread-safety: called by the engine under its own synchronization; implementations need none.
#pragma once

#include <cstdint>
#include <memory>
#include <span>

#include "base/units.h"

namespace tiermem::chunks {

inline constexpr uint64_t kNeverUsed = UINT64_MAX;

struct EvictionCandidate {
  ChunkId chunk = kNoChunk;
  Bytes bytes = 0;
  bool dirty = false;              // evicting it costs a write-back of `bytes`
  uint64_t last_use = 0;           // access counter of its last acquire (bigger = more recent)
  uint64_t next_use = kNeverUsed;  // position of its next acquire in the recorded order
  bool order_known = false;        // next_use is meaningful (a recorded order is being followed)
};

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  // Returns an index into `candidates` (non-empty).
  virtual size_t ChooseVictim(std::span<const EvictionCandidate> candidates) = 0;
};

// Farthest next use when the order is known (chunks never used again first, then clean before
// dirty, then the farthest next use); otherwise least recently used, clean before dirty.
std::unique_ptr<EvictionPolicy> NewDefaultEvictionPolicy();

}  // namespace tiermem::chunks
