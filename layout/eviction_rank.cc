#include "layout/eviction_rank.h"

namespace tiermem::chunks {

EvictionRank RankForEviction(const EvictionCandidate& c) {
  EvictionRank r;
  r.dirty = c.dirty ? 1 : 0;
  if (!c.order_known) {
    r.order = c.last_use;
    return r;
  }
  if (c.next_use != kNeverUsed) {
    r.used_again = 1;
    r.order = kNeverUsed - c.next_use;
  }
  return r;
}

}  // namespace tiermem::chunks
