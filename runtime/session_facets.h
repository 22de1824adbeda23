// The Session's faces, one concern each (leveldb's DB is one narrow class with DBImpl behind
// it; a session has more to say, so it says it through a few small facets):
//
//   session.chunks()      chunk access: acquire, release, prefetch, where a chunk is, read-only
//                         homes (the bindings' views of chunk memory)
//   session.values()      tensor values in and out: params, grads, optimizer state, raw
//                         compressed state, step counts
//   session.optimizer()   gradients and the step: has-grad flags, gradient stats, zeroing,
//                         Step, deferred updates, the loss scaler, where groups step
//   session.iterations()  the run's time: iterations, moments, phases, tracing, the compute
//                         stream, collectives the binding ran
//   session.memory()      compute and host memory outside the chunks: external bytes, scratch
//                         regions, activations spilled to NVMe
//   session.traces()      the warm-up trace and the timeline's report
//   session.plans()       executed plans: their status, and what they ask of activations
//
// A facet is a view: it holds the session by reference (the facets are Session's friends);
// it owns nothing and is cheap to make, so callers make one per use
// (`s.values().ReadParam(t, out)`). Session has one accessor per facet, callable on a const
// session too (session.h says why); a facet held const offers its queries only.
//
// Where a member's body lives (the one rule): in the facet's own file (session_facets.cc),
// working on the session's state directly, unless the session itself calls it too (its Step,
// Close, checkpoints, the stepper's site, another of its bodies); then the body is a private
// member of Session (session.cc, checkpoint.cc, session_file_homes.cc) and the facet forwards
// to it in one line. Either way a member is documented here only: Session's private
// declarations carry no docs of their own.
//
// Ownership: the session must outlive every facet made from it.
// Thread-safety: the session's (externally synchronized: the training thread).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "base/units.h"
#include "kernels/cpu/optim.h"
#include "layout/chunk_layout.h"
#include "planners/planner.h"
#include "planners/trace.h"
#include "prof/analysis.h"
#include "runtime/optimizer_stepper.h"
#include "runtime/phase.h"
#include "runtime/plan_runner.h"
#include "tiers/tier.h"

namespace tiermem {
class FileHomeTier;
}  // namespace tiermem

namespace tiermem::session {

class Session;

struct StepResult {
  bool applied = false;    // false between accumulation micro-steps and when skipped
  bool skipped = false;    // fp16: the gradients overflowed; nothing changed but the scale
  double grad_norm = -1;   // total (unscaled) norm when it was computed (clipping or fp16)
  float clip_coef = 1.0f;  // the factor the step applied (1 = no clipping)
};

// fp16 dynamic loss scaling state (torch.amp.GradScaler's).
struct ScalerState {
  double scale = 1.0;
  int good_steps = 0;
  uint64_t skipped_steps = 0;
};

// What plans() reports (docs/planner.md, "Executing plans").
struct PlanStatus {
  bool active = false;
  PlanRunner::Stats runner;
  planners::PlanEstimate estimate;  // of the plan executing (or the last one)
  uint32_t actions = 0;             // of that plan, per iteration
  std::string error;                // why planning stopped, "" if it did not
  std::string declined;             // why plan: auto kept the reactive engine, "" if not
  PlanDecision decision;            // plan: auto's bar on the last plan it judged
};

// Chunk access (the bindings' views of chunk memory).
class ChunksFacet {
 public:
  explicit ChunksFacet(Session& s) : s_(s) {}

