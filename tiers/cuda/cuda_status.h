// The one place a cudaError_t becomes a Status (tiers/cuda and kernels/cuda both use it).
//
//   cudaErrorInsufficientDriver (35), cudaErrorNoDevice (100)  -> kUnavailable "no CUDA device"
//   cudaErrorMemoryAllocation                                  -> kResourceExhausted
//   cudaErrorInvalidValue, InvalidDevicePointer, InvalidMemcpyDirection, InvalidConfiguration
//                                                              -> kInvalidArgument
//   cudaErrorHostMemoryAlreadyRegistered                       -> kAlreadyExists
//   cudaErrorHostMemoryNotRegistered                           -> kFailedPrecondition
//   cudaErrorECCUncorrectable                                  -> kDataLoss
//   cudaErrorNotSupported                                      -> kUnimplemented
//   anything else                                              -> kInternal
// The message names the context, the CUDA error name and its description.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <string_view>

#include "base/status.h"

namespace tiermem {

Status CudaErrorToStatus(cudaError_t err, std::string_view context);

}  // namespace tiermem

// Returns the converted status from the enclosing function if `expr` is not cudaSuccess.
#define TIERMEM_CUDA_RETURN_IF_ERROR(expr, context)                      \
  do {                                                                   \
    const cudaError_t tiermem_cuda_err_ = (expr);                        \
    if (tiermem_cuda_err_ != cudaSuccess) {                              \
      return ::tiermem::CudaErrorToStatus(tiermem_cuda_err_, (context)); \
    }                                                                    \
  } while (0)

// For benchmark mains (no Status to return to): prints the converted error and exits 1.
#define TIERMEM_CUDA_CHECK_OR_DIE(expr)                                                        \
  do {                                                                                         \
    const cudaError_t tiermem_cuda_err_ = (expr);                                              \
    if (tiermem_cuda_err_ != cudaSuccess) {                                                    \
      std::fprintf(stderr, "%s\n",                                                             \
                   ::tiermem::CudaErrorToStatus(tiermem_cuda_err_, #expr).ToString().c_str()); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)
#define TIERMEM_OK_OR_DIE(expr)                                    \
  do {                                                             \
    const ::tiermem::Status tiermem_s_ = (expr);                   \
    if (!tiermem_s_.ok()) {                                        \
      std::fprintf(stderr, "%s\n", tiermem_s_.ToString().c_str()); \
      std::exit(1);                                                \
    }                                                              \
  } while (0)
