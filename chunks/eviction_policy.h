// Eviction policy: which unpinned chunk leaves a full tier. A small interface so the planner
// (driven by a profiled warm-up iteration) can replace the default later.
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
