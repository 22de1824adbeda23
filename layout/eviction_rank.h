// Eviction ranking: which cached chunk leaves a full tier first, by the chunk engine's rule.
// The engine's default EvictionPolicy (chunks/eviction_policy.h) evicts by it, and the
// simulator's `engine` and `lru` policies (planners/simulator.cc) replay it, so the simulated
// engine is the engine.
//
// The rule, smaller rank first: while a recorded order is followed (next uses known), chunks
// never used again, then clean before dirty, then the farthest next use; otherwise the least
// recently used, clean before dirty. Equal ranks are equally good victims: callers take the
// first candidate (the engine and the simulator both scan chunks by id).
//
// Thread-safety: values and pure functions.
#pragma once

#include <compare>
#include <cstdint>

#include "base/units.h"

namespace tiermem::chunks {

// A next use that never comes (not again in the recorded order, or no order).
inline constexpr uint64_t kNeverUsed = UINT64_MAX;

struct EvictionCandidate {
  ChunkId chunk = kNoChunk;
  Bytes bytes = 0;
  bool dirty = false;              // evicting it costs a write-back of `bytes`
  uint64_t last_use = 0;           // access counter of its last acquire (bigger = more recent)
  uint64_t next_use = kNeverUsed;  // position of its next acquire in the recorded order
  bool order_known = false;        // next_use is meaningful (a recorded order is being followed)
};

// Compared member by member; smaller = evicted first.
struct EvictionRank {
  uint8_t used_again = 0;  // 1: the order is known and uses it again (0 otherwise)
  uint8_t dirty = 0;       // 1: evicting it costs a write-back
  uint64_t order = 0;      // order known: kNeverUsed - next_use (the farthest first; 0 for a
                           // chunk never used again); else last_use (the least recent first)
  friend auto operator<=>(const EvictionRank&, const EvictionRank&) = default;
};

EvictionRank RankForEviction(const EvictionCandidate& c);

}  // namespace tiermem::chunks
