// OptimizerStepper (optimizer_stepper.h): placement, deferred and speculative updates.
//
// Invariants. A tensor's step count is incremented exactly when its AdamW update is counted —
// in Apply, for every tensor with a gradient of every trainable group — and given back only
// when an acquire of that update failed before any kernel ran (UpdateGroup). A group has at
// most one of: a pending update (pending_[g].active), a speculation (spec_[g].active);
// SpeculateReady skips pending, pinned and device-placed groups, and Apply resolves a
// speculation (commit or drop) before it defers or runs the group's update. A pending update
// is marked inactive before it runs, so the session's access paths it goes through
// (Acquire/Release call RunPending) see nothing pending and do not recurse. num_pending_
// counts the active entries of pending_. A speculation's shadows (host scratch) or NVMe
// regions (NVMe scratch, counted in nvme_bytes_in_flight) are live exactly while it is active;
// committing hands them to the engine (AdoptHostCopy, AdoptNvmeCopy), dropping frees them.
// The NVMe regions are fresh: no speculation ever writes a chunk's current home. Placement is
// decided once (placed_) and never revised: on_device_ is what UpdateTier and SpeculateReady read
// from then on. grad_done_ holds, per group, the pre-backward moment count (bwd_moments_) of this
// iteration's last grad write; at BeginIteration it becomes grad_done_prev_, the guide for when the
// next backward has completed a group's gradients.
//
// Ownership and threading: the stepper owns its bookkeeping and the speculation scratch
// (through the engine's AllocateScratch); it borrows the layout (layout.h) and the config, its
// owner (StepperOwner: the session's traced chunk access, moments and phases, the step
// decision's facts), the tier stack (the engine, tier stats) and the trace recorder (the
// optimizer work per sub-step), all of which outlive it. It runs on the session's
// thread only; device-placed kernels are enqueued on the session's compute stream and
// ordered by the chunk releases, host kernels run on that thread now.
#include "runtime/optimizer_stepper.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "base/logging.h"
#include "runtime/device_kernels.h"
#include "runtime/layout.h"
#include "runtime/tier_stack.h"
#include "runtime/trace_recorder.h"

