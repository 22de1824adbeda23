// OptimizerStepper: the session's optimizer stepping — where each chunk group's AdamW update
// runs and when. The session (session.h) decides a step: it validates the hyper-parameters,
// counts accumulation micro-steps, computes the gradient stats, the clip factor and the fp16
// verdict, and keeps the loss scale; an applied step then comes here (Apply), and the stepper
// updates every group with gradients on fused kernels — inside Step, deferred into the next
// forward, or by adopting what it computed speculatively in the backward.
//
// Placement (config optimizer_placement, decided once at the first applied step): a group
// steps *on the device* when its optimizer state (m, v and, in mixed precision, the fp32
// master) fits there next to the training working set — every group's compute and grad
// chunks plus the most activation/KV bytes the device held so far — taking groups in order
// while room is left (Deep Optimizer States' idea with a static rule; "host" turns it off). Its
// params and grads then never cross to the host: the CUDA kernels (kernels/cuda) run on the
// compute stream on CUDA, the CPU kernels on SimDevice's memory (its twin). Other groups step
// on host copies with the CPU kernels. The kernels agree bit for bit (device_kernels.h).
//
// Deferred steps (config optimizer_overlap: next-forward, the default): Apply counts the steps
// and captures, per chunk group, the runs it updates and the hyper-parameters; each group's
// AdamW update then runs when anything next touches that group's chunks or values —
// normally the next forward's first use of the group, which the bindings announce with
// FinishStep before the unit's moment so the update is its own optimizer moment. So the
// update's optimizer-state reads from NVMe and its write-backs overlap the previous unit's
// forward instead of stalling a separate optimizer phase. Exact by construction: the same
// kernels on the same values, only later; every access path of the session (Acquire, values,
// ZeroChunk, GradStats, checkpoints, Flush, Synchronize, the next Step) first runs the pending
// update of what it touches (RunPending). ZeroGrad on a pending group zeroes its grads after
// the update. A group any of whose chunks is pinned at Step (the binding may use the pointer
// without acquiring again: resident training) is updated inside Step. An update that fails
// later returns its error from the call that ran it, naming the group.
//
// Speculative steps (optimizer_overlap: backward): deferred steps as above, and in the
// backward, once a host-stepped group's gradients are complete — judged from the previous
// iteration: at the first backward moment after the one in which its grad chunk was last
// written then — its AdamW update runs speculatively and out of place: params, m, v (and the
// master) are copied into host scratch and updated there with the gradients as they are,
// every trainable tensor of the group stepped, clip factor 1, the current loss scale and the
// hyper-parameters the binding announced for this iteration (SetStepHyper). The scratch
// counts in the host budget and is taken only from free room (the group's bytes plus as much
// again left over): nothing is evicted for it. Nothing anyone reads changes.
//
// Where the host lacks that room (the budgets that matter: the host full of homes), the
// update goes copy-on-write to NVMe: every output chunk (params, m, v, master) gets a fresh
// region of the NVMe tier — never the group's current homes — and the outputs are computed
// slice by slice into a host staging area of two slices (each an eighth of the group's
// elements or 256, the larger; all kinds: at most 28 bytes per 8 elements of the group, under
// one fp32 chunk from 2 Ki elements;
// it may evict cached copies, as any host scratch) and written there, double-buffered. The
// NVMe room it takes is the group's output chunks' bytes, from the backward to Step, for every
// speculated group at once (at most one step's params and optimizer state: stats
// nvme_bytes_in_flight and _peak); taken only from the NVMe tier's free room: where that is
// too small, the group is not speculated (no_room) and steps deferred, exact as ever.
// Committing flips each NVMe-homed chunk's home to its new region and frees the old one
// (Engine::AdoptNvmeCopy: no bytes move); a host-homed output chunk (params homed on the host)
// is read back into its home then. Cached copies of those chunks are dropped unwritten.
// Dropping frees the new regions: the old homes were never written (a process killed
// mid-speculation leaves them as they were). Compressed optimizer state (updated in place)
// takes only the host path. While the backward runs, the m, v and master of the groups whose
// gradients complete at the next backward moment are read ahead into the host (the engine's
// PrefetchHint), so the speculation finds them there. Apply commits a
// speculation — the scratch becomes the chunks' content (Engine::AdoptHostCopy: no bytes
// move) — when the update Step would run is the same one: the same runs and step counts, a
// clip factor of exactly 1 (no clipping, or the norm at or below max_norm), no fp16 overflow,
// the same loss scale and hyper-parameters; otherwise it drops it and the group is updated as
// without speculation (deferred). Bit-identical to the unoverlapped step by construction: the
// same kernel on the same inputs (a clip factor of 1 multiplies by 1). Anything that writes
// the group between the speculation and Step (a later gradient, zero_grad, a value, a
// checkpoint load, an accumulation micro-step) drops it first (DropSpeculation); reads see
// the old values.
//
// Step counts: per tensor, shared by all ranks when sharded; a tensor without a gradient
// (torch's `p.grad is not None` is false) is not stepped and its count does not move.
//
// Thread-safety: externally synchronized (the session's thread, like the session).
// Ownership: the session owns the stepper; its layout, config, owner (StepperOwner), tier
// stack and trace recorder must outlive it. Speculation scratch is host (or NVMe) scratch of
// the engine: DropSpeculations frees it (the session's Close calls it before the tiers go).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/status.h"
#include "base/units.h"
#include "layout/chunk_layout.h"
#include "planners/trace.h"
#include "runtime/config.h"
#include "runtime/phase.h"
#include "tiers/tier.h"

