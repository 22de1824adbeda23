// LayOut and HostRoomFor (see layout.h): the session's pure layout, moved out of
// Session::Create step by step (validate the tensors, choose the chunk size, split off the
// compressed-state tensors, round for sharding, pack, count bytes). Every rule and message is
// the one Create applied; the steps only name them.
#include "runtime/layout.h"

#include <algorithm>
#include <map>
#include <set>

#include "base/logging.h"
#include "runtime/host_floor.h"

namespace tiermem::session {
namespace {

// Elements of the largest tensor.
uint64_t MaxNumel(const std::vector<TensorSpec>& tensors) {
  uint64_t m = 0;
  for (const TensorSpec& t : tensors) m = std::max(m, t.numel);
  return m;
}

// A budget refused for the largest row (ChooseChunkElems names it by index) also names the
// tensor: the first with the longest row, as the layout picks it.
Status NameLargestRow(Status refused, const std::vector<TensorSpec>& tensors,
                      const std::vector<chunks::PackTensor>& packed) {
  if (refused.code() != StatusCode::kResourceExhausted ||
      refused.message().find(" elements of tensor ") == std::string::npos) {
    return refused;
  }
  size_t row_of = 0;
  for (size_t i = 0; i < packed.size(); ++i) {
    if (packed[i].row_elems() > packed[row_of].row_elems()) row_of = i;
  }
  const TensorSpec& t = tensors[row_of];
  std::string dims;
  for (int64_t d : t.shape) dims += (dims.empty() ? "" : " x ") + std::to_string(d);
  return ResourceExhaustedError(refused.message() + ": tensor " + std::to_string(row_of) + " is '" +
                                t.name + "' (" + (dims.empty() ? std::to_string(t.numel) : dims) +
                                ")");
}

// The tensors sorted into the packer's four subsets (compressed is filled by
// SplitCompressed; compute_only: frozen tensors exact in the compute dtype, mixed precision),
// and every tensor as the packer sees it.
struct Subsets {
  std::vector<size_t> compressed, trainable, frozen, compute_only;
  std::vector<chunks::PackTensor> packed;
};

Status CheckSharding(const Sharding& sharding) {
  if (sharding.world < 1 || sharding.rank < 0 || sharding.rank >= sharding.world) {
    return InvalidArgumentError("session: rank " + std::to_string(sharding.rank) +
                                " of a world of " + std::to_string(sharding.world));
  }
  if (sharding.world > 1 && sharding.collectives == nullptr) {
    return InvalidArgumentError("session: a sharded session needs its collectives");
  }
  return OkStatus();
}

Status CheckStateFormat(const kernels::StateFormat& state) {
  TIERMEM_RETURN_IF_ERROR(
      kernels::ValidateStateFormat(state).WithContext("config 'optimizer.state_block'"));
  if (state.stochastic && state.dtype != kernels::StateDType::kBF16) {
    return InvalidArgumentError(
        "session: stochastic rounding of optimizer state needs "
        "optimizer.state_dtype 'bf16'");
  }
  return OkStatus();
}

Status CheckTensor(const TensorSpec& t, size_t i) {
  if (t.numel == 0) {
    return InvalidArgumentError("session: tensor " + std::to_string(i) + " (" + t.name +
                                ") has no elements");
  }
  if (t.opt_group < 0) {
    return InvalidArgumentError("session: tensor " + t.name + " has a negative param group");
  }
  if (!t.shape.empty()) {
    uint64_t prod = 1;
    for (int64_t d : t.shape) prod *= d < 0 ? 0 : static_cast<uint64_t>(d);
    if (prod != t.numel) {
      return InvalidArgumentError("session: tensor " + t.name + " has a shape of " +
                                  std::to_string(prod) + " elements, not " +
                                  std::to_string(t.numel));
    }
  }
  if (t.expert_set >= 0 && t.expert < 0 && t.shape.empty()) {
    return InvalidArgumentError("session: tensor " + t.name +
                                " is a fused expert tensor "
                                "without a shape (its first dimension indexes the experts)");
  }
  return OkStatus();
}

// Validates every tensor and sorts it into trainable, frozen and (mixed precision) frozen with
// values exact in the compute dtype.
StatusOr<Subsets> SortTensors(const std::vector<TensorSpec>& tensors, bool mixed) {
  Subsets s;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorSpec& t = tensors[i];
    TIERMEM_RETURN_IF_ERROR(CheckTensor(t, i));
    (t.trainable                          ? s.trainable
     : mixed && t.values_in_compute_dtype ? s.compute_only
                                          : s.frozen)
        .push_back(i);
    chunks::PackTensor pt;
    pt.numel = t.numel;
    pt.rows = t.shape.empty() ? 1 : static_cast<uint64_t>(t.shape[0]);
    pt.expert_set = t.expert_set;
    pt.expert = t.expert;
    s.packed.push_back(pt);
  }
  return s;
}

// Host mode without expert sets, chunk_size or sharding: the chunk size, and whether tensors
// larger than a chunk are split, follow the host budget (host_floor.h). A budget below what
// the split sizing needs is refused here, naming the tensor that sets it. nullopt where the
// rule does not apply (tensors then stay whole in host mode, as before).
StatusOr<std::optional<HostSizing>> SizeForHost(const SessionConfig& config,
                                                const std::vector<TensorSpec>& tensors,
                                                const Sharding& sharding, Bytes per_elem,
                                                uint64_t state_align, bool any_trainable,
                                                const std::vector<chunks::PackTensor>& packed,
                                                uint64_t expert_item) {
  if (!IsHostCompute(config.device_kind) || expert_item != 0 || config.chunk_size ||
      sharding.world != 1) {
    return std::optional<HostSizing>();
  }
  const Bytes compute_esize = IsMixed(config.precision) ? 2 : 4;
  HostSizingInputs in;
  in.per_elem = per_elem;
  in.compute_esize = compute_esize;
  in.align_elems = state_align;
  in.trainable = any_trainable;
  in.nvme = config.nvme_size > 0;
  in.host_reserve = config.host_reserve;
  for (const TensorSpec& t : tensors) {
    in.frozen.push_back(!t.trainable);
    in.units.push_back(t.units);
  }
  TIERMEM_ASSIGN_OR_RETURN(const HostSizing hs, SizeHostChunks(packed, in, config.host_budget));
  if (hs.compute_room > 0 && hs.need() > config.host_budget) {
    TIERMEM_ASSIGN_OR_RETURN(const Bytes enough, SufficientHostBudget(packed, in));
    const TensorSpec& t = tensors[static_cast<size_t>(hs.room_tensor)];
    return ResourceExhaustedError(HostFloorRefusal(config.host_budget, hs, in, t.name, t.shape,
                                                   t.numel, ModeName(config.precision), enough));
  }
  return std::optional<HostSizing>(hs);
}

// Chooses chunk_elems (and min_device_budget, and in host mode the split sizing) for the
// packed tensors; `per_elem` is the device working set per element (the compute param and,
// when anything trains, its grad).
Status ChooseChunkSize(const SessionConfig& config, const std::vector<TensorSpec>& tensors,
                       const Sharding& sharding, Bytes per_elem, uint64_t state_align,
                       std::vector<chunks::PackTensor>& packed, Layout& l) {
  const bool host = IsHostCompute(config.device_kind);
  // The smallest chunk that holds the largest piece a unit needs at once: a row of any
  // tensor, and with expert sets an expert's slices (each expert in chunks of its own).
  TIERMEM_ASSIGN_OR_RETURN(const uint64_t expert_item, chunks::LargestExpertItem(packed));
  TIERMEM_ASSIGN_OR_RETURN(const std::optional<HostSizing> host_sizing,
                           SizeForHost(config, tensors, sharding, per_elem, state_align,
                                       l.any_trainable, packed, expert_item));
  if (host && expert_item == 0 && !(host_sizing && host_sizing->split)) {
    // Host mode sizes chunks by a share of the host budget, not by a device working set that
    // must hold them: tensors stay whole unless the host sizing splits them (host_floor.h).
    for (chunks::PackTensor& pt : packed) pt.rows = 1;
  }
  uint64_t min_piece = 0;
  for (const chunks::PackTensor& pt : packed) min_piece = std::max(min_piece, pt.row_elems());
  min_piece = std::max(min_piece, expert_item);
  // Host mode: no device budget. The chunk size follows the host budget instead: an fp32
  // chunk is at most 1/kHostChunkShare of it (per_elem x that share passed as the working
  // budget), so the host room held for NVMe-homed chunks in use stays a small part of it.
  const Bytes sizing_budget =
      host ? per_elem * (config.host_budget / kHostChunkShare) : config.device_budget;
  l.min_device_budget =
      host ? 0 : chunks::MinimumDeviceBudget(min_piece, per_elem, kMinResidentChunks);
  if (host_sizing) {
    l.chunk_elems = host_sizing->chunk_elems;
    l.host_pinned_chunks = host_sizing->pinned_chunks;
    l.host_compute_room = host_sizing->compute_room;
    return OkStatus();
  }
  if (config.chunk_size) {
    l.chunk_elems = *config.chunk_size;
    const Bytes need = l.chunk_elems * per_elem * kMinResidentChunks;
    if (!host && need > config.device_budget) {
      return ResourceExhaustedError("device budget of " + std::to_string(config.device_budget) +
                                    " bytes is below the minimum of " + std::to_string(need) +
                                    " bytes for chunk_size=" + std::to_string(l.chunk_elems));
    }
    return OkStatus();
  }
  StatusOr<chunks::ChunkSizeChoice> choice =
      chunks::ChooseChunkElems(packed, sizing_budget, per_elem, kMinResidentChunks, state_align);
  if (!choice.ok() && host) {
    // The largest piece alone is more than 1/kHostChunkShare of the host budget: chunks of
    // about that piece, the least waste up to 1.25x it (the host tier's own minimum is checked
    // when it is built). Not exactly the piece: a layer whose tensors sum to a multiple of its
    // largest would leave its small ones a chunk of their own (GPT 8 x 2304 at 2 GiB: 5 groups
    // per block instead of 3, chunks 1.7x the state).
    const Bytes at_least = chunks::MinimumDeviceBudget(min_piece, per_elem, kMinResidentChunks);
    choice = chunks::ChooseChunkElems(packed, at_least + at_least / 4, per_elem, kMinResidentChunks,
                                      state_align);
  }
  if (!choice.ok()) return NameLargestRow(choice.status(), tensors, packed);
  l.chunk_elems = choice->chunk_elems;
  return OkStatus();
}

// The trainable tensors whose m and v take the configured compressed format: those of at
// least optimizer.state_min_elems elements that stay whole (one piece, outside an expert set:
// a compressed tensor's blocks start at its first element, and its raw state is one run of
// codes). The others keep fp32 state, the split ones with a warning.
Status SplitCompressed(const SessionConfig& config, const std::vector<TensorSpec>& tensors,
                       uint64_t chunk_elems, uint64_t state_align, Subsets& s) {
  const kernels::StateFormat& state = config.optimizer_state.format;
  if (state.compressed()) {
    std::vector<size_t> rest;
    size_t split = 0;
    std::string first_split;
    for (size_t i : s.trainable) {
      const TensorSpec& t = tensors[i];
      if (t.numel < config.optimizer_state.min_elems) {
        rest.push_back(i);
      } else if (t.expert_set >= 0 || t.numel > chunk_elems) {
        rest.push_back(i);
        if (split++ == 0) first_split = t.name;
      } else {
        s.compressed.push_back(i);
      }
    }
    s.trainable = std::move(rest);
    if (split > 0) {
      TIERMEM_LOG(kWarn) << "optimizer.state_dtype '" << kernels::StateDTypeName(state.dtype)
                         << "': " << split << " tensor(s) split across chunks or in an expert "
                         << "set (the first: " << first_split << ") keep fp32 optimizer state; "
                         << "compressed state covers whole tensors only";
    }
  }
  if (config.chunk_size && !s.compressed.empty() && chunk_elems % state_align != 0) {
    return InvalidArgumentError("chunk_size=" + std::to_string(chunk_elems) +
                                " is not a multiple of "
                                "optimizer.state_block (" +
                                std::to_string(state_align) +
                                "): chunks of int8 "
                                "optimizer state hold whole blocks");
  }
  return OkStatus();
}

// Sharded: every rank holds an equal, aligned slice of every chunk (int8 state: whole blocks
// in every shard too).
void RoundForSharding(const Sharding& sharding, uint64_t state_align, Layout& l) {
  if (sharding.world > 1) {
    const uint64_t unit =
        static_cast<uint64_t>(sharding.world) * std::max<uint64_t>(kShardAlignElems, state_align);
    l.chunk_elems = (l.chunk_elems + unit - 1) / unit * unit;
  }
  l.world = sharding.world;
  l.rank = sharding.rank;
  l.shard_elems = l.chunk_elems / static_cast<uint64_t>(sharding.world);
  l.shard_begin = l.shard_elems * static_cast<uint64_t>(sharding.rank);
}

// Packs trainable tensors (those in the compressed state format first), then frozen ones, then
// compute_only ones, into groups of their own.
Status Pack(const SessionConfig& config, const std::vector<TensorSpec>& tensors, const Subsets& s,
            uint64_t state_align, Layout& l) {
  l.tensors.resize(tensors.size());
  for (const std::vector<size_t>* subset :
       {&s.compressed, &s.trainable, &s.frozen, &s.compute_only}) {
    if (subset->empty()) continue;
    std::vector<chunks::PackTensor> sub;
    for (size_t i : *subset) sub.push_back(s.packed[i]);
    const bool packed_compressed = subset == &s.compressed;
    auto layout = chunks::PackPieces(sub, l.chunk_elems,
                                     packed_compressed ? state_align : chunks::kAlignElems);
    if (!layout.ok()) {
      return layout.status().WithContext("chunk_size=" + std::to_string(l.chunk_elems));
    }
    const size_t base = l.groups.size();
    for (size_t g = 0; g < layout->num_groups(); ++g) {
      ChunkGroup grp;
      grp.trainable = subset == &s.compressed || subset == &s.trainable;
      grp.compute_only = subset == &s.compute_only;
      if (packed_compressed) grp.state = config.optimizer_state.format;
      grp.chunks.fill(kNoChunk);
      l.groups.push_back(std::move(grp));
    }
    for (size_t k = 0; k < subset->size(); ++k) {
      const size_t i = (*subset)[k];
      TensorPlace& tp = l.tensors[i];
      tp.pieces = layout->pieces[k];
      tp.numel = tensors[i].numel;
      tp.trainable = tensors[i].trainable;
      tp.opt_group = tensors[i].opt_group;
      for (size_t pi = 0; pi < tp.pieces.size(); ++pi) {
        Piece& p = tp.pieces[pi];
        p.group += static_cast<uint32_t>(base);
        ChunkGroup& grp = l.groups[p.group];
        grp.pieces.push_back({static_cast<uint32_t>(i), static_cast<uint32_t>(pi)});
        grp.used_elems = std::max(grp.used_elems, p.offset + p.numel);
      }
      tp.group = tp.pieces.front().group;
      tp.offset = tp.pieces.front().offset;
    }
  }
  return OkStatus();
}

// A sharded unit holds the full chunks of every group it touches (gathered params and
// gradient buffers, outside the engine's eviction): a tensor split into pieces spreads a unit
// over more of them than the budget was sized for. Refused before anything changes.
Status CheckShardedWhole(const SessionConfig& config, const std::vector<TensorSpec>& tensors,
                         Bytes per_elem, const Layout& l) {
  for (size_t i = 0; i < l.tensors.size(); ++i) {
    if (!l.tensors[i].split()) continue;
    return ResourceExhaustedError(
        "sharded training keeps every tensor whole in a chunk, but tensor " + tensors[i].name +
        " (" + std::to_string(tensors[i].numel) + " elements) is larger than a chunk of " +
        std::to_string(l.chunk_elems) + " elements at this device budget of " +
        std::to_string(config.device_budget) +
        " bytes: give each rank a device budget of at "
        "least " +
        std::to_string(
            chunks::MinimumDeviceBudget(MaxNumel(tensors), per_elem, kMinResidentChunks)) +
        " bytes, or a chunk_size of at least " + std::to_string(MaxNumel(tensors)) + " elements");
  }
  return OkStatus();
}

// Every group's pieces in offset order and its tensors by first offset; the model's bytes;
// which groups hold only experts.
void Finish(Layout& l) {
  for (ChunkGroup& grp : l.groups) {
    std::sort(grp.pieces.begin(), grp.pieces.end(), [&](const PieceRef& a, const PieceRef& b) {
      return l.tensors[a.tensor].pieces[a.piece].offset <
             l.tensors[b.tensor].pieces[b.piece].offset;
    });
    for (const PieceRef& r : grp.pieces) {
      if (std::find(grp.tensors.begin(), grp.tensors.end(), r.tensor) == grp.tensors.end()) {
        grp.tensors.push_back(r.tensor);
      }
    }
  }
  const Bytes esize = l.mixed() ? 2 : 4;
  for (size_t i = 0; i < l.specs.size(); ++i) {
    const TensorSpec& t = l.specs[i];
    const Bytes m_and_v = 2 * kernels::StateBytes(l.groups[l.tensors[i].group].state, t.numel);
    const bool master = l.mixed() && !l.groups[l.tensors[i].group].compute_only;
    l.model_bytes += t.numel * (t.trainable ? esize * 2 : esize) + (t.trainable ? m_and_v : 0) +
                     (master ? t.numel * 4 : 0);
  }
  std::vector<std::vector<int>> units;
  std::vector<int> expert_sets;
  std::vector<std::vector<Piece>> pieces;
  for (size_t i = 0; i < l.specs.size(); ++i) {
    units.push_back(l.specs[i].units);
    expert_sets.push_back(l.specs[i].expert_set);
    pieces.push_back(l.tensors[i].pieces);
  }
  l.units = UnitsOf(units, expert_sets, pieces);
  l.expert_group.assign(l.groups.size(), 0);
  for (size_t g = 0; g < l.groups.size(); ++g) {
    const ChunkGroup& grp = l.groups[g];
    l.expert_group[g] = !grp.pieces.empty() &&
                        std::all_of(grp.pieces.begin(), grp.pieces.end(), [&](const PieceRef& r) {
                          return l.tensors[r.tensor].pieces[r.piece].expert >= 0;
                        });
  }
}

}  // namespace