namespace tiermem::session {
namespace {

int K(ChunkKind k) { return static_cast<int>(k); }

}  // namespace

OptimizerStepper::OptimizerStepper(const Layout& layout, const SessionConfig& config,
                                   StepperOwner* owner, TierStack* stack, TraceRecorder* trace)
    : layout_(layout), config_(config), owner_(owner), stack_(stack), trace_(trace) {
  const size_t groups = layout_.groups.size();
  steps_.assign(layout_.tensors.size(), 0);
  pending_.resize(groups);
  spec_.resize(groups);
  spec_tried_.assign(groups, 0);
  grad_done_.assign(groups, kNotWritten);
  grad_done_prev_.assign(groups, kNotWritten);
}

chunks::Engine* OptimizerStepper::engine() const { return stack_->engine(); }

Bytes OptimizerStepper::ChunkBytes(size_t group, ChunkKind kind) const {
  const ChunkId c = Chunk(group, kind);
  return c == kNoChunk ? 0 : engine()->ChunkBytes(c);
}

ChunkId OptimizerStepper::Chunk(size_t group, ChunkKind kind) const {
  return layout_.groups[group].chunks[K(kind)];
}

// ---- runs --------------------------------------------------------------------------------------

std::vector<OptimizerStepper::Run> OptimizerStepper::GradRuns(size_t group, bool same_step,
                                                              bool every_trainable) const {
  const ChunkGroup& g = layout_.groups[group];
  std::vector<Run> runs;
  for (const PieceRef& ref : g.pieces) {
    const uint32_t i = ref.tensor;
    if (every_trainable ? !layout_.tensors[i].trainable : !owner_->has_grad(i)) continue;
    const TensorPlace& t = layout_.tensors[i];
    const Piece& p = t.pieces[ref.piece];
    if (!runs.empty() && runs.back().hi == p.offset &&
        (!same_step || (runs.back().opt_group == t.opt_group && runs.back().step == steps_[i]))) {
      runs.back().hi = p.offset + p.numel;
    } else {
      runs.push_back(Run{p.offset, p.offset + p.numel, t.opt_group, steps_[i]});
    }
  }
  return runs;
}

std::vector<OptimizerStepper::Run> OptimizerStepper::LocalRuns(std::vector<Run> runs) const {
  if (!layout_.sharded()) return runs;
  std::vector<Run> out;
  const uint64_t b = layout_.shard_begin;
  const uint64_t e = b + layout_.shard_elems;
  for (Run r : runs) {
    const uint64_t lo = std::max(r.lo, b), hi = std::min(r.hi, e);
    if (lo >= hi) continue;
    r.lo = lo - b;
    r.hi = hi - b;
    out.push_back(r);
  }
  return out;
}

// ---- the applied step ---------------------------------------------------------------------------

Status OptimizerStepper::Apply(const std::vector<GroupHyper>& hyper, float clip_coef,
                               float inv_loss_scale) {
  if (!placed_) Place();
  step_args_.hyper = hyper;
  step_args_.clip_coef = clip_coef;
  step_args_.inv_loss_scale = inv_loss_scale;
  const bool defer = DefersSteps(config_.optimizer_overlap);
  for (size_t gi = 0; gi < layout_.groups.size(); ++gi) {
    const ChunkGroup& g = layout_.groups[gi];
    if (!g.trainable) continue;
    // A tensor's step is counted once, at the group of its first piece (the lowest: pieces
    // are packed in order), before the runs of its later groups read it.
    std::vector<uint32_t> stepped;
    bool any = false;
    for (uint32_t i : g.tensors) {
      if (!owner_->has_grad(i)) continue;
      any = true;
      if (layout_.tensors[i].pieces.front().group == gi) {
        ++steps_[i];
        stepped.push_back(i);
      }
    }
    if (!any) continue;
    std::vector<Run> runs = LocalRuns(GradRuns(gi, true));
    if (runs.empty()) continue;  // none of it in this rank's shard
    if (spec_[gi].active) {
      // Committed: the update is done (the step counts above are its). Dropped, or a commit
      // that could not be made: updated as without speculation, below.
      if (SpeculationHolds(gi, runs)) {
        bool committed = false;
        Status c = CommitSpeculation(gi, &committed);
        if (committed && !c.ok()) {
          return c.WithContext("optimizer step of chunk group " + std::to_string(gi) +
                               ": adopting its speculative update (groups before it were "
                               "stepped)");
        }
        if (committed) continue;
      }
      DropSpeculation(gi);
    }
    uint64_t work = 0;
    for (const Run& run : LocalRuns(GradRuns(gi, false))) work += run.hi - run.lo;
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
                           std::to_string(layout_.groups.size()) +
                           " (groups before it were stepped)");
    }
  }
  return OkStatus();
}

Status OptimizerStepper::UpdateGroup(size_t gi, const std::vector<Run>& runs, uint64_t work,
                                     const std::vector<uint32_t>& stepped, bool quiet) {
  // Acquired in this order (compute params first), released in any order.
  std::vector<ChunkKind> kinds = {layout_.compute_kind(), ChunkKind::kGrad, ChunkKind::kExpAvg,
                                  ChunkKind::kExpAvgSq};
  if (layout_.mixed()) kinds.push_back(ChunkKind::kParamFp32);
  const TierKind where = UpdateTier(gi);
  chunks::Engine* eng = engine();
  if (!quiet) {
    // Named by group: a plan matches a deferred update by its label, whichever unit's
    // forward runs it.
    const std::string label =
        where == TierKind::kDevice ? "optimizer-substep:device:g" : "optimizer-substep:host:g";
    owner_->Moment(label + std::to_string(gi), planners::MomentKind::kOptimizerStep);
    trace_->SetWorkElems(work, where == TierKind::kDevice);
  }
  std::array<char*, chunks::kNumChunkKinds> v{};
  size_t acquired = 0;
  Status s;
  for (; acquired < kinds.size(); ++acquired) {
    StatusOr<void*> p = quiet ? eng->Acquire(Chunk(gi, kinds[acquired]), where)
                              : owner_->Acquire(gi, kinds[acquired], where);
    if (!p.ok()) {
      s = p.status();
      break;
    }
    v[K(kinds[acquired])] = static_cast<char*>(*p);
  }
  for (const Run& run : s.ok() ? runs : std::vector<Run>{}) {
    // On the device: enqueued on the compute stream (the releases below record it). On the
    // host: the CPU kernel, now (host copies are the CPU's; nothing orders a stream there).
    s = RunAdam(gi, v, run, step_args_.hyper[run.opt_group], step_args_.inv_loss_scale,
                step_args_.clip_coef, where == TierKind::kDevice);
    if (!s.ok()) break;
  }
  // All acquired: the kernel ran (on some runs at least): the chunks are modified. An
  // acquire that failed came before any kernel: nothing was.
  const bool ran = acquired == kinds.size();
  for (size_t k = 0; k < acquired; ++k) {
    const bool modified = ran && kinds[k] != ChunkKind::kGrad;
    Status rel = quiet ? eng->Release(Chunk(gi, kinds[k]), modified)
                       : owner_->Release(gi, kinds[k], modified);
    if (s.ok()) s = rel;
  }
  if (!s.ok() && !ran) {
    for (uint32_t i : stepped) --steps_[i];  // this group was not stepped
  }
  return s;
}

