// Checkpoint tensors as torch tensors, for what the session does not hold: a module's buffers
// (both bindings load the persistent buffers a checkpoint has, and export them beside the
// parameters). Header-only, like dtypes.h, so the Python extension (which does not link the
// LibTorch library) and the LibTorch API share it.
// Thread-safety: pure functions.
#pragma once

#include <torch/torch.h>

#include <string>
#include <string_view>

#include "base/status.h"
#include "integrations/torch/cpp/dtypes.h"
#include "weights/weight_files.h"

namespace tiermem::torch_weights {

// `key` of `files` as a CPU tensor of its own dtype and shape. kInvalidArgument naming the key
// and file for a dtype torch has no equivalent for; ReadTensorBytes' errors otherwise.
inline StatusOr<::torch::Tensor> ReadTensor(const weights::WeightFiles& files,
                                            std::string_view key) {
  uint32_t f = 0;
  const weights::TensorInfo* info = files.Find(key, &f);
  if (info == nullptr) {
    return InvalidArgumentError("weights: " + files.path + " has no key '" + std::string(key) +
                                "'");
  }
  const std::optional<c10::ScalarType> t = torch_dtypes::TorchDType(info->dtype);
  if (!t) {
    return InvalidArgumentError(
        "weights: key '" + std::string(key) + "' in " + files.files[f].path + " is " +
        std::string(weights::DTypeName(info->dtype)) + ", which a module buffer cannot hold");
  }
  TIERMEM_ASSIGN_OR_RETURN(const std::string bytes, weights::ReadTensorBytes(files, key));
  std::vector<int64_t> shape(info->shape.begin(), info->shape.end());
  ::torch::Tensor out = ::torch::empty(shape, ::torch::TensorOptions().dtype(*t));
  std::memcpy(out.data_ptr(), bytes.data(), bytes.size());
  return out;
}

}  // namespace tiermem::torch_weights
