// Session: one model's training state in chunks, torch-free. Both bindings (the Python
// package and the LibTorch API) are adapters over this class: they describe the model's
// tensors once, move values in and out, mark iterations, and call Step(); everything about
// where bytes live and how the optimizer runs is here.
//
// The class's own face is narrow: Create and Close, the layout and the facts derived from it,
// stats, checkpoints and the speculative steps' hyper-parameters. Everything else is reached
// through a facet of one concern (session_facets.h): chunks(), values(), optimizer(),
// iterations(), memory(), traces(), plans(); their members are implemented here, privately.
//
// A session owns
//   - the tier stack (tier_stack.h): device (SimDevice or CUDA; none in host mode, where the
//     host tier is the compute tier), host, NVMe, staging, the mover, the timeline recorder
//     and the chunk engine;
//   - the layout (layout.h, a pure unit tested alone: LayOut decides it from the config, the
//     tensor specs and the sharding before any tier exists; layout() hands it out): tensors
//     (in the order given — first use, i.e. module registration order) packed into chunk
//     groups; every group has one chunk per ChunkKind it needs, all at the
//     same element offsets. Trainable groups: the compute params (kParamFp32 in fp32 training,
//     kParamLowp in bf16/fp16), kGrad (compute dtype), kExpAvg and kExpAvgSq (the group's
//     optimizer-state format, below), and in
//     mixed precision the fp32 master (kParamFp32). Frozen groups: the compute params, plus
//     the fp32 master in mixed precision (so their values stay exact) — except for tensors
//     whose values are exact in the compute dtype (TensorSpec::values_in_compute_dtype: a
//     bf16 checkpoint computed in bf16), packed into compute_only groups without one: their
//     fp32 value (ReadParam, kParamFp32 reads) is the compute copy upcast, and an fp32 value
//     the compute dtype cannot hold exactly is refused (never rounded). Chunks are created
//     compute params first, then grads, masters, m and v, so the optimizer state is what
//     spills to NVMe first when the host budget is short;
//   - the optimizer: AdamW over every group with gradients, with per-group hyper-parameters
//     passed at each Step (LR schedules), gradient accumulation (every N-th Step applies),
//     global-norm clipping and fp16 dynamic loss scaling (skipped steps lower the scale), all
//     on fused kernels. The session decides each step (validation, micro-steps, gradient
//     stats, clip factor, fp16 verdict, loss scale); its OptimizerStepper
//     (optimizer_stepper.h: it reads the layout and calls the session only through
//     StepperOwner — traced acquire and release, moments and phases, the step's facts)
//     applies it: where each group steps (device or host, decided at
//     the first applied step: optimizer_placement), and when (optimizer_overlap: inside Step,
//     deferred into the next forward, or speculated in the backward and adopted by Step).
//     Every access path of the session first runs the pending update of what it touches, and
//     anything that writes a group drops its speculation: values are those of the
//     unoverlapped step, bit for bit;
//   - the optimizer-state format (config optimizer.state_*; kernels/cpu/optim.h "Compressed
//     state"): fp32, or compressed — bf16, or int8 codes with one absmax per block — in every
//     tier (a chunk of m is StateBytes(format, elements): int8's is its codes, then its absmax
//     values), so host, NVMe, the mover, the trace and the planner all see the compressed
//     bytes. With compressed state, trainable tensors of at least optimizer.state_min_elems
//     elements are packed into groups of that format, the smaller ones into groups of their
//     own with fp32 state; int8 groups start every tensor on a block boundary (no block
//     straddles two tensors) and every chunk holds whole blocks. Values of m and v
//     (ReadTensor / WriteTensor) are fp32 whatever the format (dequantized / quantized);
//     ReadStateRaw / WriteStateRaw move the stored codes and absmax (checkpoints);
//   - per-tensor "has a gradient" flags (torch's `p.grad is not None`: a tensor without a
//     gradient is not stepped, like torch.optim) and, through the stepper, step counts;
//   - checkpoints (SaveCheckpoint/LoadCheckpoint: a versioned, checksummed file streamed
//     tensor by tensor, so a model larger than RAM can be saved), stats and the timeline.
//
// Sharding (ZeRO-3 style; collectives.h): with Sharding{world, rank, collectives}, world > 1,
// the layout (groups, chunk size, tensor offsets — "full" coordinates) is the same on every
// rank, but each rank's chunks hold only its shard of every chunk: elements
// [rank * shard_elems, (rank + 1) * shard_elems) of every kind (params, grads, m, v, masters),
// in this rank's own tiers and budgets. Acquire/Release hand out shards; the binding gathers
// a unit's full chunks into scratch (AllocateScratch) with torch.distributed and
// reduce-scatters its full gradients into the grad shards. Values are written locally (each
// rank keeps its part of WriteParam/WriteTensor) and read collectively (ReadParam/ReadTensor
// gather the chunk through Collectives: every rank must call them). The step runs on each
// rank's shard only, with per-tensor step counts shared by all ranks; with clipping or fp16 the
// binding passes the global gradient stats (its all-reduce of every rank's GradStats()).
// Checkpoints are the same file at any world size: every rank gathers, rank 0 writes; every
// rank loads its part.
//
// Gradients: bindings accumulate into kGrad chunks themselves (they own the autograd glue)
// and say which tensors received one (SetHasGrad). Only the spans of tensors that have a
// gradient are read, so a tensor whose gradient was dropped (torch's zero_grad(set_to_none))
// may leave stale bytes in its span; ZeroGrad() additionally zeroes every grad chunk lazily.
//
// Thread-safety: externally synchronized (the training thread), like the model.
// Ownership: the session owns every chunk and tier. Close() (or destruction) frees them and
// completes the timeline; afterwards only the const accessors work, everything else is
// kFailedPrecondition.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "base/status.h"
#include "chunks/engine.h"
#include "kernels/cpu/optim.h"
#include "layout/chunk_layout.h"
#include "prof/analysis.h"
#include "runtime/checkpoint_meta.h"
#include "runtime/collectives.h"
#include "runtime/config.h"
#include "runtime/layout.h"
#include "runtime/optimizer_stepper.h"
#include "runtime/phase.h"
#include "runtime/plan_runner.h"
#include "runtime/session_facets.h"
#include "runtime/trace_recorder.h"