  // Makes the chunk resident on `where` (device or host), pins it and returns its address.
  // Errors as chunks::Engine::Acquire; kInvalidArgument for a kind the group lacks.
  // `cls` (not chunks::kNoClass): acquired as a member of that class — an expert of a
  // mixture-of-experts layer, chosen by the routing (chunks/expert_cache.h): outside the
  // recorded order, and not checked against an executed plan (divergence there is expected).
  StatusOr<void*> Acquire(size_t group, chunks::ChunkKind kind, TierKind where,
                          uint32_t cls = chunks::kNoClass);
  // As Acquire for a caller about to overwrite: a lazily zero chunk (on any tier) is
  // handed over unfilled and `*must_zero` set (the caller writes or zeroes all of it first).
  StatusOr<void*> AcquireForWrite(size_t group, chunks::ChunkKind kind, TierKind where,
                                  bool* must_zero, uint32_t cls = chunks::kNoClass);
  // Starts bringing the chunk to `where` ahead of an acquire expected soon with `probability`:
  // 1 for a routed expert, less for a predicted one (chunks::Engine::PrefetchHint). False when
  // nothing was started (there already, no room, planned mode); kInvalidArgument for a kind
  // the group lacks or a probability outside (0, 1].
  StatusOr<bool> Prefetch(size_t group, chunks::ChunkKind kind, TierKind where,
                          double probability = 1.0);
  Status Release(size_t group, chunks::ChunkKind kind, bool modified);
  // Starts writing the chunk's unpinned, idle cached copy on `where` home in the background and
  // frees the copy once it is written (a clean copy at once: chunks::Engine::PlanEvict); an
  // acquire short of room on `where` waits for such a write rather than evicting another chunk.
  // False (nothing done) when it has no such copy there. A failed write keeps the copy, dirty,
  // and is returned by whatever waits for it (Session::Flush waits for them all).
  StatusOr<bool> WriteHome(size_t group, chunks::ChunkKind kind, TierKind where);
  // Its content becomes zeros lazily (no bytes move). kFailedPrecondition while pinned.
  Status ZeroChunk(size_t group, chunks::ChunkKind kind);
  int Pins(size_t group, chunks::ChunkKind kind) const;
  // Whether the chunk's content is zeros as far as the engine knows (not modified since it was
  // added or zeroed: chunks::Engine::ZeroContent): zeroing it again changes nothing.
  bool LazilyZero(size_t group, chunks::ChunkKind kind) const;
  TierKind Resident(size_t group, chunks::ChunkKind kind) const;
  TierKind Home(size_t group, chunks::ChunkKind kind) const;
  Bytes ChunkBytes(size_t group, chunks::ChunkKind kind) const;
  // Serving in place (runtime/weights.h; session_file_homes.cc): the NVMe tier's read-only
  // file homes (tiers/nvme/file_homes.h); null without NVMe or once closed.
  FileHomeTier* file_homes();
  // Makes `region`, a file home, the chunk's home (chunks::Engine::SetReadOnlyHome): its
  // content is read from there, and anything that would write it is refused.
  Status SetReadOnlyHome(size_t group, chunks::ChunkKind kind, const Region& region);
  // Whether the chunk's home is read-only (false once closed).
  bool ReadOnlyHome(size_t group, chunks::ChunkKind kind) const;
  // The groups whose compute chunk holds a placeholder home (TensorSpec::read_in_place: no
  // NVMe room held for it), ascending, until HomePlaceholders: which gives each group not in
  // `in_place` (those got their file homes) a home of the NVMe tier's own
  // (chunks::Engine::RehomeOnNvme; kResourceExhausted when the tier is full).
  const std::vector<uint32_t>& placeholder_homes() const;
  Status HomePlaceholders(const std::set<uint32_t>& in_place);

 private:
  Session& s_;
};

// Tensor values, through host copies (each call acquires and releases its chunks).
class ValuesFacet {
 public:
  explicit ValuesFacet(Session& s) : s_(s) {}

