// Engine implementation.
//
// A chunk's state (ChunkRec) is where its copies are — a home (host or NVMe, for life) and at
// most one cached copy above it —, what its values are (Content) and its one move in flight
// (Flight), plus independent facts: pins, `dirty` (the cached copy differs from home), the
// last use and the `soon` hint.
//
// Content: AddChunk and Zero() make a chunk kZero — all zeros, lazily: no copy holds them, so
// no bytes move. Its first fill (an acquire, a prefetch, a WriteAt) writes zeros into the copy
// it lands in (kZeroFilled; a fill into a cached copy leaves home stale: dirty). Any
// modification (Release(modified), WriteAt, AdoptHostCopy, AdoptNvmeCopy) makes it kData until
// Zero().
//
// Flight: idle, or one of
//   kFilling / kFillingDirect / kFillingZeros   a prefetch into the cached copy (StartFill),
//       from an NVMe home (a staged bounce), a host home or the zero source (one copy each);
//   kWritingBack       a write-behind of the dirty cached copy home (MaybeWriteBehind);
//   kWritingBackDrop   a planned eviction's write-back (PlanEvict): the copy goes when it lands.
// ChunkRec::Start leaves idle, ChunkRec::Land returns to it (WaitInflight: a finished write-back
// makes the copy clean, a failed prefetch drops the copy — and a failed fill from zeros makes
// the chunk kZero again —, a failed write-back keeps the copy, dirty). An acquire of a chunk
// whose planned eviction is still writing back keeps the copy (KeepCopy).
//
// Acquire(c, T):
//   - T is where c is resident: pin.
//   - T is c's home and c has a cached copy above: write the copy back if dirty, free it.
//   - otherwise: allocate on T (evicting), then fill it from the cached copy (moving it up or
//     down a tier; dirty is kept), from zeros (dirty, home stale), or from home (clean).
// AcquireForWrite is Acquire except that a zero chunk is handed over unfilled, on any tier, and
// the caller zeroes what it does not overwrite (no synchronous copy from the zero source on a
// device, no memset the caller's own writes would repeat on the host); it is dirty all the same.
// Release unpins; a modified cached copy becomes dirty. Eviction frees a cached copy after
// writing it back if dirty. Homes never move and are freed only by the destructor (or
// replaced by AdoptHostCopy, AdoptNvmeCopy or SetReadOnlyHome).
// Invariants (ChunkRec::Check asserts them in debug builds):
//   - a chunk has at most one cached copy (one `cache` field) and at most one move in flight,
//     which reads or writes that copy;
//   - a move starts only on an unpinned chunk; only a one-copy prefetch may be pinned while it
//     lands (Acquire orders the compute stream after it); a write-back is never pinned;
//   - `dirty` only with a cached copy; a write-back in flight is of a dirty copy;
//   - kZero: no cached copy, nothing dirty, nothing in flight;
//   - a pinned chunk is never chosen for eviction, nor an in-flight one by a prefetch (a demand
//     eviction waits for the move first); a region is freed only with no move in flight on it
//     (FreeRegion asserts it).
// The zero source (Zeros) is a read-only anonymous mapping: reading it maps the kernel's zero
// page, so zero fills of any size cost no resident memory.
// The recorded order of acquires — following it, resyncing, next uses, the cyclic window — is
// AccessOrder's (access_order.cc); the engine feeds it only while tracing_ is on.
// This file has the chunk records, acquire/release, eviction and scratch; the moves made
// ahead of an acquire (lookahead, hints, planned mode) are in engine_prefetch.cc, and
// replacing a home (AdoptHostCopy, AdoptNvmeCopy, SetReadOnlyHome) in engine_adopt.cc.
#include "chunks/engine.h"

#include <sys/mman.h>

#include <algorithm>
#include <cassert>
#include <cerrno>
#include <cstring>
#include <string>

#include "base/clock.h"
#include "base/logging.h"

namespace tiermem::chunks {
namespace {
int Idx(TierKind k) { return static_cast<int>(k); }
}  // namespace

void Engine::ChunkRec::Start(Flight f, std::shared_ptr<Completion> move) {
  assert(f != Flight::kIdle && move != nullptr);
  assert(flight_ == Flight::kIdle && pins == 0 && cached());
  flight_ = f;
  move_ = std::move(move);
  Check();
}

std::pair<Engine::Flight, std::shared_ptr<Completion>> Engine::ChunkRec::Land() {
  std::pair<Flight, std::shared_ptr<Completion>> out{flight_, std::move(move_)};
  flight_ = Flight::kIdle;
  move_.reset();
  return out;
}

void Engine::ChunkRec::KeepCopy() {
  if (flight_ == Flight::kWritingBackDrop) flight_ = Flight::kWritingBack;
}

void Engine::ChunkRec::Check() const {
  assert((flight_ == Flight::kIdle) == (move_ == nullptr));
  assert(home.tier == TierKind::kHost || home.tier == TierKind::kNvme);
  assert(cache.tier != home.tier);
  assert(pins >= 0);
  assert(!dirty || cached());
  assert(flight_ == Flight::kIdle || cached());
  assert(!writing_back() || (dirty && pins == 0));
  assert(flight_ != Flight::kFilling || pins == 0);
  assert(flight_ != Flight::kFillingZeros || (dirty && content != Content::kZero));
  assert(content != Content::kZero || (!cached() && !dirty && flight_ == Flight::kIdle));
  assert(!read_only || (!dirty && home.tier == TierKind::kNvme && content == Content::kData));
}

StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineConfig& config, EngineTiers tiers,
                                                 Mover* mover, TimelineRecorder* recorder,
                                                 std::unique_ptr<EvictionPolicy> policy) {
  if (tiers.host == nullptr) {
    return InvalidArgumentError("engine: a host tier is required");
  }
  if (tiers.device != nullptr && tiers.device->kind() != TierKind::kDevice) {
    return InvalidArgumentError("engine: the device tier must be of kind device");
  }
  if (tiers.host->kind() != TierKind::kHost) {
    return InvalidArgumentError("engine: the host tier must be of kind host");
  }
  if (mover == nullptr) return InvalidArgumentError("engine: a mover is required");
  if (config.prefetch_depth < 0) return InvalidArgumentError("engine: prefetch_depth < 0");
  if (policy == nullptr) policy = NewDefaultEvictionPolicy();
  std::unique_ptr<Engine> e(new Engine(config, tiers, mover, recorder, std::move(policy)));
  if (recorder != nullptr) {
    for (Tier* t : {tiers.device, tiers.host, tiers.nvme}) {
      if (t == nullptr) continue;
      Event ev;
      ev.type = EventType::kBudget;
      ev.tier = t->kind();
      ev.bytes = t->Stats().capacity;
      recorder->Record(ev);
    }
  }
  return e;
}

