// The session's layout: a pure function from (config, tensor specs, sharding) to where every
// tensor's elements live in chunk groups, how large a chunk is, and how much host room the
// tier stack must keep for it. No tier, no engine, no chunk exists here: the session builds
// those from a Layout (session.cc), and the optimizer stepper, the checkpoint code and the
// bindings read it (Session::layout()).
//
// What LayOut decides, in order:
//   1. validation of the inputs (tensors of 0 elements, negative param groups, shapes that
//      disagree with numel, fused expert tensors without a shape, a bad Sharding, a bad
//      optimizer-state format);
//   2. the chunk size (config chunk_size, else chunks::ChooseChunkElems for the device budget:
//      kMinResidentChunks compute + grad chunks of the largest piece a unit needs at once must
//      fit; in host mode for a share of the host budget, kHostChunkShare);
//   3. the compressed-state split: trainable tensors of at least optimizer.state_min_elems
//      elements that stay whole take the configured compressed format, the others fp32 state;
//   4. sharding rounding: every chunk a multiple of world x kShardAlignElems (x the int8
//      block), so that every rank holds an equal, aligned shard;
//   5. packing (chunks::PackPieces): compressed trainable tensors, then fp32-state trainable
//      ones, then frozen ones, then (mixed precision) frozen ones whose values are exact in the
//      compute dtype (compute_only groups, no fp32 master), each into groups of their own;
//   6. the byte counts: the model's bytes and the minimum device budget.
// HostRoomFor then sizes the host room of the tier stack from a Layout (see there).
//
// Invariants of a Layout: every tensor's pieces cover [0, numel) in order, each in one group;
// a group lists every piece it holds in offset order; a group's chunks all have chunk_elems
// elements of their kind (m and v: of the group's state format, StateBytes); in an int8 group
// every tensor starts on a block boundary and chunk_elems (and every shard) is a multiple of
// the block; sharded, no tensor is split. A Layout is a value: copyable, never changed after
// LayOut except for ChunkGroup::chunks, which the session fills as it creates the chunks.
//
// Thread-safety: plain values and pure functions.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "base/status.h"
#include "base/units.h"
#include "kernels/cpu/optim.h"
#include "layout/chunk_layout.h"
#include "runtime/collectives.h"
#include "runtime/config.h"