  // The fp32 value of a tensor: its master (mixed precision) or its fp32 param; a tensor of
  // a compute_only group (layout.h: no master) its compute copy, upcast (exact).
  Status ReadParam(size_t tensor, float* out);
  // Sets the fp32 master and the compute copy (rounded to nearest even in mixed precision).
  // A tensor of a compute_only group: its compute copy, when every value is exact in the
  // compute dtype; else kInvalidArgument naming the tensor, and nothing is written. The same
  // holds for ReadTensor / WriteTensor (and their ranges) of kParamFp32.
  Status WriteParam(size_t tensor, const float* values);
  // Raw bytes of `kind` for the tensor (numel * element size of that kind: dtype(kind), fp32
  // for m and v). Compressed m and v are dequantized on the way out and quantized on the way
  // in (int8: the tensor's blocks get new absmax values).
  Status ReadTensor(size_t tensor, chunks::ChunkKind kind, void* out);
  Status WriteTensor(size_t tensor, chunks::ChunkKind kind, const void* values);
  // The same for elements [begin, begin + n) of the tensor (`n` elements of dtype(kind) at
  // `out` / `values`): a tensor streamed in pieces (runtime/weights.h). Sharded: reads gather
  // (every rank must call), writes keep this rank's part. kOutOfRange past the tensor's end;
  // kInvalidArgument for compressed m or v.
  Status ReadTensorRange(size_t tensor, chunks::ChunkKind kind, uint64_t begin, uint64_t n,
                         void* out);
  Status WriteTensorRange(size_t tensor, chunks::ChunkKind kind, uint64_t begin, uint64_t n,
                          const void* values);
  // The optimizer-state format of a group's m and v (fp32 for frozen groups).
  const kernels::StateFormat& state_format(size_t group) const;
  // Stored m or v of a tensor in its group's format: `codes` gets StateBytes' code part
  // (numel bytes for int8, 2 x numel for bf16, 4 x numel for fp32), `absmax` (int8 only,
  // else unused) StateBlocks(format, numel) values. kInvalidArgument for another kind.
  Status ReadStateRaw(size_t tensor, chunks::ChunkKind kind, void* codes, float* absmax);
  Status WriteStateRaw(size_t tensor, chunks::ChunkKind kind, const void* codes,
                       const float* absmax);
  // Bytes of every m and v chunk, and what they would be in fp32 (the same layout).
  Bytes state_bytes() const;
  Bytes state_bytes_fp32() const;
  // The tensor's optimizer step count (shared by every rank), and setting it (checkpoints).
  int64_t step_count(size_t tensor) const;
  Status SetStepCount(size_t tensor, int64_t steps);

 private:
  Session& s_;
};

// Gradients and the optimizer: which tensors have gradients, their stats, zeroing them, the
// step (see session.h's file comment: AdamW over every group with gradients, accumulation,
// clipping, fp16 loss scaling; applied by the OptimizerStepper), deferred updates, the loss
// scaler and where each group steps.
class OptimizerFacet {
 public:
  explicit OptimizerFacet(Session& s) : s_(s) {}

  // Whether the tensor received a gradient (torch's `p.grad is not None`): a tensor without
  // one is not stepped, like torch.optim.
  void SetHasGrad(size_t tensor, bool has);
  bool has_grad(size_t tensor) const;
  // Sum of squares of the unscaled gradients of every tensor that has one, and whether any is
  // NaN/Inf (the kernels' GradNormAndOverflow, accumulated in double). Sharded: of this rank's
  // shard only (the binding sums over ranks).
  StatusOr<kernels::GradStats> GradStats();
  // Clears every gradient (lazily) unless an accumulation window is open (the last Step did
  // not apply); returns whether it cleared.
  StatusOr<bool> ZeroGrad();
  // True while gradients are being accumulated across micro-steps (the last Step did not
  // apply because of gradient_accumulation_steps).
  bool accumulating() const;
  // Whether the next Step applies (not a micro-step of an accumulation window).
  bool next_step_applies() const;
  // One AdamW step (applied by the OptimizerStepper). `hyper[g]` are the hyper-parameters of
  // optimizer group g; every trainable tensor's opt_group must have an entry.
  // kInvalidArgument for bad hyper-parameters (nothing changes); chunk errors otherwise.
  // `global`: the gradient stats of the whole model (unscaled sum of squares, overflow) when
  // the binding computed them across ranks; required when sharded with clipping or fp16
  // (kFailedPrecondition).
  StatusOr<StepResult> Step(const std::vector<GroupHyper>& hyper,
                            const kernels::GradStats* global = nullptr);
  // Runs group `group`'s deferred update now, if one is pending (optimizer_stepper.h): the
  // unit protocol calls it for a unit's groups before the unit's pre-forward moment. OK when
  // none is.
  Status FinishStep(size_t group);
  // Runs every pending update (in group order).
  Status FinishSteps();
  size_t pending_steps() const;
  // fp16 dynamic loss scaling (torch.amp.GradScaler's state), and the micro-step counter.
  double loss_scale() const;
  ScalerState scaler() const;
  void set_scaler(const ScalerState& state);
  uint64_t micro_steps() const;
  // Optimizer placement (optimizer_stepper.h): decided at the first applied Step.
  bool placed() const;
  bool OnDevice(size_t group) const;

