// The one map between torch's dtypes and the core's element types (kernels::DType), for both
// torch bindings: the Python extension (csrc/module.cc) and the LibTorch API
// (chunked_model.cc). The core decides each chunk kind's element type
// (session::Layout::dtype); a binding only translates it, here.
//
// Header-only (like torch_pool.h), so the extension, which does not link the LibTorch
// library, and the library share it without a third target; installed with the LibTorch
// API's headers.
// Thread-safety: pure functions.
#pragma once

#include <c10/core/ScalarType.h>

#include <optional>

#include "kernels/cpu/optim.h"
#include "weights/safetensors.h"

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

// The torch dtype of a safetensors dtype (a checkpoint's buffers); nullopt for one torch
// has no dtype for here (sub-byte and 8-bit float formats, unsigned wider than 8 bits).
inline std::optional<c10::ScalarType> TorchDType(weights::DType d) {
  switch (d) {
    case weights::DType::kBool:
      return c10::ScalarType::Bool;
    case weights::DType::kU8:
      return c10::ScalarType::Byte;
    case weights::DType::kI8:
      return c10::ScalarType::Char;
    case weights::DType::kI16:
      return c10::ScalarType::Short;
    case weights::DType::kI32:
      return c10::ScalarType::Int;
    case weights::DType::kI64:
      return c10::ScalarType::Long;
    case weights::DType::kF16:
      return c10::ScalarType::Half;
    case weights::DType::kBF16:
      return c10::ScalarType::BFloat16;
    case weights::DType::kF32:
      return c10::ScalarType::Float;
    case weights::DType::kF64:
      return c10::ScalarType::Double;
    case weights::DType::kF8E4M3:
      return c10::ScalarType::Float8_e4m3fn;
    case weights::DType::kF8E5M2:
      return c10::ScalarType::Float8_e5m2;
    default:
      return std::nullopt;
  }
}

// The safetensors dtype a torch tensor is written as; nullopt when there is none here.
inline std::optional<weights::DType> WeightsDType(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Bool:
      return weights::DType::kBool;
    case c10::ScalarType::Byte:
      return weights::DType::kU8;
    case c10::ScalarType::Char:
      return weights::DType::kI8;
    case c10::ScalarType::Short:
      return weights::DType::kI16;
    case c10::ScalarType::Int:
      return weights::DType::kI32;
    case c10::ScalarType::Long:
      return weights::DType::kI64;
    case c10::ScalarType::Half:
      return weights::DType::kF16;
    case c10::ScalarType::BFloat16:
      return weights::DType::kBF16;
    case c10::ScalarType::Float:
      return weights::DType::kF32;
    case c10::ScalarType::Double:
      return weights::DType::kF64;
    case c10::ScalarType::Float8_e4m3fn:
      return weights::DType::kF8E4M3;
    case c10::ScalarType::Float8_e5m2:
      return weights::DType::kF8E5M2;
    default:
      return std::nullopt;
  }
}

}  // namespace tiermem::torch_dtypes