namespace tiermem::chunks {
class Engine;
}  // namespace tiermem::chunks

namespace tiermem::session {

struct Layout;
class TierStack;
class TraceRecorder;

// AdamW hyper-parameters of one optimizer param group, as of this step (the config's
// `optimizer` keys are the defaults of every group).
using GroupHyper = OptimizerConfig;

// What the stepper needs of its owner (the session) beyond the layout, the configuration, the
// tier stack and the trace recorder: the owner's traced chunk access (as the bindings'
// acquires: noted in the trace and checked against an executed plan; they run the pending
// update of the group first, which the stepper marks inactive before it runs its own), its
// moments and phases, and the facts of the step decision. Called on the owner's thread only.
class StepperOwner {
 public:
  virtual ~StepperOwner() = default;
  virtual StatusOr<void*> Acquire(size_t group, chunks::ChunkKind kind, TierKind where) = 0;
  virtual Status Release(size_t group, chunks::ChunkKind kind, bool modified) = 0;
  virtual void Moment(std::string_view label, planners::MomentKind kind) = 0;
  virtual void Phase(RunPhase phase) = 0;
  virtual RunPhase phase() const = 0;  // the last Phase (kNone before any)
  virtual bool tracing() const = 0;    // acquires are part of the recorded order
  virtual ComputeStream compute_stream() const = 0;
  virtual bool has_grad(size_t tensor) const = 0;
  virtual double loss_scale() const = 0;
  virtual bool next_step_applies() const = 0;  // not a micro-step of an accumulation window
};

class OptimizerStepper {
 public:
  // Tensors of a group that are adjacent in its chunks, updated by one kernel call.
  struct Run {
    uint64_t lo = 0, hi = 0;  // elements
    int opt_group = 0;
    int64_t step = 0;
  };
  struct SpeculationStats {
    uint64_t speculated = 0;       // groups updated speculatively in a backward
    uint64_t speculated_host = 0;  // of those, into free host room
    uint64_t speculated_nvme = 0;  // of those, copy-on-write to fresh NVMe regions
    uint64_t committed = 0;        // of those, adopted by Step
    uint64_t dropped = 0;          // of those, dropped (then updated as without speculation)
    uint64_t no_room = 0;  // groups not speculated: no free host room and no NVMe room either
    Bytes nvme_bytes_in_flight = 0;  // NVMe regions of live speculations, now
    Bytes nvme_bytes_peak = 0;       // the most at once
    uint64_t prefetched = 0;         // inputs read ahead of a speculation (PrefetchHint started)
  };

  // Sized for `layout` (its groups fixed by then; their chunk ids may be filled later).
  // `layout`, `config` (the device kind resolved), `owner`, `stack` and `trace` must outlive
  // the stepper.
  OptimizerStepper(const Layout& layout, const SessionConfig& config, StepperOwner* owner,
                   TierStack* stack, TraceRecorder* trace);
  OptimizerStepper(const OptimizerStepper&) = delete;
  OptimizerStepper& operator=(const OptimizerStepper&) = delete;

