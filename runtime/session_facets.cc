// The facets forward to the session's implementation (session_facets.h).
#include "runtime/session_facets.h"

#include "runtime/session.h"

namespace tiermem::session {

// ---- ChunksFacet ----
StatusOr<void*> ChunksFacet::Acquire(size_t group, chunks::ChunkKind kind, TierKind where,
                                     uint32_t cls) {
  return s_.Acquire(group, kind, where, cls);
}
StatusOr<void*> ChunksFacet::AcquireForWrite(size_t group, chunks::ChunkKind kind, TierKind where,
                                             bool* must_zero, uint32_t cls) {
  return s_.AcquireForWrite(group, kind, where, must_zero, cls);
}
StatusOr<bool> ChunksFacet::Prefetch(size_t group, chunks::ChunkKind kind, TierKind where,
                                     double probability) {
  return s_.Prefetch(group, kind, where, probability);
}
Status ChunksFacet::Release(size_t group, chunks::ChunkKind kind, bool modified) {
  return s_.Release(group, kind, modified);
}
Status ChunksFacet::ZeroChunk(size_t group, chunks::ChunkKind kind) {
  return s_.ZeroChunk(group, kind);
}
int ChunksFacet::Pins(size_t group, chunks::ChunkKind kind) const { return s_.Pins(group, kind); }
bool ChunksFacet::LazilyZero(size_t group, chunks::ChunkKind kind) const {
  return s_.LazilyZero(group, kind);
}
TierKind ChunksFacet::Resident(size_t group, chunks::ChunkKind kind) const {
  return s_.Resident(group, kind);
}
TierKind ChunksFacet::Home(size_t group, chunks::ChunkKind kind) const {
  return s_.Home(group, kind);
}
Bytes ChunksFacet::ChunkBytes(size_t group, chunks::ChunkKind kind) const {
  return s_.ChunkBytes(group, kind);
}
FileHomeTier* ChunksFacet::file_homes() { return s_.file_homes(); }
Status ChunksFacet::SetReadOnlyHome(size_t group, chunks::ChunkKind kind, const Region& region) {
  return s_.SetReadOnlyHome(group, kind, region);
}
bool ChunksFacet::ReadOnlyHome(size_t group, chunks::ChunkKind kind) const {
  return s_.ReadOnlyHome(group, kind);
}

// ---- ValuesFacet ----

Status ValuesFacet::ReadParam(size_t tensor, float* out) { return s_.ReadParam(tensor, out); }
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
  return s_.SetStepCount(tensor, steps);
}

// ---- OptimizerFacet ----
void OptimizerFacet::SetHasGrad(size_t tensor, bool has) { s_.has_grad_[tensor] = has ? 1 : 0; }
bool OptimizerFacet::has_grad(size_t tensor) const { return s_.has_grad(tensor); }
StatusOr<kernels::GradStats> OptimizerFacet::GradStats() { return s_.GradStats(); }
StatusOr<bool> OptimizerFacet::ZeroGrad() { return s_.ZeroGrad(); }
bool OptimizerFacet::accumulating() const { return s_.accumulating_; }
bool OptimizerFacet::next_step_applies() const { return s_.next_step_applies(); }
StatusOr<StepResult> OptimizerFacet::Step(const std::vector<GroupHyper>& hyper,
                                          const kernels::GradStats* global) {
  return s_.Step(hyper, global);
}
Status OptimizerFacet::FinishStep(size_t group) { return s_.FinishStep(group); }
Status OptimizerFacet::FinishSteps() { return s_.FinishSteps(); }
size_t OptimizerFacet::pending_steps() const { return s_.stepper_->pending_steps(); }
double OptimizerFacet::loss_scale() const { return s_.loss_scale(); }
ScalerState OptimizerFacet::scaler() const { return s_.scaler_; }
void OptimizerFacet::set_scaler(const ScalerState& state) { s_.scaler_ = state; }
uint64_t OptimizerFacet::micro_steps() const { return s_.micro_; }
bool OptimizerFacet::placed() const { return s_.stepper_->placed(); }
bool OptimizerFacet::OnDevice(size_t group) const { return s_.stepper_->OnDevice(group); }

