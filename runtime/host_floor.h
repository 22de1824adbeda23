// Host mode's chunk sizing and its floor: the host budget below which a model cannot run in
// host mode with NVMe (docs/host-mode.md "Chunk size and the host room").
//
// Without a device budget, an fp32 chunk is at most 1/kHostChunkShare of the host budget, and
// with NVMe the host keeps room for the NVMe-homed chunks in use (HostReserveChunks of them).
// Tensors stay whole while that room fits the budget: compute then reads every chunk's host
// copy in place, and chunks are sized by the largest tensor when it exceeds the share. A
// large tensor (a 32,000-token vocabulary's embedding or head) would then set the floor at
// 7 chunks of itself. Below that, tensors larger than a chunk of the share are split into
// pieces of whole rows, each in its own chunk group, as in device mode: the optimizer steps
// them piece by piece (one piece's p, g, m and v at a time, the group's chunks). While its unit
// computes, the binding holds one contiguous copy of a split tensor, assembled one piece's
// chunk pinned at a time (kSplitPinnedChunks: kept free of homes, in the reserve), and,
// when it trains, torch's dense gradient of it (a frozen tensor has none); a copy autograd saves
// for the backward is kept as a reference to the pieces and assembled again there. Those copies are
// counted in the host budget: the host tier is built kSplitCopies x the largest split tensor
// smaller (compute_room), so the budget stays the ceiling of both. Floor with splitting, T the
// largest tensor: 2 T + 8 chunks of about budget / 32, i.e. about 2.56 T, against 7 T whole.
//
// Why split only below the whole-tensor floor: splitting costs a copy of each split tensor
// per unit call and keeps split tensors out of compressed optimizer-state formats
// (session.cc), so a budget that trains with whole tensors keeps them whole.
//
// Pure functions of the layout inputs: no tiers, no session.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "base/status.h"
#include "base/units.h"
#include "layout/chunk_layout.h"
#include "runtime/layout.h"

namespace tiermem::session {

// A chunk sized by a tensor larger than the share: the least waste up to 5/4 of it.
inline constexpr Bytes kHostChunkSlackNum = 5, kHostChunkSlackDen = 4;
// Copies of a split tensor a unit holds while it computes, in the compute dtype: the
// contiguous compute copy, and training, torch's dense gradient (dense even for an
// embedding, whose gradient is sparse in use).
inline constexpr Bytes kSplitCopiesTrain = 2;
inline constexpr Bytes kSplitCopiesServe = 1;
// Chunks of a split tensor's pieces pinned at once: its copy is assembled piece by piece.
inline constexpr uint64_t kSplitPinnedChunks = 1;

// Chunks of host room held for NVMe-homed chunks in use in host mode: one chunk group's
// optimizer step (kStepGroupChunks: param lowp, param fp32, grad, m, v), or what a served unit
// computes with (kMinResidentChunks, the device minimum, or `unit_groups` when more: the
// largest unit's groups, all pinned while it computes), plus kPrefetchedChunks prefetched
// next (the constants of layout.h, shared with HostRoomFor).
int HostReserveChunks(bool trainable, size_t unit_groups = 0);

// What host sizing reads. `tensors` as given (rows: their first dimension).
struct HostSizingInputs {
  Bytes per_elem = 0;        // compute (+ grad) bytes per element, as the device working set
  Bytes compute_esize = 4;   // bytes per element of a compute copy
  uint64_t align_elems = 0;  // chunk sizes are multiples of it (int8 state: its block)
  bool trainable = true;     // anything trains
  bool nvme = false;         // with NVMe: room is held for NVMe-homed chunks
  Bytes host_reserve = 0;    // config host_reserve: kept out of homes beside that room
  // Per tensor (index-parallel with the tensors; empty: none): frozen tensors have no
  // gradient, so a frozen split tensor's compute room is its copy alone.
  std::vector<bool> frozen;
  // Per tensor, its units (TensorSpec::units; empty: none): serving sizes its room by the most
  // chunk groups one unit pins at the chunk size chosen (MostPinGroups).
  std::vector<std::vector<int>> units;
  bool trains(size_t t) const { return trainable && (t >= frozen.size() || !frozen[t]); }
};

// Host mode's layout at one host budget (no expert sets, no chunk_size given).
struct HostSizing {
  uint64_t chunk_elems = 0;
  bool split = false;          // tensors larger than a chunk are pieces of rows (else all whole)
  Bytes reserve = 0;           // host room never used for homes: HostReserveChunks fp32 chunks
                               // (page-aligned; split: + pinned_chunks) + host_reserve; 0
                               // without NVMe
  Bytes compute_room = 0;      // split: the most one split tensor's copies take
                               // (kSplitCopiesTrain when it trains, else kSplitCopiesServe)
  int64_t room_tensor = -1;    // the tensor that sets compute_room (-1: none)
  uint64_t pinned_chunks = 0;  // split: chunks of a split tensor's pieces pinned at once
  Bytes need() const { return reserve + compute_room; }
};

// The chunk size and split choice at `host_budget` (the file comment's rule).
// kResourceExhausted only as ChooseChunkElems reports it.
StatusOr<HostSizing> SizeHostChunks(const std::vector<chunks::PackTensor>& tensors,
                                    const HostSizingInputs& in, Bytes host_budget);

// The host floor: a host budget at which SizeHostChunks needs no more than the budget and one
// byte less is refused (found by raising the budget by MiBs to what it needs there until it
// holds — the chunk size follows the budget — then bisecting between the last refused budget
// and it).
StatusOr<Bytes> SufficientHostBudget(const std::vector<chunks::PackTensor>& tensors,
                                     const HostSizingInputs& in);

// The refusal of `host_budget` when sizing.need() exceeds it and a split tensor sets the
// room: names the tensor (`name`, `shape`, `dtype_name`), what it needs, and `sufficient`.
std::string HostFloorRefusal(Bytes host_budget, const HostSizing& sizing,
                             const HostSizingInputs& in, const std::string& name,
                             const std::vector<int64_t>& shape, uint64_t numel,
                             std::string_view dtype_name, Bytes sufficient);

// The floors of a model's training (or serving) state, without building anything: what
// `tiermem floor` prints (docs/configuration.md "The floors of a model").
struct ModelFloors {
  // Host mode with NVMe: tensors whole (7 chunks of about the largest, the floor before
  // splitting), and the budget SufficientHostBudget finds, with its sizing.
  Bytes host_whole = 0;
  Bytes host_sufficient = 0;
  HostSizing host_at_sufficient;
  // Device mode (SimDevice, CUDA): the device budget below which the layout is refused
  // (kMinResidentChunks chunks of the longest row: `device_row_tensor`'s), and the most a
  // split tensor's compute copies take on the device beside it (outside the device budget:
  // the largest tensor's copy and, training, its gradient, in the compute dtype).
  Bytes device_minimum = 0;
  size_t device_row_tensor = 0;
  Bytes device_split_copies = 0;
  size_t largest_tensor = 0;
};

// `tensors` in the session's order, rows = their first dimension; `in` as Session::Create
// builds it (nvme true for the host floors).
StatusOr<ModelFloors> ComputeModelFloors(const std::vector<chunks::PackTensor>& tensors,
                                         const HostSizingInputs& in);

}  // namespace tiermem::session
