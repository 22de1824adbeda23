// ClassScores (expert_cache.h). Decay is applied lazily: a member's pick count is kept as of
// the visit it was last updated at, and brought up to the class's current visit by
// kDecay^(visits since) when read or counted, so a visit costs O(1), not O(members).
#include "chunks/expert_cache.h"

#include <algorithm>
#include <cmath>

#include "layout/eviction_rank.h"  // kNeverUsed

namespace tiermem::chunks {

void ClassScores::Observe(uint32_t cls, ChunkId chunk, uint64_t recorded) {
  if (cls >= classes_.size()) classes_.resize(cls + 1);
  Class& c = classes_[cls];
  if (current_ != cls) {  // a new visit of the class
    current_ = cls;
    ++c.visits;
    c.decayed_visits = c.decayed_visits * kDecay + 1.0;
    c.decayed_picks *= kDecay;
    c.recording.push_back(recorded);
  }
  Member& m = members_[chunk];
  if (m.cls != cls) {  // first seen (or moved to another class: start over)
    m = Member{};
    m.cls = cls;
    m.seen = c.visits;
    ++c.members;
  }
  m.picks = Picks(m, c);
  m.seen = c.visits;
  if (m.last_visit != c.visits) {
    m.last_visit = c.visits;
    m.picks += 1.0;
    c.decayed_picks += 1.0;
  }
}

void ClassScores::BeginIteration() {
  current_ = kNoClass;
  for (Class& c : classes_) {
    if (!c.recording.empty()) c.positions = std::move(c.recording);
    c.recording.clear();
  }
}

double ClassScores::Picks(const Member& m, const Class& c) const {
  const uint64_t since = c.visits - m.seen;
  return since == 0 ? m.picks : m.picks * std::pow(kDecay, static_cast<double>(since));
}

uint32_t ClassScores::ClassOf(ChunkId chunk) const {
  auto it = members_.find(chunk);
  return it == members_.end() ? kNoClass : it->second.cls;
}

uint64_t ClassScores::visits(uint32_t cls) const {
  return cls < classes_.size() ? classes_[cls].visits : 0;
}

double ClassScores::PickProbability(ChunkId chunk) const {
  auto it = members_.find(chunk);
  if (it == members_.end()) return 0.0;
  const Class& c = classes_[it->second.cls];
  if (c.decayed_visits <= 0 || c.members == 0) return 0.0;
  const double mean = c.decayed_picks / c.decayed_visits / c.members;
  return (Picks(it->second, c) + kPrior * mean) / (c.decayed_visits + kPrior);
}

uint64_t ClassScores::ExpectedNextUse(ChunkId chunk, uint64_t pos, uint64_t size,
                                      bool cyclic) const {
  auto it = members_.find(chunk);
  if (it == members_.end()) return kNeverUsed;
  const Class& c = classes_[it->second.cls];
  if (c.positions.empty()) return kNeverUsed;
  // The class's next visit at or after `pos` (cyclic: wrapping into the next iteration).
  auto v = std::lower_bound(c.positions.begin(), c.positions.end(), pos);
  uint64_t next;
  if (v != c.positions.end()) {
    next = *v;
  } else if (cyclic) {
    next = c.positions.front() + size;
  } else {
    return kNeverUsed;
  }
  const double p = PickProbability(chunk);
  if (p <= 0) return kNeverUsed;
  // Visits apart: an iteration's order over its visits of the class.
  const double gap =
      static_cast<double>(std::max<uint64_t>(size, 1)) / static_cast<double>(c.positions.size());
  const double expected = static_cast<double>(next) + (1.0 / p - 1.0) * gap;
  constexpr double kCap = 1e18;
  return static_cast<uint64_t>(std::min(expected, kCap));
}

}  // namespace tiermem::chunks
