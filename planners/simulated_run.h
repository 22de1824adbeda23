// SimulatedRun: the simulator's discrete-event run of effective iterations under a policy
// against a machine model — the simulated twin of runtime's PlanRunner, which executes plans
// on the real chunk engine. It keeps two views of every tier.
//
// Program order. Policies decide in the order the runtime would (before each moment's compute)
// and see the program-order state: which chunk is cached where, dirty or not, and the bytes
// in use per tier counting every region allocated and not yet freed in program order. A
// policy must keep that within the budget: Fetch() refuses an allocation that would exceed
// it (a policy bug), and a moment whose chunks are not resident on their tier when it runs is
// refused too. Frees are issued in program order but happen when the copy that empties the
// region ends (a dirty eviction frees its region when its write-back completes).
//
// Time. Copies run on one FIFO lane per directed tier pair, concurrently with each other and
// with compute; the device stream runs moments one after another; an overlapped optimizer
// step runs on the CPU lane. An allocation happens at the earliest time at which the tier has
// room for it from then on, given every allocation and free issued so far (OccupancyProfile):
// so the schedule in time never exceeds a budget, which the profile asserts (a violation is
// an internal error, i.e. a bug here). A moment starts when the stream is free, its chunks'
// copies are done (and nothing still writes them), its activations are back and its device
// temporaries are allocated; the wait is a stall, attributed to the last thing it waited for.
//
// Moment lifecycle in Run(): the policy's Before(i) issues evictions and fetches at the
// moment's issue time (the end of the previous moment's compute); accesses on a chunk's home
// tier drop a copy cached above it (written back first if dirty: the moment waits); the
// moment's temporaries and new saved activations are allocated at its compute start; at its
// end temporaries are freed, offloaded activations start their copy to the host, and spans
// whose backward it is are freed.
//
// Thread-safety: externally synchronized; a single-threaded discrete simulation.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "planners/effective.h"
#include "planners/machine.h"
#include "planners/trace.h"

namespace tiermem::planners {

// Why the device stream (or the iteration's end) waited.
enum class StallCause : uint8_t {
  kFetch = 0,       // a chunk's copy into its tier was not done
  kWriteBack = 1,   // a write-back the moment depends on (a dirty copy dropped to its home)
  kRoom = 2,        // an allocation waited for a region to be freed
  kActivation = 3,  // an offloaded activation was not back yet
  kOptimizer = 4,   // an overlapped CPU optimizer step (its results, or the iteration's end)
};
inline constexpr int kNumStallCauses = 5;
std::string_view StallCauseName(StallCause c);  // "fetch", "write-back", ...

using PairBytes = std::array<std::array<Bytes, kNumTierKinds>, kNumTierKinds>;

// One moment as executed (SimulatedRun::set_record_moments).
struct MomentTiming {
  std::string label;
  uint64_t issue_ns = 0, start_ns = 0, end_ns = 0;  // since the iteration's start
  uint64_t stall_ns = 0;
  StallCause cause = StallCause::kFetch;
  bool async = false;
  uint32_t fetches = 0, evictions = 0;  // issued at this moment
  Bytes device_bytes = 0;               // in use on the device after its actions (program order)
};

// A move a policy made in its Before() (SimulatedRun::set_move_log); MimicSchedule turns the
// moves of a baseline into plan actions.
struct LoggedMove {
  uint32_t moment = 0;  // the moment whose Before() made it
  bool evict = false;
  ChunkId chunk = kNoChunk;
  TierKind tier = TierKind::kNone;  // fetch: the tier it came to; evict: the tier it left
  bool copy = true;                 // fetch: copies content (false: allocation only)
};

struct IterationStats {
  uint64_t iteration_ns = 0;  // = compute_ns + stall_ns
  uint64_t compute_ns = 0;    // device-stream compute (recompute included)
  uint64_t recompute_ns = 0;
  uint64_t cpu_overlap_ns = 0;  // optimizer compute run on the CPU lane, overlapped
  uint64_t stall_ns = 0;
  std::array<uint64_t, kNumStallCauses> stall_by_cause{};
  PairBytes bytes{};              // [src][dst] copies issued for this iteration
  Bytes activation_bytes_in = 0;  // activation bytes copied host->device
  uint64_t fetches = 0, evictions = 0, writebacks = 0;
  std::vector<MomentTiming> moments;  // when recording
  Bytes DeviceInBytes() const;        // into the device tier from host and NVMe
  Bytes NvmeBytes() const;            // to and from the NVMe tier, either way
};

// Program-order per-chunk state visible to policies.
struct ChunkView {
  TierKind cache = TierKind::kNone;  // tier of the cached copy above home, kNone if none
  bool dirty = false;
  uint64_t last_use = 0;  // program counter of its last access (0 = never)
};

// Residency (program order): per chunk the tier of its cached copy above home (kNone: only
// the home copy) and whether it is dirty. A plan is made for one.
struct StartState {
  std::vector<TierKind> cache;
  std::vector<bool> dirty;
};

// The occupancy of one tier over time. Allocations and frees are issued in program order at
// non-decreasing issue times; Alloc returns the earliest time >= t from which `bytes` fit
// for good given all events issued so far. Externally synchronized.
class OccupancyProfile {
 public:
  explicit OccupancyProfile(Bytes capacity = 0) : cap_(capacity) {}
  void Advance(uint64_t now);  // folds events at or before `now` (no later request is earlier)
  StatusOr<uint64_t> Alloc(Bytes bytes, uint64_t t);
  // The earliest time a >= t at which `bytes` fit during [a, a + duration), given all events
  // issued so far; allocates them for that window (a region whose free time is known).
  StatusOr<uint64_t> AllocFor(Bytes bytes, uint64_t t, uint64_t duration);
  Status Free(Bytes bytes, uint64_t t);
  Bytes peak() const { return peak_; }
  // Restarts peak tracking from the occupancy now and after (e.g. after a warm-up).
  void ResetPeak();
  Bytes capacity() const { return cap_; }