Engine::Engine(const EngineConfig& config, EngineTiers tiers, Mover* mover,
               TimelineRecorder* recorder, std::unique_ptr<EvictionPolicy> policy)
    : config_(config),
      tiers_(tiers),
      mover_(mover),
      recorder_(recorder),
      policy_(std::move(policy)) {
  stats_.waits_by_phase.emplace_back("", AcquireWaits{});
}

Engine::~Engine() {
  for (ChunkRec& c : chunks_) {
    if (c.in_flight()) c.Land().second->Wait().IgnoreError();
  }
  for (ChunkId id = 0; id < chunks_.size(); ++id) {
    ChunkRec& c = chunks_[id];
    if (c.cache.tier != TierKind::kNone) FreeRegion(c.cache, id, !c.dirty).IgnoreError();
    FreeRegion(c.home, id, true).IgnoreError();
  }
  for (const Mapping& z : zeros_) munmap(z.addr, z.bytes);  // no copy reads them any more
}

Tier* Engine::TierOf(TierKind k) const {
  switch (k) {
    case TierKind::kDevice:
      return tiers_.device;
    case TierKind::kHost:
      return tiers_.host;
    case TierKind::kNvme:
      return tiers_.nvme;
    default:
      return nullptr;
  }
}

Status Engine::NoTier(TierKind tier, std::string_view what) {
  return FailedPreconditionError("engine: " + std::string(what) + " on the " +
                                 std::string(TierKindName(tier)) +
                                 " tier, but this stack has none (device_kind 'host' computes "
                                 "on host memory: use the host tier)");
}

Status Engine::CheckChunk(ChunkId chunk) const {
  if (chunk >= chunks_.size()) {
    return OutOfRangeError("engine: unknown chunk " + std::to_string(chunk));
  }
  return OkStatus();
}

void Engine::RecordRegion(EventType type, const Placed& p, ChunkId chunk, uint8_t flags) {
  if (recorder_ == nullptr) return;
  Event e;
  e.type = type;
  e.id = p.region.id;
  e.bytes = p.region.bytes;
  e.tier = p.tier;
  e.chunk = chunk;
  e.category = chunk < chunks_.size() ? chunks_[chunk].category : Category::kOther;
  e.flags = flags;
  recorder_->Record(e);
}

void Engine::RecordScratch(EventType type, TierKind tier, const Region& r, Category category) {
  if (recorder_ == nullptr) return;
  Event e;
  e.type = type;
  e.id = r.id;
  e.bytes = r.bytes;
  e.tier = tier;
  e.chunk = kNoChunk;
  e.category = category;
  recorder_->Record(e);
}

void Engine::RecordLabel(EventType type, std::string_view label, uint64_t id) {
  if (recorder_ == nullptr) return;
  Event e;
  e.type = type;
  e.id = id;
  e.label = recorder_->InternLabel(label);
  recorder_->Record(e);
}

void Engine::RecordOom(TierKind tier, Bytes bytes, ChunkId chunk, Category category) {
  if (recorder_ == nullptr) return;
  Event e;
  e.type = EventType::kOom;
  e.tier = tier;
  e.bytes = bytes;
  e.chunk = chunk;
  e.category = category;
  recorder_->Record(e);
}

bool Engine::HostHasRoomFor(Bytes bytes) const {
  const TierStats host = tiers_.host->Stats();
  return host.used + bytes + config_.host_reserve_bytes <= host.capacity;
}