namespace tiermem::session {

class TierStack;
}  // namespace tiermem::session
namespace tiermem {
class FileHomeTier;
}
namespace tiermem::session {

// The factor global-norm clipping multiplies every gradient by, exactly as
// torch.nn.utils.clip_grad_norm_(max_norm) computes it in fp32 (1 when the norm is below).
float ClipCoefficient(double max_norm, double total_norm);

// The optimizer-state format's effect on storage and NVMe traffic (optimizer.state_dtype;
// Session::StateTraffic), bytes.
struct StateTraffic {
  Bytes state_bytes = 0;       // every m and v chunk, in the state format
  Bytes state_bytes_fp32 = 0;  // what they would be in fp32 (the same layout)
  Bytes nvme_state_bytes = 0;  // optimizer-state bytes moved to or from NVMe so far
  // What those moves would have added in fp32 state, estimated with the layout's ratio:
  // nvme_state_bytes x (state_bytes_fp32 / state_bytes - 1), truncated; 0 without state.
  Bytes nvme_bytes_saved = 0;
};
// Pure: the estimate above from its three inputs.
StateTraffic EstimateStateTraffic(Bytes state_bytes, Bytes state_bytes_fp32,
                                  Bytes nvme_state_bytes);

class Session {
 public:
  // kInvalidArgument: no tensors, a tensor of 0 elements, a negative group; kResourceExhausted:
  // a device budget below the minimum for the largest tensor (the message names the minimum
  // bytes), or no host/NVMe room for the chunks; kUnavailable: "cuda" without a GPU; tier and
  // timeline errors as their factories report them. On failure nothing is left behind.
  // kInvalidArgument also for a bad Sharding (rank outside [0, world), no collectives).
  static StatusOr<std::unique_ptr<Session>> Create(const SessionConfig& config,
                                                   std::vector<TensorSpec> tensors,
                                                   Sharding sharding = {});
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  // Frees every chunk and tier and completes the timeline. Idempotent.
  void Close();
  bool closed() const;

