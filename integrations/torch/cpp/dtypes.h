// The one map between torch's dtypes and the core's element types (kernels::DType), for both
// torch bindings: the Python extension (csrc/module.cc) and the LibTorch API
// (chunked_model.cc). The core decides each chunk kind's element type
// (session::Session::dtype); a binding only translates it, here.
//
// Header-only (like torch_pool.h), so the extension, which does not link the LibTorch
// library, and the library share it without a third target; installed with the LibTorch
// API's headers.
// Thread-safety: pure functions.
#pragma once

#include <c10/core/ScalarType.h>

#include <optional>

#include "kernels/cpu/optim.h"

namespace tiermem::torch_dtypes {

// The torch dtype of a core element type.
inline c10::ScalarType TorchDType(kernels::DType d) {
  switch (d) {
    case kernels::DType::kBF16:
      return c10::ScalarType::BFloat16;
    case kernels::DType::kF16:
      return c10::ScalarType::Half;
    case kernels::DType::kF32:
      break;
  }
  return c10::ScalarType::Float;
}

// The core element type of a torch dtype; nullopt for a dtype the core has no kernels for
// (the caller says so in its own error).
inline std::optional<kernels::DType> CoreDType(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float:
      return kernels::DType::kF32;
    case c10::ScalarType::BFloat16:
      return kernels::DType::kBF16;
    case c10::ScalarType::Half:
      return kernels::DType::kF16;
    default:
      return std::nullopt;
  }
}

}  // namespace tiermem::torch_dtypes
