#include "runtime/plan_runner.h"

#include <utility>

#include "base/logging.h"

namespace tiermem::session {

using planners::ActionKind;
using planners::MomentKind;

void PlanRunner::Start(planners::Plan plan, engine::Engine* engine) {
  Stop();
  engine_ = engine;
  plan_ = std::make_unique<planners::Plan>(std::move(plan));
  checker_ = std::make_unique<planners::DivergenceChecker>(plan_.get(), /*check_modes=*/false);
  in_iteration_ = false;
  diverged_ = false;
  ++stats_.plans;
}

void PlanRunner::Stop() {
  if (engine_ != nullptr) engine_->SetPlanned(false);
  checker_.reset();
  plan_.reset();
  in_iteration_ = false;
  diverged_ = false;
}

bool PlanRunner::EndIteration() {
  if (!active() || !in_iteration_) return false;
  in_iteration_ = false;
  if (!diverged_ && !checker_->EndIteration()) Diverge();
  if (!diverged_) ++stats_.followed_iterations;
  return !diverged_;
}

void PlanRunner::BeginIteration() {
  if (!active()) return;
  checker_->Reset();
  diverged_ = false;
  in_iteration_ = true;
  fetches_.clear();
  ++stats_.planned_iterations;
  engine_->SetPlanned(true);
  // The recorder opens every iteration with this moment (trace_recorder.cc).
  Open("iteration-start", MomentKind::kOther);
}

void PlanRunner::Open(std::string_view label, MomentKind kind) {
  label_ = std::string(label);
  serial_ = (serial_ + 1) % 0x3fffffffu;
  if (!checker_->OnMoment(label, kind)) {
    Diverge();
    return;
  }
  Issue(checker_->current());
}

void PlanRunner::Moment(std::string_view label, MomentKind kind) {
  if (!active() || !in_iteration_ || diverged_ || paused_) return;
  Open(label, kind);
}

void PlanRunner::Access(ChunkId chunk, TierKind tier) {
  if (!active() || !in_iteration_ || diverged_ || paused_) return;
  if (chunk >= tier_in_moment_.size()) tier_in_moment_.resize(chunk + 1, ~0u);
  const uint32_t stamp = (serial_ << 2) | static_cast<uint32_t>(tier);
  if ((tier_in_moment_[chunk] >> 2) == serial_ && tier_in_moment_[chunk] != stamp) {
    Open(label_ + "+", MomentKind::kOther);  // the recorder split this moment here
    if (diverged_) return;
  }
  tier_in_moment_[chunk] = (serial_ << 2) | static_cast<uint32_t>(tier);
  if (!checker_->OnAccess(chunk, planners::AccessMode::kRead, tier)) Diverge();
}

void PlanRunner::Issue(int64_t planned_moment) {
  if (planned_moment < 0) return;
  const planners::PlannedMoment& pm = plan_->moments[static_cast<size_t>(planned_moment)];
  for (uint32_t k = 0; k < pm.num_actions; ++k) {
    const planners::PlanAction& a = plan_->actions[pm.first_action + k];
    StatusOr<bool> r = true;
    switch (a.kind) {
      case ActionKind::kEvict: r = engine_->PlanEvict(a.chunk, a.tier); break;
      case ActionKind::kPrefetch: r = engine_->PlanPrefetch(a.chunk, a.tier); break;
      case ActionKind::kFetchActivation: fetches_.push_back(a.unit); break;  // the binding's
    }
    if (!r.ok()) {
      // A move that cannot start is left to the reactive path (the acquire will need it).
      TIERMEM_LOG(kWarn) << "plan: " << planners::ActionKindName(a.kind) << " of chunk "
                         << a.chunk << " at " << pm.label << ": " << r.status().message();
    }
  }
}

bool PlanRunner::UnitIs(uint32_t unit, planners::ActivationPolicy policy) const {
  if (!following()) return false;
  for (const planners::UnitPlan& u : plan_->units) {
    if (u.unit == unit) return u.policy == policy;
  }
  return false;
}
bool PlanRunner::OffloadsUnit(uint32_t unit) const {
  return UnitIs(unit, planners::ActivationPolicy::kOffload);
}
bool PlanRunner::RecomputesUnit(uint32_t unit) const {
  return UnitIs(unit, planners::ActivationPolicy::kRecompute);
}

std::vector<uint32_t> PlanRunner::TakeActivationFetches() {
  std::vector<uint32_t> out;
  out.swap(fetches_);
  return out;
}

void PlanRunner::Diverge() {
  if (diverged_) return;
  diverged_ = true;
  ++stats_.divergences;
  stats_.last_divergence = checker_->divergence().reason;
  engine_->SetPlanned(false);  // reactive for the rest of this iteration
}

}  // namespace tiermem::session