  // ---- layout (valid after Close too) ---------------------------------------------------
  // The pure layout (layout.h): tensors, groups (with their chunk ids), chunk size, bytes.
  const Layout& layout() const { return layout_; }
  // As parsed, with the device kind resolved (never DeviceKind::kAuto).
  const SessionConfig& config() const { return config_; }
  Precision precision() const { return config_.precision; }
  bool mixed() const { return IsMixed(config_.precision); }
  kernels::DType compute_dtype() const { return ComputeDType(config_.precision); }
  kernels::DType dtype(ChunkKind kind) const { return layout_.dtype(kind); }
  ChunkKind compute_kind() const {  // the chunks the model computes with
    return mixed() ? ChunkKind::kParamLowp : ChunkKind::kParamFp32;
  }
  uint64_t chunk_elems() const { return layout_.chunk_elems; }  // full chunks (every rank alike)
  // Sharding (see the file comment): world 1 = not sharded, one shard = the whole chunk.
  int world() const { return sharding_.world; }
  int rank() const { return sharding_.rank; }
  bool sharded() const { return sharding_.world > 1; }
  uint64_t shard_elems() const {
    return layout_.shard_elems;
  }  // elements of each kind per chunk here
  uint64_t shard_begin() const {
    return layout_.shard_begin;
  }  // its first element, full coordinates
  size_t num_tensors() const { return layout_.tensors.size(); }
  size_t num_groups() const { return layout_.groups.size(); }
  const TensorSpec& spec(size_t tensor) const { return layout_.specs[tensor]; }
  const TensorPlace& place(size_t tensor) const { return layout_.tensors[tensor]; }
  const ChunkGroup& group(size_t g) const { return layout_.groups[g]; }
  bool has_kind(size_t g, ChunkKind kind) const {
    return layout_.groups[g].chunks[static_cast<int>(kind)] != kNoChunk;
  }
  Bytes model_bytes() const { return layout_.model_bytes; }       // every chunk byte of tensor data
  Bytes total_chunk_bytes() const { return total_chunk_bytes_; }  // incl. padding and tails
  // The device bytes the layout needs at least: min-resident compute + grad chunks of the
  // largest piece a unit needs at once (a row of the largest tensor's first dimension; an
  // expert's slices with expert sets).
  Bytes minimum_device_budget() const { return layout_.min_device_budget; }
  // kCuda, kHost, kSim or kSimAsync (kAuto resolved).
  DeviceKind device_kind() const { return config_.device_kind; }
  bool cuda() const { return IsCuda(config_.device_kind); }
  // Host mode (DeviceKind::kHost): no device tier; the bindings compute on chunks acquired
  // on the host tier, in place for host-homed chunks (no copy), NVMe-homed ones read into
  // host room before use and written back (dirty) or dropped (clean) after.
  bool host_compute() const { return IsHostCompute(config_.device_kind); }
  // Where the bindings acquire the chunks they compute with: kDevice, or kHost in host mode.
  TierKind compute_tier() const { return host_compute() ? TierKind::kHost : TierKind::kDevice; }

  // ---- what the bindings ask of the layout (answered here, so that none re-derives it) ------
  // Bytes per element of the compute copy (the params and grads the model computes with).
  size_t compute_element_size() const { return kernels::DTypeSize(compute_dtype()); }
  // The budget of the compute tier as far as the bindings may plan with it: the device's;
  // in host mode the host's when every chunk is homed there, else 0 (NVMe-homed chunks come
  // and go through the host room the session keeps for them). Fixed at Create: homes never
  // move.
  Bytes compute_budget() const { return compute_budget_; }
  // Every chunk of every kind fits the compute tier at once, so nothing ever has to move:
  // there is no schedule to plan, and a binding may keep its compute chunks acquired.
  bool compute_tier_holds_every_chunk() const { return compute_budget_ >= total_chunk_bytes_; }
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
  // The compute-tier bytes one unit pins at once: the compute chunks of its `groups`, and of
  // the largest of `experts` (each the groups of one expert that moves alone) beyond those.
  // Serving needs a device budget of at least the largest unit's (OutOfRange for an unknown
  // group).
  StatusOr<Bytes> UnitComputeBytes(const std::vector<size_t>& groups,
                                   const std::vector<std::vector<size_t>>& experts = {}) const;
  // Serving: the largest UnitComputeBytes of the units the tensors name (TensorSpec::units;
  // Layout::units), and which unit it is. A device budget below `bytes` cannot serve: the
  // unit's chunks are pinned together while it computes. {0, -1} when no units were given.
  struct UnitNeed {
    Bytes bytes = 0;
    int unit = -1;
  };
  UnitNeed ServingMinimum() const;
  std::string io_backend() const;  // "io_uring", "posix"; "" without NVMe (TierStack)
  // Host bytes registered with the NVMe tier as io_uring fixed buffers (TierStack).
  Bytes nvme_registered_bytes() const;
  const std::string& timeline_path() const { return timeline_path_; }

