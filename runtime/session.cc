// Session (see session.h): layout, chunk access, values, gradients and the optimizer step's
// decision (its application: optimizer_stepper.cc; planning: plan_runner.cc).
//
// Layout invariants: trainable tensors are packed first (those in a compressed optimizer-state
// format, then those with fp32 state), frozen ones after, into separate groups (a frozen group
// has no grad or optimizer chunks; a group's m and v have one format); within a group tensors
// keep the given order; a tensor that fits in a chunk is one piece in one group, a larger one
// (or one of an expert set) is pieces of whole rows (layout/chunk_layout.h), each in one
// group, and a group lists every piece it holds; only whole (one-piece) tensors outside expert
// sets take a compressed state format; every chunk of a group has chunk_elems_ elements of its
// kind's dtype (m and v: of the group's state format, StateBytes); in an int8 group every
// tensor starts on a block boundary and chunk_elems_ (and, sharded, every shard) is a
// multiple of the block. The device working set the chunk size is chosen for is
// kMinResidentChunks (compute + grad) chunks.
//
// Step invariants: hyper-parameters are validated before anything changes; an accumulation
// micro-step and an fp16 overflow hand nothing to the stepper (the overflow changes nothing
// but the loss scale, and counts a skipped step); gradients are read only in the spans of
// tensors that have one. Every access path below first runs the stepper's pending update of
// the group it touches (RunPending), and every write drops the group's speculation.
#include "runtime/session.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

#include "base/logging.h"
#include "runtime/device_kernels.h"
#include "runtime/host_floor.h"
#include "runtime/tier_stack.h"

