// AccessOrder (access_order.h): the recorded order of acquires and the following of it.
//
// Invariants: `order_` is the last adopted recording and `positions_` indexes it exactly (for
// every chunk, the ascending positions of its entries in `order_`); `pos_` <= order_.size();
// `following_` implies `order_` is not empty and no acquire of this iteration failed to be
// found; `skipped_` is set only while following. Adoption: at BeginIteration a non-empty
// recording replaces the order, except when the iteration was still followed at its end but
// skipped entries on the way (`skipped_`): the skipped accesses usually come back (an
// optimizer update that ran early this time), so the old order is kept for the next
// iteration, and the next recording that skips again is adopted (`kept_order_` makes the
// keeping one-shot). A diverged
// iteration's recording is always adopted: control flow changed.
//
// Ownership and threading: a value inside the engine, touched only by the engine's thread
// (Acquire, BeginIteration, eviction and prefetch decisions); no locks.
#include "chunks/access_order.h"

#include <algorithm>
#include <utility>

namespace tiermem::chunks {

AccessOrder::Follow AccessOrder::Observe(ChunkId chunk, TierKind where) {
  recording_.emplace_back(chunk, where);
  if (!following_) return Follow::kNotFollowing;
  const Entry key{chunk, where};
  if (pos_ < order_.size() && order_[pos_] == key) {
    ++pos_;
    return Follow::kMatched;
  }
  // Entries that did not come: skip to this acquire if it is close ahead.
  const uint64_t end = std::min<uint64_t>(order_.size(), pos_ + kResyncWindow);
  uint64_t j = pos_ + 1;
  while (j < end && order_[j] != key) ++j;
  if (j < end) {
    pos_ = j + 1;
    skipped_ = true;
    return Follow::kResynced;
  }
  following_ = false;  // diverged: reactive (LRU) for the rest of the iteration
  return Follow::kDiverged;
}

void AccessOrder::BeginIteration() {
  if (!recording_.empty()) {
    // Followed only by skipping: keep the old order once (see the file comment).
    const bool keep = following_ && skipped_ && !kept_order_;
    if (!keep) {
      order_ = std::move(recording_);
      positions_.clear();
      for (uint64_t i = 0; i < order_.size(); ++i) positions_[order_[i].first].push_back(i);
    }
    kept_order_ = keep;
  }
  skipped_ = false;
  recording_.clear();
  pos_ = 0;
  following_ = !order_.empty();
}

uint64_t AccessOrder::NextUse(ChunkId chunk, bool wrap) const {
  if (!following_) return kNeverUsed;
  auto it = positions_.find(chunk);
  if (it == positions_.end()) return kNeverUsed;
  auto p = std::lower_bound(it->second.begin(), it->second.end(), pos_);
  if (p != it->second.end()) return *p;
  // Cyclic: its first use in the next iteration, at virtual position size + first.
  return cyclic_ || wrap ? order_.size() + it->second.front() : kNeverUsed;
}

uint64_t AccessOrder::WindowEnd(uint64_t n) const {
  // Cyclic: the window may run one iteration past the end (positions size..2*size-1 are the
  // next iteration's, as NextUse counts them).
  const uint64_t limit = cyclic_ ? 2 * order_.size() : order_.size();
  return std::min<uint64_t>(limit, pos_ + n);
}

}  // namespace tiermem::chunks
