// The session's reports as Python dicts (csrc/reports.cc): what Session.stats(),
// Session.speculation and the timeline reports return.
#pragma once

#include <torch/extension.h>

#include "prof/analysis.h"
#include "runtime/session.h"

namespace tiermem::torch_ext {

// A timeline's report (prof/analysis.h): peaks, budgets, copies, stalls, collectives, I/O.
pybind11::dict ReportDict(const prof::Report& r);
// The session's counters now (Session.stats()): tiers, bytes moved, stalls, the optimizer's
// placement and state format, the plan's counters.
pybind11::dict StatsDict(const session::Session& s);
// The speculative steps' counters (runtime/optimizer_stepper.h).
pybind11::dict SpeculationDict(const session::Session& s);

}  // namespace tiermem::torch_ext