namespace tiermem::session {
namespace {

constexpr int kMinResidentChunks = 4;

// Elements of the largest tensor.
uint64_t MaxNumel(const std::vector<TensorSpec>& tensors) {
  uint64_t m = 0;
  for (const TensorSpec& t : tensors) m = std::max(m, t.numel);
  return m;
}

constexpr Bytes kPage = 4096;
constexpr std::array<ChunkKind, 5> kCreationOrder = {ChunkKind::kParamLowp, ChunkKind::kParamFp32,
                                                     ChunkKind::kGrad, ChunkKind::kExpAvg,
                                                     ChunkKind::kExpAvgSq};

int K(ChunkKind k) { return static_cast<int>(k); }

bool IsStateKind(ChunkKind k) { return k == ChunkKind::kExpAvg || k == ChunkKind::kExpAvgSq; }

// Bytes per element of a state format's codes (before int8's absmax).
size_t CodeSize(const kernels::StateFormat& f) {
  return f.dtype == kernels::StateDType::kInt8 ? 1 : f.dtype == kernels::StateDType::kBF16 ? 2 : 4;
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

Status CheckHyper(const GroupHyper& h, size_t g) {
  auto bad = [&](const std::string& what) {
    return InvalidArgumentError("optimizer param group " + std::to_string(g) + ": " + what);
  };
  if (!(h.lr >= 0) || !std::isfinite(h.lr)) {
    return bad("lr must be >= 0, got " + std::to_string(h.lr));
  }
  if (!(h.beta1 >= 0 && h.beta1 < 1)) return bad("betas[0] must be in [0, 1)");
  if (!(h.beta2 >= 0 && h.beta2 < 1)) return bad("betas[1] must be in [0, 1)");
  if (!(h.eps > 0) || !std::isfinite(h.eps)) return bad("eps must be > 0");
  if (!(h.weight_decay >= 0) || !std::isfinite(h.weight_decay)) {
    return bad("weight_decay must be >= 0");
  }
  return OkStatus();
}

}  // namespace

float ClipCoefficient(double max_norm, double total_norm) {
  // torch.nn.utils.clip_grad_norm_ computes `max_norm / (total_norm + 1e-6)` on an fp32
  // tensor, which torch evaluates as reciprocal(total + 1e-6) * max_norm, then clamps to 1.
  const float t = static_cast<float>(total_norm) + 1e-6f;
  return std::min((1.0f / t) * static_cast<float>(max_norm), 1.0f);
}

StatusOr<std::unique_ptr<Session>> Session::Create(const SessionConfig& config,
                                                   std::vector<TensorSpec> tensors,
                                                   Sharding sharding) {
  if (tensors.empty()) return InvalidArgumentError("session: the model has no parameters");
  if (sharding.world < 1 || sharding.rank < 0 || sharding.rank >= sharding.world) {
    return InvalidArgumentError("session: rank " + std::to_string(sharding.rank) +
                                " of a world of " + std::to_string(sharding.world));
  }
  if (sharding.world > 1 && sharding.collectives == nullptr) {
    return InvalidArgumentError("session: a sharded session needs its collectives");
  }
  // Trainable tensors in the configured state format (`compressed`, chosen once the chunk
  // size is known), or in fp32 state.
  const kernels::StateFormat state = config.optimizer_state.format;
  TIERMEM_RETURN_IF_ERROR(
      kernels::ValidateStateFormat(state).WithContext("config 'optimizer.state_block'"));
  if (state.stochastic && state.dtype != kernels::StateDType::kBF16) {
    return InvalidArgumentError(
        "session: stochastic rounding of optimizer state needs "
        "optimizer.state_dtype 'bf16'");
  }
  // int8 groups align every tensor (and every chunk size) to the block.
  const uint64_t state_align =
      state.dtype == kernels::StateDType::kInt8 ? state.block : chunks::kAlignElems;
  std::vector<size_t> trainable, compressed, frozen;
  std::vector<chunks::PackTensor> packed;  // every tensor, as the packer sees it
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorSpec& t = tensors[i];
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
    (t.trainable ? trainable : frozen).push_back(i);
    chunks::PackTensor pt;
    pt.numel = t.numel;
    pt.rows = t.shape.empty() ? 1 : static_cast<uint64_t>(t.shape[0]);
    pt.expert_set = t.expert_set;
    pt.expert = t.expert;
    packed.push_back(pt);
  }
  const bool any_trainable = !trainable.empty() || !compressed.empty();
  std::unique_ptr<Session> s(new Session());
  s->config_ = config;
  const bool mixed = config.precision != Precision::kFp32;
  const Bytes esize = mixed ? 2 : 4;
  // Device working set per element: the compute param and (when anything trains) its grad.
  const Bytes per_elem = esize + (any_trainable ? esize : 0);
  TIERMEM_ASSIGN_OR_RETURN(s->config_.device_kind,
                           TierStack::ResolveDeviceKind(config.device_kind));
  const bool host = s->host_compute();
  if (host && config.device_budget_given) {
    // ParseConfig refuses a budget with an explicit "host": this is "auto" on a machine
    // without a GPU, so a script written for one still runs.
    TIERMEM_LOG(kWarn) << "config 'device' (" << config.device_budget
                       << " bytes) is ignored: there is no GPU, so device_kind 'auto' computes "
                          "on the host (device_kind 'host'; 'sim' simulates a device of that "
                          "budget)";
  }
  if (host && OffloadsActivations(config.activations)) {
    return InvalidArgumentError(
        "activations '" + std::string(ModeName(config.activations)) +
        "' moves saved activations from the device to "
        "host memory, but with device_kind 'host' they are in host memory already: use "
        "'budget' (counted in the host budget), 'recompute' or 'outside'");
  }
  // The smallest chunk that holds the largest piece a unit needs at once: a row of any
  // tensor, and with expert sets an expert's slices (each expert in chunks of its own).
  TIERMEM_ASSIGN_OR_RETURN(const uint64_t expert_item, chunks::LargestExpertItem(packed));
  // Host mode without expert sets: the chunk size, and whether large tensors are split,
  // follow the host budget (host_floor.h); with chunk_size given, or sharded (a sharded
  // session keeps every tensor whole, below), tensors stay whole as before.
  const HostSizingInputs host_in{
      per_elem, esize, state_align, any_trainable, config.nvme_size > 0, config.host_reserve};
  std::optional<HostSizing> host_sizing;
  if (host && expert_item == 0 && !config.chunk_size && sharding.world == 1) {
    TIERMEM_ASSIGN_OR_RETURN(host_sizing, SizeHostChunks(packed, host_in, config.host_budget));
  }
  if (host && expert_item == 0 && !(host_sizing && host_sizing->split)) {
    for (chunks::PackTensor& pt : packed) pt.rows = 1;
  }
  uint64_t min_piece = 0;
  for (const chunks::PackTensor& pt : packed) min_piece = std::max(min_piece, pt.row_elems());
  min_piece = std::max(min_piece, expert_item);
  // Host mode: no device budget. The chunk size follows the host budget instead: an fp32
  // chunk is at most 1/32 of it (per_elem x budget / 32 passed as the working budget), so the
  // host room held for NVMe-homed chunks in use (below) stays a small part of it.
  const Bytes sizing_budget = host ? per_elem * (config.host_budget / 32) : config.device_budget;
  s->min_device_budget_ =
      host ? 0 : chunks::MinimumDeviceBudget(min_piece, per_elem, kMinResidentChunks);
  if (host_sizing) {
    s->chunk_elems_ = host_sizing->chunk_elems;
  } else if (!config.chunk_size) {
    StatusOr<chunks::ChunkSizeChoice> choice =
        chunks::ChooseChunkElems(packed, sizing_budget, per_elem, kMinResidentChunks, state_align);
    if (!choice.ok() && host) {
      // The largest piece alone is more than 1/32 of the host budget: chunks of about that
      // piece, the least waste up to 1.25x it (the host tier's own minimum is checked when it
      // is built). Not exactly the piece: a layer whose tensors sum to a multiple of its
      // largest would leave its small ones a chunk of their own (GPT 8 x 2304 at 2 GiB: 5
      // groups per block instead of 3, chunks 1.7x the state).
      const Bytes at_least = chunks::MinimumDeviceBudget(min_piece, per_elem, kMinResidentChunks);
      choice = chunks::ChooseChunkElems(packed, at_least + at_least / 4, per_elem,
                                        kMinResidentChunks, state_align);
    }
    if (!choice.ok()) return NameLargestRow(choice.status(), tensors, packed);
    s->chunk_elems_ = choice->chunk_elems;
  } else {
    s->chunk_elems_ = *config.chunk_size;
    const Bytes need = s->chunk_elems_ * per_elem * kMinResidentChunks;
    if (!host && need > config.device_budget) {
      return ResourceExhaustedError("device budget of " + std::to_string(config.device_budget) +
                                    " bytes is below the minimum of " + std::to_string(need) +
                                    " bytes for chunk_size=" + std::to_string(s->chunk_elems_));
    }
  }
  // The trainable tensors whose m and v take the configured compressed format: those of at
  // least optimizer.state_min_elems elements that stay whole (one piece, outside an expert
  // set: a compressed tensor's blocks start at its first element, and its raw state is one
  // run of codes). The others keep fp32 state, the split ones with a warning.
  if (state.compressed()) {
    std::vector<size_t> rest;
    size_t split = 0;
    std::string first_split;
    for (size_t i : trainable) {
      const TensorSpec& t = tensors[i];
      if (t.numel < config.optimizer_state.min_elems) {
        rest.push_back(i);
      } else if (t.expert_set >= 0 || t.numel > s->chunk_elems_) {
        rest.push_back(i);
        if (split++ == 0) first_split = t.name;
      } else {
        compressed.push_back(i);
      }
    }
    trainable = std::move(rest);
    if (split > 0) {
      TIERMEM_LOG(kWarn) << "optimizer.state_dtype '" << kernels::StateDTypeName(state.dtype)
                         << "': " << split << " tensor(s) split across chunks or in an expert "
                         << "set (the first: " << first_split << ") keep fp32 optimizer state; "
                         << "compressed state covers whole tensors only";
    }
  }
  if (config.chunk_size && !compressed.empty() && s->chunk_elems_ % state_align != 0) {
    return InvalidArgumentError("chunk_size=" + std::to_string(s->chunk_elems_) +
                                " is not a multiple of "
                                "optimizer.state_block (" +
                                std::to_string(state_align) +
                                "): chunks of int8 "
                                "optimizer state hold whole blocks");
  }
  // Sharded: every rank holds an equal, aligned slice of every chunk (64 elements keep the
  // kernels' vectors and the host tier's classes aligned).
  s->sharding_ = sharding;
  if (sharding.world > 1) {
    // int8 state: every shard holds whole blocks too.
    const uint64_t unit =
        static_cast<uint64_t>(sharding.world) * std::max<uint64_t>(64, state_align);
    s->chunk_elems_ = (s->chunk_elems_ + unit - 1) / unit * unit;
  }
  s->shard_elems_ = s->chunk_elems_ / static_cast<uint64_t>(sharding.world);
  s->shard_begin_ = s->shard_elems_ * static_cast<uint64_t>(sharding.rank);
  // Pack trainable tensors (those in the compressed state format first), then frozen ones,
  // into their own groups.
  s->tensors_.resize(tensors.size());
  for (const std::vector<size_t>* subset : {&compressed, &trainable, &frozen}) {
    if (subset->empty()) continue;
    std::vector<chunks::PackTensor> sub;
    for (size_t i : *subset) sub.push_back(packed[i]);
    const bool packed_compressed = subset == &compressed;
    auto layout = chunks::PackPieces(sub, s->chunk_elems_,
                                     packed_compressed ? state_align : chunks::kAlignElems);
    if (!layout.ok()) {
      return layout.status().WithContext("chunk_size=" + std::to_string(s->chunk_elems_));
    }
    const size_t base = s->groups_.size();
    for (size_t g = 0; g < layout->num_groups(); ++g) {
      ChunkGroup grp;
      grp.trainable = subset != &frozen;
      if (packed_compressed) grp.state = state;
      grp.chunks.fill(kNoChunk);
      s->groups_.push_back(std::move(grp));
    }
    for (size_t k = 0; k < subset->size(); ++k) {
      const size_t i = (*subset)[k];
      TensorPlace& tp = s->tensors_[i];
      tp.pieces = layout->pieces[k];
      tp.numel = tensors[i].numel;
      tp.trainable = tensors[i].trainable;
      tp.opt_group = tensors[i].opt_group;
      for (size_t pi = 0; pi < tp.pieces.size(); ++pi) {
        Piece& p = tp.pieces[pi];
        p.group += static_cast<uint32_t>(base);
        ChunkGroup& grp = s->groups_[p.group];
        grp.pieces.push_back({static_cast<uint32_t>(i), static_cast<uint32_t>(pi)});
        grp.used_elems = std::max(grp.used_elems, p.offset + p.numel);
      }
      tp.group = tp.pieces.front().group;
      tp.offset = tp.pieces.front().offset;
    }
  }
  if (sharding.world > 1) {
    // A sharded unit holds the full chunks of every group it touches (gathered params and
    // gradient buffers, outside the engine's eviction): a tensor split into pieces spreads a
    // unit over more of them than the budget was sized for. Refused before anything changes.
    for (size_t i = 0; i < s->tensors_.size(); ++i) {
      if (!s->tensors_[i].split()) continue;
      return ResourceExhaustedError(
          "sharded training keeps every tensor whole in a chunk, but tensor " + tensors[i].name +
          " (" + std::to_string(tensors[i].numel) + " elements) is larger than a chunk of " +
          std::to_string(s->chunk_elems_) + " elements at this device budget of " +
          std::to_string(config.device_budget) +
          " bytes: give each rank a device budget of at "
          "least " +
          std::to_string(
              chunks::MinimumDeviceBudget(MaxNumel(tensors), per_elem, kMinResidentChunks)) +
          " bytes, or a chunk_size of at least " + std::to_string(MaxNumel(tensors)) + " elements");
    }
  }
  for (ChunkGroup& grp : s->groups_) {
    std::sort(grp.pieces.begin(), grp.pieces.end(), [&](const PieceRef& a, const PieceRef& b) {
      return s->tensors_[a.tensor].pieces[a.piece].offset <
             s->tensors_[b.tensor].pieces[b.piece].offset;
    });
    for (const PieceRef& r : grp.pieces) {
      if (std::find(grp.tensors.begin(), grp.tensors.end(), r.tensor) == grp.tensors.end()) {
        grp.tensors.push_back(r.tensor);
      }
    }
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorSpec& t = tensors[i];
    const Bytes m_and_v = 2 * kernels::StateBytes(s->groups_[s->tensors_[i].group].state, t.numel);
    s->model_bytes_ += t.numel * (t.trainable ? esize * 2 : esize) + (t.trainable ? m_and_v : 0) +
                       (mixed ? t.numel * 4 : 0);
  }
  s->specs_ = std::move(tensors);
  s->has_grad_.assign(s->specs_.size(), 0);
  s->scaler_.scale = config.precision == Precision::kFp16 ? config.loss_scaling.initial_scale : 1.0;

