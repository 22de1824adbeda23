// Engine: the residency manager of chunks across the device, host and NVMe tiers.
//
// Every chunk has a *home* — a permanent region on the host tier when it fits there (keeping
// `host_reserve_bytes` free as working space), else on NVMe — and at most one *cached copy*
// on a tier above its home (device; or host for an NVMe-homed chunk). The chunk is *resident*
// on the tier of its cached copy if it has one, else on its home tier; it is *in flight*
// while a move of its cached copy runs (a prefetch into it, or a background write-back from
// it). `dirty` means the cached copy differs from the home copy, so evicting a clean chunk
// only frees its region (no bytes move). Each chunk's state is named (Flight, Content below;
// engine.cc has the lifecycle and the invariants).
//
// Acquire(chunk, tier) makes the chunk resident on `tier` (device or host), pins it, and
// returns its address there; Release unpins (and marks it modified if it was written). A
// pinned chunk never moves. When a tier is full, the EvictionPolicy picks an unpinned cached
// chunk to evict: farthest next use in the recorded order of acquires (the previous
// iteration's) while the current iteration follows it, least recently used otherwise, clean
// first. While the order is followed, each Acquire also prefetches ahead of it in the order,
// asynchronously (EngineConfig::lookahead):
//   - kDepth (the default): the next `prefetch_depth` acquires of this iteration, evicting for
//     them only clean chunks whose next use is later;
//   - kRoom (opt-in until it is measured to win on a quiet machine): host acquires as far ahead as
//   host room can be made — for the
//     lookahead the order is taken to repeat (as cyclic below), so the window runs past the
//     end of the backward into the next iteration's first uses (the deferred optimizer
//     updates' reads of grads, m and v). For room it takes the chunk used farthest after the
//     entry (in that repeating order), clean or dirty: a clean one is evicted, a dirty one is
//     written home in the background (as write-behind) and the lookahead waits for it — a
//     later acquire's or release's prefetch evicts it clean —, so no clean chunk needed sooner
//     is dropped while a dirty one needed later stays. Device acquires still look
//     `prefetch_depth` ahead (the
//     device's room is shared with activations that grow through the forward). A tier's
//     lookahead stops at its first entry that finds no room, so nothing is evicted for a use
//     later than one it could not serve; no prefetch ever evicts a chunk needed sooner than the
//     one it brings.
// An acquire whose chunk had to be read synchronously (no move of it was started) is a *miss*,
// one that waited for a prefetch not yet landed is *late* (EngineStats::waits, by phase too).
// Waiting for an unfinished prefetch or a write-back is a *stall*, recorded with its cause.
// Following tolerates accesses of the order that do not come (an optimizer update that ran
// early, before an eval forward): an acquire found a few entries ahead (kResyncWindow) skips
// to it; an iteration followed only by skipping keeps the old order for the next one (the
// skipped accesses usually come back), and the new one is adopted when it skips again
// (chunks/access_order.h keeps the order).
//
// Write-behind: while the order is followed, a chunk released modified and unpinned whose
// next use is more than 2 x `prefetch_depth` acquires away (or not again this iteration), on
// a tier that had to evict during the previous iteration (without pressure the copy would
// just stay), is written home in the background right away, so that its later eviction only frees
// the region instead of stalling on the write. The copy is in flight like a prefetch: anything that
// touches the chunk (acquire, evict, read, write, zero, flush) waits for it first, so nothing
// writes the cached copy while it is being read; when it is done the chunk is clean. A failed
// write-back leaves the cached copy in place and dirty (nothing is lost) and is returned by
// whatever waited for it.
//
// Cyclic order (SetCyclic, for serving: every iteration is the same forward): the recorded
// order is taken to repeat, so the prefetch window runs past
// the end of the iteration into the start of the next one and a chunk's next use after its
// last one this iteration is its first one in the next (farthest-next-use then keeps what the
// next forward needs soonest).
//
// External bytes (SetExternalBytes): device or host memory the caller keeps live outside
// chunks (a KV cache and activations on the device, offloaded activations on the host) counts
// against that tier's budget: cached chunks are evicted to make room for it (homes are not:
// a host budget full of homes refuses), and chunk allocations only use what is left.
//
// Read-only homes (SetReadOnlyHome; serving a checkpoint in place): a chunk's NVMe home may
// be a region the NVMe tier only reads (a span list of the user's checkpoint files). Such a
// chunk is never dirty: every write of it is refused with kFailedPrecondition (see
// SetReadOnlyHome), so nothing ever writes the region; eviction only frees its cached copy.
//
// Planned mode (SetPlanned; runtime/plan_runner.h drives it from a planner's plan):
// the plan's actions replace the lookahead prefetch and write-behind above. PlanEvict drops a
// cached copy — a dirty one is first written home in the background (a write-behind that
// frees the region when it ends, so the room is reusable then) — and PlanPrefetch starts a
// copy into a tier, using only free room (it waits for no one and evicts nothing: a prefetch
// that finds the room still held by planned write-backs is deferred, in order, until they
// end). Acquire is unchanged: it makes the chunk resident whatever the plan did, evicting by
// farthest next use when the tier is full, so a plan can cost bytes but never change a value.
//
// Scratch (AllocateScratch): a region on a tier outside every chunk, for a binding's
// temporaries that must count in the budget (a sharded session's gathered chunks, an
// activation spilled to NVMe and its host bounce). On the device or host it is allocated like
// a chunk's copy — evicting unpinned chunks for room —, on NVMe from its free room (homes are
// never evicted); it shows in the timeline as a region of its category without a chunk;
// FreeScratch records the caller's compute use of it (tiers/tier.h) before the memory goes
// back.
//
// Ordering against compute (tiers/tier.h; SetComputeStream): the caller computes on device
// chunks with work queued on a stream (torch's current CUDA stream; a SimStream in tests;
// kHostStream for CPU tensors, the default). Every Release of a chunk cached on the device
// records a compute use of its region on that stream, and so do ReadAt/WriteAt before they
// copy, so write-backs, reads and reuse of the memory wait for the work queued so far. An
// Acquire on the device of a chunk whose prefetch from host memory (one direct copy) is still
// in flight does not block: the stream is made to wait for the copy (a *device wait*,
// counted); a prefetch that bounces through staging (NVMe home), and any prefetch when the
// compute is the caller's own thread (kHostStream), is waited for on the host.
//
// Every allocation, free, move, stall, moment and phase goes to the timeline recorder when
// one is attached (the external bytes as one region of category `activation`); moves go
// through the Mover.
//
// Thread-safety: externally synchronized (one thread drives the engine; completions of moves
// fire on the tiers' threads and touch only their Completion objects).
// Ownership: tiers, mover and recorder must outlive the engine; the engine owns its regions
// and frees them on destruction (after waiting for moves in flight).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/timeline.h"
#include "chunks/access_order.h"
#include "chunks/eviction_policy.h"
#include "chunks/expert_cache.h"
#include "chunks/mover.h"
#include "tiers/tier.h"

