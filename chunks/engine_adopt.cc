// Engine: replacing a chunk's home — adopting a copy the caller wrote the new content into
// (copy-on-write: AdoptHostCopy, AdoptNvmeCopy, after PrepareAdopt) and a read-only home read
// in place from a checkpoint (SetReadOnlyHome). Same class and invariants as engine.cc's
// essay: only an unpinned chunk with no move in flight takes a new copy (PrepareAdopt waits
// for the move), the copies it supersedes are freed here, and the chunk is kData afterwards.
#include <algorithm>
#include <string>

#include "chunks/engine.h"

namespace tiermem::chunks {
namespace {
int Idx(TierKind k) { return static_cast<int>(k); }
}  // namespace

Status Engine::PrepareAdopt(ChunkId chunk) {
  TIERMEM_RETURN_IF_ERROR(CheckChunk(chunk));
  if (chunks_[chunk].read_only) return ReadOnlyError(chunk, "adopting a new copy of");
  if (chunks_[chunk].pins > 0) {
    return FailedPreconditionError("engine: chunk " + std::to_string(chunk) +
                                   " is pinned: a new copy of it cannot be adopted");
  }
  return WaitInflight(chunk, "adopt: move in flight");
}

Status Engine::AdoptHostCopy(ChunkId chunk, const Region& region) {
  TIERMEM_RETURN_IF_ERROR(PrepareAdopt(chunk));
  ChunkRec& c = chunks_[chunk];
  if (region.bytes < c.bytes || region.addr == nullptr) {
    return InvalidArgumentError("engine: the region adopted for chunk " + std::to_string(chunk) +
                                " is not a host region of its size");
  }
  RecordScratch(EventType::kFree, TierKind::kHost, region, c.category);
  Bytes& live = stats_.scratch[Idx(TierKind::kHost)];
  live -= std::min(live, region.bytes);
  // The old copies are superseded (clean as far as the timeline goes: nothing is written).
  Status s = FreeRegion(c.cache, chunk, true);
  c.cache = Placed{};
  const Placed mine{TierKind::kHost, region};
  if (c.home.tier == TierKind::kHost) {
    Status h = FreeRegion(c.home, chunk, true);
    if (s.ok()) s = h;
    c.home = mine;
    c.dirty = false;
  } else {
    c.cache = mine;
    c.dirty = true;
  }
  RecordRegion(EventType::kAlloc, mine, chunk, kFlagNone);
  c.content = Content::kData;
  c.last_use = ++use_counter_;
  c.Check();
  return s;
}

Status Engine::AdoptNvmeCopy(ChunkId chunk, const Region& region) {
  TIERMEM_RETURN_IF_ERROR(PrepareAdopt(chunk));
  ChunkRec& c = chunks_[chunk];
  if (tiers_.nvme == nullptr || region.bytes < c.bytes) {
    return InvalidArgumentError("engine: the region adopted for chunk " + std::to_string(chunk) +
                                " is not an NVMe region of its size");
  }
  Status s;
  if (c.home.tier == TierKind::kHost) {
    // The new content comes up into the home; the region is scratch again, freed below.
    s = WaitStall(
        tiers_.nvme->Copy(CopyRequest{region, 0, c.home.region.addr, c.bytes, CopyDir::kFromTier}),
        chunk, "adopt: read");
  }
  RecordScratch(EventType::kFree, TierKind::kNvme, region, c.category);
  Bytes& live = stats_.scratch[Idx(TierKind::kNvme)];
  live -= std::min(live, region.bytes);
  // The old copies are superseded (clean as far as the timeline goes: nothing is written).
  Status f = FreeRegion(c.cache, chunk, true);
  if (s.ok()) s = f;
  c.cache = Placed{};
  c.dirty = false;
  if (c.home.tier == TierKind::kNvme) {
    f = FreeRegion(c.home, chunk, true);
    if (s.ok()) s = f;
    c.home = Placed{TierKind::kNvme, region};
    RecordRegion(EventType::kAlloc, c.home, chunk, kFlagNone);
  } else {
    f = tiers_.nvme->Free(region);
    if (s.ok()) s = f;
  }
  c.content = Content::kData;
  c.last_use = ++use_counter_;
  c.Check();
  return s;
}

Status Engine::ReadOnlyError(ChunkId chunk, std::string_view what) const {
  return FailedPreconditionError(
      "engine: " + std::string(what) + " chunk " + std::to_string(chunk) +
      ", whose home is a checkpoint read in place (read-only: a served model's weights are "
      "never written; serve with in_place: off, or load the weights with "
      "tiermem.initialize, to change them)");
}

Status Engine::RehomeOnNvme(ChunkId chunk) {
  TIERMEM_RETURN_IF_ERROR(CheckChunk(chunk));
  ChunkRec& c = chunks_[chunk];
  if (tiers_.nvme == nullptr || c.home.tier != TierKind::kNvme || c.read_only || c.pins > 0 ||
      c.cached() || c.in_flight() || c.content != Content::kZero) {
    return FailedPreconditionError("engine: chunk " + std::to_string(chunk) +
                                   " cannot be given a new NVMe home (not NVMe-homed, read-only, "
                                   "in use or holding values)");
  }
  StatusOr<Region> r = tiers_.nvme->Allocate(c.bytes);
  if (!r.ok()) {
    RecordOom(TierKind::kNvme, c.bytes, chunk, c.category);
    return r.status().WithContext("engine: NVMe home of chunk " + std::to_string(chunk));
  }
  Status f = FreeRegion(c.home, chunk, /*clean=*/true);
  c.home = Placed{TierKind::kNvme, *r};
  RecordRegion(EventType::kAlloc, c.home, chunk, kFlagNone);
  c.Check();
  return f;
}

Status Engine::SetReadOnlyHome(ChunkId chunk, const Region& region) {
  TIERMEM_RETURN_IF_ERROR(CheckChunk(chunk));
  ChunkRec& c = chunks_[chunk];
  if (c.pins > 0 || c.home.tier != TierKind::kNvme || region.bytes < c.bytes) {
    return FailedPreconditionError("engine: chunk " + std::to_string(chunk) +
                                   " cannot take a read-only home (pinned, not homed on NVMe, "
                                   "or the region is smaller than the chunk)");
  }
  TIERMEM_RETURN_IF_ERROR(WaitInflight(chunk, "read-only home: move in flight"));
  if (c.cached()) {
    TIERMEM_RETURN_IF_ERROR(FreeRegion(c.cache, chunk, /*clean=*/true));
    c.cache = Placed{};
  }
  TIERMEM_RETURN_IF_ERROR(FreeRegion(c.home, chunk, /*clean=*/true));
  c.home = Placed{TierKind::kNvme, region};
  RecordRegion(EventType::kAlloc, c.home, chunk, kFlagNone);
  c.content = Content::kData;
  c.dirty = false;
  c.read_only = true;
  c.Check();
  return OkStatus();
}

}  // namespace tiermem::chunks