  StackLayout sl;
  sl.chunk_bytes = s->shard_elems_ * 4;  // the largest (fp32) chunk of a group held here
  // Host room for caches of NVMe-homed chunks: every kind of one group at once (the optimizer
  // step holds them there); without trainable tensors (serving) one chunk, for value reads.
  // Host mode computes on host copies too: host_floor.h's HostReserveChunks, and with split
  // tensors the chunks the largest one's pieces span (its unit pins them all).
  const Bytes reserve_chunks = host ? static_cast<Bytes>(HostReserveChunks(any_trainable)) +
                                          (host_sizing ? host_sizing->pinned_chunks : 0)
                                    : (any_trainable ? 5 : 1);
  sl.host_reserve = config.nvme_size == 0
                        ? 0
                        : reserve_chunks * AlignUp(sl.chunk_bytes, kPage) + config.host_reserve;
  // Host mode with split tensors: their compute copies count in the host budget, outside the
  // host tier (host_floor.h). Refused here, naming the tensor, before anything is built.
  SessionConfig tier_config = s->config_;
  if (host_sizing && host_sizing->compute_room > 0) {
    const HostSizing& hs = *host_sizing;
    if (hs.need() > config.host_budget) {
      TIERMEM_ASSIGN_OR_RETURN(const Bytes enough, SufficientHostBudget(packed, host_in));
      const TensorSpec& t = s->specs_[static_cast<size_t>(hs.room_tensor)];
      return ResourceExhaustedError(HostFloorRefusal(config.host_budget, hs, host_in, t.name,
                                                     t.shape, t.numel, ModeName(config.precision),
                                                     enough));
    }
    tier_config.host_budget -= hs.compute_room;
  }
  // A served mixture-of-experts model: the dense groups are created first and homed on the
  // host; the experts are homed on NVMe and the rest of the host budget caches them by use.
  std::vector<uint8_t> expert_group(s->groups_.size(), 0);
  for (size_t g = 0; g < s->groups_.size(); ++g) {
    const ChunkGroup& grp = s->groups_[g];
    expert_group[g] = !grp.pieces.empty() &&
                      std::all_of(grp.pieces.begin(), grp.pieces.end(), [&](const PieceRef& r) {
                        return s->tensors_[r.tensor].pieces[r.piece].expert >= 0;
                      });
  }
  const bool experts = std::find(expert_group.begin(), expert_group.end(), 1) != expert_group.end();
  if (experts && !any_trainable) {
    for (size_t g = 0; g < s->groups_.size(); ++g) {
      if (!expert_group[g]) {
        sl.host_homes_first += (mixed ? 2 : 1) * AlignUp(s->shard_elems_ * 4, kPage);
      }
    }
  }
  // State beyond the host budget with NVMe: homes fill the host budget, so map it all now,
  // registered with the NVMe tier (tier_stack.h).
  sl.host_prefault =
      config.nvme_size > 0 && s->model_bytes_ > config.host_budget ? config.host_budget : 0;
  // The stack builds the device kind resolved above (config_'s).
  TIERMEM_ASSIGN_OR_RETURN(s->stack_, TierStack::Create(tier_config, sl));
  s->stepper_ = std::make_unique<OptimizerStepper>(s.get(), s->stack_.get(), &s->trace_);
  s->timeline_path_ = s->stack_->timeline_path();
  chunks::Engine* eng = s->stack_->engine();
  // Chunks in creation order (homes go to the host while it has room): kCreationOrder, group
  // by group; a served MoE creates every dense chunk before its experts'.
  const bool dense_first = experts && !any_trainable;
  for (int pass = 0; pass < (dense_first ? 2 : 1); ++pass) {
    for (ChunkKind kind : kCreationOrder) {
      for (size_t gi = 0; gi < s->groups_.size(); ++gi) {
        if (dense_first && expert_group[gi] != pass) continue;
        ChunkGroup& g = s->groups_[gi];
        const bool need = kind == ChunkKind::kParamLowp   ? mixed
                          : kind == ChunkKind::kParamFp32 ? true
                                                          : g.trainable;
        if (!need) continue;
        const bool state_kind = kind == ChunkKind::kExpAvg || kind == ChunkKind::kExpAvgSq;
        const Bytes bytes = state_kind ? kernels::StateBytes(g.state, s->shard_elems_)
                                       : s->shard_elems_ * kernels::DTypeSize(s->dtype(kind));
        auto id = eng->AddChunk(bytes, chunks::ChunkKindCategory(kind));
        if (!id.ok()) return id.status();  // `s` is destroyed: every region freed
        g.chunks[K(kind)] = *id;
        s->total_chunk_bytes_ += eng->ChunkBytes(*id);
        if (state_kind) {
          s->state_bytes_ += eng->ChunkBytes(*id);
          s->state_bytes_fp32_ += s->shard_elems_ * 4;
        }
      }
    }
  }
  s->compute_budget_ = s->ComputeBudget();
  return s;
}

Session::~Session() { Close(); }

void Session::Close() {
  if (!stack_ || stack_->closed()) return;
  if (trace_.armed()) {
    StatusOr<bool> w = FinishTrace();
    if (!w.ok()) {
      TIERMEM_LOG(kError) << w.status().message();
    }
  }
  runner_.Stop();                // before the engine goes
  stepper_->DropSpeculations();  // their scratch too
  stack_->Close();
}

bool Session::closed() const { return stack_ == nullptr || stack_->closed(); }

Status Session::Live() const {
  if (closed()) return FailedPreconditionError("tiermem session is closed");
  return OkStatus();
}

kernels::DType Session::dtype(ChunkKind kind) const {
  return (kind == ChunkKind::kParamLowp || kind == ChunkKind::kGrad) ? compute_dtype()
                                                                     : kernels::DType::kF32;
}

Bytes Session::ComputeBudget() const {
  if (!host_compute()) return config_.device_budget;
  for (size_t g = 0; g < groups_.size(); ++g) {
    for (int k = 0; k < chunks::kNumChunkKinds; ++k) {
      const ChunkKind kind = static_cast<ChunkKind>(k);
      if (has_kind(g, kind) && Home(g, kind) != TierKind::kHost) return 0;
    }
  }
  return config_.host_budget;
}

// One group's compute and grad chunks, full (gathered when sharded).
Bytes Session::GroupComputeBytes() const { return chunk_elems_ * compute_element_size() * 2; }

bool Session::holds_grad_chunks() const {
  return compute_budget_ >= GroupComputeBytes() * groups_.size() || sharded();
}

Bytes Session::ActivationCap(size_t unit_groups) const {
  const Bytes units = 2 * static_cast<Bytes>(unit_groups) * GroupComputeBytes();
  return compute_budget_ > units ? compute_budget_ - units : 0;
}

size_t Session::RecentFullChunks(size_t unit_groups) const {
  const Bytes tier = host_compute() ? config_.host_budget : config_.device_budget;
  const Bytes full = chunk_elems_ * compute_element_size();
  return std::min<size_t>(2 * unit_groups + 1, tier / (4 * full));
}

StatusOr<Bytes> Session::UnitComputeBytes(const std::vector<size_t>& groups,
                                          const std::vector<std::vector<size_t>>& experts) const {
  auto bytes = [&](size_t g) -> StatusOr<Bytes> {
    if (g >= groups_.size()) {
      return OutOfRangeError("session: unknown chunk group " + std::to_string(g));
    }
    return ChunkBytes(g, compute_kind());
  };
  Bytes unit = 0, expert = 0;
  for (size_t g : groups) {
    TIERMEM_ASSIGN_OR_RETURN(const Bytes b, bytes(g));
    unit += b;
  }
  for (const std::vector<size_t>& e : experts) {
    Bytes beyond = 0;
    for (size_t g : e) {
      if (std::find(groups.begin(), groups.end(), g) != groups.end()) continue;
      TIERMEM_ASSIGN_OR_RETURN(const Bytes b, bytes(g));
      beyond += b;
    }
    expert = std::max(expert, beyond);
  }
  return unit + expert;
}

std::string Session::io_backend() const { return stack_ ? stack_->io_backend() : ""; }
Bytes Session::nvme_registered_bytes() const {
  return stack_ ? stack_->nvme_registered_bytes() : 0;
}

ChunkId Session::Chunk(size_t group, ChunkKind kind) const {
  return groups_[group].chunks[K(kind)];
}

Status Session::CheckKind(size_t group, ChunkKind kind) const {
  TIERMEM_RETURN_IF_ERROR(Live());
  if (group >= groups_.size()) {
    return OutOfRangeError("session: unknown chunk group " + std::to_string(group));
  }
  if (K(kind) < 0 || K(kind) >= chunks::kNumChunkKinds || Chunk(group, kind) == kNoChunk) {
    return InvalidArgumentError("session: chunk group " + std::to_string(group) + " has no " +
                                std::string(chunks::ChunkKindName(kind)) + " chunk");
  }
  return OkStatus();
}

void Session::NoteClassAccess(ChunkId c, TierKind where, uint32_t cls) {
  if (cls == chunks::kNoClass) {
    runner_.Access(c, where);
    return;
  }
  // An expert chosen by the routing: marked in the trace as a member of its set, bound to a
  // slot of the executing plan, never checked against it (plan_runner.h).
  if (c >= expert_set_of_.size()) expert_set_of_.resize(c + 1, planners::kNoExpertSet);
  expert_set_of_[c] = cls;
  trace_.MarkExpertSet(c, cls);
  runner_.ClassAccess(c);
}

StatusOr<void*> Session::Acquire(size_t group, ChunkKind kind, TierKind where, uint32_t cls) {
  TIERMEM_RETURN_IF_ERROR(CheckKind(group, kind));
  TIERMEM_RETURN_IF_ERROR(stepper_->RunPending(group, true));
  const ChunkId c = Chunk(group, kind);
  StatusOr<void*> p = stack_->engine()->Acquire(c, where, cls);
  if (p.ok()) {
    trace_.Access(c, planners::AccessMode::kRead, where);
    NoteClassAccess(c, where, cls);
  }
  return p;
}

StatusOr<bool> Session::Prefetch(size_t group, ChunkKind kind, TierKind where, double probability) {
  TIERMEM_RETURN_IF_ERROR(CheckKind(group, kind));
  if (stepper_->pending(group)) return false;  // its update reads it first, on its own tier
  return stack_->engine()->PrefetchHint(Chunk(group, kind), where, probability);
}

StatusOr<void*> Session::AcquireForWrite(size_t group, ChunkKind kind, TierKind where,
                                         bool* must_zero, uint32_t cls) {
  TIERMEM_RETURN_IF_ERROR(CheckKind(group, kind));
  TIERMEM_RETURN_IF_ERROR(stepper_->RunPending(group, true));
  stepper_->DropSpeculation(group);  // about to be written
  const ChunkId c = Chunk(group, kind);
  // Lazily zero content is not needed from below (nothing has to be copied in): a write.
  const bool zero = stack_->engine()->ZeroContent(c);
  StatusOr<void*> p = stack_->engine()->AcquireForWrite(c, where, must_zero, cls);
  if (p.ok()) {
    trace_.Access(c, zero ? planners::AccessMode::kWrite : planners::AccessMode::kReadWrite, where);
    NoteClassAccess(c, where, cls);
  }
  return p;
}

Status Session::Release(size_t group, ChunkKind kind, bool modified) {
  TIERMEM_RETURN_IF_ERROR(CheckKind(group, kind));
  const ChunkId c = Chunk(group, kind);
  if (modified) {
    trace_.MarkWritten(c);
    stepper_->DropSpeculation(group);  // its inputs changed after it ran
    if (kind == ChunkKind::kGrad) stepper_->GradWritten(group);
  }
  return stack_->engine()->Release(c, modified);
}

Status Session::ZeroChunk(size_t group, ChunkKind kind) {
  TIERMEM_RETURN_IF_ERROR(CheckKind(group, kind));
  // A pending update reads these grads first: it zeroes them after it runs.
  if (kind == ChunkKind::kGrad && stepper_->ZeroGradsAfterPending(group)) return OkStatus();
  TIERMEM_RETURN_IF_ERROR(stepper_->RunPending(group, true));
  stepper_->DropSpeculation(group);
  return stack_->engine()->Zero(Chunk(group, kind));
}

int Session::Pins(size_t group, ChunkKind kind) const {
  if (!CheckKind(group, kind).ok()) return 0;
  return stack_->engine()->Pins(Chunk(group, kind));
}

bool Session::LazilyZero(size_t group, ChunkKind kind) const {
  if (!CheckKind(group, kind).ok()) return false;
  return stack_->engine()->ZeroContent(Chunk(group, kind));
}

TierKind Session::Resident(size_t group, ChunkKind kind) const {
  if (!CheckKind(group, kind).ok()) return TierKind::kNone;
  return stack_->engine()->Resident(Chunk(group, kind));
}

TierKind Session::Home(size_t group, ChunkKind kind) const {
  if (!CheckKind(group, kind).ok()) return TierKind::kNone;
  return stack_->engine()->Home(Chunk(group, kind));
}

Bytes Session::ChunkBytes(size_t group, ChunkKind kind) const {
  if (!CheckKind(group, kind).ok()) return 0;
  return stack_->engine()->ChunkBytes(Chunk(group, kind));
}

// ---- values --------------------------------------------------------------------------------

// Values move through ReadAt/WriteAt: from/into whichever copy the chunk is resident in, without
// moving it (so also while a binding has it pinned on the device for compute).
Status Session::ReadTensor(size_t tensor, ChunkKind kind, void* out) {
  TIERMEM_RETURN_IF_ERROR(Live());
  if (tensor >= tensors_.size()) return OutOfRangeError("session: unknown tensor");
  const TensorPlace& t = tensors_[tensor];
  TIERMEM_RETURN_IF_ERROR(CheckKind(t.group, kind));
  TIERMEM_RETURN_IF_ERROR(stepper_->RunPending(t.group, true));
  const kernels::StateFormat& f = groups_[t.group].state;
  if (IsStateKind(kind) && f.compressed()) {  // dequantized
    std::vector<char> codes(t.numel * CodeSize(f));
    std::vector<float> absmax(kernels::StateBlocks(f, t.numel));
    TIERMEM_RETURN_IF_ERROR(StateRaw(tensor, kind, codes.data(), absmax.data(), false));
    kernels::DequantizeState(f, kind == ChunkKind::kExpAvg, {codes.data(), absmax.data()},
                             static_cast<float*>(out), t.numel);
    return OkStatus();
  }
  return ReadTensorRange(tensor, kind, 0, t.numel, out);
}

Status Session::ReadTensorRange(size_t tensor, ChunkKind kind, uint64_t begin, uint64_t n,
                                void* out) {
  TIERMEM_RETURN_IF_ERROR(CheckRange(tensor, kind, begin, n));
  const size_t es = kernels::DTypeSize(dtype(kind));
  for (const Piece& p : tensors_[tensor].pieces) {
    const uint64_t lo = std::max(p.begin, begin), hi = std::min(p.begin + p.numel, begin + n);
    if (lo >= hi) continue;
    TIERMEM_RETURN_IF_ERROR(CheckKind(p.group, kind));
    TIERMEM_RETURN_IF_ERROR(stepper_->RunPending(p.group, true));
    char* dst = static_cast<char*>(out) + (lo - begin) * es;
    const uint64_t at = p.offset + (lo - p.begin);  // in the chunk
    if (sharded()) {                                // collective: the chunk from every rank's shard
      TIERMEM_ASSIGN_OR_RETURN(const char* full, GatherChunk(p.group, kind));
      std::memcpy(dst, full + at * es, (hi - lo) * es);
      continue;
    }
    TIERMEM_RETURN_IF_ERROR(
        stack_->engine()->ReadAt(Chunk(p.group, kind), at * es, dst, (hi - lo) * es));
  }
  return OkStatus();
}

Status Session::CheckRange(size_t tensor, ChunkKind kind, uint64_t begin, uint64_t n) const {
  TIERMEM_RETURN_IF_ERROR(Live());
  if (tensor >= tensors_.size()) return OutOfRangeError("session: unknown tensor");
  const TensorPlace& t = tensors_[tensor];
  TIERMEM_RETURN_IF_ERROR(CheckKind(t.group, kind));
  if (begin > t.numel || n > t.numel - begin) {
    return OutOfRangeError("session: elements [" + std::to_string(begin) + ", " +
                           std::to_string(begin + n) + ") are outside tensor '" +
                           specs_[tensor].name + "' (" + std::to_string(t.numel) + ")");
  }
  if (IsStateKind(kind) && groups_[t.group].state.compressed()) {
    return InvalidArgumentError(
        "session: a range of compressed optimizer state (use "
        "ReadTensor / WriteTensor)");
  }
  return OkStatus();
}

Status Session::WriteTensor(size_t tensor, ChunkKind kind, const void* values) {
  TIERMEM_RETURN_IF_ERROR(Live());
  if (tensor >= tensors_.size()) return OutOfRangeError("session: unknown tensor");
  const TensorPlace& t = tensors_[tensor];
  TIERMEM_RETURN_IF_ERROR(CheckKind(t.group, kind));
  TIERMEM_RETURN_IF_ERROR(stepper_->RunPending(t.group, true));
  stepper_->DropSpeculation(t.group);
  const kernels::StateFormat& f = groups_[t.group].state;
  if (IsStateKind(kind) && f.compressed()) {  // quantized: the tensor's blocks start at it
    std::vector<char> codes(t.numel * CodeSize(f));
    std::vector<float> absmax(kernels::StateBlocks(f, t.numel));
    kernels::QuantizeState(f, kind == ChunkKind::kExpAvg, static_cast<const float*>(values),
                           {codes.data(), absmax.data()}, t.numel, tensor);
    return StateRaw(tensor, kind, codes.data(), absmax.data(), true);
  }
  return WriteTensorRange(tensor, kind, 0, t.numel, values);
}

Status Session::WriteTensorRange(size_t tensor, ChunkKind kind, uint64_t begin, uint64_t n,
                                 const void* values) {
  TIERMEM_RETURN_IF_ERROR(CheckRange(tensor, kind, begin, n));
  const size_t es = kernels::DTypeSize(dtype(kind));
  for (const Piece& p : tensors_[tensor].pieces) {
    const uint64_t tlo = std::max(p.begin, begin), thi = std::min(p.begin + p.numel, begin + n);
    if (tlo >= thi) continue;
    TIERMEM_RETURN_IF_ERROR(CheckKind(p.group, kind));
    TIERMEM_RETURN_IF_ERROR(stepper_->RunPending(p.group, true));
    stepper_->DropSpeculation(p.group);
    // This rank's part of the elements, in chunk coordinates (all of them when not sharded).
    const uint64_t lo = std::max(p.offset + (tlo - p.begin), shard_begin_);
    const uint64_t hi = std::min(p.offset + (thi - p.begin), shard_begin_ + shard_elems_);
    if (lo >= hi) continue;
    gathered_key_ = {SIZE_MAX, -1};  // a cached gather is stale now
    TIERMEM_RETURN_IF_ERROR(stack_->engine()->WriteAt(
        Chunk(p.group, kind), (lo - shard_begin_) * es,
        static_cast<const char*>(values) + (p.begin + lo - p.offset - begin) * es, (hi - lo) * es));
  }
  return OkStatus();
}

Status Session::ReadStateRaw(size_t tensor, ChunkKind kind, void* codes, float* absmax) {
  TIERMEM_RETURN_IF_ERROR(Live());
  if (tensor >= tensors_.size()) return OutOfRangeError("session: unknown tensor");
  if (!IsStateKind(kind))
    return InvalidArgumentError("session: raw state is exp_avg or exp_avg_sq");
  TIERMEM_RETURN_IF_ERROR(CheckKind(tensors_[tensor].group, kind));
  TIERMEM_RETURN_IF_ERROR(stepper_->RunPending(tensors_[tensor].group, true));
  return StateRaw(tensor, kind, codes, absmax, false);
}

Status Session::WriteStateRaw(size_t tensor, ChunkKind kind, const void* codes,
                              const float* absmax) {
  TIERMEM_RETURN_IF_ERROR(Live());
  if (tensor >= tensors_.size()) return OutOfRangeError("session: unknown tensor");
  if (!IsStateKind(kind))
    return InvalidArgumentError("session: raw state is exp_avg or exp_avg_sq");
  TIERMEM_RETURN_IF_ERROR(CheckKind(tensors_[tensor].group, kind));
  TIERMEM_RETURN_IF_ERROR(stepper_->RunPending(tensors_[tensor].group, true));
  stepper_->DropSpeculation(tensors_[tensor].group);
  return StateRaw(tensor, kind, const_cast<void*>(codes), const_cast<float*>(absmax), true);
}

// A chunk of m or v is the codes of its shard_elems_ elements, then (int8) one absmax per
// block; a tensor's blocks start at its first element (aligned to the block). Sharded, the
// gathered chunk is every rank's shard chunk back to back.
Status Session::StateRaw(size_t tensor, ChunkKind kind, void* codes_v, float* absmax, bool write) {
  const TensorPlace& t = tensors_[tensor];
  const kernels::StateFormat& f = groups_[t.group].state;
  const size_t es = CodeSize(f);
  const bool int8 = f.dtype == kernels::StateDType::kInt8;
  const Bytes absmax_at = shard_elems_ * es;  // in each shard's chunk
  char* codes = static_cast<char*>(codes_v);
  chunks::Engine* eng = stack_->engine();
  const ChunkId c = Chunk(t.group, kind);
  if (write) {  // this rank's part (block-aligned: shards hold whole blocks)
    const uint64_t lo = std::max(t.offset, shard_begin_);
    const uint64_t hi = std::min(t.offset + t.numel, shard_begin_ + shard_elems_);
    if (lo >= hi) return OkStatus();
    gathered_key_ = {SIZE_MAX, -1};
    TIERMEM_RETURN_IF_ERROR(
        eng->WriteAt(c, (lo - shard_begin_) * es, codes + (lo - t.offset) * es, (hi - lo) * es));
    if (!int8) return OkStatus();
    return eng->WriteAt(c, absmax_at + (lo - shard_begin_) / f.block * 4,
                        absmax + (lo - t.offset) / f.block, (hi - lo + f.block - 1) / f.block * 4);
  }
  if (!sharded()) {
    TIERMEM_RETURN_IF_ERROR(eng->ReadAt(c, t.offset * es, codes, t.numel * es));
    if (!int8) return OkStatus();
    return eng->ReadAt(c, absmax_at + t.offset / f.block * 4, absmax,
                       kernels::StateBlocks(f, t.numel) * 4);
  }
  TIERMEM_ASSIGN_OR_RETURN(const char* full, GatherChunk(t.group, kind));
  const Bytes stride = eng->ChunkBytes(c);
  for (uint64_t r = t.offset / shard_elems_; r * shard_elems_ < t.offset + t.numel; ++r) {
    const uint64_t lo = std::max(t.offset, r * shard_elems_);
    const uint64_t hi = std::min(t.offset + t.numel, (r + 1) * shard_elems_);
    const char* shard = full + r * stride;
    std::memcpy(codes + (lo - t.offset) * es, shard + (lo - r * shard_elems_) * es, (hi - lo) * es);
    if (int8) {
      std::memcpy(absmax + (lo - t.offset) / f.block,
                  shard + absmax_at + (lo - r * shard_elems_) / f.block * 4,
                  (hi - lo + f.block - 1) / f.block * 4);
    }
  }
  return OkStatus();
}

StatusOr<const char*> Session::GatherChunk(size_t group, ChunkKind kind) {
  const std::pair<size_t, int> key{group, K(kind)};
  if (gather_cache_ && gathered_key_ == key) return gathered_.data();
  // Every rank's shard chunk, back to back (for compressed m and v: codes, then absmax).
  const Bytes shard_bytes = stack_->engine()->ChunkBytes(Chunk(group, kind));
  shard_buf_.resize(shard_bytes);
  gathered_.resize(shard_bytes * static_cast<size_t>(sharding_.world));
  TIERMEM_RETURN_IF_ERROR(
      stack_->engine()->ReadAt(Chunk(group, kind), 0, shard_buf_.data(), shard_buf_.size()));
  gathered_key_ = {SIZE_MAX, -1};
  TIERMEM_RETURN_IF_ERROR(
      sharding_.collectives->AllGather(shard_buf_.data(), gathered_.data(), shard_buf_.size())
          .WithContext("gathering chunk group " + std::to_string(group) + " (" +
                       std::string(chunks::ChunkKindName(kind)) + ") from every rank"));
  gathered_key_ = key;
  return gathered_.data();
}

Status Session::ReadParam(size_t tensor, float* out) {
  return ReadTensor(tensor, ChunkKind::kParamFp32, out);
}

Status Session::WriteParam(size_t tensor, const float* values) {
  TIERMEM_RETURN_IF_ERROR(WriteTensor(tensor, ChunkKind::kParamFp32, values));
  if (!mixed()) return OkStatus();
  std::vector<uint16_t> low(tensors_[tensor].numel);
  kernels::CastFromF32(values, low.data(), compute_dtype(), low.size());
  return WriteTensor(tensor, ChunkKind::kParamLowp, low.data());
}

Status Session::SetStepCount(size_t tensor, int64_t steps) {
  if (tensor >= tensors_.size()) return OutOfRangeError("session: unknown tensor");
  if (steps < 0) return InvalidArgumentError("session: negative step count");
  TIERMEM_RETURN_IF_ERROR(Live());
  // The pending update counted the old value.
  for (const Piece& p : tensors_[tensor].pieces) {
    TIERMEM_RETURN_IF_ERROR(stepper_->RunPending(p.group, true));
    stepper_->DropSpeculation(p.group);
  }
  stepper_->set_step_count(tensor, steps);
  return OkStatus();
}

// ---- gradients -------------------------------------------------------------------------------

StatusOr<kernels::GradStats> Session::GradStats() {
  TIERMEM_RETURN_IF_ERROR(Live());
  kernels::GradStats total;
  const kernels::DType gd = dtype(ChunkKind::kGrad);
  const size_t es = kernels::DTypeSize(gd);
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    const ChunkGroup& g = groups_[gi];
    if (!g.trainable) continue;
    const std::vector<OptimizerStepper::Run> runs =
        stepper_->LocalRuns(stepper_->GradRuns(gi, false));
    if (runs.empty()) continue;
    const TierKind where = ReadTier(gi, ChunkKind::kGrad);
    TIERMEM_ASSIGN_OR_RETURN(void* base, Acquire(gi, ChunkKind::kGrad, where));
    std::vector<GradSpan> spans;
    for (const OptimizerStepper::Run& r : runs) {
      spans.push_back({static_cast<const char*>(base) + r.lo * es, r.hi - r.lo});
    }
    // On a CUDA device the reduction runs there (and waits for the stream); elsewhere the CPU
    // reads the memory in place.
    const bool dev = where == TierKind::kDevice;
    StatusOr<kernels::GradStats> st =
        DeviceGradStats(cuda() && dev, spans, gd, dev ? stream_ : kHostStream);
    Status rel = Release(gi, ChunkKind::kGrad, false);
    TIERMEM_RETURN_IF_ERROR(st.status());
    TIERMEM_RETURN_IF_ERROR(rel);
    total.sq_norm += st->sq_norm;
    total.overflow = total.overflow || st->overflow;
  }
  total.sq_norm /= scaler_.scale * scaler_.scale;
  return total;
}

