// Status -> Python exception, the one place the extension converts them (module.cc and the
// files it registers): kInvalidArgument/kOutOfRange -> ValueError, kResourceExhausted ->
// MemoryError, kNotFound/kIOError/kDataLoss -> OSError, anything else -> RuntimeError.
#pragma once

#include <torch/extension.h>

#include <string>
#include <utility>

#include "base/status.h"

namespace tiermem::torch_ext {

[[noreturn]] inline void Throw(const Status& s) {
  namespace py = pybind11;
  const std::string msg = s.ToString();
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kOutOfRange:
      throw py::value_error(msg);
    case StatusCode::kResourceExhausted:
      PyErr_SetString(PyExc_MemoryError, msg.c_str());
      throw py::error_already_set();
    case StatusCode::kNotFound:
    case StatusCode::kIOError:
    case StatusCode::kDataLoss:
      PyErr_SetString(PyExc_OSError, msg.c_str());
      throw py::error_already_set();
    default:
      throw std::runtime_error(msg);
  }
}
inline void Check(const Status& s) {
  if (!s.ok()) Throw(s);
}
template <typename T>
T Check(StatusOr<T> s) {
  if (!s.ok()) Throw(s.status());
  return std::move(s).value();
}

}  // namespace tiermem::torch_ext