 private:
  Bytes cap_;
  int64_t base_ = 0;  // occupancy at base_t_ and before the first event
  uint64_t base_t_ = 0;
  std::map<uint64_t, int64_t> delta_;  // future changes by time
  Bytes peak_ = 0;
};

class SimulatedRun;

// A policy decides the moves. Before() must leave every access of moment `i` resident on its
// tier (a chunk accessed on its home tier may stay cached above: the simulated run drops it) with
// room for the moment's non-chunk bytes (SimulatedRun::NeedExtra).
class Policy {
 public:
  virtual ~Policy() = default;
  virtual Status BeginIteration(SimulatedRun& ex) { return OkStatus(); }
  virtual Status Before(SimulatedRun& ex, size_t i) = 0;
  virtual void After(SimulatedRun& ex, size_t i) {}
};

class SimulatedRun {
 public:
  // `trace` and `machine` must outlive the simulated run. Homes are fixed for its lifetime.
  // kResourceExhausted when the homes do not fit their tiers.
  static StatusOr<std::unique_ptr<SimulatedRun>> Create(const Trace* trace,
                                                        const MachineModel* machine,
                                                        std::vector<TierKind> homes);

  // Runs one effective iteration (`it` must outlive the call) under `policy`. `tag` is the
  // iteration index the copies are accounted to. On error the simulated run is unusable.
  StatusOr<IterationStats> Run(const EffIteration& it, Policy& policy, uint32_t tag);

  // ---- for policies (program order) --------------------------------------------------------
  const EffIteration& iteration() const { return *it_; }
  uint32_t tag() const { return tag_; }
  const ChunkView& Chunk(ChunkId c) const { return view_[c]; }
  TierKind Home(ChunkId c) const { return homes_[c]; }
  Bytes ChunkBytes(ChunkId c) const { return trace_->chunks[c].bytes; }
  size_t NumChunks() const { return view_.size(); }
  Bytes Used(TierKind t) const { return used_[Idx(t)]; }
  Bytes Budget(TierKind t) const { return machine_->Budget(t); }
  Bytes Free(TierKind t) const { return Budget(t) - std::min(Budget(t), Used(t)); }
  // Non-chunk bytes moment `i` allocates on tier `t` beyond what is already allocated when
  // its actions are issued (device: temporaries, new saved activations, fetched-back ones;
  // host: offload copies made at its end).
  Bytes NeedExtra(size_t i, TierKind t) const;
  uint64_t program_counter() const { return pc_; }
  const Trace& trace() const { return *trace_; }
  const MachineModel& machine() const { return *machine_; }