StatusOr<bool> Session::ZeroGrad() {
  TIERMEM_RETURN_IF_ERROR(Live());
  if (accumulating_) return false;
  // Clearing the flags is what matters (only spans with a gradient are read); zeroing the
  // chunks lazily lets the next backward skip fetching them. A chunk the binding keeps
  // pinned (resident training) keeps its stale bytes instead.
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    if (groups_[gi].trainable && Pins(gi, ChunkKind::kGrad) == 0) {
      TIERMEM_RETURN_IF_ERROR(ZeroChunk(gi, ChunkKind::kGrad));
    }
  }
  std::fill(has_grad_.begin(), has_grad_.end(), 0);
  return true;
}

// ---- optimizer --------------------------------------------------------------------------------

StatusOr<StepResult> Session::Step(const std::vector<GroupHyper>& hyper,
                                   const kernels::GradStats* global) {
  TIERMEM_RETURN_IF_ERROR(Live());
  TIERMEM_RETURN_IF_ERROR(stepper_->RunAllPending(true));  // the last step's updates come first
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (tensors_[i].trainable && static_cast<size_t>(tensors_[i].opt_group) >= hyper.size()) {
      return InvalidArgumentError("optimizer step: tensor " + specs_[i].name +
                                  " is in param "
                                  "group " +
                                  std::to_string(tensors_[i].opt_group) + " but " +
                                  std::to_string(hyper.size()) + " groups were given");
    }
  }
  for (size_t g = 0; g < hyper.size(); ++g) TIERMEM_RETURN_IF_ERROR(CheckHyper(hyper[g], g));
  StepResult r;
  ++micro_;
  if (micro_ % static_cast<uint64_t>(config_.gradient_accumulation_steps) != 0) {
    stepper_->DropSpeculations();  // more gradients come
    accumulating_ = true;
    return r;
  }
  accumulating_ = false;
  Phase("optimizer");
  const bool fp16 = config_.precision == Precision::kFp16;
  if ((config_.gradient_clipping > 0 || fp16) && sharded() && global == nullptr) {
    return FailedPreconditionError(
        "optimizer step of a sharded session with clipping or fp16: the gradient stats of the "
        "whole model (summed over ranks) are required");
  }
  if (config_.gradient_clipping > 0 || fp16) {
    Moment("optimizer:grad-stats");
    kernels::GradStats st;
    if (global != nullptr) {
      st = *global;
    } else {
      TIERMEM_ASSIGN_OR_RETURN(st, GradStats());
    }
    r.grad_norm = std::sqrt(st.sq_norm);
    if (fp16 && st.overflow) {
      stepper_->DropSpeculations();
      scaler_.scale *= config_.loss_scaling.backoff_factor;
      scaler_.good_steps = 0;
      ++scaler_.skipped_steps;
      r.skipped = true;
      return r;
    }
    if (config_.gradient_clipping > 0) {
      r.clip_coef = ClipCoefficient(config_.gradient_clipping, r.grad_norm);
    }
  }
  TIERMEM_RETURN_IF_ERROR(
      stepper_->Apply(hyper, r.clip_coef, static_cast<float>(1.0 / scaler_.scale)));
  // What the binding or the user does between this step and the next forward (reading
  // values, logging) is its own moment, not the last sub-step's.
  Moment("optimizer:done");
  if (fp16 && ++scaler_.good_steps >= config_.loss_scaling.growth_interval) {
    scaler_.scale *= config_.loss_scaling.growth_factor;
    scaler_.good_steps = 0;
  }
  r.applied = true;
  return r;
}