  // ---- the facets (session_facets.h): one concern each ------------------------------------
  // A facet made from a const session is const (its queries only).
  ChunksFacet chunks() { return ChunksFacet(*this); }
  const ChunksFacet chunks() const { return ChunksFacet(mut()); }
  ValuesFacet values() { return ValuesFacet(*this); }
  const ValuesFacet values() const { return ValuesFacet(mut()); }
  OptimizerFacet optimizer() { return OptimizerFacet(*this); }
  const OptimizerFacet optimizer() const { return OptimizerFacet(mut()); }
  IterationsFacet iterations() { return IterationsFacet(*this); }
  const IterationsFacet iterations() const { return IterationsFacet(mut()); }
  MemoryFacet memory() { return MemoryFacet(*this); }
  const MemoryFacet memory() const { return MemoryFacet(mut()); }
  TracesFacet traces() { return TracesFacet(*this); }
  const TracesFacet traces() const { return TracesFacet(mut()); }
  PlansFacet plans() { return PlansFacet(*this); }
  const PlansFacet plans() const { return PlansFacet(mut()); }

  // ---- speculative steps (optimizer_stepper.h; optimizer_overlap: backward) ----------------
  // The hyper-parameters the next Step will be given, announced before the backward (the
  // bindings do it at an iteration's first forward); nothing is speculated until they are.
  void SetStepHyper(std::vector<GroupHyper> hyper) { stepper_->SetStepHyper(std::move(hyper)); }
  using SpeculationStats = OptimizerStepper::SpeculationStats;
  const SpeculationStats& speculation_stats() const { return stepper_->speculation_stats(); }

  // ---- stats ------------------------------------------------------------------------------
  Status Synchronize();
  Status Flush();  // home copies current (e.g. before reading many values)
  StatusOr<chunks::EngineStats> Stats() const;
  // The state format's bytes and NVMe traffic, with the optimizer-state bytes `stats` (the
  // engine's counters, Stats()) moved to or from NVMe.
  StateTraffic StateTrafficOf(const chunks::EngineStats& stats) const;
  // Host memory the runtime holds for itself outside every budget now, bytes: the tiers' own
  // buffers (the NVMe bounce pool and checksum table, host memory mapped beyond the budget:
  // TierStack::host_overhead) and, sharded, the buffers whole chunks are gathered into.
  // (docs/engine.md, "Memory outside the budgets").
  StatusOr<Bytes> RuntimeHostBytes() const;

  // ---- checkpoints (checkpoint.cc: a safetensors file, torch-loadable without tiermem) ------
  // Every tensor's fp32 value, its Adam m and v and step count, the loss-scaling state and
  // the micro-step counter, plus `metadata` (the optimizer param groups, the binding's RNG
  // state and the user's extra: checkpoint_meta.h, the one format of both bindings), streamed
  // tensor by tensor (never the whole model in RAM), with a CRC32C per tensor.
  // Written to `path`.tmp, fsync'ed, then renamed over `path`: a crash never leaves a torn
  // file under `path`. kIOError for disk trouble (the old file, if any, stays).
  Status SaveCheckpoint(const std::string& path, const CheckpointMeta& metadata = {});
  // Verifies the whole file first (checksums, tensor names and sizes, precision-independent;
  // the metadata against `how`: the binding's number of param groups and RNG state size) and
  // only then loads it: a torn or mismatched file is kDataLoss / kInvalidArgument and changes
  // nothing. `metadata` gets the saved metadata (the earlier formats' binding metadata
  // converted). Reads the format-1 and format-2 files of earlier builds too.
  // `how.verify_only`: every check of a load, nothing applied (a sharded binding verifies on
  // every rank before any rank loads).
  Status LoadCheckpoint(const std::string& path, CheckpointMeta* metadata = nullptr,
                        const CheckpointLoad& how = {});
  // The metadata of a checkpoint (its header verified), without loading anything.
  static StatusOr<CheckpointMeta> CheckpointMetadata(const std::string& path);

 private:
  Session() = default;