namespace tiermem::chunks {

// The timeline id of the external-bytes pseudo-region of the device tier; the host's is the
// next one (tiers count ids up from 1).
inline constexpr uint64_t kExternalRegionId = 0xffffffffffffff00ull;

// How far the lookahead prefetch looks ahead in the recorded order (the file comment).
enum class Lookahead : uint8_t {
  kDepth,  // `prefetch_depth` acquires, within the iteration, evicting only clean chunks
  kRoom,   // as far as host/device room can be made, across the iteration boundary
};

struct EngineConfig {
  int prefetch_depth = 4;  // acquires of lookahead in the recorded order (0 = off)
  Lookahead lookahead = Lookahead::kDepth;
  bool write_behind = true;      // background write-back of dirty chunks not needed soon
  Bytes host_reserve_bytes = 0;  // host bytes never used for homes (caches of NVMe chunks)
};

struct EngineTiers {
  // Optional: without one (device_kind "host") the host tier is where compute acquires
  // chunks, and every device call (Acquire, external bytes, scratch) is kFailedPrecondition.
  Tier* device = nullptr;
  Tier* host = nullptr;  // required, byte-addressable
  Tier* nvme = nullptr;  // optional
};

// Acquires that found their chunk not yet resident where asked and had to wait for bytes to
// come from below: a *miss* (no move of it was started before the acquire: the acquire reads
// it synchronously) or *late* (a prefetch was started but had not landed). Zero fills are
// neither (no bytes are read).
struct AcquireWaits {
  uint64_t misses = 0;
  Bytes miss_bytes = 0;
  uint64_t late = 0;
  Bytes late_bytes = 0;
};

struct EngineStats {
  std::array<TierStats, kNumTierKinds> tiers{};  // per TierKind (device, host, nvme)
  // bytes_moved[src][dst] by TierKind index.
  std::array<std::array<Bytes, kNumTierKinds>, kNumTierKinds> bytes_moved{};
  // Bytes moved to or from the NVMe tier, by the chunks' Category (optimizer state: the
  // bytes compressed state saves there).
  std::array<Bytes, kNumCategories> nvme_bytes_by_category{};
  uint64_t stall_ns = 0;
  uint64_t stalls = 0;
  uint64_t evictions = 0;
  uint64_t clean_evictions = 0;  // evictions that moved no bytes
  uint64_t prefetches = 0;
  uint64_t hint_prefetches = 0;  // PrefetchHint's (counted in prefetches too)
  uint64_t write_behinds = 0;    // background write-backs started
  uint64_t acquires = 0;
  AcquireWaits waits;  // over all acquires
  // The same by the timeline phase current at the acquire (Phase; "" before the first one),
  // in the order the phases first came.
  std::vector<std::pair<std::string, AcquireWaits>> waits_by_phase;
  uint64_t iterations = 0;
  uint64_t diverged = 0;  // iterations whose acquires left the recorded order
  uint64_t resynced = 0;  // acquires that skipped ahead in it (accesses that did not come)
  // Planned mode: actions applied, actions that did not apply (already there, pinned, no
  // room), prefetches deferred behind planned write-backs.
  uint64_t plan_prefetches = 0, plan_evictions = 0, plan_skipped = 0, plan_deferred = 0;
  // Acquires that ordered the compute stream after a prefetch still in flight instead of
  // blocking (devices with ComputeOrdering only).
  uint64_t device_waits = 0;
  // The most external bytes (SetExternalBytes) each tier held at once, by TierKind index.
  std::array<Bytes, kNumTierKinds> external_peak{};
  // Scratch bytes (AllocateScratch) live now and at most, by TierKind index.
  std::array<Bytes, kNumTierKinds> scratch{}, scratch_peak{};
};

class Engine {
 public:
  // kInvalidArgument without a byte-addressable host tier.
  static StatusOr<std::unique_ptr<Engine>> Create(const EngineConfig& config, EngineTiers tiers,
                                                  Mover* mover, TimelineRecorder* recorder,
                                                  std::unique_ptr<EvictionPolicy> policy = nullptr);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Adds a chunk of `bytes` (content: zeros) homed on host if it fits, else on NVMe.
  // kResourceExhausted naming the bytes needed when neither has room.
  StatusOr<ChunkId> AddChunk(Bytes bytes, Category category);
  // Same with the home tier forced (kHost or kNvme).
  StatusOr<ChunkId> AddChunk(Bytes bytes, Category category, TierKind home);
  // Same with the home's region allocated by the caller from that tier (at least `bytes`; a
  // served chunk's placeholder file home: runtime/session.cc), owned by the chunk from then on.
  StatusOr<ChunkId> AddChunk(Bytes bytes, Category category, TierKind home, const Region& region);
  // Whether AddChunk(bytes, category) would try the host first: room left there beside the
  // host reserve.
  bool HostHasRoomFor(Bytes bytes) const;