Status Session::FinishStep(size_t group) {
  TIERMEM_RETURN_IF_ERROR(Live());
  if (group >= groups_.size()) {
    return OutOfRangeError("session: unknown chunk group " + std::to_string(group));
  }
  return stepper_->RunPending(group, false);
}

Status Session::FinishSteps() {
  TIERMEM_RETURN_IF_ERROR(Live());
  return stepper_->RunAllPending(true);
}

TierKind Session::ReadTier(size_t g, ChunkKind kind) const {
  // Where a reduction over a chunk (GradStats) reads it without moving it: in place on the
  // device when it is there (a CUDA kernel on CUDA, the CPU on SimDevice), else on the host.
  return Resident(g, kind) == TierKind::kDevice ? TierKind::kDevice : TierKind::kHost;
}

// ---- iterations and stats -----------------------------------------------------------------------

void Session::BeginIteration() {
  if (closed()) return;
  stepper_->BeginIteration();
  const bool was_planned = runner_.active() && runner_.in_iteration();
  const bool diverged = was_planned && !runner_.EndIteration();
  stack_->engine()->BeginIteration();
  if (trace_.armed()) {
    if (trace_.needs_chunks()) DeclareTraceChunks();
    const bool ours = trace_.in_memory();
    StatusOr<bool> w = trace_.BeginIteration(TraceProbes(), TraceBudgets());
    if (!w.ok()) {
      // Training goes on; the error waits for FinishTrace (and is logged now).
      TIERMEM_LOG(kError) << w.status().message();
      trace_error_ = w.status();
    } else if (*w && !ours) {
      written_trace_ = trace_.path();
    }
  }
  if (PlansIterations(config_.plan) && runner_.AtBoundary(diverged, &trace_, RunnerContext()) &&
      trace_.ArmInMemory(1).ok()) {
    // Recorded in memory for the runner's next boundary.
    if (trace_.needs_chunks()) DeclareTraceChunks();
    StatusOr<bool> w = trace_.BeginIteration(TraceProbes(), TraceBudgets());
    if (!w.ok()) {
      TIERMEM_LOG(kWarn) << "plan: recording: " << w.status().message();
    }
  }
  runner_.BeginIteration();
}