  // ---- the facets' implementation (session_facets.h documents each member) ---------------
  friend class ChunksFacet;
  friend class ValuesFacet;
  friend class OptimizerFacet;
  friend class IterationsFacet;
  friend class MemoryFacet;
  friend class TracesFacet;
  friend class PlansFacet;
  // The facets of a const session are made from it, const.
  Session& mut() const { return const_cast<Session&>(*this); }
  // chunks()
  StatusOr<void*> Acquire(size_t group, ChunkKind kind, TierKind where,
                          uint32_t cls = chunks::kNoClass);
  StatusOr<void*> AcquireForWrite(size_t group, ChunkKind kind, TierKind where, bool* must_zero,
                                  uint32_t cls = chunks::kNoClass);
  StatusOr<bool> Prefetch(size_t group, ChunkKind kind, TierKind where, double probability);
  Status Release(size_t group, ChunkKind kind, bool modified);
  Status ZeroChunk(size_t group, ChunkKind kind);
  int Pins(size_t group, ChunkKind kind) const;
  bool LazilyZero(size_t group, ChunkKind kind) const;
  TierKind Resident(size_t group, ChunkKind kind) const;
  TierKind Home(size_t group, ChunkKind kind) const;
  Bytes ChunkBytes(size_t group, ChunkKind kind) const;
  FileHomeTier* file_homes();
  Status SetReadOnlyHome(size_t group, ChunkKind kind, const Region& region);
  bool ReadOnlyHome(size_t group, ChunkKind kind) const;
  // values()
  Status ReadParam(size_t tensor, float* out);
  Status WriteParam(size_t tensor, const float* values);
  Status ReadTensor(size_t tensor, ChunkKind kind, void* out);
  Status WriteTensor(size_t tensor, ChunkKind kind, const void* values);
  Status ReadTensorRange(size_t tensor, ChunkKind kind, uint64_t begin, uint64_t n, void* out);
  Status WriteTensorRange(size_t tensor, ChunkKind kind, uint64_t begin, uint64_t n,
                          const void* values);
  Status ReadStateRaw(size_t tensor, ChunkKind kind, void* codes, float* absmax);
  Status WriteStateRaw(size_t tensor, ChunkKind kind, const void* codes, const float* absmax);
  Status SetStepCount(size_t tensor, int64_t steps);
  // optimizer()
  bool has_grad(size_t tensor) const { return has_grad_[tensor] != 0; }
  StatusOr<kernels::GradStats> GradStats();
  StatusOr<bool> ZeroGrad();
  bool next_step_applies() const {
    return (micro_ + 1) % static_cast<uint64_t>(config_.gradient_accumulation_steps) == 0;
  }
  StatusOr<StepResult> Step(const std::vector<GroupHyper>& hyper,
                            const kernels::GradStats* global = nullptr);
  Status FinishStep(size_t group);
  Status FinishSteps();
  double loss_scale() const { return scaler_.scale; }
  // iterations()
  void BeginIteration();
  void Moment(std::string_view label, planners::MomentKind kind = planners::MomentKind::kOther,
              uint32_t unit = planners::kNoUnit);
  void Phase(RunPhase phase);
  void RecordCollective(std::string_view op, Bytes bytes, uint64_t ns);
  void SetTracing(bool on);
  void SetCyclic(bool on);
  void SetComputeStream(ComputeStream stream);
  // memory()
  Status SetExternalDeviceBytes(Bytes bytes);
  Status SetExternalComputeBytes(Bytes bytes);
  Status SetExternalHostBytes(Bytes bytes);
  StatusOr<Region> AllocateScratch(TierKind tier, Bytes bytes);
  Status FreeScratch(TierKind tier, const Region& region);
  StatusOr<Region> AllocateSpill(Bytes bytes);
  Status FreeSpill(const Region& spill);
  Status SpillCopy(const Region& spill, Bytes spill_offset, const Region& host, Bytes host_offset,
                   Bytes bytes, bool to_nvme);
  StatusOr<std::shared_ptr<Completion>> StartSpillCopy(const Region& spill, Bytes spill_offset,
                                                       const Region& host, Bytes host_offset,
                                                       Bytes bytes, bool to_nvme);
  // traces()
  Status RecordTrace(const std::string& path, int iterations);
  void AddSavedBytes(Bytes b) {
    if (!host_compute()) trace_.AddSavedBytes(b);
  }
  void SetActivationBytes(Bytes b) {
    if (!host_compute()) trace_.SetActivationBytes(b);
  }
  StatusOr<bool> FinishTrace();
  StatusOr<prof::Report> TimelineReport();
  // plans()
  PlanStatus plan_status() const;
  Status ExecutePlanFrom(const planners::Trace& trace, int64_t iteration = -1);

