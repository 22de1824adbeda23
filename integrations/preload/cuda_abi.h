// The slice of the CUDA runtime and driver ABI that the preload shim and the fake runtime
// use, declared here so that neither needs the CUDA headers nor links libcudart/libcuda.
// Only what crosses the boundary is declared: error codes as plain ints (cudaError_t and
// CUresult are C enums, passed as int), handles as opaque pointers, and the two small structs
// passed by value (dim3, cudaMemLocation), whose layout is fixed by the CUDA ABI.
//
// ABI differences between CUDA major versions that the shim must respect (checked against
// the CUDA 12.x and 13.0 headers):
//  - cudaMemAdvise / cudaMemPrefetchAsync take an `int device` in CUDA 12 and a
//    `cudaMemLocation` (+ `unsigned flags` for the prefetch) in CUDA 13.
//  - cuGetProcAddress is exported twice by libcuda: the 4-argument v1 and "_v2" with a
//    trailing status pointer (cuda.h maps cuGetProcAddress to _v2 since CUDA 12).
#pragma once

#include <cstddef>
#include <cstdint>

namespace tiermem::preload {

using CudaError = int;                   // cudaError_t
using CuResult = int;                    // CUresult
using CudaStream = void*;                // cudaStream_t
using CudaMemPool = void*;               // cudaMemPool_t
using CudaFunction = void*;              // cudaFunction_t == CUfunction
using CuDevicePtr = unsigned long long;  // CUdeviceptr
using CuMemHandle = unsigned long long;  // CUmemGenericAllocationHandle

inline constexpr CudaError kCudaSuccess = 0;
inline constexpr CudaError kCudaErrorInvalidValue = 1;
inline constexpr CudaError kCudaErrorMemoryAllocation = 2;
inline constexpr CudaError kCudaErrorInitializationError = 3;
inline constexpr CuResult kCuSuccess = 0;
inline constexpr CuResult kCuErrorInvalidValue = 1;
inline constexpr CuResult kCuErrorOutOfMemory = 2;
inline constexpr CuResult kCuErrorNotInitialized = 3;

inline constexpr unsigned kCudaMemAttachGlobal = 0x01;
inline constexpr int kCudaCpuDeviceId = -1;
inline constexpr int kCudaMemAdviseSetPreferredLocation = 3;
inline constexpr int kCudaMemLocationTypeDevice = 1;
inline constexpr int kCudaMemLocationTypeHost = 2;

struct Dim3 {  // dim3
  unsigned x, y, z;
};
struct CudaMemLocation {  // struct cudaMemLocation (CUDA >= 12.2)
  int type;
  int id;
};
static_assert(sizeof(Dim3) == 12 && sizeof(CudaMemLocation) == 8);

// Function-pointer types of every entry point the shim forwards or calls.
using CudaMallocFn = CudaError (*)(void**, size_t);
using CudaFreeFn = CudaError (*)(void*);
using CudaMallocAsyncFn = CudaError (*)(void**, size_t, CudaStream);
using CudaFreeAsyncFn = CudaError (*)(void*, CudaStream);
using CudaMallocFromPoolAsyncFn = CudaError (*)(void**, size_t, CudaMemPool, CudaStream);
using CudaMallocManagedFn = CudaError (*)(void**, size_t, unsigned);
using CudaHostAllocFn = CudaError (*)(void**, size_t, unsigned);
using CudaMallocHostFn = CudaError (*)(void**, size_t);
using CudaFreeHostFn = CudaError (*)(void*);
using CudaHostRegisterFn = CudaError (*)(void*, size_t, unsigned);
using CudaHostUnregisterFn = CudaError (*)(void*);
using CudaMemGetInfoFn = CudaError (*)(size_t*, size_t*);
using CudaLaunchKernelFn = CudaError (*)(const void*, Dim3, Dim3, void**, size_t, CudaStream);
using CudaGetDriverEntryPointFn = CudaError (*)(const char*, void**, unsigned long long, int*);
using CudaGetDriverEntryPointByVersionFn = CudaError (*)(const char*, void**, unsigned,
                                                         unsigned long long, int*);
using CuGetProcAddressV1Fn = CuResult (*)(const char*, void**, int, uint64_t);
using CuGetProcAddressV2Fn = CuResult (*)(const char*, void**, int, uint64_t, int*);
// Called, not interposed:
using CudaGetLastErrorFn = CudaError (*)();
using CudaGetDeviceFn = CudaError (*)(int*);
using CudaRuntimeGetVersionFn = CudaError (*)(int*);
using CudaGetFuncBySymbolFn = CudaError (*)(CudaFunction*, const void*);
using CudaMemAdvise12Fn = CudaError (*)(const void*, size_t, int, int);
using CudaMemAdvise13Fn = CudaError (*)(const void*, size_t, int, CudaMemLocation);
using CudaMemPrefetch12Fn = CudaError (*)(const void*, size_t, int, CudaStream);
using CudaMemPrefetch13Fn = CudaError (*)(const void*, size_t, CudaMemLocation, unsigned,
                                          CudaStream);
// Driver (reached through the entry-point lookup):
using CuMemCreateFn = CuResult (*)(CuMemHandle*, size_t, const void*, unsigned long long);
using CuMemReleaseFn = CuResult (*)(CuMemHandle);
using CuMemMapFn = CuResult (*)(CuDevicePtr, size_t, size_t, CuMemHandle, unsigned long long);
using CuMemUnmapFn = CuResult (*)(CuDevicePtr, size_t);
using CuMemAddressReserveFn = CuResult (*)(CuDevicePtr*, size_t, size_t, CuDevicePtr,
                                           unsigned long long);
using CuFuncGetParamInfoFn = CuResult (*)(CudaFunction, size_t, size_t*, size_t*);

}  // namespace tiermem::preload
