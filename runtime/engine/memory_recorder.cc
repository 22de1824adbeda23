#include "runtime/engine/memory_recorder.h"

#include <map>

namespace tiermem::engine {

uint32_t MemoryRecorder::InternLabel(std::string_view text) {
  uint32_t id;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = label_ids_.find(std::string(text));
    if (it != label_ids_.end()) return it->second;
    labels_.emplace_back(text);
    id = static_cast<uint32_t>(labels_.size());
    label_ids_.emplace(std::string(text), id);
  }
  // The forwarded recorder has its own ids: we keep ours and forward the text-derived ones.
  return id;
}

void MemoryRecorder::Record(Event e) {
  if (e.ts_ns == 0) e.ts_ns = Clock::Real()->NowNs();
  if (next_ != nullptr) {
    Event f = e;
    if (f.label != 0) f.label = next_->InternLabel(label(f.label));
    next_->Record(f);
  }
  std::lock_guard<std::mutex> lock(mu_);
  events_.push_back(e);
}

std::vector<Event> MemoryRecorder::events() const {
  std::lock_guard<std::mutex> lock(mu_);
  return events_;
}

std::string MemoryRecorder::label(uint32_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return id == 0 || id > labels_.size() ? std::string() : labels_[id - 1];
}

void MemoryRecorder::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  events_.clear();
}

TimelinePeaks ReplayPeaks(const std::vector<Event>& events) {
  TimelinePeaks p;
  Bytes used[kNumTierKinds] = {};
  std::map<uint64_t, uint64_t> copy_begin;  // id -> index of kCopyBegin
  std::map<uint64_t, uint64_t> stall_begin;
  for (size_t i = 0; i < events.size(); ++i) {
    const Event& e = events[i];
    const int t = static_cast<int>(e.tier);
    switch (e.type) {
      case EventType::kBudget:
        if (t < kNumTierKinds) p.budget[t] = e.bytes;
        break;
      case EventType::kAlloc:
        if (t < kNumTierKinds) {
          used[t] += e.bytes;
          if (used[t] > p.peak[t]) p.peak[t] = used[t];
          if (p.budget[t] != 0 && used[t] > p.budget[t]) p.over_budget = true;
        }
        break;
      case EventType::kFree:
        if (t < kNumTierKinds) used[t] -= e.bytes;
        break;
      case EventType::kCopyBegin:
        copy_begin[e.id] = i;
        break;
      case EventType::kCopyEnd: {
        auto it = copy_begin.find(e.id);
        if (it != copy_begin.end() && !(e.flags & kFlagFailed)) {
          const Event& b = events[it->second];
          const int s = static_cast<int>(b.tier), d = static_cast<int>(b.tier2);
          if (s < kNumTierKinds && d < kNumTierKinds) p.copied[s][d] += b.bytes;
        }
        break;
      }
      case EventType::kStallBegin:
        stall_begin[e.id] = e.ts_ns;
        break;
      case EventType::kStallEnd: {
        auto it = stall_begin.find(e.id);
        if (it != stall_begin.end() && e.ts_ns >= it->second) p.stall_ns += e.ts_ns - it->second;
        break;
      }
      default:
        break;
    }
  }
  return p;
}

}  // namespace tiermem::engine
