// The fake CUDA runtime (libcudart.so.12 / .13 built from fake_cudart.cc): the CUDA entry
// points the preload shim interposes or calls, implemented over host memory, so the shim is
// tested and benchmarked on machines without a GPU. This header is what a test program that
// "uses CUDA" includes: the CUDA prototypes it calls (declared with the shim's own ABI types,
// no CUDA headers) plus the fake's test hooks.
//
// Behaviour:
//  - Device, managed and pinned allocations are 256-byte aligned host memory; cudaMalloc and
//    cudaMallocAsync fail with cudaErrorMemoryAllocation (2) when the bytes in use would pass
//    FAKE_CUDART_TOTAL (default 80 GiB); cudaMemGetInfo reports that total and what is free.
//  - Freeing an unknown pointer fails with cudaErrorInvalidValue (1). Failures set the
//    per-thread last error that cudaGetLastError returns and clears.
//  - FAKE_CUDART_LOG=path: every call appends one line "<function> key=value ... rc=N" to the
//    file (O_APPEND, one write per line), so tests can check what reached the runtime.
//  - Kernels: cudaLaunchKernel runs nothing; cudaGetFuncBySymbol maps a host function to
//    itself, and cuFuncGetParamInfo (through the driver entry-point lookup) answers with the
//    layout given to fake_cudart_register_kernel.
//  - The driver entry-point lookup (cudaGetDriverEntryPoint[ByVersion], cuGetProcAddress[_v2])
//    knows cuMemCreate, cuMemRelease, cuMemMap, cuMemUnmap, cuMemAddressReserve and
//    cuFuncGetParamInfo.
// Thread-safety: every function is thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>

#include "integrations/preload/cuda_abi.h"

extern "C" {
using tiermem::preload::CudaError;
using tiermem::preload::CudaMemPool;
using tiermem::preload::CudaStream;
using tiermem::preload::CuResult;
using tiermem::preload::Dim3;

CudaError cudaMalloc(void** ptr, size_t size);
CudaError cudaFree(void* ptr);
CudaError cudaMallocAsync(void** ptr, size_t size, CudaStream stream);
CudaError cudaFreeAsync(void* ptr, CudaStream stream);
CudaError cudaMallocFromPoolAsync(void** ptr, size_t size, CudaMemPool pool, CudaStream stream);
CudaError cudaMallocManaged(void** ptr, size_t size, unsigned flags);
CudaError cudaHostAlloc(void** ptr, size_t size, unsigned flags);
CudaError cudaMallocHost(void** ptr, size_t size);
CudaError cudaFreeHost(void* ptr);
CudaError cudaHostRegister(void* ptr, size_t size, unsigned flags);
CudaError cudaHostUnregister(void* ptr);
CudaError cudaMemGetInfo(size_t* free, size_t* total);
CudaError cudaLaunchKernel(const void* func, Dim3 grid, Dim3 block, void** args, size_t shared,
                           CudaStream stream);
CudaError cudaGetDriverEntryPoint(const char* symbol, void** fn, unsigned long long flags,
                                  int* status);
CudaError cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned version,
                                           unsigned long long flags, int* status);
CuResult cuGetProcAddress(const char* symbol, void** fn, int version, uint64_t flags);
CuResult cuGetProcAddress_v2(const char* symbol, void** fn, int version, uint64_t flags,
                             int* status);
CudaError cudaGetLastError();
CudaError cudaRuntimeGetVersion(int* version);

// Test hook: `func` takes `n` parameters of the given sizes (bytes).
void fake_cudart_register_kernel(const void* func, int n, const size_t* sizes);
}