StatusOr<ChunkId> Engine::AddChunk(Bytes bytes, Category category) {
  if (bytes == 0) return InvalidArgumentError("engine: chunk of 0 bytes");
  const TierStats host = tiers_.host->Stats();
  if (HostHasRoomFor(bytes)) {
    auto id = AddChunk(bytes, category, TierKind::kHost);
    if (id.ok() || tiers_.nvme == nullptr) return id;
  }
  if (tiers_.nvme == nullptr) {
    RecordOom(TierKind::kHost, bytes, kNoChunk, category);  // refused like an allocation
    return ResourceExhaustedError(
        "engine: host tier cannot hold a chunk of " + std::to_string(bytes) + " bytes (" +
        std::to_string(host.capacity - std::min(host.capacity, host.used)) + " of " +
        std::to_string(host.capacity) + " bytes free, " +
        std::to_string(config_.host_reserve_bytes) +
        " reserved) and there is no NVMe tier; raise the host budget or configure nvme");
  }
  return AddChunk(bytes, category, TierKind::kNvme);
}

StatusOr<ChunkId> Engine::AddChunk(Bytes bytes, Category category, TierKind home) {
  if (bytes == 0) return InvalidArgumentError("engine: chunk of 0 bytes");
  if (home != TierKind::kHost && home != TierKind::kNvme) {
    return InvalidArgumentError("engine: a chunk's home must be host or nvme");
  }
  Tier* t = TierOf(home);
  if (t == nullptr) return FailedPreconditionError("engine: no nvme tier configured");
  auto r = t->Allocate(bytes);
  if (!r.ok()) {
    RecordOom(home, bytes, kNoChunk, category);
    return r.status().WithContext("engine: home of a " + std::to_string(bytes) + "-byte chunk");
  }
  return AddChunk(bytes, category, home, *r);
}

StatusOr<ChunkId> Engine::AddChunk(Bytes bytes, Category category, TierKind home,
                                   const Region& region) {
  if (bytes == 0 || region.bytes < bytes) {
    return InvalidArgumentError("engine: chunk of 0 bytes, or a home region smaller than it");
  }
  if (TierOf(home) == nullptr || (home != TierKind::kHost && home != TierKind::kNvme)) {
    return InvalidArgumentError("engine: a chunk's home must be host or nvme, of this engine");
  }
  const ChunkId id = static_cast<ChunkId>(chunks_.size());
  ChunkRec c;
  c.bytes = bytes;
  c.category = category;
  c.home = Placed{home, region};
  chunks_.push_back(std::move(c));
  RecordRegion(EventType::kAlloc, chunks_[id].home, id, kFlagNone);
  return id;
}

Status Engine::WaitStall(const std::shared_ptr<Completion>& c, ChunkId chunk,
                         std::string_view cause) {
  if (c->Poll()) return c->Wait();
  const uint64_t id = ++stall_id_;
  const uint64_t t0 = Clock::Real()->NowNs();
  if (recorder_ != nullptr) {
    Event e;
    e.type = EventType::kStallBegin;
    e.id = id;
    e.chunk = chunk;
    e.label = recorder_->InternLabel(cause);
    recorder_->Record(e);
  }
  Status s = c->Wait();
  stats_.stall_ns += Clock::Real()->NowNs() - t0;
  ++stats_.stalls;
  if (recorder_ != nullptr) {
    Event e;
    e.type = EventType::kStallEnd;
    e.id = id;
    e.chunk = chunk;
    recorder_->Record(e);
  }
  return s;
}

Status Engine::WaitInflight(ChunkId chunk, std::string_view cause) {
  ChunkRec& c = chunks_[chunk];
  if (!c.in_flight()) return OkStatus();
  const auto [was, done] = c.Land();
  if (was == Flight::kWritingBack || was == Flight::kWritingBackDrop) {
    const bool drop = was == Flight::kWritingBackDrop;
    Status s = WaitStall(done, chunk, drop ? "planned write-back" : "write-behind late");
    // Nothing touched the cached copy meanwhile (everything waits for the move first).
    if (s.ok()) {
      c.dirty = false;
      if (drop) {  // a planned eviction: its home copy is current now, free the cached one
        ++evictions_now_[Idx(c.cache.tier)];
        TIERMEM_RETURN_IF_ERROR(FreeRegion(c.cache, chunk, true));
        c.cache = Placed{};
        ++stats_.evictions;
      }
      c.Check();
      return OkStatus();
    }
    return s.WithContext("engine: background write-back of chunk " + std::to_string(chunk) +
                         " (its cached copy is kept, still dirty)");
  }
  Status s = WaitStall(done, chunk, cause);
  if (!s.ok()) {
    // The prefetched copy is unusable: drop it; home still holds the data — or, for a fill
    // from zeros that nothing wrote over since, nothing does: the chunk is lazily zero again.
    FreeRegion(c.cache, chunk, true).IgnoreError();
    c.cache = Placed{};
    c.dirty = false;
    if (was == Flight::kFillingZeros && c.content == Content::kZeroFilled) {
      c.content = Content::kZero;
    }
    c.Check();
    return s.WithContext("engine: prefetch of chunk " + std::to_string(chunk));
  }
  c.Check();
  return OkStatus();
}

std::shared_ptr<Completion> Engine::StartMove(ChunkId chunk, const Placed& src, const Placed& dst) {
  const ChunkRec& c = chunks_[chunk];
  MoveRequest r;
  r.src = Endpoint{TierOf(src.tier), src.region, 0};
  r.dst = Endpoint{TierOf(dst.tier), dst.region, 0};
  r.bytes = c.bytes;
  r.chunk = chunk;
  r.category = c.category;
  stats_.bytes_moved[Idx(src.tier)][Idx(dst.tier)] += c.bytes;
  if (src.tier == TierKind::kNvme || dst.tier == TierKind::kNvme) {
    stats_.nvme_bytes_by_category[static_cast<int>(c.category)] += c.bytes;
  }
  return mover_->Move(r);
}