 private:
  Session& s_;
};

// The run's time: iterations, moments, phases, what is traced, the compute stream.
class IterationsFacet {
 public:
  explicit IterationsFacet(Session& s) : s_(s) {}

  void BeginIteration();
  // A timeline moment; while a warm-up trace is recorded also a trace moment of that kind
  // (a unit's pre-forward / pre-backward: `unit` is the binding's unit index).
  void Moment(std::string_view label, planners::MomentKind kind = planners::MomentKind::kOther,
              uint32_t unit = planners::kNoUnit);
  // The run's phase (runtime/phase.h): the timeline's phase event, spelled by its table.
  void Phase(RunPhase phase);
  RunPhase phase() const;  // the last Phase (kNone before any)
  // A collective the (sharded) binding ran: the timeline's kCollective event.
  void RecordCollective(std::string_view op, Bytes bytes, uint64_t ns);
  // Off: acquires are not part of the recorded order (eval, no_grad inference), so they
  // neither disturb nor follow the order the next training iteration replays.
  void SetTracing(bool on);
  bool tracing() const;
  // Serving: every iteration repeats the same forward, so prefetch runs across the iteration
  // boundary (engine.h, "Cyclic order").
  void SetCyclic(bool on);
  // The stream the binding's device work is queued on from now on (torch's current CUDA
  // stream; kHostStream for CPU tensors, the default): releases record their compute use on
  // it, device-placed optimizer kernels run on it (tiers/tier.h "Ordering against compute").
  void SetComputeStream(ComputeStream stream);
  ComputeStream compute_stream() const;

 private:
  Session& s_;
};

// Memory outside the chunks, counted in the tiers' budgets.
class MemoryFacet {
 public:
  explicit MemoryFacet(Session& s) : s_(s) {}

  // Device bytes the binding keeps live outside chunks (the KV cache of a served model),
  // counted in the device budget: device chunks are evicted to make room. kResourceExhausted
  // naming the bytes (nothing changes) when the chunks in use leave too little room.
  Status SetExternalDeviceBytes(Bytes bytes);
  // The same on the compute tier (the device; the host in host mode): saved activations the
  // binding counts, a served model's KV cache.
  Status SetExternalComputeBytes(Bytes bytes);
  // Host bytes the binding keeps outside chunks (activations offloaded from the device),
  // counted in the host budget: host caches of NVMe-homed chunks are evicted to make room.
  // kResourceExhausted naming the bytes (nothing changes) when homes and chunks in use leave
  // too little room.
  Status SetExternalHostBytes(Bytes bytes);
  // A device or host region outside chunks, counted in that tier's budget (chunks are evicted
  // for it): a sharded binding's gathered chunks. kResourceExhausted naming the bytes when the
  // pinned chunks leave too little room. FreeScratch orders its reuse after the compute
  // stream's work so far.
  StatusOr<Region> AllocateScratch(TierKind tier, Bytes bytes);
  Status FreeScratch(TierKind tier, const Region& region);
  // Activations spilled to NVMe (activations: offload / auto when the host budget has no room
  // for them): a region of the NVMe tier, counted in its budget (the timeline's NVMe
  // `activation` category); kFailedPrecondition without NVMe, kResourceExhausted naming the
  // bytes when its free room is short (nothing changes). The binding copies through host
  // scratch (AllocateScratch(kHost): the bounce counts in the host budget) with SpillCopy:
  // `bytes` between `host` at `host_offset` and `spill` at `spill_offset`, NVMe-ward when
  // `to_nvme`, through the mover (timeline copy events of category activation); it returns
  // when the copy is done, with its error (kIOError; kDataLoss for bytes that read back
  // other than written, a torn or overwritten block). Thread-safety: the training thread.
  StatusOr<Region> AllocateSpill(Bytes bytes);
  Status FreeSpill(const Region& spill);
  Status SpillCopy(const Region& spill, Bytes spill_offset, const Region& host, Bytes host_offset,
                   Bytes bytes, bool to_nvme);
  // SpillCopy without the wait: the copy's completion (its error there). Until it is done the
  // host bytes must stay untouched (to_nvme) or unread (from NVMe), and neither region freed.
  StatusOr<std::shared_ptr<Completion>> StartSpillCopy(const Region& spill, Bytes spill_offset,
                                                       const Region& host, Bytes host_offset,
                                                       Bytes bytes, bool to_nvme);

