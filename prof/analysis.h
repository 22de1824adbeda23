// The analysis side of `tiermem prof`: a time-ordered event stream over a TimelineReader, a
// streaming Analyzer that tracks memory in use per tier and category, copies, stalls, phases
// and iterations, and the Report it produces. Depends only on base, so any recorder
// that writes the timeline format (the linked engine, the LD_PRELOAD shim) can be analysed.
//
// Semantics (also in docs/profiling.md):
//  - Times in the report are ns relative to t0, the timestamp of the first event.
//  - Memory in use on a tier = sum of bytes of live regions (kAlloc adds, kFree of a known
//    region removes the bytes it was allocated with). Regions are keyed by (tier, id).
//  - Average = time-weighted over [t0, t_end] (t_end = the last event's timestamp).
//  - A peak is the first moment the maximum is reached; it carries the label of the last
//    kMoment and kPhase seen before it.
//  - Bytes moved count completed copies (kCopyEnd without kFlagFailed), per (src, dst).
//  - Stall time = kStallEnd - kStallBegin per stall id, by the cause label of the begin.
//  - Phase time runs from a kPhase marker to the next kPhase marker (or t_end); copies and
//    stalls are attributed to the phase current at their begin, device peaks to the phase
//    current at the peak.
//  - Step time = time between consecutive kIteration markers; the last iteration runs to
//    t_end.
//  - Kernel launches (preload shim) = sum of kKernelLaunches counts; a peak carries the
//    launches counted before it, relating memory to progress. Prefetches (kPrefetch) are
//    counted when issued; their completion is not observed, so they are not bytes moved.
// Thread-safety: all classes are externally synchronized; the functions are reentrant.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base/status.h"
#include "base/timeline_event.h"
#include "base/timeline_reader.h"
#include "base/units.h"

namespace tiermem::prof {

// Yields a file's events in timestamp order (ties: file order). Blocks of one recorder
// thread are already ordered; threads are merged, holding `window` events back (about 72 MB
// for the default), so an event may arrive up to `window` events late in the file. An event
// that arrives after a later one was already handed out (possible only if a thread's events
// were more than `window` events late, or if timestamps were supplied out of order) is handed
// out on arrival and counted in out_of_order().
class OrderedEvents {
 public:
  static constexpr size_t kDefaultWindow = 1 << 20;
  // `reader` must outlive this object.
  explicit OrderedEvents(TimelineReader* reader, size_t window = kDefaultWindow)
      : reader_(reader), window_(window) {}

  // Like TimelineReader::Next; out->label is resolved and stays valid while the reader lives.
  StatusOr<bool> Next(TimelineEntry* out);
  uint64_t out_of_order() const { return out_of_order_; }

 private:
  struct Queue {
    uint32_t thread;
    std::deque<TimelineEntry> events;
  };
  bool PopMin(TimelineEntry* out);