  // Create's steps (the layout between them: layout.h). Validate: `config` with its device
  // kind resolved, or the mode it refuses there. Build: the tier stack sized for `sized`, the
  // stepper, and every chunk of layout_ (its ids into layout_.groups).
  static StatusOr<SessionConfig> Validate(const SessionConfig& config);
  Status Build(const HostRoom& sized);
  Status Live() const;
  ChunkId Chunk(size_t group, ChunkKind kind) const;
  Status CheckKind(size_t group, ChunkKind kind) const;
  // The checks of ReadTensorRange / WriteTensorRange.
  Status CheckRange(size_t tensor, ChunkKind kind, uint64_t begin, uint64_t n) const;
  // A tensor of a compute_only group (layout.h): no fp32 chunk; its fp32 value is its compute
  // copy upcast (ReadUpcast, exact), and WriteExact writes fp32 values into the compute chunk
  // only when every one of them is exact in the compute dtype (else kInvalidArgument naming
  // the tensor and the element, nothing written; CheckExact is that check alone).
  bool ComputeOnly(size_t tensor) const;
  Status CheckExact(size_t tensor, uint64_t begin, uint64_t n, const float* values) const;
  Status ReadUpcast(size_t tensor, uint64_t begin, uint64_t n, float* out);
  Status WriteExact(size_t tensor, uint64_t begin, uint64_t n, const float* values);
  // After an acquire of `c` on `where`: the plan runner checks a dense acquire; an expert's
  // (cls set) is marked in the trace and bound to the plan's slots, not checked.
  void NoteClassAccess(ChunkId c, TierKind where, uint32_t cls);
  // Sharded reads: the whole chunk of `kind` of `group` gathered from every rank into
  // gathered_ (host); cached for (group, kind) while gather_cache_ is on.
  StatusOr<const char*> GatherChunk(size_t group, ChunkKind kind);
  // Moves a tensor's stored m or v (its code bytes and, int8, its absmax) between the chunk
  // and host buffers: this rank's part when writing, the whole tensor (gathered when
  // sharded) when reading.
  Status StateRaw(size_t tensor, ChunkKind kind, void* codes, float* absmax, bool write);
  // Where a reduction over a chunk (GradStats) reads it without moving it.
  TierKind ReadTier(size_t g, ChunkKind kind) const;
  TraceRecorder::Probes TraceProbes() const;
  Status LoadCheckpointV1(const std::string& path, CheckpointMeta* metadata,
                          const CheckpointLoad& how);
  // The header of `path` through `fd`; tensor bytes through `data_fd`, opened with O_DIRECT
  // when `direct` (block-aligned reads).
  Status LoadCheckpointV2(const std::string& path, int fd, int data_fd, bool direct,
                          CheckpointMeta* metadata, const CheckpointLoad& how);
  planners::TraceBudgets TraceBudgets() const;
  Bytes ComputeBudget() const;      // compute_budget(), from the chunks' homes
  Bytes GroupComputeBytes() const;  // a group's compute and grad chunks, full
  void DeclareTraceChunks();
  // What the plan runner plans with: this session's engine and configuration.
  PlanRunner::PlanContext RunnerContext() const;

  SessionConfig config_;
  Sharding sharding_;
  std::vector<char> gathered_, shard_buf_;  // GatherChunk's buffers
  bool gather_cache_ = false;
  std::pair<size_t, int> gathered_key_{SIZE_MAX, -1};  // (group, kind) in gathered_
  std::string timeline_path_;
  // The pure layout (layout.h); its groups' chunk ids filled as the chunks are created.
  Layout layout_;
  Bytes total_chunk_bytes_ = 0;                   // every chunk of every kind
  Bytes state_bytes_ = 0, state_bytes_fp32_ = 0;  // m and v chunks, and in fp32
  Bytes compute_budget_ = 0;                      // compute_budget(), set once the chunks exist
  std::vector<uint8_t> has_grad_;
  ScalerState scaler_;
  uint64_t micro_ = 0;
  bool accumulating_ = false;
  TraceRecorder trace_;
  Status trace_error_;         // an automatic trace write that failed (FinishTrace reports it)
  std::string written_trace_;  // the last trace file written
  PlanRunner runner_;
  // Per chunk: the expert set it was last acquired as a member of (kNoExpertSet: never), so a
  // trace declares the experts it was told of before its recording began.
  std::vector<uint32_t> expert_set_of_;
  // What the stepper may call of the session (StepperOwner over its public parts: session.cc).
  class StepperSite;
  std::unique_ptr<StepperSite> stepper_site_;
  std::unique_ptr<OptimizerStepper> stepper_;  // made right after stack_, never null then
  RunPhase phase_ = RunPhase::kNone;           // the current phase (restored after an update)
  bool tracing_ = true;                        // SetTracing's state
  ComputeStream stream_ = kHostStream;
  std::unique_ptr<TierStack> stack_;
};

}  // namespace tiermem::session