Status Engine::MoveSync(ChunkId chunk, const Placed& src, const Placed& dst,
                        std::string_view cause) {
  return WaitStall(StartMove(chunk, src, dst), chunk, cause);
}

Status Engine::FillZero(ChunkId chunk, const Placed& dst, std::string_view cause) {
  const Bytes n = chunks_[chunk].bytes;
  if (dst.tier == TierKind::kHost && dst.region.addr != nullptr) {
    std::memset(dst.region.addr, 0, n);
    return OkStatus();
  }
  TIERMEM_ASSIGN_OR_RETURN(char* zeros, Zeros(n));
  return WaitStall(TierOf(dst.tier)->Copy(CopyRequest{dst.region, 0, zeros, n, CopyDir::kToTier}),
                   chunk, cause);
}

StatusOr<char*> Engine::Zeros(Bytes n) {
  if (zeros_.empty() || zeros_.back().bytes < n) {
    // Never written: every page reads as the kernel's shared zero page (no RSS). Copies in
    // flight may still read the old mapping: it stays until the engine goes.
    void* p = mmap(nullptr, n, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      return ErrnoToStatus(errno, "engine: mapping " + std::to_string(n) + " bytes of zeros");
    }
    zeros_.push_back(Mapping{p, n});
  }
  return static_cast<char*>(zeros_.back().addr);
}

Status Engine::FreeRegion(const Placed& p, ChunkId chunk, bool clean) {
  if (p.tier == TierKind::kNone) return OkStatus();
  // A region is freed only with no move in flight on it (callers wait for it first).
  assert(chunk >= chunks_.size() || !chunks_[chunk].in_flight());
  Status s = TierOf(p.tier)->Free(p.region);
  if (s.ok()) RecordRegion(EventType::kFree, p, chunk, clean ? kFlagClean : kFlagNone);
  return s;
}

Status Engine::Evict(ChunkId victim) {
  ChunkRec& c = chunks_[victim];
  TIERMEM_RETURN_IF_ERROR(WaitInflight(victim, "evict: prefetch in flight"));
  if (c.cache.tier == TierKind::kNone) return OkStatus();  // a planned eviction just ended
  const bool was_dirty = c.dirty;
  if (was_dirty) TIERMEM_RETURN_IF_ERROR(MoveSync(victim, c.cache, c.home, "evict: write-back"));
  ++evictions_now_[Idx(c.cache.tier)];
  TIERMEM_RETURN_IF_ERROR(FreeRegion(c.cache, victim, !was_dirty));
  c.cache = Placed{};
  c.dirty = false;
  ++stats_.evictions;
  if (!was_dirty) ++stats_.clean_evictions;
  c.Check();
  return OkStatus();
}

Bytes Engine::ChunkCapacity(TierKind tier, const TierStats& st) const {
  const Bytes ext = external_[static_cast<int>(tier)];
  return st.capacity > ext ? st.capacity - ext : 0;
}

void Engine::SettleLandedWriteBack(ChunkId chunk) {
  const ChunkRec& c = chunks_[chunk];
  if (!c.writing_back() || !c.Landed()) return;
  Status wb = WaitInflight(chunk, "");
  if (!wb.ok()) {
    TIERMEM_LOG(kWarn) << wb.message() << "; retrying when evicted";
  }
}

StatusOr<bool> Engine::EvictOne(TierKind tier, ChunkId chunk, bool for_prefetch,
                                uint64_t prefetch_pos, Bytes* pinned) {
  *pinned = 0;
  if (for_prefetch && config_.lookahead == Lookahead::kRoom && tier == TierKind::kHost) {
    return EvictForLookahead(tier, chunk, prefetch_pos);
  }
  std::vector<EvictionCandidate> cands;
  for (ChunkId id = 0; id < chunks_.size(); ++id) {
    SettleLandedWriteBack(id);
    const ChunkRec& c = chunks_[id];
    if (c.cache.tier != tier || id == chunk) continue;
    if (c.pins > 0) {
      *pinned += c.cache.region.bytes;
      continue;
    }
    EvictionCandidate e{id, c.bytes, c.dirty, c.last_use, NextUse(id), order_.following()};
    if (for_prefetch) {
      if (c.dirty || c.in_flight() || c.soon) continue;  // (soon: hinted, about to be acquired)
      if (speculating_ && scores_.ClassOf(id) == kNoClass) continue;
      if (e.next_use != kNeverUsed && e.next_use <= prefetch_pos) continue;
    }
    cands.push_back(e);
  }
  if (cands.empty()) return false;
  const size_t v = policy_->ChooseVictim(cands);
  TIERMEM_RETURN_IF_ERROR(Evict(cands[v].chunk));
  return true;
}

StatusOr<Region> Engine::AllocateOn(TierKind tier, ChunkId chunk, bool for_prefetch,
                                    uint64_t prefetch_pos) {
  return AllocateBytes(tier, chunks_[chunk].bytes, chunk, chunks_[chunk].category, for_prefetch,
                       prefetch_pos);
}