  // Makes `chunk` resident on `where` (kDevice or kHost) and pins it. Returns its address
  // there. kFailedPrecondition if it is pinned on another tier; kResourceExhausted if the
  // tier is full of pinned chunks.
  // `cls` (not kNoClass): acquired as a member of that class — one of a mixture-of-experts
  // layer's experts, chosen by the routing at run time: not an entry of the recorded order
  // (it neither follows nor leaves it), scored by chunks/expert_cache.h instead.
  StatusOr<void*> Acquire(ChunkId chunk, TierKind where, uint32_t cls = kNoClass);
  // Same, but when the content is lazily zero the region (on any tier) is handed over unfilled
  // and `*must_zero` is set: the caller then owes every one of the ChunkBytes(chunk) bytes —
  // its own values or zeros — before anything else reads them (e.g. a device-side memset
  // ordered before its own writes, or a loader zeroing only what it does not fill). Otherwise
  // `*must_zero` is false and the content is as Acquire gives it. `must_zero` is required.
  StatusOr<void*> AcquireForWrite(ChunkId chunk, TierKind where, bool* must_zero,
                                  uint32_t cls = kNoClass);
  // Starts bringing `chunk` to `where` (device or host) ahead of an acquire the caller
  // expects with `probability` (like the lookahead prefetch, it evicts only clean, unpinned
  // chunks): 1 (a mixture-of-experts layer's routed experts) evicts chunks not needed before
  // now, and the chunk is kept (no prefetch evicts it) until it is acquired or the iteration
  // ends; below 1 (a prediction) it evicts only chunks whose (expected) next use is later than
  // this one's expected use — now, or (1/p - 1) iterations' orders later — and the copy is kept
  // no longer than any other. False when it is there or in flight already, pinned elsewhere,
  // there is no room, or in planned mode (the plan moves copies then). kInvalidArgument for a
  // bad tier or a probability outside (0, 1]; kOutOfRange for a bad chunk.
  StatusOr<bool> PrefetchHint(ChunkId chunk, TierKind where, double probability = 1.0);
  // Unpins; `modified`: the caller wrote to it (its lower copy is now stale).
  Status Release(ChunkId chunk, bool modified);
  // Its content becomes zeros (lazily: no bytes move now). kFailedPrecondition if pinned.
  Status Zero(ChunkId chunk);
  // Copies bytes [offset, offset + n) of the chunk's current content out to / in from host
  // memory, from / into the copy it is resident in, without moving it (also while pinned:
  // the caller orders these with its own use of the memory). WriteAt makes a cached copy
  // dirty. kOutOfRange past the chunk's end. Synchronous.
  Status ReadAt(ChunkId chunk, Bytes offset, void* dst, Bytes n);
  Status WriteAt(ChunkId chunk, Bytes offset, const void* src, Bytes n);
  // Writes back every dirty unpinned cached copy and keeps it cached clean, so the home
  // copies are current (e.g. before a checkpoint).
  Status Flush();