PlanRunner::PlanContext Session::RunnerContext() const {
  PlanRunner::PlanContext ctx;
  ctx.engine = stack_->engine();
  ctx.activations = config_.activations;
  ctx.cuda = cuda();
  ctx.bar = DeclinesCostlierPlans(config_.plan);  // kAlways: the plan runs whatever its bytes
  ctx.compute_tier_holds_every_chunk = compute_tier_holds_every_chunk();
  return ctx;
}

Status Session::ExecutePlanFrom(const planners::Trace& trace, int64_t iteration) {
  TIERMEM_RETURN_IF_ERROR(Live());
  return runner_.ExecuteFrom(trace, iteration, RunnerContext());
}

Session::PlanStatus Session::plan_status() const {
  PlanStatus s;
  s.active = runner_.active();
  s.runner = runner_.stats();
  s.estimate = runner_.estimate();
  s.actions = runner_.actions();
  s.error = runner_.error();
  s.declined = runner_.declined();
  return s;
}

void Session::Moment(std::string_view label, planners::MomentKind kind, uint32_t unit) {
  if (closed()) return;
  stack_->engine()->Moment(label);
  if (trace_.recording()) trace_.Moment(label, kind, unit, TraceProbes());
  runner_.Moment(label, kind);
  // After the moment's planned actions: the speculative updates' acquires are this moment's.
  stepper_->AfterMoment(kind);
}