// ---- IterationsFacet ----
void IterationsFacet::BeginIteration() { s_.BeginIteration(); }
void IterationsFacet::Moment(std::string_view label, planners::MomentKind kind, uint32_t unit) {
  s_.Moment(label, kind, unit);
}
void IterationsFacet::Phase(RunPhase phase) { s_.Phase(phase); }
RunPhase IterationsFacet::phase() const { return s_.phase_; }
void IterationsFacet::RecordCollective(std::string_view op, Bytes bytes, uint64_t ns) {
  s_.RecordCollective(op, bytes, ns);
}
void IterationsFacet::SetTracing(bool on) { s_.SetTracing(on); }
bool IterationsFacet::tracing() const { return s_.tracing_; }
void IterationsFacet::SetCyclic(bool on) { s_.SetCyclic(on); }
void IterationsFacet::SetComputeStream(ComputeStream stream) { s_.SetComputeStream(stream); }
ComputeStream IterationsFacet::compute_stream() const { return s_.stream_; }

// ---- MemoryFacet ----
Status MemoryFacet::SetExternalDeviceBytes(Bytes bytes) { return s_.SetExternalDeviceBytes(bytes); }
Status MemoryFacet::SetExternalComputeBytes(Bytes bytes) {
  return s_.SetExternalComputeBytes(bytes);
}
Status MemoryFacet::SetExternalHostBytes(Bytes bytes) { return s_.SetExternalHostBytes(bytes); }
StatusOr<Region> MemoryFacet::AllocateScratch(TierKind tier, Bytes bytes) {
  return s_.AllocateScratch(tier, bytes);
}
Status MemoryFacet::FreeScratch(TierKind tier, const Region& region) {
  return s_.FreeScratch(tier, region);
}
StatusOr<Region> MemoryFacet::AllocateSpill(Bytes bytes) { return s_.AllocateSpill(bytes); }
Status MemoryFacet::FreeSpill(const Region& spill) { return s_.FreeSpill(spill); }
Status MemoryFacet::SpillCopy(const Region& spill, Bytes spill_offset, const Region& host,
                              Bytes host_offset, Bytes bytes, bool to_nvme) {
  return s_.SpillCopy(spill, spill_offset, host, host_offset, bytes, to_nvme);
}
StatusOr<std::shared_ptr<Completion>> MemoryFacet::StartSpillCopy(const Region& spill,
                                                                  Bytes spill_offset,
                                                                  const Region& host,
                                                                  Bytes host_offset, Bytes bytes,
                                                                  bool to_nvme) {
  return s_.StartSpillCopy(spill, spill_offset, host, host_offset, bytes, to_nvme);
}

// ---- TracesFacet ----
Status TracesFacet::RecordTrace(const std::string& path, int iterations) {
  return s_.RecordTrace(path, iterations);
}
bool TracesFacet::recording_trace() const { return s_.trace_.recording(); }
bool TracesFacet::trace_armed() const { return s_.trace_.armed(); }
void TracesFacet::AddSavedBytes(Bytes b) { s_.AddSavedBytes(b); }
void TracesFacet::SetActivationBytes(Bytes b) { s_.SetActivationBytes(b); }
StatusOr<bool> TracesFacet::FinishTrace() { return s_.FinishTrace(); }
const std::string& TracesFacet::written_trace() const { return s_.written_trace_; }
StatusOr<prof::Report> TracesFacet::TimelineReport() { return s_.TimelineReport(); }

// ---- PlansFacet ----
PlanStatus PlansFacet::plan_status() const { return s_.plan_status(); }
Status PlansFacet::ExecutePlanFrom(const planners::Trace& trace, int64_t iteration) {
  return s_.ExecutePlanFrom(trace, iteration);
}
bool PlansFacet::PlanOffloadsUnit(uint32_t unit) const { return s_.runner_.OffloadsUnit(unit); }
bool PlansFacet::PlanRecomputesUnit(uint32_t unit) const { return s_.runner_.RecomputesUnit(unit); }
bool PlansFacet::PlanFollowed() const { return s_.runner_.following(); }
std::vector<uint32_t> PlansFacet::TakeActivationFetches() {
  return s_.runner_.TakeActivationFetches();
}

}  // namespace tiermem::session