  void BeginIteration();  // ends the recorded order of the previous one
  // Off: acquires are neither recorded into this iteration's order nor matched against the
  // previous one, and start no prefetch (eval / no-grad forwards between training
  // iterations). On by default.
  void SetTracing(bool on) { tracing_ = on; }
  void SetCyclic(bool on) { order_.SetCyclic(on); }
  // The stream the caller's device work is queued on from now on (see the file comment).
  void SetComputeStream(ComputeStream stream) { stream_ = stream; }
  ComputeStream compute_stream() const { return stream_; }
  // Sets the external bytes of `tier` (kDevice or kHost; absolute, not a delta), evicting
  // unpinned cached chunks there until chunks + `bytes` fit the budget. kResourceExhausted,
  // before anything is evicted, when the pinned chunks (and, on the host, the homes) leave
  // too little room; the message names the bytes.
  Status SetExternalBytes(TierKind tier, Bytes bytes);
  Status SetExternalDeviceBytes(Bytes bytes) { return SetExternalBytes(TierKind::kDevice, bytes); }
  Bytes external_bytes(TierKind tier) const { return external_[static_cast<int>(tier)]; }
  Bytes external_device_bytes() const { return external_bytes(TierKind::kDevice); }
  void Moment(std::string_view label);  // timeline moment
  // A collective the binding ran (`op`, over `bytes`, `ns` long, ending now): a timeline
  // kCollective event.
  void RecordCollective(std::string_view op, Bytes bytes, uint64_t ns);
  void Phase(std::string_view label);  // timeline phase
  Status Synchronize();                // waits for all moves in flight