kernels::DType Layout::dtype(ChunkKind kind) const {
  return (kind == ChunkKind::kParamLowp || kind == ChunkKind::kGrad) ? ComputeDType(precision)
                                                                     : kernels::DType::kF32;
}

bool Layout::NeedsKind(size_t g, ChunkKind kind) const {
  return kind == ChunkKind::kParamLowp   ? mixed()
         : kind == ChunkKind::kParamFp32 ? !groups[g].compute_only
                                         : groups[g].trainable;
}

Bytes Layout::ShardChunkBytes(size_t g, ChunkKind kind) const {
  const bool state_kind = kind == ChunkKind::kExpAvg || kind == ChunkKind::kExpAvgSq;
  return state_kind ? kernels::StateBytes(groups[g].state, shard_elems)
                    : shard_elems * kernels::DTypeSize(dtype(kind));
}

Bytes Layout::total_chunk_bytes() const {
  Bytes total = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (int k = 0; k < chunks::kNumChunkKinds; ++k) {
      if (NeedsKind(g, static_cast<ChunkKind>(k)))
        total += ShardChunkBytes(g, static_cast<ChunkKind>(k));
    }
  }
  return total;
}

StatusOr<Bytes> Layout::UnitComputeBytes(const std::vector<size_t>& unit_groups,
                                         const std::vector<std::vector<size_t>>& experts) const {
  auto bytes = [&](size_t g) -> StatusOr<Bytes> {
    if (g >= groups.size()) {
      return OutOfRangeError("session: unknown chunk group " + std::to_string(g));
    }
    return ShardChunkBytes(g, compute_kind());
  };
  Bytes unit = 0, expert = 0;
  for (size_t g : unit_groups) {
    TIERMEM_ASSIGN_OR_RETURN(const Bytes b, bytes(g));
    unit += b;
  }
  for (const std::vector<size_t>& e : experts) {
    Bytes beyond = 0;
    for (size_t g : e) {
      if (std::find(unit_groups.begin(), unit_groups.end(), g) != unit_groups.end()) continue;
      TIERMEM_ASSIGN_OR_RETURN(const Bytes b, bytes(g));
      beyond += b;
    }
    expert = std::max(expert, beyond);
  }
  return unit + expert;
}