namespace tiermem::session {

using chunks::ChunkKind;

struct TensorSpec {
  std::string name;       // for messages and checkpoints, e.g. "blocks.0.attn.c_attn.weight"
  uint64_t numel = 0;     // > 0
  bool trainable = true;  // false: frozen (no grad or optimizer chunks)
  int opt_group = 0;      // optimizer param group (trainable tensors only), >= 0
  std::vector<int64_t> shape = {};  // as the binding's tensor (checkpoints); empty = {numel}
  // Mixture of experts (layout/chunk_layout.h, "expert set"): >= 0 names the set of one
  // layer's experts, packed expert by expert so that each expert's slices share chunks of
  // their own; `expert` -1 = fused (shape[0] indexes the experts), >= 0 = the whole tensor is
  // that expert's.
  int expert_set = -1;
  int expert = -1;
  // The units (the binding's module subtrees materialized together, numbered from 0) that
  // compute with it: one, or more for a tensor shared by several (tied weights); empty when
  // not given. The session reads what each unit computes with from them (Layout::units): the
  // serving minimum, and in host mode with NVMe the host room for the chunk groups one unit
  // pins at once.
  std::vector<int> units = {};
  // Its exact values are representable in the compute dtype (a frozen tensor loaded from a
  // checkpoint in the compute dtype: bf16 file, bf16 compute). Mixed precision, frozen: it is
  // packed into groups of its own that keep no fp32 master (ChunkGroup::compute_only); its fp32
  // value is its compute copy upcast, and a write of a value the compute dtype cannot hold
  // exactly is refused. Ignored for trainable tensors and in fp32 sessions.
  bool values_in_compute_dtype = false;
  // A served checkpoint stores it in the compute dtype (runtime/weights.h, "Serving in place"),
  // so its compute chunk, where homed on NVMe, is likely read in place from the file: the
  // session then holds no NVMe room for that chunk (a placeholder home, Session::Build), and
  // the loader gives it its file home — or, where the chunk turns out not readable in place,
  // a home of the NVMe tier's own then (an error naming the bytes when the tier is too small).
  // Counts only where every tensor of a group has it; ignored without an NVMe tier.
  bool read_in_place = false;
};

// What one unit computes with, from the tensors that name it (TensorSpec::units).
struct UnitChunks {
  std::vector<uint32_t> groups;      // of its tensors outside expert sets, ascending, distinct
  std::vector<uint32_t> pin_groups;  // those of its whole (one-piece) ones: pinned together
                                     // while it computes (a split tensor's pieces one at a time)
  // Per expert of its expert sets (expert sets in order, then experts): that expert's groups,
  // ascending, distinct. An expert computes while its unit's groups are pinned.
  std::vector<std::vector<uint32_t>> experts;
};

// The units' chunks, by unit index (up to the largest index named; units no tensor names are
// empty). Index-parallel inputs, per tensor: `units` (TensorSpec::units), `expert_sets`
// (TensorSpec::expert_set; empty: none) and `pieces` (Layout::tensors' or
// chunks::PieceLayout's).
std::vector<UnitChunks> UnitsOf(const std::vector<std::vector<int>>& units,
                                const std::vector<int>& expert_sets,
                                const std::vector<std::vector<chunks::Piece>>& pieces);
// The most groups one unit pins at once (UnitChunks::pin_groups); 0 with no units.
size_t MostPinGroups(const std::vector<UnitChunks>& units);

// Where a tensor lives: one piece (the same element offset in every chunk of its group), or
// several for a tensor larger than a chunk or of an expert set — whole rows of its first
// dimension each, in element order.
using chunks::Piece;
struct TensorPlace {
  uint32_t group = 0;         // the first piece's group and element offset: the tensor's
  uint64_t offset = 0;        // place unless split (then read `pieces`)
  std::vector<Piece> pieces;  // cover [0, numel) in order; never empty
  uint64_t numel = 0;
  bool trainable = true;
  int opt_group = 0;
  bool split() const { return pieces.size() > 1; }
};

// A piece of a tensor, as a chunk group lists it.
struct PieceRef {
  uint32_t tensor = 0;
  uint32_t piece = 0;  // index in place(tensor).pieces
};

struct ChunkGroup {
  bool trainable = false;
  // Mixed precision, frozen, every tensor's values exact in the compute dtype
  // (TensorSpec::values_in_compute_dtype): no kParamFp32 chunk, the compute chunk holds the
  // values (Layout::value_kind).
  bool compute_only = false;
  kernels::StateFormat state;  // of its kExpAvg / kExpAvgSq chunks
  uint64_t used_elems = 0;     // end of its last piece
  // By ChunkKind; kNoChunk if absent. All kNoChunk in a Layout from LayOut: the session
  // fills them as it creates the chunks (Layout::NeedsKind says which it creates).
  std::array<ChunkId, chunks::kNumChunkKinds> chunks;
  std::vector<uint32_t> tensors;  // tensors with a piece here, by first offset
  std::vector<PieceRef> pieces;   // its pieces, in offset order
};

// The device working set the chunk size is chosen for: this many chunks of the compute
// params and (when anything trains) of the gradients fit the device budget at once.
inline constexpr int kMinResidentChunks = 4;
// Host mode (no device budget): an fp32 chunk is at most 1/kHostChunkShare of the host
// budget, so that the host room held for NVMe-homed chunks in use stays a small part of it.
inline constexpr Bytes kHostChunkShare = 32;
// Sharded: every shard starts on a multiple of this many elements (the kernels' vectors and
// the host tier's size classes stay aligned).
inline constexpr uint64_t kShardAlignElems = 64;

struct Layout {
  std::vector<TensorSpec> specs;     // as given, in the given order
  std::vector<TensorPlace> tensors;  // by tensor, as specs
  std::vector<ChunkGroup> groups;
  Precision precision = Precision::kFp32;
  bool any_trainable = false;  // some tensor has gradients and optimizer state
  uint64_t chunk_elems = 0;    // elements of every full chunk (every rank alike)
  uint64_t shard_elems = 0;    // elements of each kind per chunk on this rank
  uint64_t shard_begin = 0;    // this rank's first element, full coordinates
  int world = 1;               // ranks sharing every chunk (Sharding::world)
  int rank = 0;                // this rank, in [0, world) (Sharding::rank)
  // Every chunk byte of tensor data (params, grads, m and v in their formats, fp32 masters),
  // full (not per shard), without padding.
  Bytes model_bytes = 0;
  // The device bytes the layout needs at least: min-resident compute + grad chunks of the
  // largest piece a unit needs at once (a row of the largest tensor's first dimension; an
  // expert's slices with expert sets). 0 in host mode.
  Bytes min_device_budget = 0;
  // Host mode with tensors split by the host sizing (host_floor.h): the chunks of a split
  // tensor's pieces pinned at once (its copy is assembled one piece at a time), and the host
  // bytes its compute copies take while its unit computes (left out of the host tier). 0
  // otherwise.
  uint64_t host_pinned_chunks = 0;
  Bytes host_compute_room = 0;
  // By unit (TensorSpec::units): what it computes with; empty when no units were given.
  std::vector<UnitChunks> units;
  // By group: 1 when every piece it holds is an expert's (a served MoE homes these last).
  std::vector<uint8_t> expert_group;