  // ---- scratch (see the file comment) ----
  // kResourceExhausted (nothing changed; on the device or host an OOM event recorded) when the
  // pinned chunks (NVMe: the homes) leave too little room; kInvalidArgument for a tier this
  // engine lacks or 0 bytes.
  StatusOr<Region> AllocateScratch(TierKind tier, Bytes bytes, Category category);
  Status FreeScratch(TierKind tier, const Region& region, Category category);

  // ---- adopting a host copy (the session's speculative optimizer step) ----
  // Makes `region` — host scratch of this engine (AllocateScratch(kHost), at least
  // ChunkBytes(chunk) bytes) that the caller filled with the chunk's new content — that
  // content, without copying: for a host-homed chunk it becomes the home (the old home is
  // freed); for an NVMe-homed one its host cached copy, dirty (written home later like any
  // dirty copy). Every other cached copy is dropped: the caller vouches that `region` is newer
  // than all of them. The region stops counting as scratch. kFailedPrecondition while the
  // chunk is pinned; a move of it in flight is waited for first (its error returned, nothing
  // changed). PrepareAdopt does those checks and waits alone: a caller adopting several chunks
  // as one update prepares them all first, after which AdoptHostCopy does not fail.
  Status PrepareAdopt(ChunkId chunk);
  Status AdoptHostCopy(ChunkId chunk, const Region& region);
  // The same for `region` — NVMe scratch of this engine (AllocateScratch(kNvme), at least
  // ChunkBytes(chunk) bytes) the caller wrote the new content into (copy-on-write: the
  // speculative step where the host is full). An NVMe-homed chunk's home becomes `region` and
  // the old home is freed: no bytes move, and the old home was never written (a process killed
  // before this call leaves it intact). A host-homed chunk's home is read from `region`
  // (ChunkBytes(chunk) move; a failed read is returned and leaves the home's content
  // undefined), then `region` is freed. Every cached copy is dropped unwritten; the region
  // stops counting as scratch. Errors as AdoptHostCopy (PrepareAdopt first).
  Status AdoptNvmeCopy(ChunkId chunk, const Region& region);

  // ---- read-only homes (see the file comment) ----
  // Makes `region` — a read-only region of the NVMe tier holding the chunk's content (a file
  // home: tiers/nvme/file_homes.h) — the home of NVMe-homed `chunk`, freeing its old home and
  // dropping any cached copy (nothing is written). From then on the chunk's content is that
  // region's and nothing may write it: Release(modified), WriteAt, Zero and AdoptHostCopy are
  // kFailedPrecondition naming the chunk (a refused Release still unpins, and drops the
  // cached copy the caller wrote, so later reads see the home's bytes again).
  // kFailedPrecondition for a pinned chunk or one not homed on NVMe; a move in flight is
  // waited for first.
  Status SetReadOnlyHome(ChunkId chunk, const Region& region);
  bool ReadOnlyHome(ChunkId chunk) const { return chunks_[chunk].read_only; }
  // Gives NVMe-homed `chunk` — lazily zero, not read-only, with no copy and no move (a served
  // chunk's placeholder home that the loader could not read in place) — a new home allocated
  // from the NVMe tier, freeing the old one; nothing is written. kResourceExhausted naming the
  // bytes when the tier has no room (nothing changed); kFailedPrecondition otherwise.
  Status RehomeOnNvme(ChunkId chunk);