 private:
  Session& s_;
};

// The warm-up trace (planners/trace.h, docs/trace-format.md) and the timeline's report.
class TracesFacet {
 public:
  explicit TracesFacet(Session& s) : s_(s) {}

  // Records the next `iterations` iterations (from the next BeginIteration: chunk accesses
  // per moment, saved-activation bytes, compute times, measured copy and optimizer rates,
  // the budgets) and writes the trace to `path` at the BeginIteration after the last one, at
  // FinishTrace or at Close. kInvalidArgument / kFailedPrecondition (already recording):
  // nothing changes. Recording never changes what the session computes or moves.
  Status RecordTrace(const std::string& path, int iterations);
  bool recording_trace() const;
  bool trace_armed() const;
  // Bytes of non-chunk tensors the current unit saved for backward (the bindings' saved-tensor
  // hooks see each one), and the non-chunk device bytes live now when the binding knows them.
  // Host mode: not recorded. The trace's non-chunk bytes are device bytes (the planner and
  // the simulator count them in the device budget); there is none, and the activations are
  // torch's host memory outside every budget ('outside') — or, counted ('budget'), in the
  // host's external bytes, which the planner does not model yet.
  void AddSavedBytes(Bytes b);
  void SetActivationBytes(Bytes b);
  // Ends a recording now and writes what was recorded. False when nothing was armed or
  // recorded; the write's error (or an earlier one, from the automatic write) otherwise.
  StatusOr<bool> FinishTrace();
  // True once a recording was written; its path.
  const std::string& written_trace() const;
  // The timeline so far, analysed by tiermem::prof from the file (not from counters).
  StatusOr<prof::Report> TimelineReport();

 private:
  Session& s_;
};

// Executed plans (docs/planner.md, "Executing plans"). With config `plan: auto` the session
// records an iteration in memory, and its plan runner plans from it at the iteration boundary
// and executes the plan from the next iteration on (plan_runner.h, "Planning at the iteration
// boundary": when it records, re-plans or stops). Plans move copies only: every value is the
// same without them.
class PlansFacet {
 public:
  explicit PlansFacet(Session& s) : s_(s) {}

  PlanStatus plan_status() const;
  // Makes a plan from iteration `iteration` of `trace` (-1: its last) and executes it from the
  // next BeginIteration (with any `plan` config). kInvalidArgument for a trace of another
  // layout; the planner's errors otherwise (nothing changes then).
  Status ExecutePlanFrom(const planners::Trace& trace, int64_t iteration = -1);
  // activations: offload / auto, while an executed plan is followed (plan_runner.h,
  // "Activations"): whether the plan offloads `unit`'s saved activations after its forward
  // (or, auto, recomputes them in its backward), and the units whose activations the moments
  // since the last call fetch back.
  bool PlanOffloadsUnit(uint32_t unit) const;
  bool PlanRecomputesUnit(uint32_t unit) const;
  bool PlanFollowed() const;
  std::vector<uint32_t> TakeActivationFetches();

 private:
  Session& s_;
};

}  // namespace tiermem::session