// ---- warm-up trace ------------------------------------------------------------------------------

Status Session::RecordTrace(const std::string& path, int iterations) {
  TIERMEM_RETURN_IF_ERROR(Live());
  TIERMEM_RETURN_IF_ERROR(trace_.Arm(path, iterations));
  trace_error_ = OkStatus();
  return OkStatus();
}

StatusOr<bool> Session::FinishTrace() {
  if (!trace_error_.ok()) {
    Status e = trace_error_;
    trace_error_ = OkStatus();
    return e;
  }
  if (closed() || !trace_.armed()) return false;
  StatusOr<bool> w = trace_.Finish(TraceProbes(), TraceBudgets());
  if (w.ok() && *w) written_trace_ = trace_.path();
  return w;
}

TraceRecorder::Probes Session::TraceProbes() const {
  TraceRecorder::Probes p;
  p.stall_ns = stack_->engine()->Stats().stall_ns;
  p.links = stack_->mover()->Links();
  return p;
}

planners::TraceBudgets Session::TraceBudgets() const {
  return {host_compute() ? 0 : config_.device_budget, config_.host_budget, config_.nvme_size};
}

void Session::DeclareTraceChunks() {
  planners::TraceBuilder& b = trace_.builder();
  chunks::Engine* eng = stack_->engine();
  b.SetSource("tiermem session (" + std::string(ModeName(device_kind())) + " device, " +
              std::to_string(specs_.size()) + " tensors)");
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    for (int k = 0; k < chunks::kNumChunkKinds; ++k) {
      const ChunkId c = groups_[gi].chunks[k];
      if (c == kNoChunk) continue;
      planners::TraceChunk tc;
      tc.bytes = eng->ChunkBytes(c);
      tc.category = chunks::ChunkKindCategory(static_cast<ChunkKind>(k));
      tc.group = static_cast<uint32_t>(gi);
      tc.kind = b.KindIndex(chunks::ChunkKindName(static_cast<ChunkKind>(k)));
      tc.home = eng->Home(c);
      // An expert acquired before the recording (the recording marks the ones it sees).
      if (c < expert_set_of_.size()) tc.expert_set = expert_set_of_[c];
      b.DeclareChunk(c, tc);
    }
  }
  trace_.ChunksDeclared();
}
void Session::Phase(std::string_view label) {
  if (closed()) return;
  phase_ = std::string(label);
  stack_->engine()->Phase(label);
}
void Session::RecordCollective(std::string_view op, Bytes bytes, uint64_t ns) {
  if (!closed()) stack_->engine()->RecordCollective(op, bytes, ns);
}
void Session::SetTracing(bool on) {
  if (closed()) return;
  tracing_ = on;
  stack_->engine()->SetTracing(on);
  runner_.SetPaused(!on);
  trace_.SetPaused(!on, trace_.recording() ? TraceProbes() : TraceRecorder::Probes{});
}