  // ---- planned mode (see the file comment) ----
  void SetPlanned(bool on) { planned_ = on; }
  bool planned() const { return planned_; }
  // Drops the cached copy of `chunk` on `tier` (a dirty one after a background write-back).
  // False (nothing done) when it has no unpinned, idle copy there.
  StatusOr<bool> PlanEvict(ChunkId chunk, TierKind tier);
  // Starts bringing `chunk` from its home to `tier` (device or host), zero-filling instead
  // when its content is lazily zero. False when it is already there or in flight, is cached
  // on another tier, or finds no free room (deferred while planned write-backs on the tier
  // still hold room; retried in order at later calls, Moment and Acquire).
  StatusOr<bool> PlanPrefetch(ChunkId chunk, TierKind tier);

  TierKind Resident(ChunkId chunk) const;
  TierKind Home(ChunkId chunk) const;
  bool Dirty(ChunkId chunk) const;
  // The content is all zeros as far as the engine knows: not modified (Release(modified) or
  // WriteAt) since it was added or last Zero()ed, whether or not a zero-filled copy exists.
  bool ZeroContent(ChunkId chunk) const;
  int Pins(ChunkId chunk) const;
  Bytes ChunkBytes(ChunkId chunk) const;
  size_t num_chunks() const { return chunks_.size(); }
  EngineStats Stats() const;

 private:
  struct Placed {
    TierKind tier = TierKind::kNone;
    Region region;
  };
  // A chunk's one move in flight, if any (engine.cc's essay has the lifecycle). Anything that
  // touches the chunk from the host waits for it first (WaitInflight), so a chunk has at most
  // one; a move starts only on an unpinned chunk with a cached copy.
  enum class Flight : uint8_t {
    kIdle,             // no move in flight
    kFilling,          // a prefetch into the cached copy from an NVMe home (a staged bounce)
    kFillingDirect,    // a prefetch into the cached copy from a host home, in one copy
    kFillingZeros,     // a prefetch into the cached copy from the zero source, in one copy
    kWritingBack,      // a write-behind of the dirty cached copy home; the copy stays
    kWritingBackDrop,  // a planned eviction's write-back: the copy is freed when it lands
  };
  // What the chunk's values are, as far as the engine knows (ZeroContent(): not kData).
  enum class Content : uint8_t {
    kZero,        // all zeros, lazily: no copy holds them (no cached copy; the home's bytes
                  // are stale), filled at the first acquire, prefetch or write
    kZeroFilled,  // all zeros, and a copy holds them (or AcquireForWrite's caller owes them)
    kData,        // modified (Release(modified), WriteAt, AdoptHostCopy) since added or Zero()
  };
  // One chunk's state. `dirty` and Content are separate facts: a copy of zeros can be dirty
  // (filled above a stale home) or clean (written home), and so can a copy of data.
  struct ChunkRec {
    Bytes bytes = 0;
    Category category = Category::kOther;
    Placed home;
    Placed cache;  // tier kNone: no cached copy
    Content content = Content::kZero;
    bool dirty = false;  // the cached copy differs from the home copy (only with a cached copy)
    int pins = 0;
    uint64_t last_use = 0;
    bool soon = false;       // PrefetchHint'ed and not acquired since: not to be evicted
    bool read_only = false;  // SetReadOnlyHome: never dirty, never written

    bool cached() const { return cache.tier != TierKind::kNone; }
    Flight flight() const { return flight_; }
    bool in_flight() const { return flight_ != Flight::kIdle; }
    bool writing_back() const {
      return flight_ == Flight::kWritingBack || flight_ == Flight::kWritingBackDrop;
    }
    // A prefetch of one copy (all the tier sees): Acquire may order the compute stream after
    // it instead of waiting, and pin the chunk while it lands.
    bool filling_in_one_copy() const {
      return flight_ == Flight::kFillingDirect || flight_ == Flight::kFillingZeros;
    }
    // Has the move in flight finished? (false when idle)
    bool Landed() const { return move_ != nullptr && move_->Poll(); }
    // The transitions of the flight state: Start from idle (an unpinned chunk with a cached
    // copy; a write-back only of a dirty one), Land back to idle, handing over what was in
    // flight for the caller to wait for. A planned eviction that finds the chunk needed again
    // keeps its copy (KeepCopy: kWritingBackDrop becomes kWritingBack).
    void Start(Flight f, std::shared_ptr<Completion> move);
    std::pair<Flight, std::shared_ptr<Completion>> Land();
    void KeepCopy();
    // Asserts (debug builds) the invariants that tie the fields together (engine.cc).
    void Check() const;