StatusOr<Region> Engine::AllocateBytes(TierKind tier, Bytes bytes, ChunkId chunk, Category category,
                                       bool for_prefetch, uint64_t prefetch_pos) {
  Tier* t = TierOf(tier);
  for (;;) {
    // Allocate only when the budget has room: a failed Allocate is not an error here.
    const TierStats st = t->Stats();
    const Bytes cap = ChunkCapacity(tier, st);
    if (st.used + bytes <= cap) {
      auto r = t->Allocate(bytes);
      if (r.ok()) return r;
      if (r.status().code() != StatusCode::kResourceExhausted) return r.status();
    }
    if (!for_prefetch) {
      // Chunks the plan already evicted are leaving anyway: wait for their write-back rather
      // than evict another one.
      TIERMEM_ASSIGN_OR_RETURN(const bool freed, ReclaimPlanned(tier, true));
      if (freed) continue;
    }
    Bytes pinned = 0;
    TIERMEM_ASSIGN_OR_RETURN(const bool evicted,
                             EvictOne(tier, chunk, for_prefetch, prefetch_pos, &pinned));
    if (evicted) continue;
    if (for_prefetch) return ResourceExhaustedError("prefetch: no room");
    RecordOom(tier, bytes, chunk, category);
    std::string external;
    if (const Bytes ext = external_[static_cast<int>(tier)]; ext > 0) {
      external = ", " + std::to_string(ext) + " bytes of the budget held by non-chunk " +
                 std::string(TierKindName(tier)) + " memory (" +
                 (tier == TierKind::kDevice ? "KV cache, activations" : "activations") + ")";
    }
    return ResourceExhaustedError(
        std::string(TierKindName(tier)) + " tier: need " + std::to_string(bytes) + " bytes for " +
        (chunk == kNoChunk ? std::string("scratch") : "chunk " + std::to_string(chunk)) + ", but " +
        std::to_string(st.used) + " of " + std::to_string(st.capacity) + " bytes are in use (" +
        std::to_string(pinned) + " bytes pinned" + external + ") and nothing is evictable");
  }
}

Status Engine::SetExternalBytes(TierKind tier, Bytes bytes) {
  if (tier != TierKind::kDevice && tier != TierKind::kHost) {
    return InvalidArgumentError("engine: external bytes are on the device or the host tier");
  }
  Tier* t = TierOf(tier);
  if (t == nullptr) return NoTier(tier, "external bytes");
  const std::string name(TierKindName(tier));
  const std::string what = tier == TierKind::kDevice
                               ? " bytes of non-chunk device memory (KV cache, activations)"
                               : " bytes of non-chunk host memory (activations)";
  // What cannot move: pinned chunks, and on the host the homes.
  Bytes homes = 0, pinned_now = 0;
  for (const ChunkRec& c : chunks_) {
    if (c.cache.tier == tier && c.pins > 0) pinned_now += c.cache.region.bytes;
    if (c.home.tier == tier) homes += c.home.region.bytes;
  }
  auto refuse = [&](Bytes capacity, Bytes fixed) {
    std::string held = std::to_string(fixed) + " bytes of chunks in use now";
    if (homes > 0) held += " and chunk homes";
    return ResourceExhaustedError(
        name + " tier: " + std::to_string(bytes) + what + " do not fit the budget of " +
        std::to_string(capacity) + " bytes next to the " + held + "; the " + name +
        " budget must be at least " + std::to_string(bytes + fixed) + " bytes");
  };
  // Refused before anything is evicted when what cannot move leaves too little room.
  const Bytes capacity = t->Stats().capacity;
  if (bytes > capacity || homes + pinned_now > capacity - bytes) {
    return refuse(capacity, homes + pinned_now);
  }
  for (;;) {
    const TierStats st = t->Stats();
    if (bytes <= st.capacity && st.used <= st.capacity - bytes) break;
    // Chunks the plan already evicted are leaving anyway: wait for them first.
    TIERMEM_ASSIGN_OR_RETURN(const bool freed, ReclaimPlanned(tier, true));
    if (freed) continue;
    Bytes pinned = 0;
    TIERMEM_ASSIGN_OR_RETURN(const bool evicted, EvictOne(tier, kNoChunk, false, 0, &pinned));
    if (evicted) continue;
    return refuse(st.capacity, homes + pinned);
  }
  Bytes& ext = external_[static_cast<int>(tier)];
  if (bytes == ext) return OkStatus();
  ext = bytes;
  Bytes& peak = stats_.external_peak[static_cast<int>(tier)];
  peak = std::max(peak, bytes);
  if (recorder_ != nullptr) {
    // One pseudo-region per tier (a fixed id no tier hands out): re-allocating a live id
    // replaces it.
    Event e;
    e.type = bytes > 0 ? EventType::kAlloc : EventType::kFree;
    e.id = kExternalRegionId + (tier == TierKind::kDevice ? 0 : 1);
    e.bytes = bytes;
    e.tier = tier;
    e.chunk = kNoChunk;
    e.category = Category::kActivation;
    recorder_->Record(e);
  }
  return OkStatus();
}

StatusOr<void*> Engine::Acquire(ChunkId chunk, TierKind where, uint32_t cls) {
  return AcquireImpl(chunk, where, nullptr, cls);
}

StatusOr<void*> Engine::AcquireForWrite(ChunkId chunk, TierKind where, bool* must_zero,
                                        uint32_t cls) {
  if (must_zero == nullptr) return InvalidArgumentError("engine: AcquireForWrite needs must_zero");
  *must_zero = false;
  return AcquireImpl(chunk, where, must_zero, cls);
}

