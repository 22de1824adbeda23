#include "tiers/cuda/cuda_status.h"

#include <string>

namespace tiermem {

Status CudaErrorToStatus(cudaError_t err, std::string_view context) {
  if (err == cudaSuccess) return OkStatus();
  std::string msg(context);
  msg += ": ";
  if (err == cudaErrorInsufficientDriver || err == cudaErrorNoDevice) {
    msg += "no CUDA device (";
    msg += cudaGetErrorName(err);
    msg += ")";
    return UnavailableError(std::move(msg));
  }
  msg += cudaGetErrorName(err);
  msg += " (";
  msg += cudaGetErrorString(err);
  msg += ")";
  switch (err) {
    case cudaErrorMemoryAllocation:
      return ResourceExhaustedError(std::move(msg));
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidMemcpyDirection:
    case cudaErrorInvalidConfiguration:
    case cudaErrorInvalidDevice:
      return InvalidArgumentError(std::move(msg));
    case cudaErrorHostMemoryAlreadyRegistered:
      return AlreadyExistsError(std::move(msg));
    case cudaErrorHostMemoryNotRegistered:
      return FailedPreconditionError(std::move(msg));
    case cudaErrorECCUncorrectable:
      return DataLossError(std::move(msg));
    case cudaErrorNotSupported:
      return UnimplementedError(std::move(msg));
    default:
      return InternalError(std::move(msg));
  }
}

}  // namespace tiermem
