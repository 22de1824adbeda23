// The Python face of the unit protocol (runtime/unit_protocol.h): the forward hooks
// (unit_hooks.py's UnitHooks), the backward (backward.py) and serving (serve.py) call these
// and write none of the protocol themselves. Also the moment kinds as an enum and the warm-up
// trace reader (planners/trace.h), so a test can compare traces the two bindings recorded.
#include "integrations/torch/csrc/protocol.h"

#include <string>
#include <vector>

#include "integrations/torch/cpp/torch_pool.h"
#include "integrations/torch/csrc/errors.h"
#include "kernels/cpu/optim.h"
#include "planners/trace.h"
#include "runtime/unit_protocol.h"

namespace py = pybind11;

namespace tiermem::torch_ext {
namespace {

uint32_t UnitArg(int64_t u) { return u < 0 ? planners::kNoUnit : static_cast<uint32_t>(u); }

// One moment of a recorded trace, named fields (read_trace).
py::dict MomentRecord(const planners::TraceIteration& it, const planners::Moment& m) {
  py::list accesses;
  for (uint32_t i = 0; i < m.num_accesses; ++i) {
    const planners::TraceAccess& a = it.accesses[m.first_access + i];
    accesses.append(py::make_tuple(a.chunk, std::string(planners::AccessModeName(a.mode)),
                                   std::string(TierKindName(a.tier))));
  }
  py::dict d;
  d["label"] = m.label;
  d["kind"] = m.kind;
  d["unit"] = m.unit == planners::kNoUnit ? int64_t{-1} : int64_t{m.unit};
  d["saved_bytes"] = m.saved_bytes;
  d["accesses"] = accesses;
  return d;
}

}  // namespace

void BindProtocol(py::module_& m) {
  using planners::MomentKind;
  py::enum_<MomentKind>(m, "MomentKind")
      .value("PRE_FORWARD", MomentKind::kPreForward)
      .value("PRE_BACKWARD", MomentKind::kPreBackward)
      .value("OPTIMIZER_STEP", MomentKind::kOptimizerStep)
      .value("OTHER", MomentKind::kOther);

  using session::UnitProtocol;
  // Owned by its Session (Session.units); unit indices are the ones declare returned, -1 none.
  py::class_<UnitProtocol>(m, "UnitProtocol")
      .def(
          "declare",
          [](UnitProtocol& p, const std::string& name, std::vector<size_t> groups, int64_t parent) {
            return Check(p.Declare({name, std::move(groups), UnitArg(parent)}));
          },
          py::arg("name"), py::arg("groups"), py::arg("parent") = -1)
      .def_property_readonly("num_units", &UnitProtocol::num_units)
      .def_property_readonly("in_iteration", &UnitProtocol::in_iteration)
      .def("begin_iteration", &UnitProtocol::BeginIteration)
      .def(
          "enter_unit",
          [](UnitProtocol& p, uint32_t u, bool training, const std::vector<size_t>& also) {
            Status st;
            {
              py::gil_scoped_release nogil;  // the deferred updates run the CPU kernels
              kernels::ScopedParallelFor pool(torch_pool::ForThisThread());
              st = p.EnterUnit(u, training, also);
            }
            Check(st);
          },
          py::arg("unit"), py::arg("training"), py::arg("also") = std::vector<size_t>{})
      .def("exit_unit", [](UnitProtocol& p, uint32_t u) { Check(p.ExitUnit(u)); })
      .def("enter_backward", &UnitProtocol::EnterBackward)
      .def("backward_reached", [](UnitProtocol& p, int64_t u) { p.BackwardReached(UnitArg(u)); })
      .def("end_iteration", &UnitProtocol::EndIteration);

  // A recorded trace's iterations, each a list of its moments as dicts: label, kind
  // (MomentKind), unit (-1: none), saved_bytes, accesses [(chunk, mode, tier)].
  m.def("read_trace", [](const std::string& path) {
    const planners::Trace t = Check(planners::ReadTraceFile(path));
    py::list its;
    for (const planners::TraceIteration& it : t.iterations) {
      py::list moments;
      for (const planners::Moment& mo : it.moments) moments.append(MomentRecord(it, mo));
      its.append(moments);
    }
    return its;
  });
}

}  // namespace tiermem::torch_ext
