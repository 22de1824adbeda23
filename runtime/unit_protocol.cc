// The unit protocol (unit_protocol.h): the calls both bindings make at a unit's forward and
// backward, turned into the session's iterations, phases, deferred optimizer updates and
// moments. Everything here is order: which session call comes first. The deferred updates of
// a unit's groups run before its pre-forward moment, so that each is its own optimizer moment
// and the unit's moment acquires the updated chunks (optimizer_stepper.h, "deferred steps").
#include "runtime/unit_protocol.h"

#include <algorithm>
#include <iterator>

#include "runtime/session.h"

namespace tiermem::session {

UnitProtocol::UnitProtocol(Session* session) : session_(session) {}

StatusOr<uint32_t> UnitProtocol::Declare(UnitInfo info) {
  const std::string what = "unit " + std::to_string(units_.size()) + " ('" + info.name + "')";
  if (info.name.empty()) return InvalidArgumentError(what + ": a unit needs a name");
  if (units_.size() >= planners::kMaxUnits) {
    return OutOfRangeError(what + ": more than " + std::to_string(planners::kMaxUnits) + " units");
  }
  for (size_t i = 0; i < info.groups.size(); ++i) {
    if (info.groups[i] >= session_->layout().num_groups()) {
      return InvalidArgumentError(what + ": chunk group " + std::to_string(info.groups[i]) +
                                  " of " + std::to_string(session_->layout().num_groups()));
    }
    if (i > 0 && info.groups[i] <= info.groups[i - 1]) {
      return InvalidArgumentError(what + ": its chunk groups must be ascending and distinct");
    }
  }
  if (info.parent != planners::kNoUnit && info.parent >= units_.size()) {
    return InvalidArgumentError(what + ": its parent " + std::to_string(info.parent) +
                                " is not declared before it");
  }
  units_.push_back(std::move(info));
  return static_cast<uint32_t>(units_.size() - 1);
}

std::string UnitProtocol::Label(uint32_t u, std::string_view moment) const {
  if (u == planners::kNoUnit) return std::string(moment);
  return units_[u].name + ":" + std::string(moment);
}

void UnitProtocol::BeginIteration() {
  active_.clear();  // units whose forward raised before they left: no unit runs now
  session_->iterations().BeginIteration();
  session_->iterations().Phase(RunPhase::kForward);
  in_iteration_ = true;
}

Status UnitProtocol::EnterUnit(uint32_t u, bool training, std::span<const size_t> also) {
  if (u >= units_.size()) {
    return OutOfRangeError("unit " + std::to_string(u) + " of " + std::to_string(units_.size()) +
                           " declared");
  }
  if (!training && !in_iteration_ && session_->iterations().phase() != RunPhase::kEval) {
    session_->iterations().Phase(RunPhase::kEval);
  }
  if (session_->optimizer().pending_steps() > 0) {
    // The last step's deferred updates of this unit's groups (and `also`), each its own
    // optimizer moment, before the unit's.
    for (const size_t g : units_[u].groups)
      TIERMEM_RETURN_IF_ERROR(session_->optimizer().FinishStep(g));
    for (const size_t g : also) TIERMEM_RETURN_IF_ERROR(session_->optimizer().FinishStep(g));
  }
  session_->iterations().Moment(Label(u, "pre-forward"), planners::MomentKind::kPreForward, u);
  active_.push_back(u);
  return OkStatus();
}

Status UnitProtocol::ExitUnit(uint32_t u) {
  const auto it = std::find(active_.rbegin(), active_.rend(), u);
  if (it == active_.rend()) {
    return FailedPreconditionError("unit " + std::to_string(u) +
                                   " left its forward without entering it (units entered: " +
                                   std::to_string(active_.size()) + ")");
  }
  // Units entered inside it that never left (their forward raised) leave with it.
  active_.erase(std::next(it).base(), active_.end());
  return OkStatus();
}

void UnitProtocol::EnterBackward() { session_->iterations().Phase(RunPhase::kBackward); }

void UnitProtocol::BackwardReached(uint32_t u) {
  const uint32_t unit = u < units_.size() ? u : planners::kNoUnit;
  session_->iterations().Moment(Label(unit, "pre-backward"), planners::MomentKind::kPreBackward,
                                unit);
}

void UnitProtocol::EndIteration() { in_iteration_ = false; }

}  // namespace tiermem::session
