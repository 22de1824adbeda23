// Divergence checking (divergence.h): an observed iteration against its plan.
//
// The plan's moments split into two subsequences. The *stream* — every moment but the
// optimizer sub-steps — must come in the planned order, each with the planned label and
// kind. The *steps* (MomentKind::kOptimizerStep) are matched by label with the first planned
// step not seen yet, in any order (a CPU step may interleave with the backward, a deferred
// update runs in whichever forward first touches its group); a planned step that never comes
// is not a divergence. Within a moment every access must name a chunk the plan has there —
// on the planned tier, except in a step, whose tier the session chooses — and at the moment's
// close every planned access must have been seen (with its mode, when modes are checked: the
// needs-content / modifies flags of the chunk's first access in the moment, with modifies
// added by any later write). The first failure is latched in `div_` with where it showed;
// every later call returns false until Reset. An iteration that ends with stream moments left
// is kShorter; a stream moment beyond the plan, or a step once every planned one was seen,
// is kLonger. With expert classes, member accesses are skipped on both sides, and a step not
// in the plan is pending until its first access: a member makes it a class step (accepted,
// its accesses unchecked), a dense chunk the divergence it would have been at once.
//
// Ownership and threading: the checker borrows the plan (the caller's, outliving it) and is
// externally synchronized: the plan runner calls it from the session's thread.
#include "planners/divergence.h"

#include <string>
#include <utility>

