// The timeline event schema: the data model shared by every recorder (the linked engine, the
// LD_PRELOAD shim) and every reader (`tiermem prof`). The on-disk framing (header, blocks,
// checksums, label records) is specified in docs/timeline-format.md; this header fixes the
// in-memory event and the meaning of each field. Numeric values of the enums are part of the
// format: append, never renumber.
#pragma once

#include <cstdint>
#include <type_traits>

#include "base/units.h"

namespace tiermem {

enum class EventType : uint8_t {
  kAlloc = 1,       // region `id` of `bytes` allocated on `tier`, holding `category`
  kFree = 2,        // region `id` freed on `tier` (bytes = its size)
  kCopyBegin = 3,   // copy `id` of `bytes` from `tier` to `tier2` started on `lane`
  kCopyEnd = 4,     // copy `id` finished (flags & kFlagFailed: it failed)
  kStallBegin = 5,  // compute waits; `label` names the cause ("prefetch late", "evict", ...)
  kStallEnd = 6,    // the stall `id` ended
  kBudget = 7,      // the budget of `tier` is now `bytes`
  kMoment = 8,      // a moment ticked; `label` names it (module + pre-forward/pre-backward/...)
  kPhase = 9,       // a phase begins; `label` is "forward", "backward", "optimizer", "step"...
  kOom = 10,        // an allocation of `bytes` on `tier` was refused
  kIteration = 11,  // iteration `id` begins
  // Added for the LD_PRELOAD shim (2026-12; readers before it reject these two types):
  kKernelLaunches = 12,  // `bytes` kernel launches happened since the recorder's previous
                         // kKernelLaunches (an interval ending at ts_ns); `id` = interval number
  kPrefetch = 13,        // a prefetch of `bytes` of region `id` (on `tier`) to `tier2` was
                         // issued; asynchronous, its completion is not observed; `label` =
                         // the stream ("stream 0x...")
  // Added for sharded sessions (2026-12; readers before it reject this type):
  kCollective = 14,  // a collective `label` ("all_gather", "reduce_scatter", "all_reduce")
                     // over `bytes` (the full buffer's size on this rank) ended at ts_ns;
                     // `id` = its duration in ns (it began at ts_ns - id)
};

enum EventFlags : uint8_t {
  kFlagNone = 0,
  kFlagFailed = 1 << 0,   // kCopyEnd: the copy failed
  kFlagClean = 1 << 1,    // kFree on eviction of a clean chunk: no copy was needed
  kFlagManaged = 1 << 2,  // kAlloc/kFree: CUDA managed (unified) memory (preload shim)
};

// Fixed 40-byte record, little-endian on disk, written verbatim.
struct Event {
  uint64_t ts_ns = 0;        // monotonic ns (Clock); 0 when handed to Record() = "stamp it now"
  uint64_t id = 0;           // region id, copy id or stall id (pairs begin/end); iteration number
  uint64_t bytes = 0;        // size in bytes (alloc/free/copy/budget/oom)
  uint32_t label = 0;        // interned string id, 0 = none; preload kAlloc/kFree: the stream
  ChunkId chunk = kNoChunk;  // the chunk concerned, if any
  uint16_t lane = 0;         // recorder thread or copy lane
  EventType type = EventType::kAlloc;
  TierKind tier = TierKind::kNone;   // the tier (copy: source)
  TierKind tier2 = TierKind::kNone;  // copy: destination
  Category category = Category::kOther;
  uint8_t flags = kFlagNone;
  uint8_t reserved = 0;
};
static_assert(sizeof(Event) == 40, "Event is a fixed 40-byte on-disk record");
static_assert(std::is_trivially_copyable_v<Event>);

}  // namespace tiermem
