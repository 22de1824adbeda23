// Host mode's chunk sizing and floor (see host_floor.h).
#include "runtime/host_floor.h"

#include <algorithm>

namespace tiermem::session {
namespace {

constexpr Bytes kPage = 4096;
constexpr Bytes kMiB = Bytes{1} << 20;
// SufficientHostBudget's rounds: the need grows by an 8/32 share of each raise, so a handful
// converge; the bound only guards against a chunk choice that keeps growing.
constexpr int kMaxRaises = 64;

// A chunk of at most the budget's share, or, when the largest piece (a whole tensor, or a
// row of a split one) is larger, of about that piece: the least waste up to 5/4 of it. Not
// exactly the piece: a layer whose tensors sum to a multiple of its largest would leave its
// small ones a chunk of their own (GPT 8 x 2304 at 2 GiB: 5 groups per block instead of 3,
// chunks 1.7x the state).
StatusOr<uint64_t> ShareChunk(const std::vector<chunks::PackTensor>& tensors,
                              const HostSizingInputs& in, Bytes host_budget) {
  const Bytes share = in.per_elem * (host_budget / kHostChunkShare);
  StatusOr<chunks::ChunkSizeChoice> choice =
      chunks::ChooseChunkElems(tensors, share, in.per_elem, kMinResidentChunks, in.align_elems);
  if (!choice.ok()) {
    uint64_t piece = 0;
    for (const chunks::PackTensor& t : tensors) piece = std::max(piece, t.row_elems());
    const Bytes at_least = chunks::MinimumDeviceBudget(piece, in.per_elem, kMinResidentChunks);
    choice = chunks::ChooseChunkElems(tensors, at_least * kHostChunkSlackNum / kHostChunkSlackDen,
                                      in.per_elem, kMinResidentChunks, in.align_elems);
  }
  if (!choice.ok()) return choice.status();
  return choice->chunk_elems;
}

// The most chunk groups one unit pins at `chunk_elems` (serving with units given; else 0):
// the tensors packed as the layout packs them when nothing trains (one subset, in order, not
// in a compressed state format).
StatusOr<size_t> ServedUnitGroups(const std::vector<chunks::PackTensor>& tensors,
                                  const HostSizingInputs& in, uint64_t chunk_elems) {
  if (in.trainable || in.units.empty()) return size_t{0};
  TIERMEM_ASSIGN_OR_RETURN(const chunks::PieceLayout packed,
                           chunks::PackPieces(tensors, chunk_elems, chunks::kAlignElems));
  return MostPinGroups(UnitsOf(in.units, {}, packed.pieces));
}

StatusOr<Bytes> Reserve(const std::vector<chunks::PackTensor>& tensors, const HostSizingInputs& in,
                        uint64_t chunk_elems) {
  if (!in.nvme) return Bytes{0};
  TIERMEM_ASSIGN_OR_RETURN(const size_t unit_groups, ServedUnitGroups(tensors, in, chunk_elems));
  return static_cast<Bytes>(HostReserveChunks(in.trainable, unit_groups)) *
             AlignUp(chunk_elems * 4, kPage) +
         in.host_reserve;
}

}  // namespace

int HostReserveChunks(bool trainable, size_t unit_groups) {
  const Bytes in_use = trainable
                           ? kStepGroupChunks
                           : std::max<Bytes>(static_cast<Bytes>(kMinResidentChunks), unit_groups);
  return static_cast<int>(in_use + kPrefetchedChunks);
}

StatusOr<HostSizing> SizeHostChunks(const std::vector<chunks::PackTensor>& tensors,
                                    const HostSizingInputs& in, Bytes host_budget) {
  std::vector<chunks::PackTensor> whole = tensors;
  for (chunks::PackTensor& t : whole) t.rows = 1;
  HostSizing s;
  TIERMEM_ASSIGN_OR_RETURN(s.chunk_elems, ShareChunk(whole, in, host_budget));
  TIERMEM_ASSIGN_OR_RETURN(s.reserve, Reserve(whole, in, s.chunk_elems));
  if (s.reserve <= host_budget) return s;
  // Whole tensors do not fit: split those larger than a chunk of the share.
  s.split = true;
  TIERMEM_ASSIGN_OR_RETURN(s.chunk_elems, ShareChunk(tensors, in, host_budget));
  TIERMEM_ASSIGN_OR_RETURN(s.reserve, Reserve(tensors, in, s.chunk_elems));
  // The split tensor whose copies take the most: a frozen one has no gradient.
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].numel <= s.chunk_elems) continue;
    const Bytes room = tensors[i].numel * in.compute_esize *
                       (in.trains(i) ? kSplitCopiesTrain : kSplitCopiesServe);
    if (room > s.compute_room) {
      s.compute_room = room;
      s.room_tensor = static_cast<int64_t>(i);
    }
  }
  if (s.room_tensor >= 0 && in.nvme) {
    // The copy is assembled (and, saved for the backward, assembled again) one piece's chunk
    // pinned at a time.
    s.pinned_chunks = kSplitPinnedChunks;
    s.reserve += s.pinned_chunks * AlignUp(s.chunk_elems * 4, kPage);
  }
  return s;
}

