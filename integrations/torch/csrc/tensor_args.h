// Checks of the tensors Python passes to tiermem._C (csrc/*.cc): each raises ValueError naming
// what is wrong.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <string>

#include "integrations/torch/cpp/dtypes.h"
#include "kernels/cpu/optim.h"

namespace tiermem::torch_ext {

// The core element type of a tensor (torch_dtypes::CoreDType), or a ValueError.
inline kernels::DType KernelDType(const torch::Tensor& t) {
  const std::optional<kernels::DType> d = torch_dtypes::CoreDType(t.scalar_type());
  if (!d) {
    throw pybind11::value_error(std::string("unsupported dtype ") +
                                std::string(c10::toString(t.scalar_type())));
  }
  return *d;
}

inline void CheckHostSpan(const torch::Tensor& t, const char* what, int64_t n, torch::Dtype dtype) {
  if (!t.is_contiguous() || t.device().type() != torch::kCPU) {
    throw pybind11::value_error(std::string(what) + " must be a contiguous CPU tensor");
  }
  if (t.numel() != n) {
    throw pybind11::value_error(std::string(what) + " has " + std::to_string(t.numel()) +
                                " elements, expected " + std::to_string(n));
  }
  if (t.scalar_type() != dtype) {
    throw pybind11::value_error(std::string(what) + " must be " +
                                std::string(c10::toString(dtype)) + ", got " +
                                std::string(c10::toString(t.scalar_type())));
  }
}

}  // namespace tiermem::torch_ext