  TimelineReader* reader_;
  size_t window_;
  std::vector<Queue> queues_;
  size_t buffered_ = 0;
  bool eof_ = false;
  uint64_t last_ts_ = 0;
  bool emitted_any_ = false;
  uint64_t out_of_order_ = 0;
};

struct Peak {
  Bytes bytes = 0;
  uint64_t t_ns = 0;             // relative to t0
  std::string moment;            // last kMoment label before the peak ("" if none)
  std::string phase;             // last kPhase label before the peak ("" if none)
  uint64_t kernel_launches = 0;  // kernel launches counted before the peak
};

struct CategoryStats {
  Peak peak;
  double avg_bytes = 0;
};

struct TierStats {
  bool seen = false;  // any event concerned this tier
  Peak peak;          // of the tier's total
  double avg_bytes = 0;
  Bytes end_bytes = 0;     // in use at t_end
  Bytes budget_bytes = 0;  // last kBudget (0 = never set)
  Bytes max_budget_bytes = 0;
  uint64_t allocs = 0;
  uint64_t frees = 0;
  uint64_t ooms = 0;
  Bytes largest_oom_bytes = 0;
  uint64_t managed_allocs = 0;  // kAlloc with kFlagManaged (CUDA managed memory)
  std::array<CategoryStats, kNumCategories> categories;
};

struct MoveStats {
  TierKind src = TierKind::kNone;
  TierKind dst = TierKind::kNone;
  Bytes bytes = 0;       // completed copies only
  uint64_t count = 0;    // completed copies
  uint64_t failed = 0;   // copies that ended with kFlagFailed
  uint64_t busy_ns = 0;  // sum of (end - begin) over completed copies
  // Time at least one copy of this pair was in flight (the union of the copies' intervals,
  // failed ones included): bytes / active_ns is the pair's achieved rate with copies
  // overlapping, where bytes / busy_ns is the rate of one copy.
  uint64_t active_ns = 0;
};

// Copies out of (read) and into (write) one tier, whatever the other end: completed bytes and
// the union of the copies' intervals — the tier's achieved rate while it was moving data
// (an NVMe tier's disk rate inside a training step, to compare with fio's).
struct IoStats {
  Bytes read_bytes = 0, write_bytes = 0;
  // Completed bytes out of and into the tier, by the copies' Category (kOptimState on NVMe:
  // the optimizer-state traffic a compressed state format shrinks).
  std::array<Bytes, kNumCategories> category_bytes{};
  uint64_t read_active_ns = 0, write_active_ns = 0;
  uint64_t active_ns = 0;  // the union over both directions (reads and writes share a disk)
};

struct StallStats {
  std::string cause;
  uint64_t ns = 0;
  uint64_t count = 0;
};

// Collectives of a sharded session, by operation (kCollective events).
struct CollectiveStats {
  std::string op;
  uint64_t count = 0;
  Bytes bytes = 0;
  uint64_t ns = 0;
};

struct ChunkStats {
  ChunkId chunk = kNoChunk;
  uint64_t moves = 0;  // completed copies of the chunk
  Bytes bytes = 0;
};

struct PhaseStats {
  std::string name;
  uint64_t count = 0;  // times the phase began
  uint64_t time_ns = 0;
  uint64_t stall_ns = 0;
  Bytes bytes_moved = 0;
  Bytes device_peak_bytes = 0;
};

struct Report {
  // The file.
  uint64_t events = 0;
  uint64_t blocks = 0;
  bool complete = false;      // the recorder closed the file
  std::string end_note;       // the reader's truncation note ("" if complete)
  uint64_t out_of_order = 0;  // see OrderedEvents
  uint64_t wall_start_ns = 0;
  // Time.
  uint64_t t0_ns = 0;        // absolute timestamp of the first event
  uint64_t duration_ns = 0;  // t_end - t0
  std::array<TierStats, kNumTierKinds> tiers;
  std::vector<MoveStats> moves;           // by bytes, descending
  std::array<IoStats, kNumTierKinds> io;  // per TierKind
  uint64_t stall_ns = 0;
  uint64_t stall_count = 0;
  std::vector<StallStats> stalls;      // by ns, descending
  std::vector<ChunkStats> top_chunks;  // by moves then bytes, descending; at most 10
  std::vector<PhaseStats> phases;      // in order of first appearance
  uint64_t iterations = 0;
  uint64_t kernel_launches = 0;          // sum over kKernelLaunches events
  uint64_t kernel_launch_intervals = 0;  // kKernelLaunches events
  uint64_t prefetches = 0;               // kPrefetch events (issued)
  Bytes prefetch_bytes = 0;
  std::vector<CollectiveStats> collectives;  // in order of first appearance
  uint64_t step_mean_ns = 0, step_min_ns = 0, step_max_ns = 0;
  // Pairing problems (reported, never fatal).
  uint64_t unmatched_frees = 0;
  uint64_t unmatched_copy_ends = 0;
  uint64_t unmatched_stall_ends = 0;
  uint64_t open_copies = 0;  // begun, not ended at t_end
  uint64_t open_stalls = 0;
};

// Per-tier, per-category bytes in use.
using Usage = std::array<std::array<Bytes, kNumCategories>, kNumTierKinds>;

// Streaming analysis; feed events in time order (OrderedEvents), then Finish().
class Analyzer {
 public:
  Analyzer();
  ~Analyzer();
  // Returns the tier whose usage changed (kNone if none).
  TierKind Add(const Event& e, std::string_view label);
  Report Finish();

  const Usage& usage() const { return usage_; }
  Bytes tier_total(int tier) const { return totals_[tier]; }
  std::string_view current_phase() const;
  std::string_view current_moment() const;
  uint64_t t0_ns() const { return t0_; }

 private:
  struct Impl;
  // Add's steps: the areas integrated up to `ts`, returning the time the event applies at
  // (never before the previous event's), then one handler per event family. `tier`, `tier2`:
  // the event's tiers as indices (-1: none).
  uint64_t AdvanceTo(uint64_t ts);
  void OnAlloc(const Event& e, int tier, uint64_t ts);
  bool OnFree(const Event& e, int tier);  // false: no such live region
  void OnCopyBegin(const Event& e, int tier, int tier2, uint64_t ts);
  void OnCopyEnd(const Event& e, uint64_t ts);
  void OnStall(const Event& e, std::string_view label, uint64_t ts);  // begin or end
  void OnPhase(std::string_view label, uint64_t ts);
  // Budget, moment, OOM, iteration, kernel-launch, prefetch and collective marks.
  void OnMark(const Event& e, std::string_view label, int tier, int tier2, uint64_t ts);

  std::unique_ptr<Impl> impl_;
  Usage usage_{};
  std::array<Bytes, kNumTierKinds> totals_{};
  uint64_t t0_ = 0;
};

// Reads `path` to the end and analyses it. A truncated file is analysed as far as it goes
// (report.complete = false, report.end_note says where it ends); corruption is an error.
StatusOr<Report> AnalyzeFile(const std::string& path);

// Calls fn(entry) for every event of `path` in time order (corruption: the error; truncation:
// OK, the events of the complete blocks). Shared by the analyzer, the HTML and the Perfetto
// renderers.
Status ForEachOrdered(const std::string& path, const std::function<void(const TimelineEntry&)>& fn,
                      uint64_t* out_of_order = nullptr);

}  // namespace tiermem::prof
