// UnitProtocol: the unit protocol both bindings follow, written once — when an iteration
// begins, what entering a unit's forward does, the backward's moments and when an iteration
// ends. The bindings translate torch events into these calls (Python: its forward hooks and
// autograd glue; LibTorch: ChunkedModel::Run and its autograd function) and write none of the
// protocol themselves.
//
// A *unit* is a module subtree whose parameters are materialized together (docs/architecture.md
// glossary). A binding declares each one (its name, its chunk groups, the unit it is nested in)
// and refers to it by the index Declare returns. Then, per training iteration:
//
//   BeginIteration()        the first training forward: Session::BeginIteration, phase kForward
//   EnterUnit(u, true)      the outermost entry of unit u's forward: the last step's deferred
//                           updates of u's groups (and of `also`), each its own optimizer
//                           moment, then u's pre-forward moment (kind kPreForward, unit u,
//                           label "<name>:pre-forward")
//   ExitUnit(u)             u's forward has left (its chunks released by the binding)
//   EnterBackward()         the backward's first hook: phase kBackward
//   BackwardReached(u)      the backward reached unit u: u's pre-backward moment (kind
//                           kPreBackward, unit u, label "<name>:pre-backward"; kNoUnit: a
//                           moment outside every unit, labelled "pre-backward")
//   EndIteration()          the backward ended (or the forward was abandoned)
//
// An eval or no_grad forward calls EnterUnit(u, false) outside an iteration: the same deferred
// updates and moment (untraced: the binding turns tracing off), in phase kEval
// (runtime/phase.h).
// Because every moment carries its kind and unit, the warm-up trace attributes each unit's
// saved activations and its chunk accesses the same way whichever binding recorded it
// (trace_recorder.h credits saved bytes to a pre-forward with a unit).
//
// Invariants: units are numbered in declaration order, from 0, below planners::kMaxUnits; a
// unit's groups are ascending, distinct and below the session's group count; its parent was
// declared before it. active() is the stack of units entered and not exited: ExitUnit(u) pops
// u and the units entered inside it that never left (their forward raised); BeginIteration
// empties it (a forward that raised may leave entries). Ending an iteration does not touch
// it: an abandoned forward's units still leave.
//
// Thread-safety: externally synchronized, like the session (the training thread; a backward
// runs on autograd's thread while the training thread waits for it).
// Ownership: the session must outlive this object; the binding owns one per session.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "base/status.h"
#include "planners/trace.h"

namespace tiermem::session {

class Session;

// One declared unit.
struct UnitInfo {
  std::string name;                     // the moments' label stem ("blocks.3"); never empty
  std::vector<size_t> groups;           // the chunk groups of its parameters, ascending, distinct
  uint32_t parent = planners::kNoUnit;  // the unit it is nested in (its direct-only holder)
};

class UnitProtocol {
 public:
  explicit UnitProtocol(Session* session);  // `session` must outlive this object
  UnitProtocol(const UnitProtocol&) = delete;
  UnitProtocol& operator=(const UnitProtocol&) = delete;

  // Declares a unit and returns its index. kInvalidArgument: an empty name, a group the
  // session does not have, groups not ascending, a parent not declared yet; kOutOfRange: more
  // than planners::kMaxUnits units. Nothing changes on failure.
  StatusOr<uint32_t> Declare(UnitInfo info);
  size_t num_units() const { return units_.size(); }
  const UnitInfo& unit(uint32_t u) const { return units_.at(u); }
  // The units whose forward runs now, innermost last.
  const std::vector<uint32_t>& active() const { return active_; }
  bool in_iteration() const { return in_iteration_; }

  // The first training forward of an iteration (see the file comment).
  void BeginIteration();
  // The outermost entry of unit `u`'s forward; `training`: a training forward (inside an
  // iteration), else eval / no_grad. `also`: further groups whose deferred updates run first
  // (sharded: the next unit's, which the binding prefetches). kOutOfRange: an undeclared
  // unit; errors of the deferred updates (the moment is not marked, the unit not entered).
  Status EnterUnit(uint32_t u, bool training, std::span<const size_t> also = {});
  // kFailedPrecondition: `u` is not entered (nothing changes).
  Status ExitUnit(uint32_t u);
  void EnterBackward();
  void BackwardReached(uint32_t u);
  // The iteration ends: after its backward, or when its forward was abandoned. Idempotent.
  void EndIteration();

 private:
  std::string Label(uint32_t u, std::string_view moment) const;

  Session* session_;  // not owned
  std::vector<UnitInfo> units_;
  std::vector<uint32_t> active_;
  bool in_iteration_ = false;
};

}  // namespace tiermem::session