Layout::UnitNeed Layout::ServingMinimum() const {
  UnitNeed most;
  auto wide = [](const std::vector<uint32_t>& gs) {
    return std::vector<size_t>(gs.begin(), gs.end());
  };
  for (size_t u = 0; u < units.size(); ++u) {
    const UnitChunks& unit = units[u];
    std::vector<std::vector<size_t>> experts;
    for (const std::vector<uint32_t>& e : unit.experts) experts.push_back(wide(e));
    // The layout's groups exist: UnitComputeBytes cannot refuse them.
    const Bytes b = UnitComputeBytes(wide(unit.groups), experts).value();
    if (b > most.bytes) most = {b, static_cast<int>(u)};
  }
  return most;
}

bool Placement::holds_grad_chunks() const {
  return compute_budget >= GroupComputeBytes() * num_groups || sharded;
}

Bytes Placement::ActivationCap(size_t unit_groups) const {
  const Bytes units = 2 * static_cast<Bytes>(unit_groups) * GroupComputeBytes();
  return compute_budget > units ? compute_budget - units : 0;
}

size_t Placement::RecentFullChunks(size_t unit_groups) const {
  return std::min<size_t>(2 * unit_groups + 1, tier_budget / (4 * full_compute_chunk_bytes));
}

Placement PlaceOn(const Layout& layout, const SessionConfig& config, bool every_home_on_host) {
  Placement p;
  p.device_kind = config.device_kind;
  const bool host = p.host_compute();
  p.tier_budget = host ? config.host_budget : config.device_budget;
  p.compute_budget = !host ? config.device_budget : every_home_on_host ? config.host_budget : 0;
  p.total_chunk_bytes = layout.total_chunk_bytes();
  p.full_compute_chunk_bytes = layout.chunk_elems * layout.compute_element_size();
  p.num_groups = layout.groups.size();
  p.sharded = layout.sharded();
  return p;
}