   private:
    Flight flight_ = Flight::kIdle;
    std::shared_ptr<Completion> move_;  // the move flight_ names; null exactly when idle
  };

  Engine(const EngineConfig& config, EngineTiers tiers, Mover* mover, TimelineRecorder* recorder,
         std::unique_ptr<EvictionPolicy> policy);
  Tier* TierOf(TierKind k) const;
  Status CheckChunk(ChunkId chunk) const;
  // kFailedPrecondition: `what` (a release that modified, a write into, ...) a read-only home.
  Status ReadOnlyError(ChunkId chunk, std::string_view what) const;
  // kFailedPrecondition for `what` on a tier this stack does not have (no device: host mode).
  static Status NoTier(TierKind tier, std::string_view what);
  Status WaitInflight(ChunkId chunk, std::string_view cause);
  Status WaitStall(const std::shared_ptr<Completion>& c, ChunkId chunk, std::string_view cause);
  // An eviction scan passing `chunk`: a write-back of it that has landed is waited for, so the
  // chunk is clean now. A failed one stays dirty with its copy kept (logged); evicting it later
  // writes back synchronously and reports a lasting fault.
  void SettleLandedWriteBack(ChunkId chunk);
  // Acquire and AcquireForWrite (`must_zero` null for Acquire): follows or records the order,
  // waits for the chunk's move in flight (or orders the compute stream after a one-copy
  // prefetch), makes it resident on `where`, pins it and starts the lookahead prefetch.
  StatusOr<void*> AcquireImpl(ChunkId chunk, TierKind where, bool* must_zero, uint32_t cls);
  // The next use eviction compares: the order's, or a class member's expected one.
  uint64_t NextUse(ChunkId chunk) const;
  // The next use the room lookahead compares: the order's, taken to repeat (a use in the next
  // iteration counts at size + its position), or now for a hinted chunk.
  uint64_t LookaheadNextUse(ChunkId chunk) const;
  // The room lookahead's eviction on the host for a prefetch of `chunk` used at `pos`: of the
  // unpinned, idle chunks there used after `pos` (LookaheadNextUse), the one used farthest,
  // evicted if clean. False when there is none or it is dirty (then the caller writes it home:
  // CleanFor).
  StatusOr<bool> EvictForLookahead(TierKind tier, ChunkId chunk, uint64_t pos);
  // Allocates room for `chunk` on `tier`, evicting unpinned chunks as needed (any chunk when
  // `for_prefetch` is false; only clean ones used after `prefetch_pos` otherwise).
  StatusOr<Region> AllocateOn(TierKind tier, ChunkId chunk, bool for_prefetch,
                              uint64_t prefetch_pos);
  // AllocateOn's loop for `bytes` (chunk: kNoChunk for scratch).
  StatusOr<Region> AllocateBytes(TierKind tier, Bytes bytes, ChunkId chunk, Category category,
                                 bool for_prefetch, uint64_t prefetch_pos);
  // Evicts one unpinned chunk of `tier` other than `chunk` (the policy's choice; for a
  // prefetch only clean chunks used after `prefetch_pos`). False when there is none;
  // `*pinned` gets the bytes of the pinned chunks seen.
  StatusOr<bool> EvictOne(TierKind tier, ChunkId chunk, bool for_prefetch, uint64_t prefetch_pos,
                          Bytes* pinned);
  // The tier's budget for chunks: its capacity less its external bytes.
  Bytes ChunkCapacity(TierKind tier, const TierStats& st) const;
  Status Evict(ChunkId victim);
  Status FreeRegion(const Placed& p, ChunkId chunk, bool clean);
  std::shared_ptr<Completion> StartMove(ChunkId chunk, const Placed& src, const Placed& dst);
  Status MoveSync(ChunkId chunk, const Placed& src, const Placed& dst, std::string_view cause);
  Status FillZero(ChunkId chunk, const Placed& dst, std::string_view cause);
  // Frees finished planned write-backs on `tier`; with `wait`, waits for one still in flight
  // if none had finished. True when room was freed.
  StatusOr<bool> ReclaimPlanned(TierKind tier, bool wait);
  bool PlannedDropPending(TierKind tier) const;
  // 1: started, 0: not applicable, -1: no room only because planned write-backs hold it.
  StatusOr<int> TryPlanPrefetch(ChunkId chunk, TierKind tier);
  Status PumpDeferred();  // retries deferred planned prefetches in order
  void Prefetch();
  // Prefetch's kRoom lookahead (the file comment).
  void PrefetchByRoom();
  // No room on `tier` for the chunk of `need` bytes acquired at position `pos` without
  // evicting dirty chunks: starts background write-backs of the dirty, unpinned, idle chunks
  // there whose next use (LookaheadNextUse) is farthest and later than `pos`, until the bytes
  // being written back on the tier cover `need` (once clean, a later prefetch may evict them).
  void CleanFor(TierKind tier, uint64_t pos, Bytes need);
  // The acquire-wait counters of the current phase.
  AcquireWaits& PhaseWaits();
  // Allocated `dst` for `id` (no cached copy yet): starts filling it from home (or zeros).
  void StartFill(ChunkId id, const Placed& dst);
  // Records that the caller's stream used the chunk's device copy (no-op elsewhere).
  Status MarkDeviceUse(ChunkId chunk);
  void MaybeWriteBehind(ChunkId chunk);
  // Evictions per tier (by TierKind index) in this iteration and in the previous one.
  std::array<uint64_t, kNumTierKinds> evictions_now_{}, evictions_before_{};
  void RecordRegion(EventType type, const Placed& p, ChunkId chunk, uint8_t flags);
  void RecordLabel(EventType type, std::string_view label, uint64_t id);
  void RecordScratch(EventType type, TierKind tier, const Region& r, Category category);
  void RecordOom(TierKind tier, Bytes bytes, ChunkId chunk, Category category);