Status OptimizerStepper::RunAdam(size_t gi, const std::array<char*, chunks::kNumChunkKinds>& v,
                                 const Run& run, const GroupHyper& h, float inv_loss_scale,
                                 float clip, bool device,
                                 const std::array<char*, chunks::kNumChunkKinds>* in,
                                 uint64_t out_origin) {
  const kernels::DType gd = layout_.dtype(ChunkKind::kGrad);
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
  const uint64_t at = run.lo - out_origin;  // the outputs' element
  sp.param = reinterpret_cast<float*>(v[K(ChunkKind::kParamFp32)]) + at;
  const kernels::StateFormat& f = layout_.groups[gi].state;
  if (f.compressed()) {
    // Codes at run.lo; int8's absmax after the chunk's codes, one per block (run.lo is on a
    // block boundary: tensors and shards are aligned to it).
    const bool int8 = f.dtype == kernels::StateDType::kInt8;
    const size_t es = int8 ? 1 : 2;
    const uint64_t elems = layout_.shard_elems;
    auto ref = [&](ChunkKind k) {
      char* base = v[K(k)];
      return kernels::StateRef{
          base + run.lo * es,
          int8 ? reinterpret_cast<float*>(base + elems) + run.lo / f.block : nullptr};
    };
    sp.state = f;
    sp.exp_avg_q = ref(ChunkKind::kExpAvg);
    sp.exp_avg_sq_q = ref(ChunkKind::kExpAvgSq);
    // Stochastic rounding's key: a different draw for every step, group and run.
    ac.rounding_seed =
        (static_cast<uint64_t>(run.step) << 32) ^ (gi * 0x9E3779B97F4A7C15ull) ^ run.lo;
  } else {
    sp.exp_avg = reinterpret_cast<float*>(v[K(ChunkKind::kExpAvg)]) + at;
    sp.exp_avg_sq = reinterpret_cast<float*>(v[K(ChunkKind::kExpAvgSq)]) + at;
  }
  const char* grad = in != nullptr ? (*in)[K(ChunkKind::kGrad)] : v[K(ChunkKind::kGrad)];
  sp.grad = grad + run.lo * kernels::DTypeSize(gd);
  sp.grad_dtype = gd;
  if (layout_.mixed()) {
    sp.param_out = v[K(ChunkKind::kParamLowp)] + at * 2;
    sp.out_dtype = layout_.compute_dtype();
  }
  sp.n = run.hi - run.lo;
  if (in != nullptr) {
    sp.param_in = reinterpret_cast<const float*>((*in)[K(ChunkKind::kParamFp32)]) + run.lo;
    if (!f.compressed()) {
      sp.exp_avg_in = reinterpret_cast<const float*>((*in)[K(ChunkKind::kExpAvg)]) + run.lo;
      sp.exp_avg_sq_in = reinterpret_cast<const float*>((*in)[K(ChunkKind::kExpAvgSq)]) + run.lo;
    }
  }
  return DeviceAdamStep(IsCuda(config_.device_kind) && device, ac, sp,
                        device ? owner_->compute_stream() : kHostStream);
}

bool OptimizerStepper::GroupPinned(size_t gi) const {
  for (ChunkId c : layout_.groups[gi].chunks) {
    if (c != kNoChunk && engine()->Pins(c) > 0) return true;
  }
  return false;
}

// ---- deferred updates ------------------------------------------------------------------------