StatusOr<void*> Engine::AcquireImpl(ChunkId chunk, TierKind where, bool* must_zero, uint32_t cls) {
  TIERMEM_RETURN_IF_ERROR(CheckChunk(chunk));
  if (where != TierKind::kDevice && where != TierKind::kHost) {
    return InvalidArgumentError("engine: chunks are acquired on device or host, not " +
                                std::string(TierKindName(where)));
  }
  if (TierOf(where) == nullptr) return NoTier(where, "acquire");
  // Follow (or leave) the recorded order, and record this iteration's.
  if (tracing_ && cls != kNoClass) {
    scores_.Observe(cls, chunk, order_.recorded());  // a class member: not an order entry
  } else if (tracing_) {
    scores_.EndVisit();
    switch (order_.Observe(chunk, where)) {
      case AccessOrder::Follow::kResynced:
        ++stats_.resynced;
        break;
      case AccessOrder::Follow::kDiverged:
        ++stats_.diverged;
        break;  // reactive (LRU) now
      case AccessOrder::Follow::kNotFollowing:
      case AccessOrder::Follow::kMatched:
        break;
    }
  }
  ++stats_.acquires;
  ChunkRec* c = &chunks_[chunk];
  c->soon = false;
  c->KeepCopy();  // planned to leave, needed after all: keep the copy (clean when written)
  if (c->filling_in_one_copy() && c->cache.tier == where && stream_ != kHostStream &&
      TierOf(where)->ordering() != nullptr && !c->Landed()) {
    // A prefetch of one copy still landing: the compute stream waits for it, not the caller.
    // The chunk stays in flight (whatever touches it next from the host waits as usual).
    // (Compute on the host stream is this thread: it waits below, as for any tier.)
    TIERMEM_RETURN_IF_ERROR(OrderComputeAfterCopies(*TierOf(where), c->cache.region, stream_));
    ++stats_.device_waits;
  } else {
    const bool reading = c->flight() == Flight::kFilling || c->flight() == Flight::kFillingDirect;
    if (reading && c->cache.tier == where && !c->Landed()) {  // a prefetch not yet landed
      AcquireWaits& w = PhaseWaits();
      ++w.late;
      w.late_bytes += c->bytes;
      ++stats_.waits.late;
      stats_.waits.late_bytes += c->bytes;
    }
    TIERMEM_RETURN_IF_ERROR(WaitInflight(chunk, "prefetch late"));
  }
  const TierKind resident = c->cache.tier != TierKind::kNone ? c->cache.tier : c->home.tier;
  if (resident != where && c->pins > 0) {
    return FailedPreconditionError("engine: chunk " + std::to_string(chunk) + " is pinned on the " +
                                   std::string(TierKindName(resident)) + " tier");
  }
  if (resident != where) {
    if (where == c->home.tier) {
      // Down to home: write the cached copy back if needed and drop it.
      if (c->dirty) TIERMEM_RETURN_IF_ERROR(MoveSync(chunk, c->cache, c->home, "write-back"));
      TIERMEM_RETURN_IF_ERROR(FreeRegion(c->cache, chunk, !c->dirty));
      c->cache = Placed{};
      c->dirty = false;
    } else {
      TIERMEM_ASSIGN_OR_RETURN(Region r, AllocateOn(where, chunk, false, 0));
      c = &chunks_[chunk];
      Placed dst{where, r};
      RecordRegion(EventType::kAlloc, dst, chunk, kFlagNone);
      Status s;
      bool dirty = c->dirty;                              // moved between caches: as it was
      if (c->cached() || c->content != Content::kZero) {  // bytes copied in now: a miss
        AcquireWaits& w = PhaseWaits();
        ++w.misses;
        w.miss_bytes += c->bytes;
        ++stats_.waits.misses;
        stats_.waits.miss_bytes += c->bytes;
      }
      if (c->cached()) {
        s = MoveSync(chunk, c->cache, dst, "move between caches");
        if (s.ok()) s = FreeRegion(c->cache, chunk, !c->dirty);
      } else if (c->content == Content::kZero) {
        // The caller of AcquireForWrite zeroes it itself (no copy, no memset here).
        if (must_zero != nullptr) {
          *must_zero = true;
        } else {
          s = FillZero(chunk, dst, "zero fill");
        }
        dirty = true;  // the home copy is stale
      } else {
        s = MoveSync(chunk, c->home, dst, "fetch");
        dirty = false;
      }
      if (!s.ok()) {
        FreeRegion(dst, chunk, true).IgnoreError();
        return s;
      }
      c->cache = dst;
      c->dirty = dirty;
    }
  }
  // Now resident on `where`.
  Placed& at = c->cache.tier == where ? c->cache : c->home;
  if (c->content == Content::kZero) {
    if (&at == &c->home && must_zero != nullptr) {
      *must_zero = true;  // a zero home: the caller of AcquireForWrite zeroes it
    } else if (&at == &c->home) {
      TIERMEM_RETURN_IF_ERROR(FillZero(chunk, at, "zero fill"));
    }
    c->content = Content::kZeroFilled;
  }
  ++c->pins;
  c->last_use = ++use_counter_;
  void* addr = at.region.addr;
  if (addr == nullptr) {
    --c->pins;
    return InternalError("engine: tier " + std::string(TierKindName(where)) +
                         " gave no address for chunk " + std::to_string(chunk));
  }
  c->Check();
  Prefetch();
  return addr;
}