  // ---- read-only facts (the bindings ask them of Session::layout(); none re-derives them) ----
  bool mixed() const { return IsMixed(precision); }
  bool sharded() const { return world > 1; }
  kernels::DType compute_dtype() const { return ComputeDType(precision); }
  // Bytes per element of the compute copy (the params and grads the model computes with).
  size_t compute_element_size() const { return kernels::DTypeSize(compute_dtype()); }
  // The chunks the model computes with.
  ChunkKind compute_kind() const { return mixed() ? ChunkKind::kParamLowp : ChunkKind::kParamFp32; }
  size_t num_tensors() const { return tensors.size(); }
  size_t num_groups() const { return groups.size(); }
  const TensorSpec& spec(size_t tensor) const { return specs[tensor]; }
  const TensorPlace& place(size_t tensor) const { return tensors[tensor]; }
  const ChunkGroup& group(size_t g) const { return groups[g]; }
  // Whether every tensor with a piece in group `g` has TensorSpec::read_in_place.
  bool read_in_place(size_t g) const;
  // Whether group `g` was given a chunk of `kind` (its id filled: after the session created
  // it). NeedsKind says which kinds it will be given.
  bool has_kind(size_t g, ChunkKind kind) const {
    return groups[g].chunks[static_cast<int>(kind)] != kNoChunk;
  }
  // Element type of `kind`'s chunks (m and v: fp32 values; their stored format is the
  // group's state format).
  kernels::DType dtype(ChunkKind kind) const;
  // Whether group `g` has a chunk of `kind`: the compute params of its precision and the fp32
  // params (the master in mixed precision) unless the group is compute_only, grads and m and v
  // when it trains.
  bool NeedsKind(size_t g, ChunkKind kind) const;
  // The chunk holding group `g`'s values exactly: kParamFp32 (the param or the master), or
  // the compute chunk kParamLowp of a compute_only group.
  ChunkKind value_kind(size_t g) const {
    return groups[g].compute_only ? ChunkKind::kParamLowp : ChunkKind::kParamFp32;
  }
  // Bytes of the chunk of `kind` of group `g` on this rank (a shard when sharded).
  Bytes ShardChunkBytes(size_t g, ChunkKind kind) const;
  // A served mixture-of-experts model (experts and nothing trains): the dense groups' chunks
  // are created first and homed on the host, the experts' after them on NVMe.
  bool dense_first() const;
  // Every chunk of every kind on this rank (NeedsKind), bytes (a shard each when sharded).
  Bytes total_chunk_bytes() const;
  // The compute-tier bytes one unit pins at once: the compute chunks (this rank's) of its
  // `groups`, and of the largest of `experts` (each the groups of one expert that moves
  // alone) beyond those. Serving needs a device budget of at least the largest unit's
  // (kOutOfRange for an unknown group).
  StatusOr<Bytes> UnitComputeBytes(const std::vector<size_t>& groups,
                                   const std::vector<std::vector<size_t>>& experts = {}) const;
  // Serving: the largest UnitComputeBytes of `units`, and which unit it is. A device budget
  // below `bytes` cannot serve: the unit's chunks are pinned together while it computes.
  // {0, -1} when no units were given.
  struct UnitNeed {
    Bytes bytes = 0;
    int unit = -1;
  };
  UnitNeed ServingMinimum() const;
};

// What follows from where a session computes — the config's device kind and budgets, the
// layout, and where the chunks are homed — derived once when the session's chunks exist
// (PlaceOn), never changed after (homes never move), and read through Session::placement():
// the one home of these facts, so that no binding re-derives them.
struct Placement {
  DeviceKind device_kind = DeviceKind::kSim;  // resolved: never DeviceKind::kAuto
  // The budget of the compute tier as far as the bindings may plan with it, bytes: the
  // device's; in host mode the host's when every chunk is homed there, else 0 (NVMe-homed
  // chunks come and go through the host room the session keeps for them).
  Bytes compute_budget = 0;
  Bytes total_chunk_bytes = 0;  // every chunk of every kind on this rank (incl. padding)
  Bytes tier_budget = 0;        // the compute tier's configured budget (host mode: the host's)
  Bytes full_compute_chunk_bytes = 0;  // one full (gathered) chunk of the compute kind
  size_t num_groups = 0;
  bool sharded = false;