bool Layout::dense_first() const {
  return !any_trainable &&
         std::find(expert_group.begin(), expert_group.end(), 1) != expert_group.end();
}

StatusOr<Layout> LayOut(const SessionConfig& config, std::vector<TensorSpec> tensors,
                        const Sharding& sharding) {
  if (tensors.empty()) return InvalidArgumentError("session: the model has no parameters");
  TIERMEM_RETURN_IF_ERROR(CheckSharding(sharding));
  // Trainable tensors in the configured state format (`compressed`, chosen once the chunk
  // size is known), or in fp32 state; int8 groups align every tensor (and every chunk size)
  // to the block.
  const kernels::StateFormat& state = config.optimizer_state.format;
  TIERMEM_RETURN_IF_ERROR(CheckStateFormat(state));
  const uint64_t state_align =
      state.dtype == kernels::StateDType::kInt8 ? state.block : chunks::kAlignElems;
  TIERMEM_ASSIGN_OR_RETURN(Subsets subsets, SortTensors(tensors, IsMixed(config.precision)));
  Layout l;
  l.precision = config.precision;
  l.any_trainable = !subsets.trainable.empty();
  const Bytes esize = l.mixed() ? 2 : 4;
  // Device working set per element: the compute param and (when anything trains) its grad.
  const Bytes per_elem = esize + (l.any_trainable ? esize : 0);
  TIERMEM_RETURN_IF_ERROR(
      ChooseChunkSize(config, tensors, sharding, per_elem, state_align, subsets.packed, l));
  TIERMEM_RETURN_IF_ERROR(SplitCompressed(config, tensors, l.chunk_elems, state_align, subsets));
  RoundForSharding(sharding, state_align, l);
  TIERMEM_RETURN_IF_ERROR(Pack(config, tensors, subsets, state_align, l));
  if (sharding.world > 1) {
    TIERMEM_RETURN_IF_ERROR(CheckShardedWhole(config, tensors, per_elem, l));
  }
  l.specs = std::move(tensors);
  Finish(l);
  return l;
}