namespace tiermem::planners {

std::string_view DivergenceKindName(DivergenceKind k) {
  switch (k) {
    case DivergenceKind::kNone:
      return "none";
    case DivergenceKind::kMoment:
      return "moment";
    case DivergenceKind::kAccess:
      return "access";
    case DivergenceKind::kShorter:
      return "shorter";
    case DivergenceKind::kLonger:
      return "longer";
  }
  return "?";
}

namespace {

uint8_t Flags(bool needs, bool modifies) { return (needs ? 1 : 0) | (modifies ? 2 : 0); }
uint8_t ModeFlags(AccessMode m) { return Flags(Reads(m), Writes(m)); }

}  // namespace

Divergence FindDivergence(const Plan& plan, const Trace& trace, const TraceIteration& observed) {
  DivergenceChecker ck(&plan);
  ck.Reset();
  for (const Moment& m : observed.moments) {
    if (!ck.OnMoment(m.label, m.kind)) return ck.divergence();
    for (uint32_t a = 0; a < m.num_accesses; ++a) {
      const TraceAccess& ta = observed.accesses[m.first_access + a];
      if (!ck.OnAccess(ta.chunk, ta.mode, ta.tier)) return ck.divergence();
    }
  }
  ck.EndIteration();
  return ck.divergence();
}

DivergenceChecker::DivergenceChecker(const Plan* plan, bool check_modes)
    : plan_(plan), check_modes_(check_modes) {
  for (uint32_t i = 0; i < plan_->moments.size(); ++i) {
    (plan_->moments[i].kind == MomentKind::kOptimizerStep ? steps_ : stream_).push_back(i);
  }
  Reset();
}

void DivergenceChecker::Reset() {
  next_stream_ = next_step_ = 0;
  step_seen_.assign(steps_.size(), false);
  cur_ = -1;
  observed_ = 0;
  seen_.clear();
  div_ = Divergence();
}

bool DivergenceChecker::Fail(DivergenceKind kind, std::string reason) {
  if (div_.diverged()) return false;
  div_.kind = kind;
  div_.observed_moment = observed_ == 0 ? 0 : observed_ - 1;
  div_.planned_moment = cur_ < 0 ? 0 : static_cast<uint32_t>(cur_);
  div_.reason = std::move(reason);
  return false;
}

bool DivergenceChecker::CloseMoment() {
  if (cur_ == kPendingStep || cur_ == kClassStep) {
    cur_ = -1;  // a step without accesses, or an expert's: the class policy's
    return true;
  }
  if (cur_ < 0) return true;
  const PlannedMoment& pm = plan_->moments[cur_];
  for (uint32_t k = 0; k < pm.num_accesses; ++k) {
    const TraceAccess& ex = plan_->accesses[pm.first_access + k];
    if (IsMember(ex.chunk)) continue;  // the routing's choice
    bool ok = false;
    for (const auto& [c, f] : seen_) {
      if (c == ex.chunk) {
        ok = !check_modes_ || f == ModeFlags(ex.mode);
        break;
      }
    }
    if (!ok) {
      return Fail(DivergenceKind::kAccess,
                  "moment " + std::to_string(observed_ - 1) + " (" + pm.label + "): chunk " +
                      std::to_string(ex.chunk) + " was planned as " +
                      std::string(AccessModeName(ex.mode)) + " and not accessed so");
    }
  }
  cur_ = -1;
  seen_.clear();
  return true;
}

bool DivergenceChecker::OnMoment(std::string_view label, MomentKind kind) {
  if (div_.diverged()) return false;
  if (!CloseMoment()) return false;
  ++observed_;
  if (kind == MomentKind::kOptimizerStep) {
    // Steps may run in any order relative to each other and to the backward (overlap): the
    // first planned step with this label not seen yet.
    for (size_t k = 0; k < steps_.size(); ++k) {
      if (!step_seen_[k] && plan_->moments[steps_[k]].label == label) {
        step_seen_[k] = true;
        ++next_step_;
        cur_ = steps_[k];
        return true;
      }
    }
    const DivergenceKind k =
        next_step_ >= steps_.size() ? DivergenceKind::kLonger : DivergenceKind::kMoment;
    std::string reason = "moment " + std::to_string(observed_ - 1) + ": optimizer step " +
                         std::string(label) + " is not (or no longer) in the plan";
    if (plan_->expert_class.empty()) return Fail(k, std::move(reason));
    // Perhaps the step of an expert the routing chose: its first access tells.
    cur_ = kPendingStep;
    pending_ = std::move(reason);
    pending_kind_ = k;
    return true;
  }
  if (next_stream_ >= stream_.size()) {
    return Fail(DivergenceKind::kLonger, "moment " + std::to_string(observed_ - 1) + " (" +
                                             std::string(label) + ") is beyond the plan");
  }
  cur_ = stream_[next_stream_++];
  const PlannedMoment& pm = plan_->moments[cur_];
  if (pm.label != label || pm.kind != kind) {
    return Fail(DivergenceKind::kMoment,
                "moment " + std::to_string(observed_ - 1) + ": expected " + pm.label + " (" +
                    std::string(MomentKindName(pm.kind)) + "), got " + std::string(label) + " (" +
                    std::string(MomentKindName(kind)) + ")");
  }
  return true;
}

bool DivergenceChecker::OnAccess(ChunkId chunk, AccessMode mode, TierKind tier, bool member) {
  if (div_.diverged()) return false;
  member = member || IsMember(chunk);
  if (cur_ == kClassStep) return true;
  if (cur_ == kPendingStep) {
    if (!member) return Fail(pending_kind_, pending_);
    cur_ = kClassStep;
    return true;
  }
  if (cur_ < 0) return Fail(DivergenceKind::kAccess, "an access outside a moment");
  if (member) return true;  // the routing's choice
  const PlannedMoment& pm = plan_->moments[cur_];
  for (auto& [c, f] : seen_) {
    if (c == chunk) {
      f |= Writes(mode) ? 2 : 0;
      return true;
    }
  }
  const bool step = pm.kind == MomentKind::kOptimizerStep;
  for (uint32_t k = 0; k < pm.num_accesses; ++k) {
    const TraceAccess& ex = plan_->accesses[pm.first_access + k];
    if (ex.chunk != chunk) continue;
    if (!step && ex.tier != tier) {
      return Fail(DivergenceKind::kAccess,
                  "moment " + std::to_string(observed_ - 1) + " (" + pm.label + "): chunk " +
                      std::to_string(chunk) + " on " + std::string(TierKindName(tier)) +
                      ", planned on " + std::string(TierKindName(ex.tier)));
    }
    seen_.push_back({chunk, ModeFlags(mode)});
    return true;
  }
  return Fail(DivergenceKind::kAccess, "moment " + std::to_string(observed_ - 1) + " (" + pm.label +
                                           "): chunk " + std::to_string(chunk) +
                                           " was not planned there");
}

bool DivergenceChecker::EndIteration() {
  if (div_.diverged()) return false;
  if (!CloseMoment()) return false;
  // A planned optimizer step that did not come is not a divergence: a deferred update runs
  // unannounced when something touches its group before the forward does (session.h), and a
  // group without gradients is not stepped; the step's actions are only copies.
  if (next_stream_ < stream_.size()) {
    const uint32_t missing = stream_[next_stream_];
    ++observed_;
    cur_ = missing;
    return Fail(DivergenceKind::kShorter, "the iteration ended before planned moment " +
                                              std::to_string(missing) + " (" +
                                              plan_->moments[missing].label + ")");
  }
  return true;
}

}  // namespace tiermem::planners
