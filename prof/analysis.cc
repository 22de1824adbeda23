// Analyzer invariants: usage_[tier][category] is the sum of the bytes of the live regions
// recorded in regions_[tier]; totals_[tier] is the row sum. Areas (bytes x ns) are integrated
// before each event is applied, so the state between two events holds over that interval.
// Copies and stalls are open between their begin and end events, keyed by id; an end without
// a begin is counted, never fatal. Everything is O(1) per event except the final sorting.
#include "prof/analysis.h"

#include <algorithm>
#include <limits>

namespace tiermem::prof {
namespace {

int TierIndex(TierKind t) {
  const int i = static_cast<int>(t);
  return i < kNumTierKinds ? i : -1;
}

}  // namespace

// ---- OrderedEvents -------------------------------------------------------------------------

bool OrderedEvents::PopMin(TimelineEntry* out) {
  Queue* best = nullptr;
  for (Queue& q : queues_) {
    if (q.events.empty()) continue;
    if (best == nullptr || q.events.front().event.ts_ns < best->events.front().event.ts_ns) {
      best = &q;
    }
  }
  if (best == nullptr) return false;
  *out = best->events.front();
  best->events.pop_front();
  --buffered_;
  if (emitted_any_ && out->event.ts_ns < last_ts_) {
    ++out_of_order_;
  } else {
    last_ts_ = out->event.ts_ns;
  }
  emitted_any_ = true;
  return true;
}

StatusOr<bool> OrderedEvents::Next(TimelineEntry* out) {
  while (true) {
    // The minimum head is handed out once the window is full (or at EOF): any event still to
    // come from a thread, known or not yet seen, is then assumed to be later.
    if ((buffered_ > window_ || eof_) && PopMin(out)) return true;
    if (eof_) return false;
    TimelineEntry e;
    TIERMEM_ASSIGN_OR_RETURN(bool more, reader_->Next(&e));
    if (!more) {
      eof_ = true;
      continue;
    }
    Queue* q = nullptr;
    for (Queue& candidate : queues_) {
      if (candidate.thread == e.thread) q = &candidate;
    }
    if (q == nullptr) {
      queues_.push_back(Queue{e.thread, {}});
      q = &queues_.back();
    }
    q->events.push_back(e);
    ++buffered_;
  }
}

Status ForEachOrdered(const std::string& path, const std::function<void(const TimelineEntry&)>& fn,
                      uint64_t* out_of_order) {
  TIERMEM_ASSIGN_OR_RETURN(std::unique_ptr<TimelineReader> reader, TimelineReader::Open(path));
  OrderedEvents events(reader.get());
  TimelineEntry e;
  while (true) {
    TIERMEM_ASSIGN_OR_RETURN(bool more, events.Next(&e));
    if (!more) break;
    fn(e);
  }
  if (out_of_order != nullptr) *out_of_order = events.out_of_order();
  return OkStatus();
}

// ---- Analyzer ------------------------------------------------------------------------------

struct Analyzer::Impl {
  struct Region {
    Bytes bytes;
    Category category;
  };
  struct OpenCopy {
    uint64_t ts;
    TierKind src, dst;
    Bytes bytes;
    ChunkId chunk;
    int phase;
    Category category;
  };
  struct OpenStall {
    uint64_t ts;
    size_t cause;
    int phase;
  };

  bool started = false;
  uint64_t last_ts = 0;
  Report report;
  std::array<std::array<long double, kNumCategories>, kNumTierKinds> area{};
  std::array<long double, kNumTierKinds> total_area{};
  std::array<std::unordered_map<uint64_t, Region>, kNumTierKinds> regions;
  std::unordered_map<uint64_t, OpenCopy> copies;
  std::unordered_map<uint64_t, OpenStall> stalls;
  std::map<std::pair<int, int>, MoveStats> moves;
  // Copies in flight and since when, for the unions of their intervals: per (src, dst) pair
  // and per tier as source (read) and as destination (write).
  struct Busy {
    uint64_t open = 0;
    uint64_t since = 0;
    void Begin(uint64_t ts) {
      if (open++ == 0) since = ts;
    }
    // Closes one copy; returns the interval to add when it was the last one in flight.
    uint64_t End(uint64_t ts) {
      if (open == 0) return 0;
      return --open == 0 ? ts - since : 0;
    }
  };
  std::map<std::pair<int, int>, Busy> pair_busy;
  std::array<Busy, kNumTierKinds> read_busy{}, write_busy{}, any_busy{};
  std::unordered_map<std::string, size_t> cause_index;
  std::unordered_map<ChunkId, ChunkStats> chunks;
  std::unordered_map<std::string, int> phase_index;
  int phase = -1;
  uint64_t phase_start = 0;
  std::string moment;
  bool have_iteration = false;
  uint64_t iteration_ts = 0;
  uint64_t steps = 0, step_sum = 0, step_min = std::numeric_limits<uint64_t>::max(), step_max = 0;