HostRoom HostRoomFor(const Layout& layout, const SessionConfig& config) {
  const bool host = IsHostCompute(config.device_kind);
  HostRoom room;
  // The largest chunk of a group held here: fp32, or the compute chunk when no group has an
  // fp32 one (every group compute_only: a served model loaded from its compute dtype).
  const bool any_fp32 = std::any_of(layout.groups.begin(), layout.groups.end(),
                                    [](const ChunkGroup& g) { return !g.compute_only; });
  room.chunk_bytes = layout.shard_elems * (any_fp32 ? 4 : 2);
  // Host mode with split tensors: also the chunk of a piece being copied into a compute copy
  // (one at a time), and the compute copies are left out of the host tier (host_floor.h).
  const auto in_use =
      static_cast<Bytes>(HostReserveChunks(layout.any_trainable, MostPinGroups(layout.units)));
  const Bytes reserve_chunks = host
                                   ? in_use + layout.host_pinned_chunks
                                   : (layout.any_trainable ? kStepGroupChunks : kServingReadChunks);
  room.compute_room = layout.host_compute_room;
  room.host_reserve =
      config.nvme_size == 0
          ? 0
          : reserve_chunks * AlignUp(room.chunk_bytes, kHostPage) + config.host_reserve;
  if (layout.dense_first()) {
    for (size_t g = 0; g < layout.groups.size(); ++g) {
      if (!layout.expert_group[g]) {
        room.host_homes_first +=
            layout.groups[g].compute_only
                ? AlignUp(layout.shard_elems * 2, kHostPage)
                : (layout.mixed() ? 2 : 1) * AlignUp(layout.shard_elems * 4, kHostPage);
      }
    }
  }
  // State beyond the host budget with NVMe: homes fill the host budget, so map it all now,
  // registered with the NVMe tier (tier_stack.h).
  room.host_prefault =
      config.nvme_size > 0 && layout.model_bytes > config.host_budget ? config.host_budget : 0;
  return room;
}

