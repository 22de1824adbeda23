// Session (see session.h): layout, chunk access, values, gradients and the optimizer step.
//
// Layout invariants: trainable tensors are packed first, frozen ones after, into separate
// groups (a frozen group has no grad or optimizer chunks); within a group tensors keep the
// given order and never straddle chunks; every chunk of a group has chunk_elems_ elements of
// its kind's dtype. The device working set the chunk size is chosen for is
// kMinResidentChunks (compute + grad) chunks.
//
// Step invariants: hyper-parameters are validated before anything changes; a tensor's step
// count is incremented exactly when its AdamW update runs; an fp16 overflow changes nothing
// but the loss scale (and counts a skipped step); gradients are read only in the spans of
// tensors that have one.
#include "runtime/session.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "base/logging.h"
#include "runtime/device_kernels.h"
#include "runtime/tier_stack.h"

namespace tiermem::session {
namespace {

constexpr int kMinResidentChunks = 4;
constexpr Bytes kPage = 4096;
constexpr std::array<ChunkKind, 5> kCreationOrder = {
    ChunkKind::kParamLowp, ChunkKind::kParamFp32, ChunkKind::kGrad, ChunkKind::kExpAvg,
    ChunkKind::kExpAvgSq};

int K(ChunkKind k) { return static_cast<int>(k); }

Status CheckHyper(const GroupHyper& h, size_t g) {
  auto bad = [&](const std::string& what) {
    return InvalidArgumentError("optimizer param group " + std::to_string(g) + ": " + what);
  };
  if (!(h.lr >= 0) || !std::isfinite(h.lr)) return bad("lr must be >= 0, got " + std::to_string(h.lr));
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
  std::vector<size_t> trainable, frozen;
  uint64_t max_numel = 0;
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
    (t.trainable ? trainable : frozen).push_back(i);
    max_numel = std::max(max_numel, t.numel);
  }
  std::unique_ptr<Session> s(new Session());
  s->config_ = config;
  const bool mixed = config.precision != Precision::kFp32;
  const Bytes esize = mixed ? 2 : 4;
  // Device working set per element: the compute param and (when anything trains) its grad.
  const Bytes per_elem = esize + (trainable.empty() ? 0 : esize);
  std::vector<uint64_t> numels;
  for (const TensorSpec& t : tensors) numels.push_back(t.numel);
  s->min_device_budget_ = chunks::MinimumDeviceBudget(max_numel, per_elem, kMinResidentChunks);
  if (!config.chunk_size) {
    TIERMEM_ASSIGN_OR_RETURN(const chunks::ChunkSizeChoice choice,
                             chunks::ChooseChunkElems(numels, config.device_budget, per_elem,
                                                      kMinResidentChunks));
    s->chunk_elems_ = choice.chunk_elems;
  } else {
    s->chunk_elems_ = *config.chunk_size;
    const Bytes need = s->chunk_elems_ * per_elem * kMinResidentChunks;
    if (need > config.device_budget) {
      return ResourceExhaustedError(
          "device budget of " + std::to_string(config.device_budget) +
          " bytes is below the minimum of " + std::to_string(need) + " bytes for chunk_size=" +
          std::to_string(s->chunk_elems_));
    }
  }
  // Sharded: every rank holds an equal, aligned slice of every chunk (64 elements keep the
  // kernels' vectors and the host tier's classes aligned).
  s->sharding_ = sharding;
  if (sharding.world > 1) {
    const uint64_t unit = static_cast<uint64_t>(sharding.world) * 64;
    s->chunk_elems_ = (s->chunk_elems_ + unit - 1) / unit * unit;
  }
  s->shard_elems_ = s->chunk_elems_ / static_cast<uint64_t>(sharding.world);
  s->shard_begin_ = s->shard_elems_ * static_cast<uint64_t>(sharding.rank);
  // Pack trainable tensors, then frozen ones, into their own groups.
  s->tensors_.resize(tensors.size());
  for (const std::vector<size_t>* subset : {&trainable, &frozen}) {
    if (subset->empty()) continue;
    std::vector<uint64_t> sub;
    for (size_t i : *subset) sub.push_back(tensors[i].numel);
    auto layout = chunks::PackTensors(sub, s->chunk_elems_);
    if (!layout.ok()) {
      return layout.status().WithContext("chunk_size=" + std::to_string(s->chunk_elems_));
    }
    const size_t base = s->groups_.size();
    for (size_t g = 0; g < layout->num_groups(); ++g) {
      ChunkGroup grp;
      grp.trainable = subset == &trainable;
      grp.chunks.fill(kNoChunk);
      s->groups_.push_back(std::move(grp));
    }
    for (size_t k = 0; k < subset->size(); ++k) {
      const size_t i = (*subset)[k];
      const chunks::Placement& p = layout->placements[k];
      TensorPlace& tp = s->tensors_[i];
      tp.group = static_cast<uint32_t>(base + p.group);
      tp.offset = p.offset;
      tp.numel = tensors[i].numel;
      tp.trainable = tensors[i].trainable;
      tp.opt_group = tensors[i].opt_group;
      ChunkGroup& grp = s->groups_[tp.group];
      grp.tensors.push_back(static_cast<uint32_t>(i));
      grp.used_elems = std::max(grp.used_elems, p.offset + p.numel);
    }
  }
  for (const TensorSpec& t : tensors) {
    s->model_bytes_ += t.numel * (t.trainable ? esize * 2 + 8 : esize) + (mixed ? t.numel * 4 : 0);
  }
  s->specs_ = std::move(tensors);
  s->steps_.assign(s->specs_.size(), 0);
  s->has_grad_.assign(s->specs_.size(), 0);
  s->spec_.resize(s->groups_.size());
  s->spec_tried_.assign(s->groups_.size(), 0);
  s->grad_done_.assign(s->groups_.size(), kNotWritten);
  s->grad_done_prev_.assign(s->groups_.size(), kNotWritten);
  s->scaler_.scale =
      config.precision == Precision::kFp16 ? config.loss_scaling.initial_scale : 1.0;

