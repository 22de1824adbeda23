// The phase a training run is in (the timeline's phase events; the session's phase()): an enum
// with one table of spellings, read as the modes are (runtime/modes.h: ModeName, ParseMode,
// and the Python enum `tiermem._C.RunPhase`). Code compares values, never spellings.
//
// Who sets which: the unit protocol (runtime/unit_protocol.h) kForward, kBackward and kEval;
// the optimizer stepper kOptimizer around an update (restoring the phase it found); the
// Python recompute kRecompute while it runs a unit's forward again, then kBackward.
//
// Thread-safety: constants and pure functions.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

#include "runtime/modes.h"

namespace tiermem::session {

enum class RunPhase : uint8_t {
  kNone = 0,  // before any phase was set
  kForward = 1,
  kBackward = 2,
  kEval = 3,  // an eval or no_grad forward outside an iteration
  kOptimizer = 4,
  kRecompute = 5,
};
template <>
struct ModeTraits<RunPhase> {
  static constexpr std::string_view kKey = "phase";
  static constexpr std::array<ModeSpelling<RunPhase>, 6> kNames = {
      {{RunPhase::kNone, "none"},
       {RunPhase::kForward, "forward"},
       {RunPhase::kBackward, "backward"},
       {RunPhase::kEval, "eval"},
       {RunPhase::kOptimizer, "optimizer"},
       {RunPhase::kRecompute, "recompute"}}};
};

}  // namespace tiermem::session