  bool cuda() const { return IsCuda(device_kind); }
  // Host mode (DeviceKind::kHost): no device tier; the bindings compute on chunks acquired
  // on the host tier, in place for host-homed chunks (no copy), NVMe-homed ones read into
  // host room before use and written back (dirty) or dropped (clean) after.
  bool host_compute() const { return IsHostCompute(device_kind); }
  // Where the bindings acquire the chunks they compute with: kDevice, or kHost in host mode.
  TierKind compute_tier() const { return host_compute() ? TierKind::kHost : TierKind::kDevice; }
  // Every chunk of every kind fits the compute tier at once, so nothing ever has to move:
  // there is no schedule to plan, and a binding may keep its compute chunks acquired.
  bool compute_tier_holds_every_chunk() const { return compute_budget >= total_chunk_bytes; }
  // Whether a binding keeps a group's grad chunk acquired through the backward until every
  // parameter the forward used has its gradient (an acquire per parameter saved, the chunk
  // pinned meanwhile): when the compute and grad chunks of every group fit the compute budget
  // at once, and always when sharded (gradients are reduce-scattered a whole group at a time).
  bool holds_grad_chunks() const;
  // The compute-tier bytes that counted activations may keep there at most: the compute
  // budget less the compute and grad chunks of two units of `unit_groups` groups (the largest
  // unit's count), which a backward holds at once (the unit it is in and the next one, whose
  // chunks arrive meanwhile); 0 when those take it all.
  Bytes ActivationCap(size_t unit_groups) const;
  // Sharded: how many gathered full compute chunks a binding keeps after their unit (so the
  // next unit's shared groups and the backward's first unit need no second all-gather): two
  // units of `unit_groups` groups and one more, and at most a quarter of the compute tier's
  // configured budget.
  size_t RecentFullChunks(size_t unit_groups) const;

 private:
  Bytes GroupComputeBytes() const { return 2 * full_compute_chunk_bytes; }  // compute + grad
};
// The placement of `layout` under `config` (its device kind resolved), `every_home_on_host`
// when every chunk the session created is homed on the host tier.
Placement PlaceOn(const Layout& layout, const SessionConfig& config, bool every_home_on_host);

// Lays out `tensors` for `config` (its device kind resolved: never DeviceKind::kAuto; host
// mode sizes chunks by the host budget) on this rank of `sharding`. kInvalidArgument for bad
// tensors, a bad Sharding or a bad optimizer-state format; kResourceExhausted for a device
// budget below the minimum (the message names it), or a sharded tensor larger than a chunk.
StatusOr<Layout> LayOut(const SessionConfig& config, std::vector<TensorSpec> tensors,
                        const Sharding& sharding);

// The host room the tier stack keeps for a layout (tier_stack.h, StackLayout).
struct HostRoom {
  Bytes chunk_bytes = 0;   // the largest chunk; sizes the host slots and the staging slots
  Bytes host_reserve = 0;  // host bytes never used for homes (caches of NVMe-homed chunks)
  // Bytes of the chunks created first that should have host homes (a served MoE's dense
  // chunks): with NVMe, the reserve grows to all the host room beyond them, so the rest (the
  // experts) is homed on NVMe and cached on the host by use, not pinned there by creation
  // order. 0: the reserve is host_reserve.
  Bytes host_homes_first = 0;
  // Host bytes mapped (faulted, locked, registered) at creation: the whole host budget when the
  // training state exceeds it with NVMe, so that all of it is registered with NVMe up front.
  Bytes host_prefault = 0;
  // Host bytes of the host budget left out of the host tier: split tensors' compute copies
  // (Layout::host_compute_room), which the binding holds while their unit computes.
  Bytes compute_room = 0;
};

// Host room, in chunks of the largest kind (fp32, per shard, page-aligned; the compute chunk's
// size when every group is compute_only), kept for caches of
// NVMe-homed chunks (none without NVMe), plus config host_reserve:
//   - with a device: training, every kind of one group at once (kStepGroupChunks: the
//     optimizer step holds them on the host); serving (nothing trains), kServingReadChunks
//     for value reads;
//   - host mode computes on host copies too: the chunks a unit computes with (training: the
//     step's group, kStepGroupChunks; serving: kMinResidentChunks, as the device minimum, or
//     the most groups a unit pins when more, MostPinGroups(Layout::units)) and
//     kPrefetchedChunks prefetched after them (host_floor.h's HostReserveChunks), and with
//     split tensors the chunk of a piece being copied (host_pinned_chunks); its compute
//     copies are left out of the host tier (compute_room).
// A served MoE homes its dense groups' fp32 and (mixed) low-precision chunks first
// (host_homes_first). With NVMe and a model larger than the host budget, the whole host budget
// is prefaulted (host_prefault).
inline constexpr Bytes kStepGroupChunks = 5;  // lowp params, fp32 params, grads, m, v
inline constexpr Bytes kServingReadChunks = 1;
inline constexpr Bytes kPrefetchedChunks = 2;
inline constexpr Bytes kHostPage = 4096;
HostRoom HostRoomFor(const Layout& layout, const SessionConfig& config);

}  // namespace tiermem::session