  StackLayout sl;
  sl.chunk_bytes = s->shard_elems_ * 4;  // the largest (fp32) chunk of a group held here
  // Host room for caches of NVMe-homed chunks: every kind of one group at once (the optimizer
  // step holds them there); without trainable tensors (serving) one chunk, for value reads.
  sl.host_reserve = config.nvme_size == 0 ? 0
                    : (trainable.empty() ? 1 : 5) * AlignUp(sl.chunk_bytes, kPage);
  // State beyond the host budget with NVMe: homes fill the host budget, so map it all now,
  // registered with the NVMe tier (tier_stack.h).
  sl.host_prefault = config.nvme_size > 0 && s->model_bytes_ > config.host_budget
                         ? config.host_budget : 0;
  TIERMEM_ASSIGN_OR_RETURN(s->stack_, TierStack::Create(config, sl));
  s->device_kind_ = s->stack_->device_kind();
  s->timeline_path_ = s->stack_->timeline_path();
  engine::Engine* eng = s->stack_->engine();
  for (ChunkKind kind : kCreationOrder) {
    for (ChunkGroup& g : s->groups_) {
      const bool need = kind == ChunkKind::kParamLowp   ? mixed
                        : kind == ChunkKind::kParamFp32 ? true
                                                         : g.trainable;
      if (!need) continue;
      auto id = eng->AddChunk(s->shard_elems_ * kernels::DTypeSize(s->dtype(kind)),
                              chunks::ChunkKindCategory(kind));
      if (!id.ok()) return id.status();  // `s` is destroyed: every region freed
      g.chunks[K(kind)] = *id;
      s->total_chunk_bytes_ += eng->ChunkBytes(*id);
    }
  }
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
  runner_.Stop();  // before the engine goes
  DropSpeculations();
  stack_->Close();
}

bool Session::closed() const { return stack_ == nullptr || stack_->closed(); }

Status Session::Live() const {
  if (closed()) return FailedPreconditionError("tiermem session is closed");
  return OkStatus();
}

kernels::DType Session::compute_dtype() const {
  switch (config_.precision) {
    case Precision::kBf16: return kernels::DType::kBF16;
    case Precision::kFp16: return kernels::DType::kF16;
    case Precision::kFp32: break;
  }
  return kernels::DType::kF32;
}

kernels::DType Session::dtype(ChunkKind kind) const {
  return (kind == ChunkKind::kParamLowp || kind == ChunkKind::kGrad) ? compute_dtype()
                                                                      : kernels::DType::kF32;
}

std::string Session::nvme_engine() const { return stack_ ? stack_->nvme_engine() : ""; }
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

StatusOr<void*> Session::Acquire(size_t group, ChunkKind kind, TierKind where) {
  TIERMEM_RETURN_IF_ERROR(CheckKind(group, kind));
  TIERMEM_RETURN_IF_ERROR(RunPending(group, true));
  const ChunkId c = Chunk(group, kind);
  StatusOr<void*> p = stack_->engine()->Acquire(c, where);
  if (p.ok()) {
    trace_.Access(c, planners::AccessMode::kRead, where);
    runner_.Access(c, where);
  }
  return p;
}

StatusOr<void*> Session::AcquireForWrite(size_t group, ChunkKind kind, TierKind where,
                                         bool* must_zero) {
  TIERMEM_RETURN_IF_ERROR(CheckKind(group, kind));
  TIERMEM_RETURN_IF_ERROR(RunPending(group, true));
  DropSpeculation(group);  // about to be written
  const ChunkId c = Chunk(group, kind);
  // Lazily zero content is not needed from below (nothing has to be copied in): a write.
  const bool zero = stack_->engine()->ZeroContent(c);
  StatusOr<void*> p = stack_->engine()->AcquireForWrite(c, where, must_zero);
  if (p.ok()) {
    trace_.Access(c, zero ? planners::AccessMode::kWrite : planners::AccessMode::kReadWrite,
                  where);
    runner_.Access(c, where);
  }
  return p;
}

Status Session::Release(size_t group, ChunkKind kind, bool modified) {
  TIERMEM_RETURN_IF_ERROR(CheckKind(group, kind));
  const ChunkId c = Chunk(group, kind);
  if (modified) {
    trace_.MarkWritten(c);
    DropSpeculation(group);  // its inputs changed after it ran
    if (kind == ChunkKind::kGrad) grad_done_[group] = bwd_moments_;
  }
  return stack_->engine()->Release(c, modified);
}

Status Session::ZeroChunk(size_t group, ChunkKind kind) {
  TIERMEM_RETURN_IF_ERROR(CheckKind(group, kind));
  if (kind == ChunkKind::kGrad && group < pending_.size() && pending_[group].active) {
    pending_[group].zero_grad_after = true;  // the update reads these grads first
    return OkStatus();
  }
  TIERMEM_RETURN_IF_ERROR(RunPending(group, true));
  DropSpeculation(group);
  return stack_->engine()->Zero(Chunk(group, kind));
}

int Session::Pins(size_t group, ChunkKind kind) const {
  if (!CheckKind(group, kind).ok()) return 0;
  return stack_->engine()->Pins(Chunk(group, kind));
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
  TIERMEM_RETURN_IF_ERROR(RunPending(t.group, true));
  const size_t es = kernels::DTypeSize(dtype(kind));
  if (sharded()) {  // collective: the chunk from every rank's shard
    TIERMEM_ASSIGN_OR_RETURN(const char* full, GatherChunk(t.group, kind));
    std::memcpy(out, full + t.offset * es, t.numel * es);
    return OkStatus();
  }
  return stack_->engine()->ReadAt(Chunk(t.group, kind), t.offset * es, out, t.numel * es);
}

Status Session::WriteTensor(size_t tensor, ChunkKind kind, const void* values) {
  TIERMEM_RETURN_IF_ERROR(Live());
  if (tensor >= tensors_.size()) return OutOfRangeError("session: unknown tensor");
  const TensorPlace& t = tensors_[tensor];
  TIERMEM_RETURN_IF_ERROR(CheckKind(t.group, kind));
  TIERMEM_RETURN_IF_ERROR(RunPending(t.group, true));
  DropSpeculation(t.group);
  const size_t es = kernels::DTypeSize(dtype(kind));
  // This rank's part of the tensor (all of it when not sharded).
  const uint64_t lo = std::max(t.offset, shard_begin_);
  const uint64_t hi = std::min(t.offset + t.numel, shard_begin_ + shard_elems_);
  if (lo >= hi) return OkStatus();
  gathered_key_ = {SIZE_MAX, -1};  // a cached gather is stale now
  return stack_->engine()->WriteAt(Chunk(t.group, kind), (lo - shard_begin_) * es,
                                   static_cast<const char*>(values) + (lo - t.offset) * es,
                                   (hi - lo) * es);
}

StatusOr<const char*> Session::GatherChunk(size_t group, ChunkKind kind) {
  const std::pair<size_t, int> key{group, K(kind)};
  if (gather_cache_ && gathered_key_ == key) return gathered_.data();
  const size_t es = kernels::DTypeSize(dtype(kind));
  shard_buf_.resize(shard_elems_ * es);
  gathered_.resize(chunk_elems_ * es);
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
  if (tensor >= steps_.size()) return OutOfRangeError("session: unknown tensor");
  if (steps < 0) return InvalidArgumentError("session: negative step count");
  TIERMEM_RETURN_IF_ERROR(Live());
  // The pending update counted the old value.
  TIERMEM_RETURN_IF_ERROR(RunPending(tensors_[tensor].group, true));
  DropSpeculation(tensors_[tensor].group);
  steps_[tensor] = steps;
  return OkStatus();
}

// ---- gradients -------------------------------------------------------------------------------

std::vector<Session::Run> Session::GradRuns(const ChunkGroup& g, bool same_step,
                                            bool every_trainable) const {
  std::vector<Run> runs;
  for (uint32_t i : g.tensors) {
    if (every_trainable ? !tensors_[i].trainable : !has_grad_[i]) continue;
    const TensorPlace& t = tensors_[i];
    if (!runs.empty() && runs.back().hi == t.offset &&
        (!same_step || (runs.back().opt_group == t.opt_group && runs.back().step == steps_[i]))) {
      runs.back().hi = t.offset + t.numel;
    } else {
      runs.push_back(Run{t.offset, t.offset + t.numel, t.opt_group, steps_[i]});
    }
  }
  return runs;
}

std::vector<Session::Run> Session::LocalRuns(std::vector<Run> runs) const {
  if (!sharded()) return runs;
  std::vector<Run> out;
  const uint64_t b = shard_begin_, e = shard_begin_ + shard_elems_;
  for (Run r : runs) {
    const uint64_t lo = std::max(r.lo, b), hi = std::min(r.hi, e);
    if (lo >= hi) continue;
    r.lo = lo - b;
    r.hi = hi - b;
    out.push_back(r);
  }
  return out;
}

StatusOr<kernels::GradStats> Session::GradStats() {
  TIERMEM_RETURN_IF_ERROR(Live());
  kernels::GradStats total;
  const kernels::DType gd = dtype(ChunkKind::kGrad);
  const size_t es = kernels::DTypeSize(gd);
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    const ChunkGroup& g = groups_[gi];
    if (!g.trainable) continue;
    const std::vector<Run> runs = LocalRuns(GradRuns(g, false));
    if (runs.empty()) continue;
    const TierKind where = ReadTier(gi, ChunkKind::kGrad);
    TIERMEM_ASSIGN_OR_RETURN(void* base, Acquire(gi, ChunkKind::kGrad, where));
    std::vector<GradSpan> spans;
    for (const Run& r : runs) {
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
  TIERMEM_RETURN_IF_ERROR(RunAllPending(true));  // the last step's updates come first
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (tensors_[i].trainable && static_cast<size_t>(tensors_[i].opt_group) >= hyper.size()) {
      return InvalidArgumentError("optimizer step: tensor " + specs_[i].name + " is in param "
                                  "group " + std::to_string(tensors_[i].opt_group) + " but " +
                                  std::to_string(hyper.size()) + " groups were given");
    }
  }
  for (size_t g = 0; g < hyper.size(); ++g) TIERMEM_RETURN_IF_ERROR(CheckHyper(hyper[g], g));
  StepResult r;
  ++micro_;
  if (micro_ % static_cast<uint64_t>(config_.gradient_accumulation_steps) != 0) {
    DropSpeculations();  // more gradients come
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
      DropSpeculations();
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
  if (!opt_placed_) PlaceOptimizer();
  step_args_.hyper = hyper;
  step_args_.clip_coef = r.clip_coef;
  step_args_.inv_loss_scale = static_cast<float>(1.0 / scaler_.scale);
  const bool defer = config_.optimizer_overlap != "off";
  pending_.resize(groups_.size());
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    const ChunkGroup& g = groups_[gi];
    if (!g.trainable) continue;
    std::vector<uint32_t> stepped;
    for (uint32_t i : g.tensors) {
      if (has_grad_[i]) {
        ++steps_[i];
        stepped.push_back(i);
      }
    }
    if (stepped.empty()) continue;
    std::vector<Run> runs = LocalRuns(GradRuns(g, true));
    if (runs.empty()) continue;  // none of it in this rank's shard
    if (spec_[gi].active) {
      // Committed: the update is done (the step counts above are its). Dropped, or a commit
      // that could not be made: updated as without speculation, below.
      if (SpeculationHolds(gi, runs) && CommitSpeculation(gi).ok()) continue;
      DropSpeculation(gi);
    }
    uint64_t work = 0;
    for (const Run& run : LocalRuns(GradRuns(g, false))) work += run.hi - run.lo;
    if (defer && !GroupPinned(gi)) {
      Pending& p = pending_[gi];
      p.active = true;
      p.zero_grad_after = false;
      p.runs = std::move(runs);
      p.work = work;
      p.stepped = std::move(stepped);
      ++num_pending_;
      continue;
    }
    Status s = UpdateGroup(gi, runs, work, stepped);
    if (!s.ok()) {
      return s.WithContext("optimizer step of chunk group " + std::to_string(gi) + " of " +
                           std::to_string(groups_.size()) + " (groups before it were stepped)");
    }
  }
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

Status Session::UpdateGroup(size_t gi, const std::vector<Run>& runs, uint64_t work,
                            const std::vector<uint32_t>& stepped, bool quiet) {
  // Acquired in this order (compute params first), released in any order.
  std::vector<ChunkKind> kinds = {compute_kind(), ChunkKind::kGrad, ChunkKind::kExpAvg,
                                  ChunkKind::kExpAvgSq};
  if (mixed()) kinds.push_back(ChunkKind::kParamFp32);
  const TierKind where = OptimizerTier(gi);
  engine::Engine* eng = stack_->engine();
  if (!quiet) {
    // Named by group: a plan matches a deferred update by its label, whichever unit's
    // forward runs it.
    const std::string label = where == TierKind::kDevice ? "optimizer-substep:device:g"
                                                         : "optimizer-substep:host:g";
    Moment(label + std::to_string(gi), planners::MomentKind::kOptimizerStep);
    trace_.SetWorkElems(work, where == TierKind::kDevice);
  }
  std::array<char*, chunks::kNumChunkKinds> v{};
  size_t acquired = 0;
  Status s;
  for (; acquired < kinds.size(); ++acquired) {
    StatusOr<void*> p = quiet ? eng->Acquire(Chunk(gi, kinds[acquired]), where)
                              : Acquire(gi, kinds[acquired], where);
    if (!p.ok()) {
      s = p.status();
      break;
    }
    v[K(kinds[acquired])] = static_cast<char*>(*p);
  }
  for (const Run& run : s.ok() ? runs : std::vector<Run>{}) {
    // On the device: enqueued on the compute stream (the releases below record it). On the
    // host: the CPU kernel, now (host copies are the CPU's; nothing orders a stream there).
    s = RunAdam(v, run, step_args_.hyper[run.opt_group], step_args_.inv_loss_scale,
                step_args_.clip_coef, where == TierKind::kDevice);
    if (!s.ok()) break;
  }
  // All acquired: the kernel ran (on some runs at least): the chunks are modified. An
  // acquire that failed came before any kernel: nothing was.
  const bool ran = acquired == kinds.size();
  for (size_t k = 0; k < acquired; ++k) {
    const bool modified = ran && kinds[k] != ChunkKind::kGrad;
    Status rel = quiet ? eng->Release(Chunk(gi, kinds[k]), modified)
                       : Release(gi, kinds[k], modified);
    if (s.ok()) s = rel;
  }
  if (!s.ok() && !ran) {
    for (uint32_t i : stepped) --steps_[i];  // this group was not stepped
  }
  return s;
}

Status Session::RunAdam(const std::array<char*, chunks::kNumChunkKinds>& v, const Run& run,
                        const GroupHyper& h, float inv_loss_scale, float clip, bool device,
                        const std::array<char*, chunks::kNumChunkKinds>* in) {
  const kernels::DType gd = dtype(ChunkKind::kGrad);
  kernels::AdamConfig ac;
  ac.lr = static_cast<float>(h.lr);
  ac.beta1 = static_cast<float>(h.beta1);
  ac.beta2 = static_cast<float>(h.beta2);
  ac.eps = static_cast<float>(h.eps);
  ac.weight_decay = static_cast<float>(h.weight_decay);
  ac.step = run.step;
  ac.inv_loss_scale = inv_loss_scale;
  ac.clip_factor = clip;
  kernels::AdamSpans sp;
  sp.param = reinterpret_cast<float*>(v[K(ChunkKind::kParamFp32)]) + run.lo;
  sp.exp_avg = reinterpret_cast<float*>(v[K(ChunkKind::kExpAvg)]) + run.lo;
  sp.exp_avg_sq = reinterpret_cast<float*>(v[K(ChunkKind::kExpAvgSq)]) + run.lo;
  sp.grad = v[K(ChunkKind::kGrad)] + run.lo * kernels::DTypeSize(gd);
  sp.grad_dtype = gd;
  if (mixed()) {
    sp.param_out = v[K(ChunkKind::kParamLowp)] + run.lo * 2;
    sp.out_dtype = compute_dtype();
  }
  sp.n = run.hi - run.lo;
  if (in != nullptr) {
    sp.param_in = reinterpret_cast<const float*>((*in)[K(ChunkKind::kParamFp32)]) + run.lo;
    sp.exp_avg_in = reinterpret_cast<const float*>((*in)[K(ChunkKind::kExpAvg)]) + run.lo;
    sp.exp_avg_sq_in = reinterpret_cast<const float*>((*in)[K(ChunkKind::kExpAvgSq)]) + run.lo;
  }
  return DeviceAdamStep(cuda() && device, ac, sp, device ? stream_ : kHostStream);
}

bool Session::GroupPinned(size_t gi) const {
  for (ChunkId c : groups_[gi].chunks) {
    if (c != kNoChunk && stack_->engine()->Pins(c) > 0) return true;
  }
  return false;
}

Status Session::RunPending(size_t group, bool quiet) {
  if (group >= pending_.size() || !pending_[group].active) return OkStatus();
  Pending p = std::move(pending_[group]);
  pending_[group] = Pending();  // inactive before the update's own acquires come through here
  --num_pending_;
  const std::string phase = phase_;
  engine::Engine* eng = stack_->engine();
  Phase("optimizer");
  if (quiet && tracing_) eng->SetTracing(false);
  Status s = UpdateGroup(group, p.runs, p.work, p.stepped, quiet);
  if (quiet && tracing_) eng->SetTracing(true);
  if (s.ok() && p.zero_grad_after && Pins(group, ChunkKind::kGrad) == 0) {
    s = eng->Zero(Chunk(group, ChunkKind::kGrad));
  }
  if (!phase.empty()) Phase(phase);
  if (!s.ok()) {
    return s.WithContext("the optimizer update of chunk group " + std::to_string(group) +
                         ", deferred from the last step() (optimizer_overlap: " +
                         config_.optimizer_overlap + ")");
  }
  return OkStatus();
}

Status Session::RunAllPending(bool quiet) {
  for (size_t gi = 0; gi < pending_.size() && num_pending_ > 0; ++gi) {
    TIERMEM_RETURN_IF_ERROR(RunPending(gi, quiet));
  }
  return OkStatus();
}

// ---- speculative steps -------------------------------------------------------------------------

void Session::SpeculateReady() {
  if (!spec_hyper_set_ || !opt_placed_ || sharded() || !next_step_applies()) return;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    if (!groups_[gi].trainable || spec_tried_[gi] || spec_[gi].active) continue;
    // Complete as far as the last iteration shows, and written in this one.
    if (grad_done_prev_[gi] >= bwd_moments_ || grad_done_[gi] == kNotWritten) continue;
    spec_tried_[gi] = 1;
    if (OptimizerOnDevice(gi) || (gi < pending_.size() && pending_[gi].active) ||
        GroupPinned(gi)) {
      continue;
    }
    Status st = Speculate(gi);
    if (!st.ok()) {
      // The update itself will run in Step or after it, and report what it meets.
      TIERMEM_LOG(kDebug) << "speculative step of chunk group " << gi << ": " << st.message();
    }
  }
}

Status Session::Speculate(size_t gi) {
  const ChunkGroup& g = groups_[gi];
  Speculation sp;
  // Every trainable tensor stepped (the binding says which have a gradient only at step()),
  // step counts as Step will make them (one more each: the runs merge alike).
  sp.runs = GradRuns(g, true, true);
  for (Run& r : sp.runs) {
    if (static_cast<size_t>(r.opt_group) >= spec_hyper_.size()) return OkStatus();
    ++r.step;
  }
  if (sp.runs.empty()) return OkStatus();
  std::vector<ChunkKind> state = {compute_kind(), ChunkKind::kExpAvg, ChunkKind::kExpAvgSq};
  if (mixed()) state.push_back(ChunkKind::kParamFp32);
  Bytes need = 0;
  for (ChunkKind k : state) need += ChunkBytes(gi, k);
  engine::Engine* eng = stack_->engine();
  const TierStats hs = stack_->host()->Stats();
  const Bytes ext = eng->external_bytes(TierKind::kHost);
  const Bytes room = hs.capacity > hs.used + ext ? hs.capacity - hs.used - ext : 0;
  if (room < 2 * need) {
    ++spec_stats_.no_room;
    return OkStatus();
  }
  sp.hyper = spec_hyper_;
  sp.inv_loss_scale = static_cast<float>(1.0 / scaler_.scale);
  std::array<char*, chunks::kNumChunkKinds> in{}, out{};
  std::vector<ChunkKind> acquired;
  Status s;
  for (ChunkKind k : state) {
    StatusOr<Region> r = eng->AllocateScratch(TierKind::kHost, ChunkBytes(gi, k),
                                              Category::kOptimState);
    if (!r.ok()) {
      s = r.status();
      break;
    }
    sp.shadow[K(k)] = *r;
    out[K(k)] = static_cast<char*>(r->addr);
  }
  // The inputs on the host, traced (the next iteration's order prefetches them here).
  std::vector<ChunkKind> inputs = state;
  inputs.push_back(ChunkKind::kGrad);
  for (size_t i = 0; s.ok() && i < inputs.size(); ++i) {
    StatusOr<void*> p = Acquire(gi, inputs[i], TierKind::kHost);
    if (!p.ok()) {
      s = p.status();
      break;
    }
    acquired.push_back(inputs[i]);
    in[K(inputs[i])] = static_cast<char*>(*p);
  }
  if (s.ok()) {
    // The shadows become the homes at commit: the runs are written by the out-of-place
    // update, every other byte (tensors without grads, padding) is copied.
    std::vector<std::pair<uint64_t, uint64_t>> covered;
    for (const Run& run : sp.runs) covered.emplace_back(run.lo, run.hi);
    std::sort(covered.begin(), covered.end());
    for (ChunkKind k : state) {
      const Bytes es = kernels::DTypeSize(dtype(k));
      const uint64_t elems = ChunkBytes(gi, k) / es;
      uint64_t at = 0;
      for (const auto& [lo, hi] : covered) {
        if (lo > at) std::memcpy(out[K(k)] + at * es, in[K(k)] + at * es, (lo - at) * es);
        at = std::max(at, hi);
      }
      if (elems > at) std::memcpy(out[K(k)] + at * es, in[K(k)] + at * es, (elems - at) * es);
    }
    out[K(ChunkKind::kGrad)] = in[K(ChunkKind::kGrad)];  // read only
    for (const Run& run : sp.runs) {
      s = RunAdam(out, run, sp.hyper[run.opt_group], sp.inv_loss_scale, 1.0f, false, &in);
      if (!s.ok()) break;
    }
  }
  for (ChunkKind k : acquired) {
    Status rel = eng->Release(Chunk(gi, k), false);
    if (s.ok()) s = rel;
  }
  if (!s.ok()) {
    FreeShadows(sp);
    return s;
  }
  sp.active = true;
  spec_[gi] = std::move(sp);
  ++spec_stats_.speculated;
  return OkStatus();
}

bool Session::SpeculationHolds(size_t gi, const std::vector<Run>& runs) const {
  const Speculation& sp = spec_[gi];
  if (!sp.active || step_args_.clip_coef != 1.0f ||
      step_args_.inv_loss_scale != sp.inv_loss_scale || runs.size() != sp.runs.size()) {
    return false;
  }
  for (size_t i = 0; i < runs.size(); ++i) {
    const Run &a = runs[i], &b = sp.runs[i];
    if (a.lo != b.lo || a.hi != b.hi || a.opt_group != b.opt_group || a.step != b.step) {
      return false;
    }
    const GroupHyper &x = step_args_.hyper[a.opt_group], &y = sp.hyper[a.opt_group];
    if (x.lr != y.lr || x.beta1 != y.beta1 || x.beta2 != y.beta2 || x.eps != y.eps ||
        x.weight_decay != y.weight_decay) {
      return false;
    }
  }
  return true;
}

Status Session::CommitSpeculation(size_t gi) {
  Speculation& sp = spec_[gi];
  engine::Engine* eng = stack_->engine();
  for (int k = 0; k < chunks::kNumChunkKinds; ++k) {
    if (sp.shadow[k].bytes == 0) continue;
    Status s = eng->PrepareAdopt(Chunk(gi, static_cast<ChunkKind>(k)));
    if (!s.ok()) {
      DropSpeculation(gi);
      return s;
    }
  }
  // Prepared: every adoption installs its region (an error left is the old copies' free).
  for (int k = 0; k < chunks::kNumChunkKinds; ++k) {
    if (sp.shadow[k].bytes == 0) continue;
    Status a = eng->AdoptHostCopy(Chunk(gi, static_cast<ChunkKind>(k)), sp.shadow[k]);
    if (!a.ok()) {
      TIERMEM_LOG(kWarn) << "speculative step: committing: " << a.message();
    }
  }
  sp = Speculation{};
  ++spec_stats_.committed;
  return OkStatus();
}

void Session::FreeShadows(Speculation& sp) {
  for (Region& r : sp.shadow) {
    if (r.bytes == 0) continue;
    Status s = stack_->engine()->FreeScratch(TierKind::kHost, r, Category::kOptimState);
    if (!s.ok()) {
      TIERMEM_LOG(kWarn) << "speculative step: freeing its scratch: " << s.message();
    }
    r = Region{};
  }
}

void Session::DropSpeculation(size_t gi) {
  if (gi >= spec_.size() || !spec_[gi].active) return;
  FreeShadows(spec_[gi]);
  spec_[gi] = Speculation{};
  ++spec_stats_.dropped;
}

void Session::DropSpeculations() {
  for (size_t gi = 0; gi < spec_.size(); ++gi) DropSpeculation(gi);
}

Status Session::FinishStep(size_t group) {
  TIERMEM_RETURN_IF_ERROR(Live());
  if (group >= groups_.size()) {
    return OutOfRangeError("session: unknown chunk group " + std::to_string(group));
  }
  return RunPending(group, false);
}

Status Session::FinishSteps() {
  TIERMEM_RETURN_IF_ERROR(Live());
  return RunAllPending(true);
}

TierKind Session::OptimizerTier(size_t g) const {
  return OptimizerOnDevice(g) ? TierKind::kDevice : TierKind::kHost;
}

void Session::PlaceOptimizer() {
  // Device-placed optimizer state stays cached on the device between steps only if the
  // forward and backward never need its room: so it gets only what the whole training working
  // set leaves — every group's compute and grad chunks (all cached at once, as they are when
  // nothing has to move) and the most activation/KV bytes the device held so far. Without
  // that room a group steps on the host, where moving its param and grad (2 x compute dtype
  // bytes per element) costs less than moving m and v up and back (16 bytes). Groups are
  // taken in order while room is left.
  opt_placed_ = true;
  opt_device_.assign(groups_.size(), 0);
  if (config_.optimizer_placement == "host") return;
  engine::Engine* eng = stack_->engine();
  // (Sharded: the gathered full chunks the binding held as scratch count too.)
  const engine::EngineStats est = eng->Stats();
  Bytes working = est.external_peak[static_cast<int>(TierKind::kDevice)] +
                  est.scratch_peak[static_cast<int>(TierKind::kDevice)];
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    working += ChunkBytes(gi, compute_kind());
    if (groups_[gi].trainable) working += ChunkBytes(gi, ChunkKind::kGrad);
  }
  const Bytes capacity = stack_->device()->Stats().capacity;
  Bytes left = capacity > working ? capacity - working : 0;
  size_t placed = 0;
  for (size_t gi = 0; gi < groups_.size(); ++gi) {
    if (!groups_[gi].trainable) continue;
    Bytes need = ChunkBytes(gi, ChunkKind::kExpAvg) + ChunkBytes(gi, ChunkKind::kExpAvgSq);
    if (mixed()) need += ChunkBytes(gi, ChunkKind::kParamFp32);
    if (need > left) break;
    left -= need;
    opt_device_[gi] = 1;
    ++placed;
  }
  TIERMEM_LOG(kInfo) << "optimizer: " << placed << " chunk group(s) step on the device ("
                     << device_kind_ << "), the others on the host";
}