std::vector<UnitChunks> UnitsOf(const std::vector<std::vector<int>>& units,
                                const std::vector<int>& expert_sets,
                                const std::vector<std::vector<Piece>>& pieces) {
  // By unit: its groups, pinned groups, and per (expert set, expert) that expert's groups.
  std::map<int, std::set<uint32_t>> groups, pins;
  std::map<int, std::map<std::pair<int, int>, std::set<uint32_t>>> experts;
  int most = -1;
  for (size_t i = 0; i < units.size() && i < pieces.size(); ++i) {
    const int set = i < expert_sets.size() ? expert_sets[i] : -1;
    for (int u : units[i]) {
      if (u < 0) continue;
      most = std::max(most, u);
      for (const Piece& p : pieces[i]) {
        if (set >= 0) {
          experts[u][{set, p.expert}].insert(p.group);
        } else {
          groups[u].insert(p.group);
          if (pieces[i].size() == 1) pins[u].insert(p.group);
        }
      }
    }
  }
  std::vector<UnitChunks> out(static_cast<size_t>(most + 1));
  for (auto& [u, gs] : groups) out[u].groups.assign(gs.begin(), gs.end());
  for (auto& [u, gs] : pins) out[u].pin_groups.assign(gs.begin(), gs.end());
  for (auto& [u, by_expert] : experts) {
    for (auto& [key, gs] : by_expert) out[u].experts.emplace_back(gs.begin(), gs.end());
  }
  return out;
}

size_t MostPinGroups(const std::vector<UnitChunks>& units) {
  size_t most = 0;
  for (const UnitChunks& u : units) most = std::max(most, u.pin_groups.size());
  return most;
}

bool Layout::read_in_place(size_t g) const {
  const std::vector<uint32_t>& ts = groups[g].tensors;
  return !ts.empty() &&
         std::all_of(ts.begin(), ts.end(), [&](uint32_t t) { return specs[t].read_in_place; });
}

}  // namespace tiermem::session
