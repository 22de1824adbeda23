// Engine: the moves made ahead of an acquire — following the recorded order (lookahead: a
// window of prefetch_depth acquires, or room-driven, PrefetchByRoom), prefetch hints, the
// write-behinds that make room for them (CleanFor), and planned mode (the plan's evictions and
// prefetches, deferred while their tier has no room). Same class and invariants as
// engine.cc's essay: a lookahead or hinted prefetch is a fill (StartFill) of an idle, unpinned
// chunk with no cached copy, and takes room only from clean chunks next used after the
// position it is for (EvictForLookahead).
#include <algorithm>
#include <array>
#include <string>
#include <utility>
#include <vector>

#include "base/logging.h"
#include "chunks/engine.h"

namespace tiermem::chunks {
namespace {
int Idx(TierKind k) { return static_cast<int>(k); }
}  // namespace

// ---- lookahead and hints ----------------------------------------------------------------------

uint64_t Engine::LookaheadNextUse(ChunkId chunk) const {
  if (chunks_[chunk].soon) return order_.position();  // hinted: needed now
  const uint64_t ordered = order_.NextUse(chunk, /*wrap=*/true);
  if (!order_.following()) return ordered;
  return std::min(ordered, scores_.ExpectedNextUse(chunk, order_.position(), order_.size(), true));
}

StatusOr<bool> Engine::EvictForLookahead(TierKind tier, ChunkId chunk, uint64_t pos) {
  ChunkId best = kNoChunk;
  uint64_t best_next = 0;
  for (ChunkId id = 0; id < chunks_.size(); ++id) {
    SettleLandedWriteBack(id);
    const ChunkRec& c = chunks_[id];
    if (c.cache.tier != tier || id == chunk || c.pins > 0 || c.in_flight() || c.soon) continue;
    if (speculating_ && scores_.ClassOf(id) == kNoClass) continue;
    const uint64_t next = LookaheadNextUse(id);
    if (next <= pos) continue;  // needed before the chunk room is made for
    if (best == kNoChunk || next > best_next) {
      best = id;
      best_next = next;
    }
  }
  if (best == kNoChunk || chunks_[best].dirty) return false;
  TIERMEM_RETURN_IF_ERROR(Evict(best));
  return true;
}

uint64_t Engine::NextUse(ChunkId chunk) const {
  if (chunks_[chunk].soon) return order_.position();  // hinted: needed now
  const uint64_t ordered = order_.NextUse(chunk);
  if (!order_.following()) return ordered;
  return std::min(
      ordered, scores_.ExpectedNextUse(chunk, order_.position(), order_.size(), order_.cyclic()));
}

StatusOr<bool> Engine::PrefetchHint(ChunkId chunk, TierKind where, double probability) {
  TIERMEM_RETURN_IF_ERROR(CheckChunk(chunk));
  if (where != TierKind::kDevice && where != TierKind::kHost) {
    return InvalidArgumentError("engine: chunks are prefetched to device or host, not " +
                                std::string(TierKindName(where)));
  }
  if (TierOf(where) == nullptr) return NoTier(where, "prefetch");
  if (!(probability > 0 && probability <= 1)) {
    return InvalidArgumentError("engine: a prefetch hint's probability must be in (0, 1]");
  }
  const bool certain = probability >= 1;
  ChunkRec& c = chunks_[chunk];
  if (planned_ || c.cache.tier == where || c.home.tier == where || c.cached() || c.in_flight() ||
      c.pins > 0) {
    if (certain && (c.cache.tier == where || c.home.tier == where)) c.soon = true;
    return false;
  }
  const uint64_t after =
      order_.position() +
      static_cast<uint64_t>((1.0 / probability - 1.0) * static_cast<double>(order_.size()));
  // A prediction may displace only other experts expected later (never an ordered chunk,
  // whose next use is certain): a wrong one then costs its own bytes, not a dense refetch.
  speculating_ = !certain;
  auto r = AllocateOn(where, chunk, true, after);
  speculating_ = false;
  if (!r.ok()) return false;  // no room without hurting sooner uses
  StartFill(chunk, Placed{where, *r});
  chunks_[chunk].soon = certain;
  ++stats_.hint_prefetches;
  return true;
}

void Engine::Prefetch() {
  if (planned_) {
    Status s = PumpDeferred();
    if (!s.ok()) {
      TIERMEM_LOG(kWarn) << "engine: planned prefetch: " << s.message();
    }
    return;
  }
  if (!tracing_ || !order_.following() || config_.prefetch_depth == 0) return;
  if (config_.lookahead == Lookahead::kRoom) {
    PrefetchByRoom();
    return;
  }
  // Cyclic: the window may run into the next iteration's copy of the order.
  const uint64_t end = order_.WindowEnd(static_cast<uint64_t>(config_.prefetch_depth));
  for (uint64_t j = order_.position(); j < end; ++j) {
    const auto [id, where] = order_.At(j);
    ChunkRec& c = chunks_[id];
    if (c.cache.tier == where || c.home.tier == where || c.cached() || c.in_flight() ||
        c.pins > 0) {
      continue;
    }
    auto r = AllocateOn(where, id, true, j);
    if (!r.ok()) break;  // no room without hurting sooner uses: stop looking further ahead
    StartFill(id, Placed{where, *r});
  }
}

void Engine::PrefetchByRoom() {
  // One lap of the order: up to this position of the next iteration (the order repeats, so
  // positions size..2*size-1 are the next iteration's, as LookaheadNextUse counts them). Host
  // entries look the whole lap ahead; device entries only prefetch_depth acquires (the device's
  // room is shared with activations that grow through the forward: copies far ahead would be
  // evicted again for them). A tier is done at its first entry that finds no room.
  const uint64_t pos = order_.position();
  const uint64_t end = pos + order_.size();
  const uint64_t device_end = pos + static_cast<uint64_t>(config_.prefetch_depth);
  std::array<bool, kNumTierKinds> done{};
  done[Idx(TierKind::kNvme)] = true;
  // Without NVMe every chunk is homed on the host: host acquires need no prefetch.
  done[Idx(TierKind::kHost)] = tiers_.nvme == nullptr;
  for (uint64_t j = pos; j < end; ++j) {
    if (j >= device_end) done[Idx(TierKind::kDevice)] = true;
    if (done[Idx(TierKind::kDevice)] && done[Idx(TierKind::kHost)]) return;
    const auto [id, where] = order_.At(j);
    ChunkRec& c = chunks_[id];
    if (done[Idx(where)] || c.cache.tier == where || c.home.tier == where || c.cached() ||
        c.in_flight() || c.pins > 0) {
      continue;
    }
    auto r = AllocateOn(where, id, true, j);
    if (!r.ok()) {
      // The chunks used farthest after it are dirty (or there are none): write them home.
      if (where == TierKind::kHost) CleanFor(where, j, c.bytes);
      done[Idx(where)] = true;
      continue;
    }
    StartFill(id, Placed{where, *r});
  }
}

void Engine::CleanFor(TierKind tier, uint64_t pos, Bytes need) {
  if (!config_.write_behind) return;  // no background write-backs
  Bytes cleaning = 0;
  std::vector<std::pair<uint64_t, ChunkId>> dirty;  // (next use, chunk)
  for (ChunkId id = 0; id < chunks_.size(); ++id) {
    const ChunkRec& c = chunks_[id];
    if (c.cache.tier != tier) continue;
    if (c.writing_back()) {
      cleaning += c.bytes;
      continue;
    }
    if (c.pins > 0 || !c.dirty || c.in_flight() || c.soon) continue;
    const uint64_t next = LookaheadNextUse(id);
    if (next <= pos) continue;  // needed before the chunk room is made for
    dirty.emplace_back(next, id);
  }
  std::sort(dirty.begin(), dirty.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  for (const auto& [next, id] : dirty) {
    if (cleaning >= need) return;
    ChunkRec& c = chunks_[id];
    c.Start(Flight::kWritingBack, StartMove(id, c.cache, c.home));
    ++stats_.write_behinds;
    cleaning += c.bytes;
  }
}

void Engine::StartFill(ChunkId id, const Placed& dst) {
  RecordRegion(EventType::kAlloc, dst, id, kFlagNone);
  ChunkRec& cc = chunks_[id];
  std::shared_ptr<Completion> move;
  Flight fill;
  if (cc.content == Content::kZero) {
    StatusOr<char*> zeros = Zeros(cc.bytes);
    move =
        zeros.ok()
            ? TierOf(dst.tier)->Copy(CopyRequest{dst.region, 0, *zeros, cc.bytes, CopyDir::kToTier})
            : Completion::Done(zeros.status());  // WaitInflight reports it
    fill = Flight::kFillingZeros;
    cc.content = Content::kZeroFilled;
    cc.dirty = true;  // the home copy is stale
  } else {
    move = StartMove(id, cc.home, dst);
    // One copy (a host home) vs a staged bounce (an NVMe home): Acquire may order the compute
    // stream after the first kind only (its one copy is all the tier sees).
    fill = cc.home.tier == TierKind::kHost ? Flight::kFillingDirect : Flight::kFilling;
    cc.dirty = false;
  }
  cc.cache = dst;
  cc.Start(fill, std::move(move));
  ++stats_.prefetches;
}

// ---- planned mode -----------------------------------------------------------------------------

bool Engine::PlannedDropPending(TierKind tier) const {
  for (const ChunkRec& c : chunks_) {
    if (c.flight() == Flight::kWritingBackDrop && c.cache.tier == tier) return true;
  }
  return false;
}

StatusOr<bool> Engine::ReclaimPlanned(TierKind tier, bool wait) {
  bool freed = false;
  ChunkId pending = kNoChunk;
  for (ChunkId id = 0; id < chunks_.size(); ++id) {
    ChunkRec& c = chunks_[id];
    if (c.flight() != Flight::kWritingBackDrop || c.cache.tier != tier) continue;
    if (!c.Landed()) {
      if (pending == kNoChunk) pending = id;
      continue;
    }
    // A failed write-back keeps the copy, dirty (nothing lost); evicting it later retries
    // synchronously and reports a lasting fault.
    Status s = WaitInflight(id, "");
    if (s.ok()) {
      freed = true;
    } else {
      TIERMEM_LOG(kWarn) << s.message() << "; retrying when evicted";
    }
  }
  if (!freed && wait && pending != kNoChunk) {
    Status s = WaitInflight(pending, "");
    if (s.ok()) return true;
    TIERMEM_LOG(kWarn) << s.message() << "; retrying when evicted";
  }
  return freed;
}

StatusOr<bool> Engine::PlanEvict(ChunkId chunk, TierKind tier) {
  TIERMEM_RETURN_IF_ERROR(CheckChunk(chunk));
  ChunkRec& c = chunks_[chunk];
  if (c.cache.tier != tier || tier == TierKind::kNone || c.pins > 0 || c.in_flight()) {
    ++stats_.plan_skipped;
    return false;
  }
  ++stats_.plan_evictions;
  if (!c.dirty) {
    ++evictions_now_[Idx(tier)];
    TIERMEM_RETURN_IF_ERROR(FreeRegion(c.cache, chunk, true));
    c.cache = Placed{};
    ++stats_.evictions;
    ++stats_.clean_evictions;
    return true;
  }
  c.Start(Flight::kWritingBackDrop, StartMove(chunk, c.cache, c.home));
  ++stats_.write_behinds;
  return true;
}

StatusOr<int> Engine::TryPlanPrefetch(ChunkId chunk, TierKind tier) {
  ChunkRec& c = chunks_[chunk];
  if ((tier != TierKind::kDevice && tier != TierKind::kHost) || c.pins > 0 || c.in_flight() ||
      c.cached() || c.home.tier == tier || TierOf(tier) == nullptr) {
    return 0;
  }
  Tier* t = TierOf(tier);
  for (;;) {
    const TierStats st = t->Stats();
    if (st.used + c.bytes <= ChunkCapacity(tier, st)) {
      auto r = t->Allocate(c.bytes);
      if (r.ok()) {
        StartFill(chunk, Placed{tier, *r});
        return 1;
      }
      if (r.status().code() != StatusCode::kResourceExhausted) return r.status();
    }
    TIERMEM_ASSIGN_OR_RETURN(const bool freed, ReclaimPlanned(tier, false));
    if (freed) continue;
    return PlannedDropPending(tier) ? -1 : 0;
  }
}

Status Engine::PumpDeferred() {
  std::array<bool, kNumTierKinds> blocked{};
  size_t keep = 0;
  Status err;
  for (size_t i = 0; i < deferred_.size(); ++i) {
    const auto [chunk, tier] = deferred_[i];
    if (blocked[Idx(tier)] || !err.ok()) {  // FIFO per tier, like the copy lanes
      deferred_[keep++] = deferred_[i];
      continue;
    }
    StatusOr<int> r = TryPlanPrefetch(chunk, tier);
    if (!r.ok()) {
      err = r.status();
      continue;  // dropped
    }
    if (*r < 0) {
      blocked[Idx(tier)] = true;
      deferred_[keep++] = deferred_[i];
    } else if (*r > 0) {
      ++stats_.plan_prefetches;
    } else {
      ++stats_.plan_skipped;
    }
  }
  deferred_.resize(keep);
  return err;
}

StatusOr<bool> Engine::PlanPrefetch(ChunkId chunk, TierKind tier) {
  TIERMEM_RETURN_IF_ERROR(CheckChunk(chunk));
  TIERMEM_RETURN_IF_ERROR(PumpDeferred());
  for (const auto& d : deferred_) {
    if (d.second == tier) {  // behind earlier prefetches still waiting for room on this tier
      deferred_.emplace_back(chunk, tier);
      ++stats_.plan_deferred;
      return false;
    }
  }
  TIERMEM_ASSIGN_OR_RETURN(const int r, TryPlanPrefetch(chunk, tier));
  if (r < 0) {
    deferred_.emplace_back(chunk, tier);
    ++stats_.plan_deferred;
    return false;
  }
  ++(r > 0 ? stats_.plan_prefetches : stats_.plan_skipped);
  return r > 0;
}

}  // namespace tiermem::chunks
