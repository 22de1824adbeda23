// The facets (session_facets.h): the bodies only a facet calls, working on the session's state
// directly (the facets are its friends), and one-line forwards to the bodies the session
// calls itself too (session.cc, checkpoint.cc, session_file_homes.cc).
#include "runtime/session_facets.h"

#include <algorithm>

#include "base/logging.h"
#include "runtime/session.h"
#include "runtime/tier_stack.h"

namespace tiermem::session {

// ---- ChunksFacet ----
StatusOr<void*> ChunksFacet::Acquire(size_t group, chunks::ChunkKind kind, TierKind where,
                                     uint32_t cls) {
  return s_.Acquire(group, kind, where, cls);
}
StatusOr<void*> ChunksFacet::AcquireForWrite(size_t group, ChunkKind kind, TierKind where,
                                             bool* must_zero, uint32_t cls) {
  TIERMEM_RETURN_IF_ERROR(s_.CheckKind(group, kind));
  TIERMEM_RETURN_IF_ERROR(s_.stepper_->RunPending(group, true));
  s_.stepper_->DropSpeculation(group);  // about to be written
  const ChunkId c = s_.Chunk(group, kind);
  // Lazily zero content is not needed from below (nothing has to be copied in): a write.
  const bool zero = s_.stack_->engine()->ZeroContent(c);
  StatusOr<void*> p = s_.stack_->engine()->AcquireForWrite(c, where, must_zero, cls);
  if (p.ok()) {
    s_.trace_.Access(c, zero ? planners::AccessMode::kWrite : planners::AccessMode::kReadWrite,
                     where);
    s_.NoteClassAccess(c, where, cls);
  }
  return p;
}
StatusOr<bool> ChunksFacet::Prefetch(size_t group, ChunkKind kind, TierKind where,
                                     double probability) {
  TIERMEM_RETURN_IF_ERROR(s_.CheckKind(group, kind));
  if (s_.stepper_->pending(group)) return false;  // its update reads it first, on its own tier
  return s_.stack_->engine()->PrefetchHint(s_.Chunk(group, kind), where, probability);
}
Status ChunksFacet::Release(size_t group, chunks::ChunkKind kind, bool modified) {
  return s_.Release(group, kind, modified);
}
StatusOr<bool> ChunksFacet::WriteHome(size_t group, ChunkKind kind, TierKind where) {
  TIERMEM_RETURN_IF_ERROR(s_.CheckKind(group, kind));
  return s_.stack_->engine()->PlanEvict(s_.Chunk(group, kind), where);
}
Status ChunksFacet::ZeroChunk(size_t group, chunks::ChunkKind kind) {
  return s_.ZeroChunk(group, kind);
}
int ChunksFacet::Pins(size_t group, chunks::ChunkKind kind) const { return s_.Pins(group, kind); }
bool ChunksFacet::LazilyZero(size_t group, ChunkKind kind) const {
  if (!s_.CheckKind(group, kind).ok()) return false;
  return s_.stack_->engine()->ZeroContent(s_.Chunk(group, kind));
}
TierKind ChunksFacet::Resident(size_t group, chunks::ChunkKind kind) const {
  return s_.Resident(group, kind);
}
TierKind ChunksFacet::Home(size_t group, chunks::ChunkKind kind) const {
  return s_.Home(group, kind);
}
Bytes ChunksFacet::ChunkBytes(size_t group, ChunkKind kind) const {
  if (!s_.CheckKind(group, kind).ok()) return 0;
  return s_.stack_->engine()->ChunkBytes(s_.Chunk(group, kind));
}
FileHomeTier* ChunksFacet::file_homes() { return s_.file_homes(); }
Status ChunksFacet::SetReadOnlyHome(size_t group, chunks::ChunkKind kind, const Region& region) {
  return s_.SetReadOnlyHome(group, kind, region);
}
const std::vector<uint32_t>& ChunksFacet::placeholder_homes() const {
  return s_.placeholder_homes();
}
Status ChunksFacet::HomePlaceholders(const std::set<uint32_t>& in_place) {
  return s_.HomePlaceholders(in_place);
}
bool ChunksFacet::ReadOnlyHome(size_t group, chunks::ChunkKind kind) const {
  return s_.ReadOnlyHome(group, kind);
}

// ---- ValuesFacet ----

Status ValuesFacet::ReadParam(size_t tensor, float* out) {
  return s_.ReadTensor(tensor, ChunkKind::kParamFp32, out);
}
Status ValuesFacet::WriteParam(size_t tensor, const float* values) {
  return s_.WriteParam(tensor, values);
}
Status ValuesFacet::ReadTensor(size_t tensor, chunks::ChunkKind kind, void* out) {
  return s_.ReadTensor(tensor, kind, out);
}
Status ValuesFacet::WriteTensor(size_t tensor, chunks::ChunkKind kind, const void* values) {
  return s_.WriteTensor(tensor, kind, values);
}
Status ValuesFacet::ReadTensorRange(size_t tensor, chunks::ChunkKind kind, uint64_t begin,
                                    uint64_t n, void* out) {
  return s_.ReadTensorRange(tensor, kind, begin, n, out);
}
Status ValuesFacet::WriteTensorRange(size_t tensor, chunks::ChunkKind kind, uint64_t begin,
                                     uint64_t n, const void* values) {
  return s_.WriteTensorRange(tensor, kind, begin, n, values);
}
const kernels::StateFormat& ValuesFacet::state_format(size_t group) const {
  return s_.layout_.groups[group].state;
}
Status ValuesFacet::ReadStateRaw(size_t tensor, chunks::ChunkKind kind, void* codes,
                                 float* absmax) {
  return s_.ReadStateRaw(tensor, kind, codes, absmax);
}
Status ValuesFacet::WriteStateRaw(size_t tensor, chunks::ChunkKind kind, const void* codes,
                                  const float* absmax) {
  return s_.WriteStateRaw(tensor, kind, codes, absmax);
}
Bytes ValuesFacet::state_bytes() const { return s_.state_bytes_; }
Bytes ValuesFacet::state_bytes_fp32() const { return s_.state_bytes_fp32_; }
int64_t ValuesFacet::step_count(size_t tensor) const { return s_.stepper_->step_count(tensor); }
Status ValuesFacet::SetStepCount(size_t tensor, int64_t steps) {
  if (tensor >= s_.layout_.tensors.size()) return OutOfRangeError("session: unknown tensor");
  if (steps < 0) return InvalidArgumentError("session: negative step count");
  TIERMEM_RETURN_IF_ERROR(s_.Live());
  // The pending update counted the old value.
  for (const Piece& p : s_.layout_.tensors[tensor].pieces) {
    TIERMEM_RETURN_IF_ERROR(s_.stepper_->RunPending(p.group, true));
    s_.stepper_->DropSpeculation(p.group);
  }
  s_.stepper_->set_step_count(tensor, steps);
  return OkStatus();
}

// ---- OptimizerFacet ----
void OptimizerFacet::SetHasGrad(size_t tensor, bool has) { s_.has_grad_[tensor] = has ? 1 : 0; }
bool OptimizerFacet::has_grad(size_t tensor) const { return s_.has_grad(tensor); }
StatusOr<kernels::GradStats> OptimizerFacet::GradStats() { return s_.GradStats(); }
StatusOr<bool> OptimizerFacet::ZeroGrad() {
  TIERMEM_RETURN_IF_ERROR(s_.Live());
  if (s_.accumulating_) return false;
  // Clearing the flags is what matters (only spans with a gradient are read); zeroing the
  // chunks lazily lets the next backward skip fetching them. A chunk the binding keeps
  // pinned (resident training) keeps its stale bytes instead.
  for (size_t gi = 0; gi < s_.layout_.groups.size(); ++gi) {
    if (s_.layout_.groups[gi].trainable && s_.Pins(gi, ChunkKind::kGrad) == 0) {
      TIERMEM_RETURN_IF_ERROR(s_.ZeroChunk(gi, ChunkKind::kGrad));
    }
  }
  std::fill(s_.has_grad_.begin(), s_.has_grad_.end(), 0);
  return true;
}
bool OptimizerFacet::accumulating() const { return s_.accumulating_; }
bool OptimizerFacet::next_step_applies() const { return s_.next_step_applies(); }
StatusOr<StepResult> OptimizerFacet::Step(const std::vector<GroupHyper>& hyper,
                                          const kernels::GradStats* global) {
  return s_.Step(hyper, global);
}
Status OptimizerFacet::FinishStep(size_t group) {
  TIERMEM_RETURN_IF_ERROR(s_.Live());
  if (group >= s_.layout_.groups.size()) {
    return OutOfRangeError("session: unknown chunk group " + std::to_string(group));
  }
  return s_.stepper_->RunPending(group, false);
}
Status OptimizerFacet::FinishSteps() {
  TIERMEM_RETURN_IF_ERROR(s_.Live());
  return s_.stepper_->RunAllPending(true);
}
size_t OptimizerFacet::pending_steps() const { return s_.stepper_->pending_steps(); }
double OptimizerFacet::loss_scale() const { return s_.loss_scale(); }
ScalerState OptimizerFacet::scaler() const { return s_.scaler_; }
void OptimizerFacet::set_scaler(const ScalerState& state) { s_.scaler_ = state; }
uint64_t OptimizerFacet::micro_steps() const { return s_.micro_; }
bool OptimizerFacet::placed() const { return s_.stepper_->placed(); }
bool OptimizerFacet::OnDevice(size_t group) const { return s_.stepper_->OnDevice(group); }

// ---- IterationsFacet ----
void IterationsFacet::BeginIteration() {
  if (s_.closed()) return;
  s_.stepper_->BeginIteration();
  const bool was_planned = s_.runner_.active() && s_.runner_.in_iteration();
  const bool diverged = was_planned && !s_.runner_.EndIteration();
  s_.stack_->engine()->BeginIteration();
  if (s_.trace_.armed()) {
    if (s_.trace_.needs_chunks()) s_.DeclareTraceChunks();
    const bool ours = s_.trace_.in_memory();
    StatusOr<bool> w = s_.trace_.BeginIteration(s_.TraceProbes(), s_.TraceBudgets());
    if (!w.ok()) {
      // Training goes on; the error waits for FinishTrace (and is logged now).
      TIERMEM_LOG(kError) << w.status().message();
      s_.trace_error_ = w.status();
    } else if (*w && !ours) {
      s_.written_trace_ = s_.trace_.path();
    }
  }
  if (PlansIterations(s_.config_.plan) &&
      s_.runner_.AtBoundary(diverged, &s_.trace_, s_.RunnerContext()) &&
      s_.trace_.ArmInMemory(1).ok()) {
    // Recorded in memory for the runner's next boundary.
    if (s_.trace_.needs_chunks()) s_.DeclareTraceChunks();
    StatusOr<bool> w = s_.trace_.BeginIteration(s_.TraceProbes(), s_.TraceBudgets());
    if (!w.ok()) {
      TIERMEM_LOG(kWarn) << "plan: recording: " << w.status().message();
    }
  }
  s_.runner_.BeginIteration();
}
void IterationsFacet::Moment(std::string_view label, planners::MomentKind kind, uint32_t unit) {
  s_.Moment(label, kind, unit);
}
void IterationsFacet::Phase(RunPhase phase) { s_.Phase(phase); }
RunPhase IterationsFacet::phase() const { return s_.phase_; }
void IterationsFacet::RecordCollective(std::string_view op, Bytes bytes, uint64_t ns) {
  if (!s_.closed()) s_.stack_->engine()->RecordCollective(op, bytes, ns);
}
void IterationsFacet::SetTracing(bool on) {
  if (s_.closed()) return;
  s_.tracing_ = on;
  s_.stack_->engine()->SetTracing(on);
  s_.runner_.SetPaused(!on);
  s_.trace_.SetPaused(!on, s_.trace_.recording() ? s_.TraceProbes() : TraceRecorder::Probes{});
}
bool IterationsFacet::tracing() const { return s_.tracing_; }
void IterationsFacet::SetCyclic(bool on) {
  if (!s_.closed()) s_.stack_->engine()->SetCyclic(on);
}
void IterationsFacet::SetComputeStream(ComputeStream stream) {
  s_.stream_ = stream;
  if (!s_.closed()) s_.stack_->engine()->SetComputeStream(stream);
}
ComputeStream IterationsFacet::compute_stream() const { return s_.stream_; }

// ---- MemoryFacet ----
Status MemoryFacet::SetExternalDeviceBytes(Bytes bytes) {
  TIERMEM_RETURN_IF_ERROR(s_.Live());
  return s_.stack_->engine()->SetExternalDeviceBytes(bytes);
}
Status MemoryFacet::SetExternalComputeBytes(Bytes bytes) {
  TIERMEM_RETURN_IF_ERROR(s_.Live());
  return s_.stack_->engine()->SetExternalBytes(s_.placement_.compute_tier(), bytes);
}
Status MemoryFacet::SetExternalHostBytes(Bytes bytes) {
  TIERMEM_RETURN_IF_ERROR(s_.Live());
  return s_.stack_->engine()->SetExternalBytes(TierKind::kHost, bytes);
}
StatusOr<Region> MemoryFacet::AllocateScratch(TierKind tier, Bytes bytes) {
  TIERMEM_RETURN_IF_ERROR(s_.Live());
  return s_.stack_->engine()->AllocateScratch(tier, bytes, Category::kOther);
}
Status MemoryFacet::FreeScratch(TierKind tier, const Region& region) {
  TIERMEM_RETURN_IF_ERROR(s_.Live());
  return s_.stack_->engine()->FreeScratch(tier, region, Category::kOther);
}
StatusOr<Region> MemoryFacet::AllocateSpill(Bytes bytes) {
  TIERMEM_RETURN_IF_ERROR(s_.Live());
  if (s_.stack_->nvme() == nullptr) {
    return FailedPreconditionError("session: no NVMe tier to spill " + std::to_string(bytes) +
                                   " bytes to (config 'nvme')");
  }
  return s_.stack_->engine()->AllocateScratch(TierKind::kNvme, bytes, Category::kActivation);
}
Status MemoryFacet::FreeSpill(const Region& spill) {
  TIERMEM_RETURN_IF_ERROR(s_.Live());
  return s_.stack_->engine()->FreeScratch(TierKind::kNvme, spill, Category::kActivation);
}
Status MemoryFacet::SpillCopy(const Region& spill, Bytes spill_offset, const Region& host,
                              Bytes host_offset, Bytes bytes, bool to_nvme) {
  TIERMEM_ASSIGN_OR_RETURN(std::shared_ptr<Completion> c,
                           StartSpillCopy(spill, spill_offset, host, host_offset, bytes, to_nvme));
  return c->Wait();
}
StatusOr<std::shared_ptr<Completion>> MemoryFacet::StartSpillCopy(const Region& spill,
                                                                  Bytes spill_offset,
                                                                  const Region& host,
                                                                  Bytes host_offset, Bytes bytes,
                                                                  bool to_nvme) {
  TIERMEM_RETURN_IF_ERROR(s_.Live());
  if (s_.stack_->nvme() == nullptr) return FailedPreconditionError("session: no NVMe tier");
  if (bytes == 0) return Completion::Done(OkStatus());
  if (host_offset > host.bytes || bytes > host.bytes - host_offset) {
    return OutOfRangeError("session: spill copy of " + std::to_string(bytes) + " bytes at " +
                           std::to_string(host_offset) + " of a host region of " +
                           std::to_string(host.bytes));
  }
  const Endpoint h{s_.stack_->host(), host, host_offset};
  const Endpoint n{s_.stack_->nvme(), spill, spill_offset};
  MoveRequest req;
  req.src = to_nvme ? h : n;
  req.dst = to_nvme ? n : h;
  req.bytes = bytes;
  req.category = Category::kActivation;
  return s_.stack_->mover()->Move(req);  // the NVMe tier checks the spill's bounds
}

// ---- TracesFacet ----
Status TracesFacet::RecordTrace(const std::string& path, int iterations) {
  TIERMEM_RETURN_IF_ERROR(s_.Live());
  TIERMEM_RETURN_IF_ERROR(s_.trace_.Arm(path, iterations));
  s_.trace_error_ = OkStatus();
  return OkStatus();
}
bool TracesFacet::recording_trace() const { return s_.trace_.recording(); }
bool TracesFacet::trace_armed() const { return s_.trace_.armed(); }
void TracesFacet::AddSavedBytes(Bytes b) {
  if (!s_.placement_.host_compute()) s_.trace_.AddSavedBytes(b);
}
void TracesFacet::SetActivationBytes(Bytes b) {
  if (!s_.placement_.host_compute()) s_.trace_.SetActivationBytes(b);
}
StatusOr<bool> TracesFacet::FinishTrace() { return s_.FinishTrace(); }
const std::string& TracesFacet::written_trace() const { return s_.written_trace_; }
StatusOr<prof::Report> TracesFacet::TimelineReport() {
  TIERMEM_RETURN_IF_ERROR(s_.Live());
  return s_.stack_->TimelineReport();
}

// ---- PlansFacet ----
PlanStatus PlansFacet::plan_status() const {
  PlanStatus s;
  s.active = s_.runner_.active();
  s.runner = s_.runner_.stats();
  s.estimate = s_.runner_.estimate();
  s.actions = s_.runner_.actions();
  s.error = s_.runner_.error();
  s.declined = s_.runner_.declined();
  s.decision = s_.runner_.decision();
  return s;
}
Status PlansFacet::ExecutePlanFrom(const planners::Trace& trace, int64_t iteration) {
  TIERMEM_RETURN_IF_ERROR(s_.Live());
  return s_.runner_.ExecuteFrom(trace, iteration, s_.RunnerContext());
}
bool PlansFacet::PlanOffloadsUnit(uint32_t unit) const { return s_.runner_.OffloadsUnit(unit); }
bool PlansFacet::PlanRecomputesUnit(uint32_t unit) const { return s_.runner_.RecomputesUnit(unit); }
bool PlansFacet::PlanFollowed() const { return s_.runner_.following(); }
std::vector<uint32_t> PlansFacet::TakeActivationFetches() {
  return s_.runner_.TakeActivationFetches();
}

}  // namespace tiermem::session