StatusOr<Bytes> SufficientHostBudget(const std::vector<chunks::PackTensor>& tensors,
                                     const HostSizingInputs& in) {
  auto holds = [&](Bytes budget) -> StatusOr<bool> {
    TIERMEM_ASSIGN_OR_RETURN(const HostSizing s, SizeHostChunks(tensors, in, budget));
    return s.need() <= budget;
  };
  // Raised by MiBs to what it needs there until it holds (the chunk size follows the budget),
  // from a page: a small model's floor is below a MiB.
  Bytes refused = 0, budget = kPage;
  for (int i = 0; i < kMaxRaises; ++i) {
    TIERMEM_ASSIGN_OR_RETURN(const HostSizing s, SizeHostChunks(tensors, in, budget));
    if (s.need() <= budget) break;
    refused = budget;
    budget = AlignUp(std::max(s.need() + 1, budget + 1), kMiB);
  }
  // Then bisected down to where one byte less is refused: the least-waste chunk choice makes
  // the need step up and down with the budget, so this is the refusal's edge below `budget`.
  while (refused > 0 && budget - refused > 1) {
    const Bytes mid = refused + (budget - refused) / 2;
    TIERMEM_ASSIGN_OR_RETURN(const bool ok, holds(mid));
    (ok ? budget : refused) = mid;
  }
  return budget;
}

StatusOr<ModelFloors> ComputeModelFloors(const std::vector<chunks::PackTensor>& tensors,
                                         const HostSizingInputs& in) {
  if (tensors.empty()) return InvalidArgumentError("floors: the model has no tensors");
  ModelFloors f;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].numel > tensors[f.largest_tensor].numel) f.largest_tensor = i;
    if (tensors[i].row_elems() > tensors[f.device_row_tensor].row_elems()) f.device_row_tensor = i;
  }
  std::vector<chunks::PackTensor> whole = tensors;
  for (chunks::PackTensor& t : whole) t.rows = 1;
  TIERMEM_ASSIGN_OR_RETURN(const uint64_t whole_chunk, ShareChunk(whole, in, 0));
  TIERMEM_ASSIGN_OR_RETURN(f.host_whole, Reserve(whole, in, whole_chunk));
  TIERMEM_ASSIGN_OR_RETURN(f.host_sufficient, SufficientHostBudget(tensors, in));
  TIERMEM_ASSIGN_OR_RETURN(f.host_at_sufficient, SizeHostChunks(tensors, in, f.host_sufficient));
  f.device_minimum = chunks::MinimumDeviceBudget(tensors[f.device_row_tensor].row_elems(),
                                                 in.per_elem, kMinResidentChunks);
  f.device_split_copies = tensors[f.largest_tensor].numel * in.compute_esize *
                          (in.trains(f.largest_tensor) ? kSplitCopiesTrain : kSplitCopiesServe);
  return f;
}

std::string HostFloorRefusal(Bytes host_budget, const HostSizing& sizing,
                             const HostSizingInputs& in, const std::string& name,
                             const std::vector<int64_t>& shape, uint64_t numel,
                             std::string_view dtype_name, Bytes sufficient) {
  std::string dims;
  for (int64_t d : shape) dims += (dims.empty() ? "" : " x ") + std::to_string(d);
  if (dims.empty()) dims = std::to_string(numel);
  const std::string copies =
      in.trains(static_cast<size_t>(std::max<int64_t>(sizing.room_tensor, 0)))
          ? "its contiguous compute copy and its gradient"
          : "its contiguous compute copy";
  const Bytes slot = AlignUp(sizing.chunk_elems * 4, kPage);
  return "host budget of " + FormatBytes(host_budget) + " (" + std::to_string(host_budget) +
         " bytes) is below the minimum of " + FormatBytes(sizing.need()) + " (" +
         std::to_string(sizing.need()) + " bytes) for this model with NVMe: tensor '" + name +
         "' (" + dims + ", " + std::string(dtype_name) + ") is split across chunks and needs " +
         FormatBytes(sizing.compute_room) + " for " + copies + " while its unit computes, plus " +
         FormatBytes(sizing.pinned_chunks * slot) + " for the chunk of its pieces pinned at a " +
         "time meanwhile, plus " + FormatBytes(sizing.reserve - sizing.pinned_chunks * slot) +
         " of room for the other NVMe-homed chunks in use (" +
         std::to_string((sizing.reserve - sizing.pinned_chunks * slot - in.host_reserve) / slot) +
         " chunks of " + FormatBytes(slot) +
         (in.host_reserve > 0 ? ", and host_reserve's " + FormatBytes(in.host_reserve) : "") +
         "); the chunk size follows the host budget: a host budget of " + FormatBytes(sufficient) +
         " (" + std::to_string(sufficient) + " bytes) is enough";
}

}  // namespace tiermem::session