AcquireWaits& Engine::PhaseWaits() { return stats_.waits_by_phase[phase_].second; }

// ---- scratch ---------------------------------------------------------------------------------

StatusOr<Region> Engine::AllocateScratch(TierKind tier, Bytes bytes, Category category) {
  Tier* t = TierOf(tier);
  if (t == nullptr) return NoTier(tier, "scratch");
  if (bytes == 0) return InvalidArgumentError("engine: scratch of 0 bytes");
  Region r;
  if (tier == TierKind::kNvme) {
    // Nothing is ever evicted from NVMe (it holds homes): its free room or kResourceExhausted.
    TIERMEM_ASSIGN_OR_RETURN(r, t->Allocate(bytes));
  } else {
    TIERMEM_ASSIGN_OR_RETURN(r, AllocateBytes(tier, bytes, kNoChunk, category, false, 0));
  }
  RecordScratch(EventType::kAlloc, tier, r, category);
  Bytes& live = stats_.scratch[Idx(tier)];
  live += r.bytes;
  stats_.scratch_peak[Idx(tier)] = std::max(stats_.scratch_peak[Idx(tier)], live);
  return r;
}

Status Engine::FreeScratch(TierKind tier, const Region& region, Category category) {
  Tier* t = TierOf(tier);
  if (t == nullptr) return NoTier(tier, "scratch");
  // Work the caller queued on it so far comes before any reuse of the memory.
  TIERMEM_RETURN_IF_ERROR(MarkComputeUse(*t, region, stream_));
  TIERMEM_RETURN_IF_ERROR(t->Free(region));
  RecordScratch(EventType::kFree, tier, region, category);
  Bytes& live = stats_.scratch[Idx(tier)];
  live -= std::min(live, region.bytes);
  return OkStatus();
}

Status Engine::Release(ChunkId chunk, bool modified) {
  TIERMEM_RETURN_IF_ERROR(CheckChunk(chunk));
  ChunkRec& c = chunks_[chunk];
  if (c.pins <= 0) {
    return FailedPreconditionError("engine: release of unpinned chunk " + std::to_string(chunk));
  }
  TIERMEM_RETURN_IF_ERROR(MarkDeviceUse(chunk));
  --c.pins;
  if (modified && c.read_only) {
    // The caller wrote the cached copy: drop it, so that reads see the home's bytes again.
    if (c.pins == 0 && c.cached()) TIERMEM_RETURN_IF_ERROR(Evict(chunk));
    return ReadOnlyError(chunk, "a release that modified");
  }
  if (modified) {
    c.content = Content::kData;
    if (c.cached()) c.dirty = true;
    MaybeWriteBehind(chunk);
  }
  c.Check();
  // The room lookahead may go on now that the chunk can be evicted or written home (the last
  // release of a backward is followed by no acquire until the next forward).
  if (c.pins == 0 && !planned_ && config_.lookahead == Lookahead::kRoom && tracing_ &&
      order_.following() && config_.prefetch_depth > 0) {
    PrefetchByRoom();
  }
  return OkStatus();
}

Status Engine::MarkDeviceUse(ChunkId chunk) {
  const ChunkRec& c = chunks_[chunk];
  if (c.cache.tier != TierKind::kDevice) return OkStatus();
  return MarkComputeUse(*tiers_.device, c.cache.region, stream_)
      .WithContext("engine: recording the compute use of chunk " + std::to_string(chunk));
}

void Engine::MaybeWriteBehind(ChunkId chunk) {
  ChunkRec& c = chunks_[chunk];
  if (planned_ || !config_.write_behind || !tracing_ || !order_.following() || c.pins > 0 ||
      !c.dirty || c.in_flight() || !c.cached() || evictions_before_[Idx(c.cache.tier)] == 0) {
    return;
  }
  const uint64_t next = order_.NextUse(chunk);
  const uint64_t soon = 2 * static_cast<uint64_t>(std::max(config_.prefetch_depth, 1));
  // Needed soon: it may change again.
  if (next != kNeverUsed && next <= order_.position() + soon) return;
  c.Start(Flight::kWritingBack, StartMove(chunk, c.cache, c.home));
  ++stats_.write_behinds;
}

Status Engine::Zero(ChunkId chunk) {
  TIERMEM_RETURN_IF_ERROR(CheckChunk(chunk));
  ChunkRec& c = chunks_[chunk];
  if (c.read_only) return ReadOnlyError(chunk, "zeroing");
  if (c.pins > 0) {
    return FailedPreconditionError("engine: zero of pinned chunk " + std::to_string(chunk));
  }
  TIERMEM_RETURN_IF_ERROR(WaitInflight(chunk, "zero: prefetch in flight"));
  if (c.cache.tier != TierKind::kNone) {
    TIERMEM_RETURN_IF_ERROR(FreeRegion(c.cache, chunk, true));
    c.cache = Placed{};
  }
  c.dirty = false;
  c.content = Content::kZero;
  c.Check();
  return OkStatus();
}