Status OptimizerStepper::RunPending(size_t group, bool quiet) {
  if (group >= pending_.size() || !pending_[group].active) return OkStatus();
  Pending p = std::move(pending_[group]);
  pending_[group] = Pending();  // inactive before the update's own acquires come through here
  --num_pending_;
  const RunPhase phase = owner_->phase();
  chunks::Engine* eng = engine();
  owner_->Phase(RunPhase::kOptimizer);
  if (quiet && owner_->tracing()) eng->SetTracing(false);
  Status s = UpdateGroup(group, p.runs, p.work, p.stepped, quiet);
  if (quiet && owner_->tracing()) eng->SetTracing(true);
  if (s.ok() && p.zero_grad_after && engine()->Pins(Chunk(group, ChunkKind::kGrad)) == 0) {
    s = eng->Zero(Chunk(group, ChunkKind::kGrad));
  }
  if (phase != RunPhase::kNone) owner_->Phase(phase);
  if (!s.ok()) {
    return s.WithContext("the optimizer update of chunk group " + std::to_string(group) +
                         ", deferred from the last step() (optimizer_overlap: " +
                         std::string(ModeName(config_.optimizer_overlap)) + ")");
  }
  return OkStatus();
}

Status OptimizerStepper::RunAllPending(bool quiet) {
  for (size_t gi = 0; gi < pending_.size() && num_pending_ > 0; ++gi) {
    TIERMEM_RETURN_IF_ERROR(RunPending(gi, quiet));
  }
  return OkStatus();
}

bool OptimizerStepper::ZeroGradsAfterPending(size_t group) {
  if (group >= pending_.size() || !pending_[group].active) return false;
  pending_[group].zero_grad_after = true;  // the update reads these grads first
  return true;
}

// ---- speculative updates ---------------------------------------------------------------------

void OptimizerStepper::SpeculateReady() {
  if (!spec_hyper_set_ || !placed_ || layout_.sharded() || !owner_->next_step_applies()) {
    return;
  }
  for (size_t gi = 0; gi < layout_.groups.size(); ++gi) {
    if (!layout_.groups[gi].trainable || spec_tried_[gi] || spec_[gi].active) continue;
    // Complete as far as the last iteration shows, and written in this one.
    if (grad_done_prev_[gi] >= bwd_moments_ || grad_done_[gi] == kNotWritten) continue;
    spec_tried_[gi] = 1;
    if (OnDevice(gi) || (gi < pending_.size() && pending_[gi].active) || GroupPinned(gi)) {
      continue;
    }
    Status st = Speculate(gi);
    if (!st.ok()) {
      // The update itself will run in Step or after it, and report what it meets.
      TIERMEM_LOG(kDebug) << "speculative step of chunk group " << gi << ": " << st.message();
    }
  }
}

void OptimizerStepper::PrefetchNextReady() {
  if (!spec_hyper_set_ || !placed_ || layout_.sharded() || stack_->nvme() == nullptr ||
      !owner_->next_step_applies()) {
    return;
  }
  chunks::Engine* eng = engine();
  for (size_t gi = 0; gi < layout_.groups.size(); ++gi) {
    // Complete after the next moment's writes, as the last iteration shows.
    if (!layout_.groups[gi].trainable || spec_tried_[gi] || spec_[gi].active ||
        grad_done_prev_[gi] != bwd_moments_ || OnDevice(gi) ||
        (gi < pending_.size() && pending_[gi].active)) {
      continue;
    }
    std::vector<ChunkKind> kinds = {ChunkKind::kExpAvg, ChunkKind::kExpAvgSq};
    if (layout_.mixed()) kinds.push_back(ChunkKind::kParamFp32);
    for (ChunkKind k : kinds) {
      const ChunkId c = Chunk(gi, k);
      if (c == kNoChunk || eng->Home(c) != TierKind::kNvme) continue;
      StatusOr<bool> started = eng->PrefetchHint(c, TierKind::kHost);
      if (started.ok() && *started) ++spec_stats_.prefetched;
    }
  }
}

