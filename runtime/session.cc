// Session (see session.h): creation, and the bodies the session calls itself as well as its
// facets (session_facets.h, "Where a member's body lives"): chunk access, values, gradients
// and the optimizer step's decision (its application: optimizer_stepper.cc; planning:
// plan_runner.cc). The bodies only a facet calls are in session_facets.cc.
//
// Create is four steps: Validate (the device kind resolved, the modes it refuses), LayOut
// (layout.h: the pure layout and its invariants), HostRoomFor (layout.h: the host room of the
// tier stack) and Build (the tier stack, the stepper and the chunks, in creation order).
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

#include "base/logging.h"
#include "runtime/device_kernels.h"
#include "runtime/tier_stack.h"

namespace tiermem::session {
namespace {

constexpr std::array<ChunkKind, 5> kCreationOrder = {ChunkKind::kParamLowp, ChunkKind::kParamFp32,
                                                     ChunkKind::kGrad, ChunkKind::kExpAvg,
                                                     ChunkKind::kExpAvgSq};

int K(ChunkKind k) { return static_cast<int>(k); }

bool IsStateKind(ChunkKind k) { return k == ChunkKind::kExpAvg || k == ChunkKind::kExpAvgSq; }

// Bytes per element of a state format's codes (before int8's absmax).
size_t CodeSize(const kernels::StateFormat& f) {
  return f.dtype == kernels::StateDType::kInt8 ? 1 : f.dtype == kernels::StateDType::kBF16 ? 2 : 4;
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

// The session's parts the stepper calls: traced acquires and releases (Acquire runs the
// group's pending update first; the stepper marks its own inactive before it runs), moments
// and phases, and the facts of the step decision.
class Session::StepperSite final : public StepperOwner {
 public:
  explicit StepperSite(Session* s) : s_(s) {}
  StatusOr<void*> Acquire(size_t group, ChunkKind kind, TierKind where) override {
    return s_->Acquire(group, kind, where);
  }
  Status Release(size_t group, ChunkKind kind, bool modified) override {
    return s_->Release(group, kind, modified);
  }
  void Moment(std::string_view label, planners::MomentKind kind) override {
    s_->Moment(label, kind);
  }
  void Phase(RunPhase phase) override { s_->Phase(phase); }
  RunPhase phase() const override { return s_->phase_; }
  bool tracing() const override { return s_->tracing_; }
  ComputeStream compute_stream() const override { return s_->stream_; }
  bool has_grad(size_t tensor) const override { return s_->has_grad(tensor); }
  double loss_scale() const override { return s_->loss_scale(); }
  bool next_step_applies() const override { return s_->next_step_applies(); }

 private:
  Session* const s_;  // owns this site
};

StatusOr<std::unique_ptr<Session>> Session::Create(const SessionConfig& config,
                                                   std::vector<TensorSpec> tensors,
                                                   Sharding sharding) {
  TIERMEM_ASSIGN_OR_RETURN(const SessionConfig resolved, Validate(config));
  TIERMEM_ASSIGN_OR_RETURN(Layout layout, LayOut(resolved, std::move(tensors), sharding));
  const StackLayout sized = HostRoomFor(layout, resolved);
  std::unique_ptr<Session> s(new Session());
  s->config_ = resolved;
  s->sharding_ = sharding;
  s->layout_ = std::move(layout);
  s->has_grad_.assign(s->layout_.specs.size(), 0);
  s->scaler_.scale = config.precision == Precision::kFp16 ? config.loss_scaling.initial_scale : 1.0;
  TIERMEM_RETURN_IF_ERROR(s->Build(sized));  // on failure `s` is destroyed: every region freed
  return s;
}

StatusOr<SessionConfig> Session::Validate(const SessionConfig& config) {
  SessionConfig resolved = config;
  TIERMEM_ASSIGN_OR_RETURN(resolved.device_kind, TierStack::ResolveDeviceKind(config.device_kind));
  const bool host = IsHostCompute(resolved.device_kind);
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
  return resolved;
}

Status Session::Build(const HostRoom& sized) {
  // Host mode with split tensors: their compute copies count in the host budget, outside the
  // host tier (HostRoom::compute_room, host_floor.h). The stack builds the device kind
  // resolved by Validate (config_'s).
  SessionConfig tier_config = config_;
  tier_config.host_budget -= sized.compute_room;
  TIERMEM_ASSIGN_OR_RETURN(stack_, TierStack::Create(tier_config, sized));
  stepper_site_ = std::make_unique<StepperSite>(this);
  stepper_ = std::make_unique<OptimizerStepper>(layout_, config_, stepper_site_.get(), stack_.get(),
                                                &trace_);
  timeline_path_ = stack_->timeline_path();
  chunks::Engine* eng = stack_->engine();
  // Chunks in creation order (homes go to the host while it has room): kCreationOrder, group
  // by group; a served MoE creates every dense chunk before its experts'.
  const bool dense_first = layout_.dense_first();
  for (int pass = 0; pass < (dense_first ? 2 : 1); ++pass) {
    for (ChunkKind kind : kCreationOrder) {
      for (size_t gi = 0; gi < layout_.groups.size(); ++gi) {
        if (dense_first && layout_.expert_group[gi] != pass) continue;
        if (!layout_.NeedsKind(gi, kind)) continue;
        auto id = AddChunk(gi, kind);
        if (!id.ok()) return id.status();
        layout_.groups[gi].chunks[K(kind)] = *id;
        if (IsStateKind(kind)) {
          state_bytes_ += eng->ChunkBytes(*id);
          state_bytes_fp32_ += layout_.shard_elems * 4;
        }
      }
    }
  }
  placement_ = PlaceOn(layout_, config_, EveryHomeOnHost());
  return OkStatus();
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

bool Session::EveryHomeOnHost() const {
  for (size_t g = 0; g < layout_.groups.size(); ++g) {
    for (int k = 0; k < chunks::kNumChunkKinds; ++k) {
      const ChunkKind kind = static_cast<ChunkKind>(k);
      if (layout_.has_kind(g, kind) && Home(g, kind) != TierKind::kHost) return false;
    }
  }
  return true;
}

std::string Session::io_backend() const { return stack_ ? stack_->io_backend() : ""; }
Bytes Session::nvme_registered_bytes() const {
  return stack_ ? stack_->nvme_registered_bytes() : 0;
}

ChunkId Session::Chunk(size_t group, ChunkKind kind) const {
  return layout_.groups[group].chunks[K(kind)];
}

Status Session::CheckKind(size_t group, ChunkKind kind) const {
  TIERMEM_RETURN_IF_ERROR(Live());
  if (group >= layout_.groups.size()) {
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

TierKind Session::Resident(size_t group, ChunkKind kind) const {
  if (!CheckKind(group, kind).ok()) return TierKind::kNone;
  return stack_->engine()->Resident(Chunk(group, kind));
}

TierKind Session::Home(size_t group, ChunkKind kind) const {
  if (!CheckKind(group, kind).ok()) return TierKind::kNone;
  return stack_->engine()->Home(Chunk(group, kind));
}

// ---- values --------------------------------------------------------------------------------

// Values move through ReadAt/WriteAt: from/into whichever copy the chunk is resident in, without
// moving it (so also while a binding has it pinned on the device for compute).
Status Session::ReadTensor(size_t tensor, ChunkKind kind, void* out) {
  TIERMEM_RETURN_IF_ERROR(Live());
  if (tensor >= layout_.tensors.size()) return OutOfRangeError("session: unknown tensor");
  const TensorPlace& t = layout_.tensors[tensor];
  if (kind == ChunkKind::kParamFp32 && ComputeOnly(tensor)) {
    return ReadUpcast(tensor, 0, t.numel, static_cast<float*>(out));
  }
  TIERMEM_RETURN_IF_ERROR(CheckKind(t.group, kind));
  TIERMEM_RETURN_IF_ERROR(stepper_->RunPending(t.group, true));
  const kernels::StateFormat& f = layout_.groups[t.group].state;
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
  if (kind == ChunkKind::kParamFp32 && ComputeOnly(tensor)) {
    return ReadUpcast(tensor, begin, n, static_cast<float*>(out));
  }
  TIERMEM_RETURN_IF_ERROR(CheckRange(tensor, kind, begin, n));
  const size_t es = kernels::DTypeSize(layout_.dtype(kind));
  for (const Piece& p : layout_.tensors[tensor].pieces) {
    const uint64_t lo = std::max(p.begin, begin), hi = std::min(p.begin + p.numel, begin + n);
    if (lo >= hi) continue;
    TIERMEM_RETURN_IF_ERROR(CheckKind(p.group, kind));
    TIERMEM_RETURN_IF_ERROR(stepper_->RunPending(p.group, true));
    char* dst = static_cast<char*>(out) + (lo - begin) * es;
    const uint64_t at = p.offset + (lo - p.begin);  // in the chunk
    if (layout_.sharded()) {                        // collective: the chunk from every rank's shard
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
  if (tensor >= layout_.tensors.size()) return OutOfRangeError("session: unknown tensor");
  const TensorPlace& t = layout_.tensors[tensor];
  TIERMEM_RETURN_IF_ERROR(CheckKind(t.group, kind));
  if (begin > t.numel || n > t.numel - begin) {
    return OutOfRangeError("session: elements [" + std::to_string(begin) + ", " +
                           std::to_string(begin + n) + ") are outside tensor '" +
                           layout_.specs[tensor].name + "' (" + std::to_string(t.numel) + ")");
  }
  if (IsStateKind(kind) && layout_.groups[t.group].state.compressed()) {
    return InvalidArgumentError(
        "session: a range of compressed optimizer state (use "
        "ReadTensor / WriteTensor)");
  }
  return OkStatus();
}

Status Session::WriteTensor(size_t tensor, ChunkKind kind, const void* values) {
  TIERMEM_RETURN_IF_ERROR(Live());
  if (tensor >= layout_.tensors.size()) return OutOfRangeError("session: unknown tensor");
  const TensorPlace& t = layout_.tensors[tensor];
  if (kind == ChunkKind::kParamFp32 && ComputeOnly(tensor)) {
    return WriteExact(tensor, 0, t.numel, static_cast<const float*>(values));
  }
  TIERMEM_RETURN_IF_ERROR(CheckKind(t.group, kind));
  TIERMEM_RETURN_IF_ERROR(stepper_->RunPending(t.group, true));
  stepper_->DropSpeculation(t.group);
  const kernels::StateFormat& f = layout_.groups[t.group].state;
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
  if (kind == ChunkKind::kParamFp32 && ComputeOnly(tensor)) {
    return WriteExact(tensor, begin, n, static_cast<const float*>(values));
  }
  TIERMEM_RETURN_IF_ERROR(CheckRange(tensor, kind, begin, n));
  const size_t es = kernels::DTypeSize(layout_.dtype(kind));
  for (const Piece& p : layout_.tensors[tensor].pieces) {
    const uint64_t tlo = std::max(p.begin, begin), thi = std::min(p.begin + p.numel, begin + n);
    if (tlo >= thi) continue;
    TIERMEM_RETURN_IF_ERROR(CheckKind(p.group, kind));
    TIERMEM_RETURN_IF_ERROR(stepper_->RunPending(p.group, true));
    stepper_->DropSpeculation(p.group);
    // This rank's part of the elements, in chunk coordinates (all of them when not sharded).
    const uint64_t lo = std::max(p.offset + (tlo - p.begin), layout_.shard_begin);
    const uint64_t hi =
        std::min(p.offset + (thi - p.begin), layout_.shard_begin + layout_.shard_elems);
    if (lo >= hi) continue;
    gathered_key_ = {SIZE_MAX, -1};  // a cached gather is stale now
    TIERMEM_RETURN_IF_ERROR(stack_->engine()->WriteAt(
        Chunk(p.group, kind), (lo - layout_.shard_begin) * es,
        static_cast<const char*>(values) + (p.begin + lo - p.offset - begin) * es, (hi - lo) * es));
  }
  return OkStatus();
}

bool Session::ComputeOnly(size_t tensor) const {
  return tensor < layout_.tensors.size() &&
         layout_.groups[layout_.tensors[tensor].group].compute_only;
}

Status Session::ReadUpcast(size_t tensor, uint64_t begin, uint64_t n, float* out) {
  std::vector<uint16_t> low(n);
  TIERMEM_RETURN_IF_ERROR(ReadTensorRange(tensor, ChunkKind::kParamLowp, begin, n, low.data()));
  kernels::CastToF32(low.data(), layout_.compute_dtype(), out, n);
  return OkStatus();
}

Status Session::CheckExact(size_t tensor, uint64_t begin, uint64_t n, const float* values) const {
  const kernels::DType cd = layout_.compute_dtype();
  constexpr uint64_t kBlock = 1 << 16;
  std::vector<uint16_t> low(std::min(n, kBlock));
  std::vector<float> back(low.size());
  for (uint64_t at = 0; at < n; at += kBlock) {
    const uint64_t m = std::min(n - at, kBlock);
    kernels::CastFromF32(values + at, low.data(), cd, m);
    kernels::CastToF32(low.data(), cd, back.data(), m);
    if (std::memcmp(back.data(), values + at, m * sizeof(float)) == 0) continue;
    uint64_t i = 0;
    while (std::memcmp(&back[i], values + at + i, sizeof(float)) == 0) ++i;
    const std::string dt(kernels::DTypeName(cd));
    return InvalidArgumentError(
        "session: tensor '" + layout_.specs[tensor].name + "' keeps its values in " + dt +
        " only (frozen, its values exact in the compute dtype: no fp32 master), and element " +
        std::to_string(begin + at + i) + " of the value written, " +
        std::to_string(values[at + i]) + ", is not exact in " + dt +
        ": nothing was written (write values the compute dtype holds, or create the session "
        "without values_in_compute_dtype for it)");
  }
  return OkStatus();
}

Status Session::WriteExact(size_t tensor, uint64_t begin, uint64_t n, const float* values) {
  TIERMEM_RETURN_IF_ERROR(CheckRange(tensor, ChunkKind::kParamLowp, begin, n));
  // Every element checked before anything is written: a refused write changes nothing.
  TIERMEM_RETURN_IF_ERROR(CheckExact(tensor, begin, n, values));
  std::vector<uint16_t> low(n);
  kernels::CastFromF32(values, low.data(), layout_.compute_dtype(), n);
  return WriteTensorRange(tensor, ChunkKind::kParamLowp, begin, n, low.data());
}

Status Session::ReadStateRaw(size_t tensor, ChunkKind kind, void* codes, float* absmax) {
  TIERMEM_RETURN_IF_ERROR(Live());
  if (tensor >= layout_.tensors.size()) return OutOfRangeError("session: unknown tensor");
  if (!IsStateKind(kind))
    return InvalidArgumentError("session: raw state is exp_avg or exp_avg_sq");
  TIERMEM_RETURN_IF_ERROR(CheckKind(layout_.tensors[tensor].group, kind));
  TIERMEM_RETURN_IF_ERROR(stepper_->RunPending(layout_.tensors[tensor].group, true));
  return StateRaw(tensor, kind, codes, absmax, false);
}

Status Session::WriteStateRaw(size_t tensor, ChunkKind kind, const void* codes,
                              const float* absmax) {
  TIERMEM_RETURN_IF_ERROR(Live());
  if (tensor >= layout_.tensors.size()) return OutOfRangeError("session: unknown tensor");
  if (!IsStateKind(kind))
    return InvalidArgumentError("session: raw state is exp_avg or exp_avg_sq");
  TIERMEM_RETURN_IF_ERROR(CheckKind(layout_.tensors[tensor].group, kind));
  TIERMEM_RETURN_IF_ERROR(stepper_->RunPending(layout_.tensors[tensor].group, true));
  stepper_->DropSpeculation(layout_.tensors[tensor].group);
  return StateRaw(tensor, kind, const_cast<void*>(codes), const_cast<float*>(absmax), true);
}

// A chunk of m or v is the codes of its layout_.shard_elems elements, then (int8) one absmax per
// block; a tensor's blocks start at its first element (aligned to the block). Sharded, the
// gathered chunk is every rank's shard chunk back to back.
Status Session::StateRaw(size_t tensor, ChunkKind kind, void* codes_v, float* absmax, bool write) {
  const TensorPlace& t = layout_.tensors[tensor];
  const kernels::StateFormat& f = layout_.groups[t.group].state;
  const size_t es = CodeSize(f);
  const bool int8 = f.dtype == kernels::StateDType::kInt8;
  const Bytes absmax_at = layout_.shard_elems * es;  // in each shard's chunk
  char* codes = static_cast<char*>(codes_v);
  chunks::Engine* eng = stack_->engine();
  const ChunkId c = Chunk(t.group, kind);
  if (write) {  // this rank's part (block-aligned: shards hold whole blocks)
    const uint64_t lo = std::max(t.offset, layout_.shard_begin);
    const uint64_t hi = std::min(t.offset + t.numel, layout_.shard_begin + layout_.shard_elems);
    if (lo >= hi) return OkStatus();
    gathered_key_ = {SIZE_MAX, -1};
    TIERMEM_RETURN_IF_ERROR(eng->WriteAt(c, (lo - layout_.shard_begin) * es,
                                         codes + (lo - t.offset) * es, (hi - lo) * es));
    if (!int8) return OkStatus();
    return eng->WriteAt(c, absmax_at + (lo - layout_.shard_begin) / f.block * 4,
                        absmax + (lo - t.offset) / f.block, (hi - lo + f.block - 1) / f.block * 4);
  }
  if (!layout_.sharded()) {
    TIERMEM_RETURN_IF_ERROR(eng->ReadAt(c, t.offset * es, codes, t.numel * es));
    if (!int8) return OkStatus();
    return eng->ReadAt(c, absmax_at + t.offset / f.block * 4, absmax,
                       kernels::StateBlocks(f, t.numel) * 4);
  }
  TIERMEM_ASSIGN_OR_RETURN(const char* full, GatherChunk(t.group, kind));
  const Bytes stride = eng->ChunkBytes(c);
  for (uint64_t r = t.offset / layout_.shard_elems; r * layout_.shard_elems < t.offset + t.numel;
       ++r) {
    const uint64_t lo = std::max(t.offset, r * layout_.shard_elems);
    const uint64_t hi = std::min(t.offset + t.numel, (r + 1) * layout_.shard_elems);
    const char* shard = full + r * stride;
    std::memcpy(codes + (lo - t.offset) * es, shard + (lo - r * layout_.shard_elems) * es,
                (hi - lo) * es);
    if (int8) {
      std::memcpy(absmax + (lo - t.offset) / f.block,
                  shard + absmax_at + (lo - r * layout_.shard_elems) / f.block * 4,
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

Status Session::WriteParam(size_t tensor, const float* values) {
  TIERMEM_RETURN_IF_ERROR(WriteTensor(tensor, ChunkKind::kParamFp32, values));
  if (!layout_.mixed() || ComputeOnly(tensor)) return OkStatus();  // it wrote the compute chunk
  std::vector<uint16_t> low(layout_.tensors[tensor].numel);
  kernels::CastFromF32(values, low.data(), layout_.compute_dtype(), low.size());
  return WriteTensor(tensor, ChunkKind::kParamLowp, low.data());
}

// ---- gradients -------------------------------------------------------------------------------

StatusOr<kernels::GradStats> Session::GradStats() {
  TIERMEM_RETURN_IF_ERROR(Live());
  kernels::GradStats total;
  const kernels::DType gd = layout_.dtype(ChunkKind::kGrad);
  const size_t es = kernels::DTypeSize(gd);
  for (size_t gi = 0; gi < layout_.groups.size(); ++gi) {
    const ChunkGroup& g = layout_.groups[gi];
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
        DeviceGradStats(placement_.cuda() && dev, spans, gd, dev ? stream_ : kHostStream);
    Status rel = Release(gi, ChunkKind::kGrad, false);
    TIERMEM_RETURN_IF_ERROR(st.status());
    TIERMEM_RETURN_IF_ERROR(rel);
    total.sq_norm += st->sq_norm;
    total.overflow = total.overflow || st->overflow;
  }
  total.sq_norm /= scaler_.scale * scaler_.scale;
  return total;
}

// ---- optimizer --------------------------------------------------------------------------------

StatusOr<StepResult> Session::Step(const std::vector<GroupHyper>& hyper,
                                   const kernels::GradStats* global) {
  TIERMEM_RETURN_IF_ERROR(Live());
  TIERMEM_RETURN_IF_ERROR(stepper_->RunAllPending(true));  // the last step's updates come first
  for (size_t i = 0; i < layout_.tensors.size(); ++i) {
    if (layout_.tensors[i].trainable &&
        static_cast<size_t>(layout_.tensors[i].opt_group) >= hyper.size()) {
      return InvalidArgumentError("optimizer step: tensor " + layout_.specs[i].name +
                                  " is in param "
                                  "group " +
                                  std::to_string(layout_.tensors[i].opt_group) + " but " +
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
  Phase(RunPhase::kOptimizer);
  const bool fp16 = config_.precision == Precision::kFp16;
  if ((config_.gradient_clipping > 0 || fp16) && layout_.sharded() && global == nullptr) {
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

TierKind Session::ReadTier(size_t g, ChunkKind kind) const {
  // Where a reduction over a chunk (GradStats) reads it without moving it: in place on the
  // device when it is there (a CUDA kernel on CUDA, the CPU on SimDevice), else on the host.
  return Resident(g, kind) == TierKind::kDevice ? TierKind::kDevice : TierKind::kHost;
}

// ---- iterations and stats -----------------------------------------------------------------------

PlanRunner::PlanContext Session::RunnerContext() const {
  PlanRunner::PlanContext ctx;
  ctx.engine = stack_->engine();
  ctx.activations = config_.activations;
  ctx.cuda = placement_.cuda();
  ctx.bar = DeclinesCostlierPlans(config_.plan);  // kAlways: the plan runs whatever its bytes
  ctx.compute_tier_holds_every_chunk = placement_.compute_tier_holds_every_chunk();
  ctx.engine_prefetch_depth = static_cast<uint32_t>(std::max(0, config_.prefetch_depth));
  ctx.engine_lookahead = config_.prefetch_lookahead == PrefetchLookahead::kRoom
                             ? planners::EngineLookahead::kRoom
                             : planners::EngineLookahead::kDepth;
  return ctx;
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
  return {placement_.host_compute() ? 0 : config_.device_budget, config_.host_budget,
          config_.nvme_size};
}

void Session::DeclareTraceChunks() {
  planners::TraceBuilder& b = trace_.builder();
  chunks::Engine* eng = stack_->engine();
  b.SetSource("tiermem session (" + std::string(ModeName(config_.device_kind)) + " device, " +
              std::to_string(layout_.specs.size()) + " tensors)");
  for (size_t gi = 0; gi < layout_.groups.size(); ++gi) {
    for (int k = 0; k < chunks::kNumChunkKinds; ++k) {
      const ChunkId c = layout_.groups[gi].chunks[k];
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
void Session::Phase(RunPhase phase) {
  if (closed()) return;
  phase_ = phase;
  stack_->engine()->Phase(ModeName(phase));
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

StateTraffic EstimateStateTraffic(Bytes state_bytes, Bytes state_bytes_fp32,
                                  Bytes nvme_state_bytes) {
  StateTraffic t{state_bytes, state_bytes_fp32, nvme_state_bytes, 0};
  if (state_bytes > 0) {
    t.nvme_bytes_saved =
        static_cast<Bytes>(static_cast<double>(nvme_state_bytes) *
                           (static_cast<double>(state_bytes_fp32) / state_bytes - 1.0));
  }
  return t;
}

StateTraffic Session::StateTrafficOf(const chunks::EngineStats& stats) const {
  return EstimateStateTraffic(
      state_bytes_, state_bytes_fp32_,
      stats.nvme_bytes_by_category[static_cast<int>(Category::kOptimState)]);
}

StatusOr<Bytes> Session::RuntimeHostBytes() const {
  TIERMEM_RETURN_IF_ERROR(Live());
  return stack_->host_overhead() + shard_buf_.capacity() + gathered_.capacity();
}

}  // namespace tiermem::session
