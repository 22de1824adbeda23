// tiermem._C's pretrained-weights functions (csrc/weights.cc), registered by module.cc.
#pragma once

#include <torch/extension.h>

#include <functional>

#include "runtime/session.h"

namespace tiermem::torch_ext {

// `session_of` turns a bound Session object into the core session it wraps.
void RegisterWeights(pybind11::module_& m,
                     std::function<session::Session&(const pybind11::handle&)> session_of);

}  // namespace tiermem::torch_ext