TierKind Session::ReadTier(size_t g, ChunkKind kind) const {
  // Where a reduction over a chunk (GradStats) reads it without moving it: in place on the
  // device when it is there (a CUDA kernel on CUDA, the CPU on SimDevice), else on the host.
  return Resident(g, kind) == TierKind::kDevice ? TierKind::kDevice : TierKind::kHost;
}

// ---- iterations and stats -----------------------------------------------------------------------

void Session::BeginIteration() {
  if (closed()) return;
  DropSpeculations();  // a backward whose step never came
  grad_done_prev_.swap(grad_done_);
  std::fill(grad_done_.begin(), grad_done_.end(), kNotWritten);
  std::fill(spec_tried_.begin(), spec_tried_.end(), 0);
  bwd_moments_ = 0;
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
  if (config_.plan == "auto") PlanAtBoundary(diverged);
  runner_.BeginIteration();
}

void Session::PlanAtBoundary(bool diverged) {
  ++train_iterations_;
  if (diverged && !warned_divergence_) {
    warned_divergence_ = true;
    TIERMEM_LOG(kWarn) << "plan: training iteration " << train_iterations_ - 1
                       << " left the plan (" << runner_.stats().last_divergence
                       << "); it ran on the reactive policy from there (same values). The "
                          "next iteration is recorded and planned again if it diverges too. "
                          "(Warned once.)";
  }
  if (!plan_error_.empty()) return;
  std::optional<planners::Trace> t = trace_.TakeTrace();
  if (t && (!runner_.active() || diverged)) {
    Status s = ExecutePlanFrom(*t);
    if (!s.ok()) {
      plan_error_ = s.message();
      runner_.Stop();
      TIERMEM_LOG(kWarn) << "plan: no plan (" << plan_error_ << "); the engine stays reactive";
    }
    return;
  }
  if (trace_.armed()) return;
  // Nothing moves when every chunk fits on the device: nothing to plan.
  // (Counted activations can still push chunks out.)
  if (config_.activations == "outside" && stack_->device()->Stats().capacity >= total_chunk_bytes_)
    return;
  // The first iteration is cold (lazily zero chunks, first moves): record the second.
  if (!diverged && (runner_.active() || train_iterations_ != 2)) return;
  if (!trace_.ArmInMemory(1).ok()) return;
  if (trace_.needs_chunks()) DeclareTraceChunks();
  StatusOr<bool> w = trace_.BeginIteration(TraceProbes(), TraceBudgets());
  if (!w.ok()) {
    TIERMEM_LOG(kWarn) << "plan: recording: " << w.status().message();
  }
}

