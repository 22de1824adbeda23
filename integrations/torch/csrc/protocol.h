// tiermem._C's unit protocol (runtime/unit_protocol.h), its moment kinds and the trace reader
// (csrc/protocol.cc), registered by module.cc.
#pragma once

#include <torch/extension.h>

namespace tiermem::torch_ext {

// Binds `MomentKind`, `UnitProtocol` (reached as `Session.units`) and `read_trace(path)`.
void BindProtocol(pybind11::module_& m);

}  // namespace tiermem::torch_ext