  // ---- for the driver ----------------------------------------------------------------------
  // Before the first Run: chunk `c` starts cached on `tier` (above its home).
  Status Preload(ChunkId c, TierKind tier, bool dirty);
  StartState State() const;
  // Peak bytes in use on tier `t` over time (chunks and activations) since ResetPeaks().
  Bytes Peak(TierKind t) const { return profile_[Idx(t)].peak(); }
  void ResetPeaks() {
    for (OccupancyProfile& p : profile_) p.ResetPeak();
  }
  // Copies issued for iterations that were never run (prefetches past the simulated window).
  PairBytes Unclaimed() const;
  // Keep a MomentTiming per moment in the stats of the iterations run from now on.
  void set_record_moments(bool on) { record_ = on; }
  // Appends every move a policy's Before() makes from now on to `*log` (nullptr: stop); moves
  // the run makes itself (a copy dropped for an access on its home tier) are not logged.
  // `log` must outlive the logging.
  void set_move_log(std::vector<LoggedMove>* log) { log_ = log; }

  // Brings chunk `c` to tier `to` (above its home) from its cached copy or its home; with
  // copy=false only allocates (the moment overwrites it). No-op if already cached there.
  // `need_tag` is the iteration whose moment needs it (copies are accounted to it).
  // kInternal if `to` lacks room in program order (a policy bug).
  Status Fetch(ChunkId c, TierKind to, bool copy, uint32_t need_tag);
  Status Fetch(ChunkId c, TierKind to, bool copy) { return Fetch(c, to, copy, tag_); }
  // Drops the cached copy of `c` (writing it back to its home first if dirty). No-op if none.
  Status Evict(ChunkId c);
  // Writes a dirty cached copy of `c` home in the background and keeps it, clean (the engine's
  // write-behind): whatever touches the copy next — an access, a fetch from it, its eviction,
  // which then frees its region — waits for the copy (stall cause write-back). No-op unless
  // `c` is cached, dirty and holds data. Not logged (no plan action is a write-back alone).
  Status WriteBack(ChunkId c);

 private:
  struct ChunkTimes {
    uint64_t ready = 0;       // the cached copy is usable (its fetch ended)
    uint64_t home_ready = 0;  // the home copy is current (its write-back ended)
    uint64_t last_end = 0;    // end of the last moment that accessed it
    uint64_t writer_end = 0;  // end of the last moment that modified it
    bool valid = true;        // the cached copy holds data (false: allocated, not yet written)
    StallCause ready_cause = StallCause::kFetch;
  };
  struct Lane {
    uint64_t free_at = 0;
  };

  SimulatedRun(const Trace* trace, const MachineModel* machine, std::vector<TierKind> homes);
  static int Idx(TierKind t) { return static_cast<int>(t); }
  StatusOr<uint64_t> Alloc(TierKind t, Bytes bytes, uint64_t at);
  // Bytes allocated at a moment's compute start and freed at its end (program order: within
  // the moment), for `duration` ns from the returned time.
  StatusOr<uint64_t> AllocTransient(TierKind t, Bytes bytes, uint64_t at, uint64_t duration);
  Status FreeAt(TierKind t, Bytes bytes, uint64_t at);
  // Copies on the (src, dst) lane starting no earlier than `at`; returns the end.
  uint64_t Copy(TierKind src, TierKind dst, Bytes bytes, uint64_t at, uint32_t tag);
  Status RunMoment(size_t i, Policy& policy);

  const Trace* trace_;
  const MachineModel* machine_;
  std::vector<TierKind> homes_;
  std::vector<ChunkView> view_;
  std::vector<ChunkTimes> times_;
  std::array<Bytes, kNumTierKinds> used_{};
  std::array<OccupancyProfile, kNumTierKinds> profile_;
  std::array<std::array<Lane, kNumTierKinds>, kNumTierKinds> lanes_{};
  uint64_t stream_t_ = 0;  // the device stream is free from here
  uint64_t cpu_t_ = 0;     // the CPU lane is free from here
  uint64_t issue_t_ = 0;   // issue time of the current moment's actions
  uint64_t pc_ = 0;        // program counter: moments run so far (all iterations)
  bool record_ = false;
  std::vector<LoggedMove>* log_ = nullptr;  // set_move_log
  bool in_before_ = false;                  // inside a policy's Before(): moves are logged
  size_t cur_moment_ = 0;                   // the moment whose Before() runs
  uint64_t iter_start_ = 0;

  // Current iteration.
  const EffIteration* it_ = nullptr;
  uint32_t tag_ = 0;
  std::map<uint32_t, IterationStats> stats_;  // by tag (copies for later iterations too)
  std::vector<uint64_t> span_d2h_end_;        // per span: when its offload copy ended
  std::vector<uint64_t> span_h2d_end_;        // per span: when its fetch back ended
};

}  // namespace tiermem::planners
