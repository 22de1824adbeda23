// ClassScores: what the chunk engine knows about chunks acquired as members of a *class* — the
// experts of one mixture-of-experts layer, of which each visit of the layer picks a few that
// the routing chooses at run time (docs/moe.md).
//
// Such acquires are not entries of the recorded order (chunks/access_order.h): the order keeps
// only what repeats, so the engine still follows it — prefetching and evicting by farthest
// next use — through layers whose experts change at every token. Instead, per class, this
// keeps
//   - the positions of the class's visits in the recorded order (where, among the ordered
//     acquires of the previous iteration, the layer's experts were acquired), and
//   - per member chunk, how often it is picked: a count decayed by kDecay at every visit of
//     its class (frequency, weighted to the recent visits), shrunk toward the class's mean
//     pick rate while it has been seen little.
// From them, a member's *expected next use*, in order positions: its class's next visit, plus
// (1/p - 1) visits' distance for a member picked with probability p per visit (the expected
// number of visits it skips). The engine's eviction compares it with the ordered chunks' exact
// next uses: farthest (expected) next use leaves first, so hot experts stay, cold ones go,
// dense chunks are kept as by Belady on the order.
//
// A visit of a class begins at the first acquire of one of its members after any other
// acquire (ordered, or of another class); acquires of the same member within one visit count
// once.
//
// Thread-safety: externally synchronized (the engine's thread; the engine is).
// Ownership: a value the engine holds.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "base/units.h"

namespace tiermem::chunks {

inline constexpr uint32_t kNoClass = UINT32_MAX;

class ClassScores {
 public:
  // Each visit multiplies every member's pick count by this (and the visit count alike).
  static constexpr double kDecay = 0.95;
  // Weight, in visits, of the class's mean pick rate in a member's estimate.
  static constexpr double kPrior = 2.0;

  // An acquire of `chunk` as a member of class `cls`, with `recorded` ordered acquires
  // recorded so far this iteration (the position a new visit is recorded at).
  void Observe(uint32_t cls, ChunkId chunk, uint64_t recorded);
  // An ordered acquire: the class visit in progress, if any, ends.
  void EndVisit() { current_ = kNoClass; }
  // The iteration ends: the visit positions recorded become the ones predicted from.
  void BeginIteration();

  // The class `chunk` was last acquired as a member of, or kNoClass.
  uint32_t ClassOf(ChunkId chunk) const;
  // The probability that a visit of its class picks `chunk` (0 for a non-member).
  double PickProbability(ChunkId chunk) const;
  // The expected position of `chunk`'s next acquire as a member (see the file comment), at
  // order position `pos` of an order of `size` positions (cyclic: it repeats); kNeverUsed
  // for a non-member, or when its class has no recorded visit after `pos` (non-cyclic).
  uint64_t ExpectedNextUse(ChunkId chunk, uint64_t pos, uint64_t size, bool cyclic) const;

  uint64_t visits(uint32_t cls) const;

 private:
  struct Member {
    uint32_t cls = kNoClass;
    double picks = 0;         // decayed, as of visit `seen` of its class
    uint64_t seen = 0;        // the class's visit count when `picks` was last brought up to date
    uint64_t last_visit = 0;  // the visit that last counted a pick (once per visit)
  };
  struct Class {
    uint64_t visits = 0;  // all visits so far
    double decayed_visits = 0;
    double decayed_picks = 0;  // every member's picks, decayed alike (for the mean rate)
    uint32_t members = 0;
    std::vector<uint64_t> positions, recording;  // visit positions: followed, this iteration
  };
  double Picks(const Member& m, const Class& c) const;

  std::unordered_map<ChunkId, Member> members_;
  std::vector<Class> classes_;
  uint32_t current_ = kNoClass;  // the class whose visit is in progress
};

}  // namespace tiermem::chunks
