// Session: one model's training state in chunks, torch-free. Both bindings (the Python
// package and the LibTorch API) are adapters over this class: they describe the model's
// tensors once, move values in and out, mark iterations, and call Step(); everything about
// where bytes live and how the optimizer runs is here.
//
// The class's own face is narrow: Create and Close, the layout (layout(): every fact of the
// layout), the configuration (config()) and what follows from where it computes
// (placement(): layout.h's Placement, fixed at Create), stats, checkpoints and the
// speculative steps' hyper-parameters. Everything else is reached through a facet of one
// concern (session_facets.h): chunks(), values(), optimizer(), iterations(), memory(),
// traces(), plans() — which says where each body lives.
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
#include <set>
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

  // ---- layout and placement (valid after Close too) ---------------------------------------
  // The pure layout (layout.h): tensors, groups (with their chunk ids), chunk size, sharding,
  // dtypes and kinds, bytes — every fact of the layout is asked of it.
  const Layout& layout() const { return layout_; }
  // As parsed, with the device kind resolved (never DeviceKind::kAuto).
  const SessionConfig& config() const { return config_; }
  // What follows from where the session computes (layout.h, Placement: the device kind, the
  // compute tier and its budget, what fits there), fixed at Create.
  const Placement& placement() const { return placement_; }
  std::string io_backend() const;  // "io_uring", "posix"; "" without NVMe (TierStack)
  // Host bytes registered with the NVMe tier as io_uring fixed buffers (TierStack).
  Bytes nvme_registered_bytes() const;
  const std::string& timeline_path() const { return timeline_path_; }

  // ---- the facets (session_facets.h): one concern each ------------------------------------
  // One accessor per facet, callable on a const session too: a facet is a handle on the
  // session (as a file descriptor is on a file), so constness does not travel through it —
  // a holder of `const Session&` calls the facets' queries (their const members) by the same
  // accessor. C++20 cannot overload one declaration on the constness of `this`, and a pair
  // per facet doubled the face.
  ChunksFacet chunks() const { return ChunksFacet(mut()); }
  ValuesFacet values() const { return ValuesFacet(mut()); }
  OptimizerFacet optimizer() const { return OptimizerFacet(mut()); }
  IterationsFacet iterations() const { return IterationsFacet(mut()); }
  MemoryFacet memory() const { return MemoryFacet(mut()); }
  TracesFacet traces() const { return TracesFacet(mut()); }
  PlansFacet plans() const { return PlansFacet(mut()); }

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

  // ---- what the facets forward to (session_facets.h: the rule, and every member's doc) ------
  friend class ChunksFacet;
  friend class ValuesFacet;
  friend class OptimizerFacet;
  friend class IterationsFacet;
  friend class MemoryFacet;
  friend class TracesFacet;
  friend class PlansFacet;
  // The facets of a const session are made from it (see the accessors).
  Session& mut() const { return const_cast<Session&>(*this); }
  StatusOr<void*> Acquire(size_t group, ChunkKind kind, TierKind where,
                          uint32_t cls = chunks::kNoClass);
  Status Release(size_t group, ChunkKind kind, bool modified);
  Status ZeroChunk(size_t group, ChunkKind kind);
  int Pins(size_t group, ChunkKind kind) const;
  TierKind Resident(size_t group, ChunkKind kind) const;
  TierKind Home(size_t group, ChunkKind kind) const;
  FileHomeTier* file_homes();
  Status SetReadOnlyHome(size_t group, ChunkKind kind, const Region& region);
  bool ReadOnlyHome(size_t group, ChunkKind kind) const;
  const std::vector<uint32_t>& placeholder_homes() const { return placeholder_homes_; }
  Status HomePlaceholders(const std::set<uint32_t>& in_place);
  Status WriteParam(size_t tensor, const float* values);
  Status ReadTensor(size_t tensor, ChunkKind kind, void* out);
  Status WriteTensor(size_t tensor, ChunkKind kind, const void* values);
  Status ReadTensorRange(size_t tensor, ChunkKind kind, uint64_t begin, uint64_t n, void* out);
  Status WriteTensorRange(size_t tensor, ChunkKind kind, uint64_t begin, uint64_t n,
                          const void* values);
  Status ReadStateRaw(size_t tensor, ChunkKind kind, void* codes, float* absmax);
  Status WriteStateRaw(size_t tensor, ChunkKind kind, const void* codes, const float* absmax);
  bool has_grad(size_t tensor) const { return has_grad_[tensor] != 0; }
  StatusOr<kernels::GradStats> GradStats();
  bool next_step_applies() const {
    return (micro_ + 1) % static_cast<uint64_t>(config_.gradient_accumulation_steps) == 0;
  }
  StatusOr<StepResult> Step(const std::vector<GroupHyper>& hyper,
                            const kernels::GradStats* global = nullptr);
  double loss_scale() const { return scaler_.scale; }
  void Moment(std::string_view label, planners::MomentKind kind = planners::MomentKind::kOther,
              uint32_t unit = planners::kNoUnit);
  void Phase(RunPhase phase);
  StatusOr<bool> FinishTrace();

  // Create's steps (the layout between them: layout.h). Validate: `config` with its device
  // kind resolved, or the mode it refuses there. Build: the tier stack sized for `sized`, the
  // stepper, and every chunk of layout_ (its ids into layout_.groups).
  static StatusOr<SessionConfig> Validate(const SessionConfig& config);
  Status Build(const HostRoom& sized);
  // Adds group `gi`'s chunk of `kind` (Build), a placeholder home where it is likely read in
  // place (TensorSpec::read_in_place, placeholder_homes_).
  StatusOr<ChunkId> AddChunk(size_t gi, ChunkKind kind);
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
  bool EveryHomeOnHost() const;  // every chunk created so far is homed on the host tier
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
  Placement placement_;  // placement(), set once the chunks exist
  // Groups whose compute chunk took a placeholder file home at Build (AddChunk), ascending;
  // emptied by HomePlaceholders (the loader).
  std::vector<uint32_t> placeholder_homes_;
  Bytes state_bytes_ = 0, state_bytes_fp32_ = 0;  // m and v chunks, and in fp32
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