Status Engine::ReadAt(ChunkId chunk, Bytes offset, void* dst, Bytes n) {
  TIERMEM_RETURN_IF_ERROR(CheckChunk(chunk));
  ChunkRec& c = chunks_[chunk];
  if (offset > c.bytes || n > c.bytes - offset) {
    return OutOfRangeError("engine: read past the end of chunk " + std::to_string(chunk));
  }
  TIERMEM_RETURN_IF_ERROR(WaitInflight(chunk, "read: prefetch in flight"));
  if (c.content == Content::kZero) {
    std::memset(dst, 0, n);
    return OkStatus();
  }
  TIERMEM_RETURN_IF_ERROR(MarkDeviceUse(chunk));  // after the work queued on it so far
  const Placed& at = c.cache.tier != TierKind::kNone ? c.cache : c.home;
  return WaitStall(
      TierOf(at.tier)->Copy(CopyRequest{at.region, offset, dst, n, CopyDir::kFromTier}), chunk,
      "read");
}

Status Engine::WriteAt(ChunkId chunk, Bytes offset, const void* src, Bytes n) {
  TIERMEM_RETURN_IF_ERROR(CheckChunk(chunk));
  ChunkRec& c = chunks_[chunk];
  if (offset > c.bytes || n > c.bytes - offset) {
    return OutOfRangeError("engine: write past the end of chunk " + std::to_string(chunk));
  }
  if (c.read_only) return ReadOnlyError(chunk, "a write into");
  TIERMEM_RETURN_IF_ERROR(WaitInflight(chunk, "write: prefetch in flight"));
  if (c.content == Content::kZero) {  // no copy holds data: make the home copy real zeros first
    TIERMEM_RETURN_IF_ERROR(FillZero(chunk, c.home, "zero fill"));
    c.content = Content::kZeroFilled;
  }
  if (n > 0) c.content = Content::kData;
  const bool cached = c.cached();
  const Placed& at = cached ? c.cache : c.home;
  TIERMEM_RETURN_IF_ERROR(MarkDeviceUse(chunk));  // not under work queued on it so far
  TIERMEM_RETURN_IF_ERROR(
      WaitStall(TierOf(at.tier)->Copy(
                    CopyRequest{at.region, offset, const_cast<void*>(src), n, CopyDir::kToTier}),
                chunk, "write"));
  if (cached) c.dirty = true;
  c.Check();
  return OkStatus();
}

Status Engine::Flush() {
  for (ChunkId id = 0; id < chunks_.size(); ++id) {
    ChunkRec& c = chunks_[id];
    TIERMEM_RETURN_IF_ERROR(WaitInflight(id, "flush: prefetch in flight"));
    if (c.cached() && c.dirty && c.pins == 0) {
      TIERMEM_RETURN_IF_ERROR(MoveSync(id, c.cache, c.home, "flush"));
      c.dirty = false;
    }
  }
  return OkStatus();
}

void Engine::BeginIteration() {
  order_.BeginIteration();
  scores_.BeginIteration();
  for (ChunkRec& c : chunks_) c.soon = false;
  evictions_before_ = evictions_now_;
  evictions_now_ = {};
  RecordLabel(EventType::kIteration, "iteration", stats_.iterations);
  ++stats_.iterations;
}

void Engine::Moment(std::string_view label) {
  RecordLabel(EventType::kMoment, label, 0);
  if (planned_ && !deferred_.empty()) {
    Status s = PumpDeferred();
    if (!s.ok()) {
      TIERMEM_LOG(kWarn) << "engine: planned prefetch: " << s.message();
    }
  }
}
void Engine::Phase(std::string_view label) {
  RecordLabel(EventType::kPhase, label, 0);
  auto& phases = stats_.waits_by_phase;
  phase_ = 0;
  while (phase_ < phases.size() && phases[phase_].first != label) ++phase_;
  if (phase_ == phases.size()) phases.emplace_back(std::string(label), AcquireWaits{});
}

void Engine::RecordCollective(std::string_view op, Bytes bytes, uint64_t ns) {
  if (recorder_ == nullptr) return;
  Event e;
  e.type = EventType::kCollective;
  e.id = ns;
  e.bytes = bytes;
  e.label = recorder_->InternLabel(op);
  recorder_->Record(e);
}

Status Engine::Synchronize() {
  for (ChunkId id = 0; id < chunks_.size(); ++id) {
    TIERMEM_RETURN_IF_ERROR(WaitInflight(id, "synchronize"));
  }
  return OkStatus();
}

TierKind Engine::Resident(ChunkId chunk) const {
  if (chunk >= chunks_.size()) return TierKind::kNone;
  const ChunkRec& c = chunks_[chunk];
  return c.cached() ? c.cache.tier : c.home.tier;
}
TierKind Engine::Home(ChunkId chunk) const {
  return chunk < chunks_.size() ? chunks_[chunk].home.tier : TierKind::kNone;
}
bool Engine::Dirty(ChunkId chunk) const { return chunk < chunks_.size() && chunks_[chunk].dirty; }
bool Engine::ZeroContent(ChunkId chunk) const {
  return chunk < chunks_.size() && chunks_[chunk].content != Content::kData;
}
int Engine::Pins(ChunkId chunk) const { return chunk < chunks_.size() ? chunks_[chunk].pins : 0; }
Bytes Engine::ChunkBytes(ChunkId chunk) const {
  return chunk < chunks_.size() ? chunks_[chunk].bytes : 0;
}

EngineStats Engine::Stats() const {
  EngineStats s = stats_;
  for (Tier* t : {tiers_.device, tiers_.host, tiers_.nvme}) {
    if (t != nullptr) s.tiers[Idx(t->kind())] = t->Stats();
  }
  return s;
}

}  // namespace tiermem::chunks
