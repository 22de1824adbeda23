// The CUDA device tier (TierKind::kDevice) and host-registration helpers. No CUDA types in
// this header: callers compile without the CUDA toolkit's headers.
//
// The tier reserves its whole budget up front as one cudaMalloc arena and hands out regions
// from it (sizes rounded up to `alignment`, first fit, freed neighbours coalesced), so the
// budget is exact and allocation never calls into the driver. Copies run on two streams
// (host->device, device->host) like the two copy engines; each copy records an event and a
// completion thread per stream waits for the events in order and fires the completions.
// Completions therefore fire on those threads, never inside a CUDA callback, so a completion
// callback may itself call CUDA or the tier.
//
// Threading: thread-safe.
#pragma once

#include <memory>

#include "base/status.h"
#include "base/units.h"
#include "tiers/host/host_tier.h"
#include "tiers/tier.h"

namespace tiermem {

struct CudaTierConfig {
  int device = 0;
  Bytes capacity = 2 * kGiB;  // the budget; cudaMalloc'ed at creation
  Bytes alignment = 256;      // region sizes and offsets are multiples of this (power of 2)
};

// Number of CUDA devices; kUnavailable ("no CUDA device") when there is no driver or device.
StatusOr<int> CudaDeviceCount();
// CUDART_VERSION this tier was compiled against (e.g. 13000).
int CudaRuntimeBuildVersion();

// A CUDA tier on config.device. kUnavailable without a GPU, kInvalidArgument for a bad
// config or device index, kResourceExhausted when the device cannot hold the arena.
// Caller owns the result.
StatusOr<std::unique_ptr<Tier>> NewCudaTier(const CudaTierConfig& config);

// Page-locks [ptr, ptr + bytes) for fast, truly asynchronous copies (cudaHostRegister,
// portable). A host tier calls this on its pool; kUnavailable without a GPU. Must be paired
// with CudaHostUnregister(ptr) before the memory is freed.
Status CudaHostRegister(void* ptr, Bytes bytes);
Status CudaHostUnregister(void* ptr);

// The HostPinner the host tier calls for each slab it maps (tiers/host/host_tier.h):
// cudaHostRegister (portable) on Register, cudaHostUnregister on Unregister, so every host
// region the engine copies from or to is page-locked and copies are truly asynchronous.
// Thread-safe (the CUDA runtime calls are). Caller owns the result; it must outlive every
// host tier given it.
std::unique_ptr<HostPinner> NewCudaHostPinner();

// RAII form: unregisters on destruction. Move-only.
class CudaHostRegistration {
 public:
  static StatusOr<CudaHostRegistration> Make(void* ptr, Bytes bytes);
  CudaHostRegistration(CudaHostRegistration&& other) noexcept : ptr_(other.ptr_) {
    other.ptr_ = nullptr;
  }
  CudaHostRegistration& operator=(CudaHostRegistration&& other) noexcept;
  CudaHostRegistration(const CudaHostRegistration&) = delete;
  CudaHostRegistration& operator=(const CudaHostRegistration&) = delete;
  ~CudaHostRegistration();

 private:
  explicit CudaHostRegistration(void* ptr) : ptr_(ptr) {}
  void* ptr_ = nullptr;  // registered base, or nullptr once moved from
};

}  // namespace tiermem
