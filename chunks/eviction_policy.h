// Eviction policy: which unpinned chunk leaves a full tier. The engine asks its policy for a
// victim among the candidates it gathers; the default ranks them by the shared eviction rule
// (layout/eviction_rank.h). The interface lets tests substitute another rule.
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