  // ---- runs ---------------------------------------------------------------------------------
  // Runs of tensors of `group` with a gradient (`every_trainable`: of every trainable one) that
  // are adjacent in the chunk; with `same_step`, a run also needs one opt_group and one step
  // count.
  std::vector<Run> GradRuns(size_t group, bool same_step, bool every_trainable = false) const;
  // `runs` clipped to this rank's shard and moved to shard coordinates (the identity when not
  // sharded).
  std::vector<Run> LocalRuns(std::vector<Run> runs) const;

  // ---- step counts --------------------------------------------------------------------------
  int64_t step_count(size_t tensor) const { return steps_[tensor]; }
  // Sets it as given: the caller has run the group's pending update and dropped its
  // speculation first (they counted the old value).
  void set_step_count(size_t tensor, int64_t steps) { steps_[tensor] = steps; }

  // ---- the applied step ---------------------------------------------------------------------
  // Places the optimizer at the first call, then, group by group, increments the step count
  // of every tensor with a gradient and updates the group over its runs with `hyper` (by
  // optimizer group, validated by the caller), `clip_coef` and `inv_loss_scale`: by adopting a
  // speculation that holds, else deferred (optimizer_overlap not "off", no chunk pinned), else
  // now. An update that fails names its group (the groups before it were stepped).
  Status Apply(const std::vector<GroupHyper>& hyper, float clip_coef, float inv_loss_scale);

  // ---- deferred updates ---------------------------------------------------------------------
  // Runs `group`'s pending update (if any) before something touches the group. `quiet`: an
  // access path other than the announced forward (values, checkpoints, an eval forward, the
  // next Step): the update is not a moment and its acquires are neither recorded nor checked
  // against a plan — as untraced acquires, it must not disturb the training order.
  Status RunPending(size_t group, bool quiet);
  Status RunAllPending(bool quiet);  // in group order
  size_t pending_steps() const { return num_pending_; }
  bool pending(size_t group) const { return pending_[group].active; }
  // Clearing `group`'s grads while its update is pending (it reads them first): true when it
  // is, and the update zeroes them after it runs; false when nothing is pending.
  bool ZeroGradsAfterPending(size_t group);

  // ---- speculative updates ------------------------------------------------------------------
  // The hyper-parameters the next Step will be given (the file comment); nothing is
  // speculated until they are announced.
  void SetStepHyper(std::vector<GroupHyper> hyper) {
    spec_hyper_ = std::move(hyper);
    spec_hyper_set_ = true;
  }
  // `group`'s inputs are about to change or changed: its speculation, if any, is dropped.
  void DropSpeculation(size_t group);
  void DropSpeculations();
  const SpeculationStats& speculation_stats() const { return spec_stats_; }

  // ---- what the session reports -------------------------------------------------------------
  // An iteration begins: a speculation whose step never came is dropped, and the last
  // iteration's grad writes become the completeness guide of this one's backward.
  void BeginIteration();
  // A grad chunk of `group` was released modified (in the current backward moment).
  void GradWritten(size_t group) { grad_done_[group] = bwd_moments_; }
  // After the session's moment of `kind` (its plan actions issued): a pre-backward moment is
  // counted, and with optimizer_overlap: backward the groups complete by now are speculated
  // (their acquires are this moment's).
  void AfterMoment(planners::MomentKind kind);

  // ---- placement ----------------------------------------------------------------------------
  bool placed() const { return placed_; }
  bool OnDevice(size_t group) const {
    return placed_ && group < on_device_.size() && on_device_[group] != 0;
  }

 private:
  // The applied step's factors (Apply), used by every group's update of that step.
  struct StepArgs {
    std::vector<GroupHyper> hyper;
    float clip_coef = 1.0f;
    float inv_loss_scale = 1.0f;
  };
  // A deferred update (optimizer_overlap: next-forward).
  struct Pending {
    bool active = false;
    bool zero_grad_after = false;   // ZeroGrad/ZeroChunk(grad) came while pending
    std::vector<Run> runs;          // LocalRuns(GradRuns(g, true)) at Step
    uint64_t work = 0;              // elements updated
    std::vector<uint32_t> stepped;  // tensors whose step count Step incremented
  };
  // A speculative update (optimizer_overlap: backward).
  struct Speculation {
    bool active = false;
    std::vector<Run> runs;          // every trainable tensor, steps as Step will count them
    std::vector<GroupHyper> hyper;  // by optimizer group, as used
    float inv_loss_scale = 1.0f;
    std::array<Region, chunks::kNumChunkKinds> shadow{};  // host scratch by kind (bytes 0: none)
    // Copy-on-write to NVMe: NVMe scratch by kind (bytes 0: none); shadow is then unused.
    std::array<Region, chunks::kNumChunkKinds> nvme{};
  };