Status OptimizerStepper::Speculate(size_t gi) {
  Speculation sp;
  // Every trainable tensor stepped (the binding says which have a gradient only at step()),
  // step counts as Step will make them (one more each: the runs merge alike).
  sp.runs = GradRuns(gi, true, true);
  for (Run& r : sp.runs) {
    if (static_cast<size_t>(r.opt_group) >= spec_hyper_.size()) return OkStatus();
    ++r.step;
  }
  if (sp.runs.empty()) return OkStatus();
  std::vector<ChunkKind> state = {layout_.compute_kind(), ChunkKind::kExpAvg, ChunkKind::kExpAvgSq};
  if (layout_.mixed()) state.push_back(ChunkKind::kParamFp32);
  Bytes need = 0;
  for (ChunkKind k : state) need += ChunkBytes(gi, k);
  chunks::Engine* eng = engine();
  const TierStats hs = stack_->host()->Stats();
  const Bytes ext = eng->external_bytes(TierKind::kHost);
  const Bytes room = hs.capacity > hs.used + ext ? hs.capacity - hs.used - ext : 0;
  const bool on_host = room >= 2 * need;
  if (!on_host) {
    // Copy-on-write to NVMe: its fresh regions first (no room: not speculated).
    if (stack_->nvme() == nullptr || layout_.groups[gi].state.compressed()) {
      ++spec_stats_.no_room;
      return OkStatus();
    }
    for (ChunkKind k : state) {
      StatusOr<Region> r =
          eng->AllocateScratch(TierKind::kNvme, ChunkBytes(gi, k), Category::kOptimState);
      if (!r.ok()) {
        FreeShadows(sp);
        ++spec_stats_.no_room;
        return OkStatus();
      }
      sp.nvme[K(k)] = *r;
      spec_stats_.nvme_bytes_in_flight += r->bytes;
    }
    spec_stats_.nvme_bytes_peak =
        std::max(spec_stats_.nvme_bytes_peak, spec_stats_.nvme_bytes_in_flight);
  }
  sp.hyper = spec_hyper_;
  sp.inv_loss_scale = static_cast<float>(1.0 / owner_->loss_scale());
  // The inputs on the host, traced (the next iteration's order prefetches them here).
  KindPtrs in{};
  std::vector<ChunkKind> inputs = state, acquired;
  inputs.push_back(ChunkKind::kGrad);
  Status s;
  for (ChunkKind k : inputs) {
    StatusOr<void*> p = owner_->Acquire(gi, k, TierKind::kHost);
    if (!p.ok()) {
      s = p.status();
      break;
    }
    acquired.push_back(k);
    in[K(k)] = static_cast<char*>(*p);
  }
  if (s.ok()) {
    s = on_host ? SpeculateOnHost(gi, sp, state, in) : SpeculateOnNvme(gi, sp, state, in);
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
  ++(on_host ? spec_stats_.speculated_host : spec_stats_.speculated_nvme);
  return OkStatus();
}

Status OptimizerStepper::SpeculateOnHost(size_t gi, Speculation& sp,
                                         const std::vector<ChunkKind>& state, const KindPtrs& in) {
  chunks::Engine* eng = engine();
  KindPtrs out{};
  for (ChunkKind k : state) {
    StatusOr<Region> r =
        eng->AllocateScratch(TierKind::kHost, ChunkBytes(gi, k), Category::kOptimState);
    if (!r.ok()) return r.status();
    sp.shadow[K(k)] = *r;
    out[K(k)] = static_cast<char*>(r->addr);
  }
  // The shadows become the homes at commit: the runs are written by the out-of-place
  // update, every other byte (tensors without grads, padding) is copied.
  std::vector<std::pair<uint64_t, uint64_t>> covered;
  for (const Run& run : sp.runs) covered.emplace_back(run.lo, run.hi);
  std::sort(covered.begin(), covered.end());
  for (ChunkKind k : state) {
    if ((k == ChunkKind::kExpAvg || k == ChunkKind::kExpAvgSq) &&
        layout_.groups[gi].state.compressed()) {
      // Compressed m and v are updated in place: the shadow starts as all of the input.
      std::memcpy(out[K(k)], in[K(k)], ChunkBytes(gi, k));
      continue;
    }
    const Bytes es = kernels::DTypeSize(layout_.dtype(k));
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
    TIERMEM_RETURN_IF_ERROR(
        RunAdam(gi, out, run, sp.hyper[run.opt_group], sp.inv_loss_scale, 1.0f, false, &in));
  }
  return OkStatus();
}

Status OptimizerStepper::SpeculateOnNvme(size_t gi, Speculation& sp,
                                         const std::vector<ChunkKind>& state, const KindPtrs& in) {
  // Slices of an eighth of the group's elements, two in flight: one is computed while the
  // other's pieces are written to the new regions. In units of 2 Ki elements where they are
  // that large (every kind's piece then whole 4 KiB blocks: the NVMe tier's direct path),
  // else 256.
  const ChunkKind ck = layout_.compute_kind();
  const uint64_t elems = ChunkBytes(gi, ck) / kernels::DTypeSize(layout_.dtype(ck));
  const uint64_t unit = elems / 8 >= 2048 ? 2048 : 256;
  const uint64_t slice = std::min(elems, std::max(unit, elems / 8 / unit * unit));
  Bytes per_elem = 0;
  for (ChunkKind k : state) per_elem += kernels::DTypeSize(layout_.dtype(k));
  chunks::Engine* eng = engine();
  Tier* nvme = stack_->nvme();
  StatusOr<Region> staging =
      eng->AllocateScratch(TierKind::kHost, 2 * slice * per_elem, Category::kOptimState);
  if (!staging.ok()) return staging.status();
  std::array<std::vector<std::shared_ptr<Completion>>, 2> writes;
  Status s;
  for (uint64_t a = 0, i = 0; s.ok() && a < elems; a += slice, ++i) {
    const uint64_t b = std::min(elems, a + slice);
    auto& mine = writes[i % 2];
    s = WaitAll(mine);  // this buffer's writes of two slices ago
    mine.clear();
    if (!s.ok()) break;
    // The slice of every output kind, from the inputs (bytes outside the runs stay as they
    // are), then the runs inside it updated out of place over it.
    KindPtrs out{};
    char* at = static_cast<char*>(staging->addr) + (i % 2) * slice * per_elem;
    for (ChunkKind k : state) {
      const Bytes es = kernels::DTypeSize(layout_.dtype(k));
      out[K(k)] = at;
      std::memcpy(at, in[K(k)] + a * es, (b - a) * es);
      at += slice * es;
    }
    for (const Run& run : sp.runs) {
      const uint64_t lo = std::max(run.lo, a), hi = std::min(run.hi, b);
      if (lo >= hi) continue;
      s = RunAdam(gi, out, Run{lo, hi, run.opt_group, run.step}, sp.hyper[run.opt_group],
                  sp.inv_loss_scale, 1.0f, false, &in, a);
      if (!s.ok()) break;
    }
    for (ChunkKind k : s.ok() ? state : std::vector<ChunkKind>{}) {
      const Bytes es = kernels::DTypeSize(layout_.dtype(k));
      mine.push_back(nvme->Copy(
          CopyRequest{sp.nvme[K(k)], a * es, out[K(k)], (b - a) * es, CopyDir::kToTier}));
    }
  }
  // Every write done (or failed) before the staging goes back.
  for (auto& w : writes) {
    Status ws = WaitAll(w);
    if (s.ok()) s = ws;
  }
  Status f = eng->FreeScratch(TierKind::kHost, *staging, Category::kOptimState);
  return s.ok() ? f : s;
}

bool OptimizerStepper::SpeculationHolds(size_t gi, const std::vector<Run>& runs) const {
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

Status OptimizerStepper::CommitSpeculation(size_t gi, bool* committed) {
  *committed = false;
  Speculation& sp = spec_[gi];
  chunks::Engine* eng = engine();
  for (int k = 0; k < chunks::kNumChunkKinds; ++k) {
    if (sp.shadow[k].bytes == 0 && sp.nvme[k].bytes == 0) continue;
    Status s = eng->PrepareAdopt(Chunk(gi, static_cast<ChunkKind>(k)));
    if (!s.ok()) {
      DropSpeculation(gi);
      return s;
    }
  }
  // Prepared: every adoption installs its region (an error left is the old copies' free, or
  // a copy-on-write read back into a host home, which fails the step).
  *committed = true;
  Status result;
  for (int k = 0; k < chunks::kNumChunkKinds; ++k) {
    const ChunkId c = Chunk(gi, static_cast<ChunkKind>(k));
    if (sp.shadow[k].bytes != 0) {
      Status a = eng->AdoptHostCopy(c, sp.shadow[k]);
      if (!a.ok()) {
        TIERMEM_LOG(kWarn) << "speculative step: committing: " << a.message();
      }
    }
    if (sp.nvme[k].bytes != 0) {
      const bool host_home = eng->Home(c) == TierKind::kHost;
      Status a = eng->AdoptNvmeCopy(c, sp.nvme[k]);
      spec_stats_.nvme_bytes_in_flight -=
          std::min(spec_stats_.nvme_bytes_in_flight, sp.nvme[k].bytes);
      if (!a.ok() && host_home && result.ok()) result = a;
      if (!a.ok() && !host_home) {
        TIERMEM_LOG(kWarn) << "speculative step: committing: " << a.message();
      }
    }
  }
  sp = Speculation{};
  ++spec_stats_.committed;
  return result;
}

void OptimizerStepper::FreeShadows(Speculation& sp) {
  for (Region& r : sp.shadow) {
    if (r.bytes == 0) continue;
    Status s = engine()->FreeScratch(TierKind::kHost, r, Category::kOptimState);
    if (!s.ok()) {
      TIERMEM_LOG(kWarn) << "speculative step: freeing its scratch: " << s.message();
    }
    r = Region{};
  }
  for (Region& r : sp.nvme) {
    if (r.bytes == 0) continue;
    Status s = engine()->FreeScratch(TierKind::kNvme, r, Category::kOptimState);
    if (!s.ok()) {
      TIERMEM_LOG(kWarn) << "speculative step: freeing its NVMe regions: " << s.message();
    }
    spec_stats_.nvme_bytes_in_flight -= std::min(spec_stats_.nvme_bytes_in_flight, r.bytes);
    r = Region{};
  }
}

void OptimizerStepper::DropSpeculation(size_t gi) {
  if (gi >= spec_.size() || !spec_[gi].active) return;
  FreeShadows(spec_[gi]);
  spec_[gi] = Speculation{};
  ++spec_stats_.dropped;
}

void OptimizerStepper::DropSpeculations() {
  for (size_t gi = 0; gi < spec_.size(); ++gi) DropSpeculation(gi);
}

// ---- what the session reports ------------------------------------------------------------------

void OptimizerStepper::BeginIteration() {
  DropSpeculations();  // a backward whose step never came
  grad_done_prev_.swap(grad_done_);
  std::fill(grad_done_.begin(), grad_done_.end(), kNotWritten);
  std::fill(spec_tried_.begin(), spec_tried_.end(), 0);
  bwd_moments_ = 0;
}

void OptimizerStepper::AfterMoment(planners::MomentKind kind) {
  if (kind != planners::MomentKind::kPreBackward) return;
  ++bwd_moments_;
  if (!SpeculatesSteps(config_.optimizer_overlap)) return;
  SpeculateReady();
  PrefetchNextReady();
}

// ---- placement ---------------------------------------------------------------------------------

void OptimizerStepper::Place() {
  // Device-placed optimizer state stays cached on the device between steps only if the
  // forward and backward never need its room: so it gets only what the whole training working
  // set leaves — every group's compute and grad chunks (all cached at once, as they are when
  // nothing has to move) and the most activation/KV bytes the device held so far. Without
  // that room a group steps on the host, where moving its param and grad (2 x compute dtype
  // bytes per element) costs less than moving m and v up and back (16 bytes). Groups are
  // taken in order while room is left.
  placed_ = true;
  on_device_.assign(layout_.groups.size(), 0);
  // Host mode: there is no device; every group steps on the host, in place.
  if (!MayStepOnDevice(config_.optimizer_placement) || stack_->host_compute()) return;
  chunks::Engine* eng = engine();
  // (Sharded: the gathered full chunks the binding held as scratch count too.)
  const chunks::EngineStats est = eng->Stats();
  Bytes working = est.external_peak[static_cast<int>(TierKind::kDevice)] +
                  est.scratch_peak[static_cast<int>(TierKind::kDevice)];
  for (size_t gi = 0; gi < layout_.groups.size(); ++gi) {
    working += ChunkBytes(gi, layout_.compute_kind());
    if (layout_.groups[gi].trainable) working += ChunkBytes(gi, ChunkKind::kGrad);
  }
  const Bytes capacity = stack_->device()->Stats().capacity;
  Bytes left = capacity > working ? capacity - working : 0;
  size_t count = 0;
  for (size_t gi = 0; gi < layout_.groups.size(); ++gi) {
    if (!layout_.groups[gi].trainable) continue;
    Bytes need = ChunkBytes(gi, ChunkKind::kExpAvg) + ChunkBytes(gi, ChunkKind::kExpAvgSq);
    if (layout_.mixed()) need += ChunkBytes(gi, ChunkKind::kParamFp32);
    if (need > left) break;
    left -= need;
    on_device_[gi] = 1;
    ++count;
  }
  TIERMEM_LOG(kInfo) << "optimizer: " << count << " chunk group(s) step on the device ("
                     << ModeName(config_.device_kind) << "), the others on the host";
}

}  // namespace tiermem::session