void Session::SetCyclic(bool on) {
  if (!closed()) stack_->engine()->SetCyclic(on);
}

void Session::SetComputeStream(ComputeStream stream) {
  stream_ = stream;
  if (!closed()) stack_->engine()->SetComputeStream(stream);
}

Status Session::SetExternalDeviceBytes(Bytes bytes) {
  TIERMEM_RETURN_IF_ERROR(Live());
  return stack_->engine()->SetExternalDeviceBytes(bytes);
}

Status Session::SetExternalComputeBytes(Bytes bytes) {
  TIERMEM_RETURN_IF_ERROR(Live());
  return stack_->engine()->SetExternalBytes(compute_tier(), bytes);
}

Status Session::SetExternalHostBytes(Bytes bytes) {
  TIERMEM_RETURN_IF_ERROR(Live());
  return stack_->engine()->SetExternalBytes(TierKind::kHost, bytes);
}

StatusOr<Region> Session::AllocateScratch(TierKind tier, Bytes bytes) {
  TIERMEM_RETURN_IF_ERROR(Live());
  return stack_->engine()->AllocateScratch(tier, bytes, Category::kOther);
}

Status Session::FreeScratch(TierKind tier, const Region& region) {
  TIERMEM_RETURN_IF_ERROR(Live());
  return stack_->engine()->FreeScratch(tier, region, Category::kOther);
}

StatusOr<Region> Session::AllocateSpill(Bytes bytes) {
  TIERMEM_RETURN_IF_ERROR(Live());
  if (stack_->nvme() == nullptr) {
    return FailedPreconditionError("session: no NVMe tier to spill " + std::to_string(bytes) +
                                   " bytes to (config 'nvme')");
  }
  return stack_->engine()->AllocateScratch(TierKind::kNvme, bytes, Category::kActivation);
}

Status Session::FreeSpill(const Region& spill) {
  TIERMEM_RETURN_IF_ERROR(Live());
  return stack_->engine()->FreeScratch(TierKind::kNvme, spill, Category::kActivation);
}

Status Session::SpillCopy(const Region& spill, Bytes spill_offset, const Region& host,
                          Bytes host_offset, Bytes bytes, bool to_nvme) {
  TIERMEM_ASSIGN_OR_RETURN(std::shared_ptr<Completion> c,
                           StartSpillCopy(spill, spill_offset, host, host_offset, bytes, to_nvme));
  return c->Wait();
}

StatusOr<std::shared_ptr<Completion>> Session::StartSpillCopy(const Region& spill,
                                                              Bytes spill_offset,
                                                              const Region& host, Bytes host_offset,
                                                              Bytes bytes, bool to_nvme) {
  TIERMEM_RETURN_IF_ERROR(Live());
  if (stack_->nvme() == nullptr) return FailedPreconditionError("session: no NVMe tier");
  if (bytes == 0) return Completion::Done(OkStatus());
  if (host_offset > host.bytes || bytes > host.bytes - host_offset) {
    return OutOfRangeError("session: spill copy of " + std::to_string(bytes) + " bytes at " +
                           std::to_string(host_offset) + " of a host region of " +
                           std::to_string(host.bytes));
  }
  const Endpoint h{stack_->host(), host, host_offset};
  const Endpoint n{stack_->nvme(), spill, spill_offset};
  MoveRequest req;
  req.src = to_nvme ? h : n;
  req.dst = to_nvme ? n : h;
  req.bytes = bytes;
  req.category = Category::kActivation;
  return stack_->mover()->Move(req);  // the NVMe tier checks the spill's bounds
}

Status Session::Synchronize() {
  TIERMEM_RETURN_IF_ERROR(Live());
  TIERMEM_RETURN_IF_ERROR(stepper_->RunAllPending(true));
  return stack_->engine()->Synchronize();
}

Status Session::Flush() {
  TIERMEM_RETURN_IF_ERROR(Live());
  TIERMEM_RETURN_IF_ERROR(stepper_->RunAllPending(true));
  return stack_->engine()->Flush();
}

StatusOr<chunks::EngineStats> Session::Stats() const {
  TIERMEM_RETURN_IF_ERROR(Live());
  return stack_->engine()->Stats();
}

StatusOr<Bytes> Session::RuntimeHostBytes() const {
  TIERMEM_RETURN_IF_ERROR(Live());
  return stack_->host_overhead() + shard_buf_.capacity() + gathered_.capacity();
}

StatusOr<prof::Report> Session::TimelineReport() {
  TIERMEM_RETURN_IF_ERROR(Live());
  return stack_->TimelineReport();
}

}  // namespace tiermem::session
