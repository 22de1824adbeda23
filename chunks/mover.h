// Mover: async copies between any two tiers, the only way chunk bytes change tier.
//
// Lanes: device<->host goes straight to the device tier's Copy (host side = the host region's
// address); host<->NVMe to the NVMe tier's Copy; host<->host is a (parallel) memcpy;
// device<->NVMe bounces through pinned host staging slots (device->host->NVMe and back),
// pipelined slot by slot; a bounce that finds no free slot while other bounces hold some waits
// for them (a failure only when the staging tier is full of something else). Every move is recorded
// in the timeline (copy begin/end, with the source and destination tier, bytes, chunk and category)
// when a recorder is attached.
//
// Ordering: moves are independent; a caller that needs B after A waits on A's completion
// (or chains with Completion::OnDone). A region must not be freed or written while a move
// that reads or writes it is in flight; the engine enforces this through chunk states.
//
// Threading: thread-safe. Tiers, the staging tier and the recorder must outlive the Mover.
#pragma once

#include <array>
#include <memory>

#include "base/timeline.h"
#include "tiers/tier.h"

namespace tiermem {

struct Endpoint {
  Tier* tier = nullptr;
  Region region;
  Bytes offset = 0;
};

struct MoveRequest {
  Endpoint src;
  Endpoint dst;
  Bytes bytes = 0;
  ChunkId chunk = kNoChunk;  // for the timeline
  Category category = Category::kOther;
};

struct MoverConfig {
  Bytes staging_slot_bytes = 4 * kMiB;  // device<->NVMe bounce slot size
  int staging_slots = 4;                // slots in flight per device<->NVMe move
  int memcpy_threads = 0;               // host<->host parallel memcpy threads (0 = all cores)
  Bytes parallel_memcpy_min_bytes = 8 * kMiB;  // host<->host copies this big are split over them
  // A bounce's piece copies ask the tiers to do their checksum work on the threads that drive
  // them (CopyRequest::inline_work) rather than hand each piece to a worker pool.
  bool inline_work = true;
};

// The staging of a session's device <-> NVMe bounces for chunks of `chunk_bytes`, given the
// NVMe tier's I/O size and queue depth: io_depth slots (fewer for a chunk of fewer pieces) of
// whole I/O pieces, as small as that allows — one piece for chunks up to 2 x io_depth pieces.
// A lone move (one chunk's write-back in the backward, one fetch) then has the disk's queue
// full as soon as the first staging copies land, and its tail is one small piece, not a
// quarter chunk; the staging bytes per move stay at most one chunk. A chunk no larger than a
// piece: one slot of it.
MoverConfig BounceMoverConfig(Bytes chunk_bytes, Bytes io_piece, int io_depth);

// What the moves of one directed tier pair cost, summed over successful moves: bytes, count
// and busy_ns, the sum of each move's duration from Move() to its completion (a move queued
// behind another on the same lane counts its wait too, so bytes / busy_ns is a per-move rate,
// at most the lane's throughput). The planner's trace takes its measured copy rates from it.
struct LinkCounters {
  Bytes bytes = 0;
  uint64_t moves = 0;
  uint64_t busy_ns = 0;
};
using LinkTable = std::array<std::array<LinkCounters, kNumTierKinds>, kNumTierKinds>;

class Mover {
 public:
  virtual ~Mover() = default;
  virtual std::shared_ptr<Completion> Move(const MoveRequest& request) = 0;
  // Counters since creation, by [source TierKind][destination TierKind]. Thread-safe.
  virtual LinkTable Links() const = 0;
};

// `staging` is a byte-addressable host tier the mover allocates bounce slots from (may be
// null if no device<->NVMe move will be asked for). `recorder` may be null.
std::unique_ptr<Mover> NewMover(const MoverConfig& config, Tier* staging,
                                TimelineRecorder* recorder);

}  // namespace tiermem
