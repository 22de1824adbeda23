// tiermem._C: the Python binding of the session core (runtime), pybind11 through torch's
// headers. It is deliberately thin: a Config (the one parser, session::ParseConfig) and a
// Session whose methods forward to session::Session, plus the conversions only a torch
// binding can do — chunk memory as tensors (py_session.h), and the kernels' entry points for
// tests. One file per bound concern (bindings.h); Status codes become Python exceptions in one
// place (errors.h).
#include <torch/extension.h>

#include "integrations/torch/csrc/bindings.h"
#include "integrations/torch/csrc/protocol.h"
#include "integrations/torch/csrc/py_session.h"
#include "integrations/torch/csrc/weights.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  namespace te = tiermem::torch_ext;
  m.doc() = "tiermem session core (C++)";
  te::BindConfig(m);
  te::BindRecords(m);
  te::BindHandles(m);
  te::BindProtocol(m);
  te::BindSession(m);
  te::BindReports(m);
  te::BindCheckpoints(m);
  te::BindKernels(m);
  te::RegisterWeights(m, [](const py::handle& h) -> tiermem::session::Session& {
    return h.cast<te::PySession&>().s();
  });
}