  const EngineConfig config_;
  const EngineTiers tiers_;
  Mover* const mover_;
  TimelineRecorder* const recorder_;
  std::unique_ptr<EvictionPolicy> policy_;
  std::vector<ChunkRec> chunks_;
  // The source of zero fills on non-host tiers: `n` bytes of zeros that cost no resident
  // memory (a read-only anonymous mapping: reads map the kernel's zero page). kUnavailable
  // when the mapping is refused.
  StatusOr<char*> Zeros(Bytes n);
  struct Mapping {
    void* addr = nullptr;
    Bytes bytes = 0;
  };
  // The zero sources mapped, the largest (current) last; a smaller one it replaced stays mapped
  // until the engine goes, since a copy in flight may still read it.
  std::vector<Mapping> zeros_;
  uint64_t use_counter_ = 0;
  uint64_t stall_id_ = 0;
  size_t phase_ = 0;  // the current phase's index in stats_.waits_by_phase (once it has one)

  // The order of acquires: recorded this iteration, followed from the previous one (only
  // while tracing_).
  AccessOrder order_;
  ClassScores scores_;  // chunks acquired as class members (expert_cache.h)
  bool tracing_ = true;
  ComputeStream stream_ = kHostStream;
  std::array<Bytes, kNumTierKinds> external_{};  // per TierKind (device and host only)
  bool planned_ = false;
  bool speculating_ = false;  // PrefetchHint below certainty: only class members may leave
  std::vector<std::pair<ChunkId, TierKind>> deferred_;  // planned prefetches waiting for room

  EngineStats stats_;
};

}  // namespace tiermem::chunks
