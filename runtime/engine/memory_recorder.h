// MemoryRecorder: a TimelineRecorder that keeps every event in memory (and forwards it to an
// optional file recorder). The torch integration uses it so Python can read the timeline it
// just produced (peak per tier, bytes moved) while the file recorder lands; tests use it to
// check the budget at every event.
//
// Threading: thread-safe. `next` (may be null) must outlive it.
#pragma once

#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "runtime/base/timeline.h"

namespace tiermem::engine {

class MemoryRecorder final : public TimelineRecorder {
 public:
  explicit MemoryRecorder(TimelineRecorder* next = nullptr) : next_(next) {}

  uint32_t InternLabel(std::string_view text) override;
  void Record(Event e) override;
  Status Flush() override { return next_ ? next_->Flush() : OkStatus(); }
  Status Close() override { return next_ ? next_->Close() : OkStatus(); }
  const Clock* clock() const override { return Clock::Real(); }

  std::vector<Event> events() const;
  std::string label(uint32_t id) const;
  void Clear();

 private:
  TimelineRecorder* const next_;
  mutable std::mutex mu_;
  std::vector<Event> events_;                          // GUARDED_BY(mu_)
  std::unordered_map<std::string, uint32_t> label_ids_;  // GUARDED_BY(mu_)
  std::vector<std::string> labels_;                    // GUARDED_BY(mu_); id-1 -> text
};

// Replays alloc/free events: the peak of live bytes per tier (indexed by TierKind), and
// whether any event left a tier above its last kBudget.
struct TimelinePeaks {
  Bytes peak[kNumTierKinds] = {};
  Bytes budget[kNumTierKinds] = {};
  bool over_budget = false;
  Bytes copied[kNumTierKinds][kNumTierKinds] = {};  // from kCopyEnd (ok) events
  uint64_t stall_ns = 0;
};
TimelinePeaks ReplayPeaks(const std::vector<Event>& events);

}  // namespace tiermem::engine