Status Session::ExecutePlanFrom(const planners::Trace& trace, int64_t iteration) {
  TIERMEM_RETURN_IF_ERROR(Live());
  engine::Engine* eng = stack_->engine();
  if (trace.chunks.size() != eng->num_chunks()) {
    return InvalidArgumentError("plan: the trace has " + std::to_string(trace.chunks.size()) +
                                " chunks, this model " + std::to_string(eng->num_chunks()));
  }
  if (trace.iterations.empty()) return InvalidArgumentError("plan: the trace has no iteration");
  const int64_t last = static_cast<int64_t>(trace.iterations.size()) - 1;
  if (iteration < 0) iteration = last;
  if (iteration > last) {
    return InvalidArgumentError("plan: the trace has no iteration " + std::to_string(iteration));
  }
  planners::Trace t = trace;
  const bool counted = config_.activations != "outside";
  if (!counted) {
    // Activations and temporaries are not in the engine's device budget (on SimDevice they
    // live in CPU memory; on CUDA in torch's allocator): the chunks get the whole budget.
    for (planners::TraceIteration& it : t.iterations) {
      for (planners::Moment& m : it.moments) m.activation_bytes = m.saved_bytes = 0;
    }
  }
  std::vector<TierKind> homes(eng->num_chunks());
  planners::StartState start;
  start.cache.assign(eng->num_chunks(), TierKind::kNone);
  start.dirty.assign(eng->num_chunks(), false);
  for (ChunkId c = 0; c < eng->num_chunks(); ++c) {
    homes[c] = eng->Home(c);
    t.chunks[c].home = homes[c];
    if (t.chunks[c].bytes != eng->ChunkBytes(c)) {
      return InvalidArgumentError("plan: trace chunk " + std::to_string(c) + " has " +
                                  std::to_string(t.chunks[c].bytes) + " bytes, this model's " +
                                  std::to_string(eng->ChunkBytes(c)));
    }
    const TierKind r = eng->Resident(c);
    if (r != homes[c]) {
      start.cache[c] = r;
      start.dirty[c] = eng->Dirty(c);
    }
  }
  planners::MachineModel m = planners::MachineModel::FromTrace(t);
  const engine::EngineStats st = eng->Stats();
  for (int k = 0; k < kNumTierKinds; ++k) m.budget[k] = st.tiers[k].capacity;
  // Counted activations are in the trace already; other external bytes (a KV cache) are not.
  const Bytes ext = counted ? 0 : eng->external_device_bytes();
  Bytes& dev = m.budget[static_cast<int>(TierKind::kDevice)];
  dev = dev > ext ? dev - ext : 0;
  // Links the recorded iteration did not use: the reverse direction's rate, else a
  // conservative default (they matter only for moves the recording never needed).
  m.FillMissingLinks();
  planners::PlanOptions o;
  o.iteration = static_cast<uint32_t>(iteration);
  o.start = &start;
  o.homes = &homes;
  o.place_optimizer = false;    // the session steps where OptimizerTier says
  // Updates run where the trace has them (after the backward, or deferred into the next
  // forward): the runtime does not overlap them with the backward.
  o.overlap_optimizer = false;
  // "offload": the binding offloads whole units' activations to the host as the plan says;
  // "auto": it also recomputes the units the plan recomputes. Otherwise they stay where the
  // binding keeps them ("recompute": every unit recomputes, whatever a plan would choose).
  o.activation_policy = config_.activations == "offload" || config_.activations == "auto";
  o.allow_recompute = config_.activations == "auto";
  if (iteration > 0) o.earlier_iteration = iteration - 1;
  // SimDevice's copies are memcpys on the same CPU cores as the compute, which the machine
  // model (copy lanes concurrent with compute) does not see: fewest bytes is the right goal
  // there. On CUDA the copy engines run beside the kernels: least modelled time.
  o.objective = cuda() ? planners::PlanObjective::kTime : planners::PlanObjective::kBytes;
  TIERMEM_ASSIGN_OR_RETURN(planners::Plan p, planners::MakePlan(t, m, o));
  plan_estimate_ = p.estimate;
  plan_actions_ = static_cast<uint32_t>(p.actions.size());
  TIERMEM_LOG(kInfo) << "plan: " << p.actions.size() << " actions over " << p.moments.size()
                     << " moments; modelled iteration "
                     << p.estimate.steady_iteration_ns / 1e6 << " ms, stall "
                     << p.estimate.steady_stall_ns / 1e6 << " ms";
  runner_.Start(std::move(p), eng);
  return OkStatus();
}