  std::string_view PhaseName() const {
    return phase < 0 ? std::string_view() : std::string_view(report.phases[phase].name);
  }
  void AddStep(uint64_t ns) {
    ++steps;
    step_sum += ns;
    step_min = std::min(step_min, ns);
    step_max = std::max(step_max, ns);
  }
  void SetPeak(Peak* p, Bytes bytes, uint64_t ts) {
    p->bytes = bytes;
    p->t_ns = ts - report.t0_ns;
    p->moment = moment;
    p->phase = std::string(PhaseName());
    p->kernel_launches = report.kernel_launches;
  }
};

Analyzer::Analyzer() : impl_(std::make_unique<Impl>()) {}
Analyzer::~Analyzer() = default;

std::string_view Analyzer::current_phase() const { return impl_->PhaseName(); }
std::string_view Analyzer::current_moment() const { return impl_->moment; }

TierKind Analyzer::Add(const Event& e, std::string_view label) {
  const uint64_t ts = AdvanceTo(e.ts_ns);
  Report& r = impl_->report;
  ++r.events;
  const int tier = TierIndex(e.tier);
  const int tier2 = TierIndex(e.tier2);
  if (tier >= 0) r.tiers[tier].seen = true;
  if (tier2 >= 0 && (e.type == EventType::kCopyBegin || e.type == EventType::kCopyEnd)) {
    r.tiers[tier2].seen = true;
  }
  switch (e.type) {
    case EventType::kAlloc:
      if (tier >= 0) OnAlloc(e, tier, ts);
      return tier >= 0 ? e.tier : TierKind::kNone;
    case EventType::kFree:
      return tier >= 0 && OnFree(e, tier) ? e.tier : TierKind::kNone;
    case EventType::kCopyBegin:
      OnCopyBegin(e, tier, tier2, ts);
      break;
    case EventType::kCopyEnd:
      OnCopyEnd(e, ts);
      break;
    case EventType::kStallBegin:
    case EventType::kStallEnd:
      OnStall(e, label, ts);
      break;
    case EventType::kPhase:
      OnPhase(label, ts);
      break;
    case EventType::kBudget:
    case EventType::kMoment:
    case EventType::kOom:
    case EventType::kIteration:
    case EventType::kKernelLaunches:
    case EventType::kPrefetch:
    case EventType::kCollective:
      OnMark(e, label, tier, tier2, ts);
      break;
  }
  return TierKind::kNone;
}

uint64_t Analyzer::AdvanceTo(uint64_t ts) {
  Impl& s = *impl_;
  if (!s.started) {
    s.started = true;
    s.last_ts = ts;
    t0_ = s.report.t0_ns = ts;
  }
  if (ts < s.last_ts) ts = s.last_ts;  // a late event is applied at the current time
  if (ts > s.last_ts) {
    const long double dt = static_cast<long double>(ts - s.last_ts);
    for (int t = 0; t < kNumTierKinds; ++t) {
      if (totals_[t] == 0) continue;
      for (int c = 0; c < kNumCategories; ++c) s.area[t][c] += usage_[t][c] * dt;
      s.total_area[t] += totals_[t] * dt;
    }
    s.last_ts = ts;
  }
  return ts;
}

void Analyzer::OnAlloc(const Event& e, int tier, uint64_t ts) {
  Impl& s = *impl_;
  Report& r = s.report;
  TierStats& ts_stats = r.tiers[tier];
  auto [it, inserted] = s.regions[tier].try_emplace(e.id, Impl::Region{e.bytes, e.category});
  if (!inserted) {  // re-allocation of a live id: the old region is gone
    usage_[tier][static_cast<int>(it->second.category)] -= it->second.bytes;
    totals_[tier] -= it->second.bytes;
    it->second = Impl::Region{e.bytes, e.category};
  }
  const int c = static_cast<int>(e.category);
  usage_[tier][c] += e.bytes;
  totals_[tier] += e.bytes;
  ++ts_stats.allocs;
  if (e.flags & kFlagManaged) ++ts_stats.managed_allocs;
  if (totals_[tier] > ts_stats.peak.bytes) s.SetPeak(&ts_stats.peak, totals_[tier], ts);
  if (usage_[tier][c] > ts_stats.categories[c].peak.bytes) {
    s.SetPeak(&ts_stats.categories[c].peak, usage_[tier][c], ts);
  }
  if (tier == static_cast<int>(TierKind::kDevice) && s.phase >= 0) {
    Bytes& p = r.phases[s.phase].device_peak_bytes;
    p = std::max(p, totals_[tier]);
  }
}

bool Analyzer::OnFree(const Event& e, int tier) {
  Impl& s = *impl_;
  auto it = s.regions[tier].find(e.id);
  if (it == s.regions[tier].end()) {
    ++s.report.unmatched_frees;
    return false;
  }
  usage_[tier][static_cast<int>(it->second.category)] -= it->second.bytes;
  totals_[tier] -= it->second.bytes;
  s.regions[tier].erase(it);
  ++s.report.tiers[tier].frees;
  return true;
}

void Analyzer::OnCopyBegin(const Event& e, int tier, int tier2, uint64_t ts) {
  Impl& s = *impl_;
  s.copies[e.id] = Impl::OpenCopy{ts, e.tier, e.tier2, e.bytes, e.chunk, s.phase, e.category};
  s.pair_busy[{static_cast<int>(e.tier), static_cast<int>(e.tier2)}].Begin(ts);
  if (tier >= 0) s.read_busy[tier].Begin(ts);
  if (tier2 >= 0) s.write_busy[tier2].Begin(ts);
  if (tier >= 0) s.any_busy[tier].Begin(ts);
  if (tier2 >= 0 && tier2 != tier) s.any_busy[tier2].Begin(ts);
}

void Analyzer::OnCopyEnd(const Event& e, uint64_t ts) {
  Impl& s = *impl_;
  Report& r = s.report;
  auto it = s.copies.find(e.id);
  if (it == s.copies.end()) {
    ++r.unmatched_copy_ends;
    return;
  }
  const Impl::OpenCopy& c = it->second;
  MoveStats& m = s.moves[{static_cast<int>(c.src), static_cast<int>(c.dst)}];
  m.src = c.src;
  m.dst = c.dst;
  m.active_ns += s.pair_busy[{static_cast<int>(c.src), static_cast<int>(c.dst)}].End(ts);
  const int src = TierIndex(c.src), dst = TierIndex(c.dst);
  if (src >= 0) r.io[src].read_active_ns += s.read_busy[src].End(ts);
  if (dst >= 0) r.io[dst].write_active_ns += s.write_busy[dst].End(ts);
  if (src >= 0) r.io[src].active_ns += s.any_busy[src].End(ts);
  if (dst >= 0 && dst != src) r.io[dst].active_ns += s.any_busy[dst].End(ts);
  if (e.flags & kFlagFailed) {
    ++m.failed;
    s.copies.erase(it);
    return;
  }
  const int cat = static_cast<int>(c.category);
  const bool known = cat >= 0 && cat < kNumCategories;
  if (src >= 0) r.io[src].read_bytes += c.bytes;
  if (dst >= 0) r.io[dst].write_bytes += c.bytes;
  if (src >= 0 && known) r.io[src].category_bytes[cat] += c.bytes;
  if (dst >= 0 && dst != src && known) r.io[dst].category_bytes[cat] += c.bytes;
  m.bytes += c.bytes;
  ++m.count;
  m.busy_ns += ts - c.ts;
  if (c.phase >= 0) r.phases[c.phase].bytes_moved += c.bytes;
  if (c.chunk != kNoChunk) {
    ChunkStats& ch = s.chunks[c.chunk];
    ch.chunk = c.chunk;
    ++ch.moves;
    ch.bytes += c.bytes;
  }
  s.copies.erase(it);
}

void Analyzer::OnStall(const Event& e, std::string_view label, uint64_t ts) {
  Impl& s = *impl_;
  Report& r = s.report;
  if (e.type == EventType::kStallBegin) {
    std::string cause = label.empty() ? std::string("(unlabelled)") : std::string(label);
    auto [it, inserted] = s.cause_index.try_emplace(cause, r.stalls.size());
    if (inserted) r.stalls.push_back(StallStats{cause, 0, 0});
    s.stalls[e.id] = Impl::OpenStall{ts, it->second, s.phase};
    return;
  }
  auto it = s.stalls.find(e.id);
  if (it == s.stalls.end()) {
    ++r.unmatched_stall_ends;
    return;
  }
  const uint64_t ns = ts - it->second.ts;
  StallStats& st = r.stalls[it->second.cause];
  st.ns += ns;
  ++st.count;
  r.stall_ns += ns;
  ++r.stall_count;
  if (it->second.phase >= 0) r.phases[it->second.phase].stall_ns += ns;
  s.stalls.erase(it);
}

void Analyzer::OnPhase(std::string_view label, uint64_t ts) {
  Impl& s = *impl_;
  Report& r = s.report;
  if (s.phase >= 0) r.phases[s.phase].time_ns += ts - s.phase_start;
  std::string name = label.empty() ? std::string("(unlabelled)") : std::string(label);
  auto [it, inserted] = s.phase_index.try_emplace(name, static_cast<int>(r.phases.size()));
  if (inserted) r.phases.push_back(PhaseStats{name});
  s.phase = it->second;
  s.phase_start = ts;
  ++r.phases[s.phase].count;
  Bytes& p = r.phases[s.phase].device_peak_bytes;
  p = std::max(p, totals_[static_cast<int>(TierKind::kDevice)]);
}

void Analyzer::OnMark(const Event& e, std::string_view label, int tier, int tier2, uint64_t ts) {
  Impl& s = *impl_;
  Report& r = s.report;
  switch (e.type) {
    case EventType::kBudget:
      if (tier < 0) break;
      r.tiers[tier].budget_bytes = e.bytes;
      r.tiers[tier].max_budget_bytes = std::max(r.tiers[tier].max_budget_bytes, e.bytes);
      break;
    case EventType::kMoment:
      s.moment.assign(label);
      break;
    case EventType::kOom:
      if (tier < 0) break;
      ++r.tiers[tier].ooms;
      r.tiers[tier].largest_oom_bytes = std::max(r.tiers[tier].largest_oom_bytes, e.bytes);
      break;
    case EventType::kIteration:
      if (s.have_iteration) s.AddStep(ts - s.iteration_ts);
      s.have_iteration = true;
      s.iteration_ts = ts;
      ++r.iterations;
      break;
    case EventType::kKernelLaunches:
      r.kernel_launches += e.bytes;
      ++r.kernel_launch_intervals;
      break;
    case EventType::kPrefetch:
      ++r.prefetches;
      r.prefetch_bytes += e.bytes;
      if (tier2 >= 0) r.tiers[tier2].seen = true;
      break;
    case EventType::kCollective: {
      const std::string op = label.empty() ? std::string("(unlabelled)") : std::string(label);
      auto it = std::find_if(r.collectives.begin(), r.collectives.end(),
                             [&](const CollectiveStats& c) { return c.op == op; });
      if (it == r.collectives.end()) it = r.collectives.insert(it, CollectiveStats{op});
      ++it->count;
      it->bytes += e.bytes;
      it->ns += e.id;
      break;
    }
    default:
      break;
  }
}

Report Analyzer::Finish() {
  Impl& s = *impl_;
  Report r = std::move(s.report);
  const uint64_t t_end = s.last_ts;
  r.duration_ns = s.started ? t_end - r.t0_ns : 0;
  if (s.phase >= 0) r.phases[s.phase].time_ns += t_end - s.phase_start;
  if (s.have_iteration && t_end > s.iteration_ts) s.AddStep(t_end - s.iteration_ts);
  if (s.steps > 0) {
    r.step_mean_ns = s.step_sum / s.steps;
    r.step_min_ns = s.step_min;
    r.step_max_ns = s.step_max;
  }
  for (int t = 0; t < kNumTierKinds; ++t) {
    TierStats& ts = r.tiers[t];
    ts.end_bytes = totals_[t];
    if (r.duration_ns > 0) {
      ts.avg_bytes = static_cast<double>(s.total_area[t] / r.duration_ns);
      for (int c = 0; c < kNumCategories; ++c) {
        ts.categories[c].avg_bytes = static_cast<double>(s.area[t][c] / r.duration_ns);
      }
    }
  }
  for (auto& [key, m] : s.moves) r.moves.push_back(m);
  std::stable_sort(r.moves.begin(), r.moves.end(),
                   [](const MoveStats& a, const MoveStats& b) { return a.bytes > b.bytes; });
  std::stable_sort(r.stalls.begin(), r.stalls.end(),
                   [](const StallStats& a, const StallStats& b) { return a.ns > b.ns; });
  for (auto& [id, c] : s.chunks) r.top_chunks.push_back(c);
  std::sort(r.top_chunks.begin(), r.top_chunks.end(), [](const ChunkStats& a, const ChunkStats& b) {
    if (a.moves != b.moves) return a.moves > b.moves;
    if (a.bytes != b.bytes) return a.bytes > b.bytes;
    return a.chunk < b.chunk;
  });
  if (r.top_chunks.size() > 10) r.top_chunks.resize(10);
  r.open_copies = s.copies.size();
  r.open_stalls = s.stalls.size();
  impl_ = std::make_unique<Impl>();
  return r;
}

StatusOr<Report> AnalyzeFile(const std::string& path) {
  TIERMEM_ASSIGN_OR_RETURN(std::unique_ptr<TimelineReader> reader, TimelineReader::Open(path));
  OrderedEvents events(reader.get());
  Analyzer analyzer;
  TimelineEntry e;
  while (true) {
    TIERMEM_ASSIGN_OR_RETURN(bool more, events.Next(&e));
    if (!more) break;
    analyzer.Add(e.event, e.label);
  }
  Report r = analyzer.Finish();
  r.blocks = reader->blocks_read();
  r.complete = reader->complete();
  r.end_note = reader->end_note();
  r.out_of_order = events.out_of_order();
  r.wall_start_ns = reader->info().wall_start_ns;
  return r;
}

}  // namespace tiermem::prof