  chunks::Engine* engine() const;  // the stack's
  ChunkId Chunk(size_t group, chunks::ChunkKind kind) const;
  // The bytes of that chunk; 0 when the group has none of `kind`.
  Bytes ChunkBytes(size_t group, chunks::ChunkKind kind) const;
  // Where group g's update runs (its chunks acquired there).
  TierKind UpdateTier(size_t g) const { return OnDevice(g) ? TierKind::kDevice : TierKind::kHost; }
  // Decides on_device_ (the file comment's rule).
  void Place();
  // One group's AdamW update over `runs` (step_args_ as captured by Apply), on UpdateTier;
  // `quiet`: see RunPending. On an acquire failure nothing ran and the `stepped` tensors' step
  // counts are restored.
  Status UpdateGroup(size_t gi, const std::vector<Run>& runs, uint64_t work,
                     const std::vector<uint32_t>& stepped, bool quiet = false);
  // The AdamW update of `run` of group `gi` on the chunks at `v` (by kind), in place — on the
  // device's stream when `device`, else the CPU kernel now; with `in`, out of place: the old
  // params (and fp32 m and v) read there (host only; compressed m and v are updated in place
  // at `v`). m and v in the group's state format.
  // `out_origin` (out of place only, uncompressed state): the element of the chunk that the
  // outputs at `v` start at (a staging slice); the gradient and `in` are whole chunks.
  Status RunAdam(size_t gi, const std::array<char*, chunks::kNumChunkKinds>& v, const Run& run,
                 const GroupHyper& h, float inv_loss_scale, float clip, bool device,
                 const std::array<char*, chunks::kNumChunkKinds>* in = nullptr,
                 uint64_t out_origin = 0);
  bool GroupPinned(size_t gi) const;
  // SpeculateReady: at a pre-backward moment, every group complete per the previous
  // iteration. Speculate: one group (not speculated when the host lacks the room or an input
  // cannot be acquired: the step then runs as without).
  void SpeculateReady();
  Status Speculate(size_t gi);
  // The two places a speculation goes (the file comment), its outputs `state` (by kind) and
  // the inputs `in` acquired on the host (the grad too). On an error nothing is kept.
  using KindPtrs = std::array<char*, chunks::kNumChunkKinds>;
  Status SpeculateOnHost(size_t gi, Speculation& sp, const std::vector<chunks::ChunkKind>& state,
                         const KindPtrs& in);
  Status SpeculateOnNvme(size_t gi, Speculation& sp, const std::vector<chunks::ChunkKind>& state,
                         const KindPtrs& in);
  // Reads ahead the NVMe-homed optimizer state of the groups whose gradients complete at the
  // next backward moment (SpeculateReady's guide), for their speculation.
  void PrefetchNextReady();
  // Whether Apply's update of `gi` over `runs` with step_args_ is the one speculated.
  bool SpeculationHolds(size_t gi, const std::vector<Run>& runs) const;
  // Adopts the speculated values. `*committed` false: nothing was adopted (an error is
  // returned, the speculation dropped; the update runs as without). True with an error: a
  // copy-on-write commit failed part way (an NVMe read back into a host home): the step fails.
  Status CommitSpeculation(size_t gi, bool* committed);
  void FreeShadows(Speculation& sp);

  const Layout& layout_;
  const SessionConfig& config_;
  StepperOwner* const owner_;
  TierStack* const stack_;
  TraceRecorder* const trace_;
  std::vector<int64_t> steps_;  // per tensor
  StepArgs step_args_;
  std::vector<Pending> pending_;  // per group
  size_t num_pending_ = 0;
  std::vector<Speculation> spec_;    // per group
  std::vector<uint8_t> spec_tried_;  // per group: this backward
  std::vector<GroupHyper> spec_hyper_;
  bool spec_hyper_set_ = false;
  // Per group: the count of pre-backward moments when its grad chunk was last written, in this
  // iteration and in the previous one (kNotWritten: not at all).
  static constexpr uint32_t kNotWritten = UINT32_MAX;
  std::vector<uint32_t> grad_done_, grad_done_prev_;
  uint32_t bwd_moments_ = 0;
  SpeculationStats spec_stats_;
  bool placed_ = false;
  std::vector<uint8_t> on_device_;  // per group: steps on the device
};

}  // namespace tiermem::session