Session::PlanStatus Session::plan_status() const {
  PlanStatus s;
  s.active = runner_.active();
  s.runner = runner_.stats();
  s.estimate = plan_estimate_;
  s.actions = plan_actions_;
  s.error = plan_error_;
  return s;
}

void Session::Moment(std::string_view label, planners::MomentKind kind, uint32_t unit) {
  if (closed()) return;
  const bool backward = kind == planners::MomentKind::kPreBackward;
  if (backward) ++bwd_moments_;
  stack_->engine()->Moment(label);
  if (trace_.recording()) trace_.Moment(label, kind, unit, TraceProbes());
  runner_.Moment(label, kind);
  // After the moment's planned actions: the speculative updates' acquires are this moment's.
  if (backward && config_.optimizer_overlap == "backward") SpeculateReady();
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
  return {config_.device_budget, config_.host_budget, config_.nvme_size};
}

void Session::DeclareTraceChunks() {
  planners::TraceBuilder& b = trace_.builder();
  engine::Engine* eng = stack_->engine();
  b.SetSource("tiermem session (" + device_kind_ + " device, " +
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
                                                              const Region& host,
                                                              Bytes host_offset, Bytes bytes,
                                                              bool to_nvme) {
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
  TIERMEM_RETURN_IF_ERROR(RunAllPending(true));
  return stack_->engine()->Synchronize();
}

Status Session::Flush() {
  TIERMEM_RETURN_IF_ERROR(Live());
  TIERMEM_RETURN_IF_ERROR(RunAllPending(true));
  return stack_->engine()->Flush();
}

StatusOr<engine::EngineStats> Session::Stats() const {
  TIERMEM_RETURN_IF_ERROR(Live());
  return stack_->engine()->Stats();
}

StatusOr<prof::Report> Session::TimelineReport() {
  TIERMEM_RETURN_IF_ERROR(Live());
  return stack_->TimelineReport();
}

}  // namespace tiermem::session
