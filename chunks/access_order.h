// AccessOrder: the chunk engine's memory of the order of acquires (engine.h), which its
// eviction policy and lookahead prefetch read.
//
// Each iteration records its acquires, (chunk, tier) in order, while following the order
// recorded by the previous one: a *position* in it advances at every acquire that matches the
// entry there. The order answers
//   - NextUse(chunk): the position of the chunk's next acquire at or after the current
//     position — what farthest-next-use eviction and write-behind compare;
//   - the lookahead window (WindowEnd, At): the entries the engine prefetches next.
// An acquire that is not the expected entry but is found within kResyncWindow entries ahead
// skips there (the entries between did not come: an optimizer update that ran early, before an
// eval forward); one not found there ends following for the rest of the iteration (diverged:
// NextUse is kNeverUsed and the window empty until the next BeginIteration). Cyclic order
// (serving: every iteration is the same forward) takes the order to repeat: positions
// size..2*size-1 are the next iteration's, so the window runs past the end and a chunk's next
// use after its last one is its first one in the next iteration.
//
// Thread-safety: externally synchronized (the engine's thread; the engine is).
// Ownership: a value the engine holds; it owns nothing but its vectors.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base/units.h"
#include "layout/eviction_rank.h"  // kNeverUsed

namespace tiermem::chunks {

class AccessOrder {
 public:
  // How far ahead of the expected entry an acquire may be found and skipped to.
  static constexpr uint64_t kResyncWindow = 32;

  using Entry = std::pair<ChunkId, TierKind>;
  // What one acquire did to the following of the previous order.
  enum class Follow : uint8_t {
    kNotFollowing = 0,  // no order is followed (none recorded, or diverged already)
    kMatched = 1,       // it was the expected entry
    kResynced = 2,      // it was found within kResyncWindow ahead: the entries before it skipped
    kDiverged = 3,      // not found: following ends for the rest of the iteration
  };

  // Records an acquire of `chunk` on `where` into this iteration's order and follows the
  // previous one with it.
  Follow Observe(ChunkId chunk, TierKind where);
  // Ends the iteration: the recorded order becomes the one followed, from position 0 (see
  // access_order.cc for when the old one is kept instead). An iteration that recorded nothing
  // keeps the old order.
  void BeginIteration();
  void SetCyclic(bool on) { cyclic_ = on; }

  bool following() const { return following_; }
  bool cyclic() const { return cyclic_; }
  uint64_t size() const { return order_.size(); }          // positions of the followed order
  uint64_t recorded() const { return recording_.size(); }  // acquires recorded this iteration
  uint64_t position() const { return pos_; }               // the next expected entry
  // The position of the chunk's next acquire at or after position() (cyclic, or `wrap`:
  // possibly in [size, 2 * size), the next iteration's); kNeverUsed when not following or not
  // again.
  uint64_t NextUse(ChunkId chunk, bool wrap = false) const;
  // The end (exclusive) of the `n` entries from position(), cut at the end of the order
  // (cyclic: at the end of the next iteration's copy of it).
  uint64_t WindowEnd(uint64_t n) const;
  // The entry at position `pos` < WindowEnd(...) (cyclic positions wrap).
  const Entry& At(uint64_t pos) const {
    return order_[pos < order_.size() ? pos : pos - order_.size()];
  }

 private:
  std::vector<Entry> recording_;  // this iteration's acquires
  std::vector<Entry> order_;      // the previous iteration's, followed
  std::unordered_map<ChunkId, std::vector<uint64_t>> positions_;  // per chunk, ascending
  uint64_t pos_ = 0;
  bool following_ = false;
  bool skipped_ = false;     // this iteration skipped entries of order_ (and did not diverge)
  bool kept_order_ = false;  // the last BeginIteration kept order_ over a skipping recording
  bool cyclic_ = false;
};

}  // namespace tiermem::chunks
