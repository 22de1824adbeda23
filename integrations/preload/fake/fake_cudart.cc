// The fake CUDA runtime: see fake_cudart.h for what it promises. Built twice, as
// libcudart.so.12 (FAKE_CUDART_MAJOR=12: CUDA 12 ABI of cudaMemAdvise/cudaMemPrefetchAsync,
// version 12080) and libcudart.so.13 (the CUDA 13 ABI, version 13000), each exporting its
// symbols with the version node the real library uses ("libcudart.so.12"), so that programs
// linked against it hold versioned references exactly as against the real runtime.
//
// Invariants: every live block returned by an allocation function starts kHeader bytes after
// a header holding its size and a magic; `g_used` is the sum of the sizes of the live device
// blocks (cudaMalloc, cudaMallocAsync, cudaMallocFromPoolAsync, cuMemCreate), which is what
// the FAKE_CUDART_TOTAL capacity limits. Registered host ranges live in a small table.
#include "integrations/preload/fake/fake_cudart.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unordered_set>

#include "base/mutex.h"

#ifndef FAKE_CUDART_MAJOR
#define FAKE_CUDART_MAJOR 12
#endif

namespace {

using namespace tiermem::preload;  // NOLINT
using tiermem::Mutex;
using tiermem::MutexLock;

constexpr size_t kHeader = 256;
constexpr uint64_t kMagic = 0xFA4ECDA7ull;
enum Kind : uint64_t { kDevice = 1, kManaged = 2, kPinned = 3 };

struct Header {
  uint64_t magic;
  uint64_t size;
  uint64_t kind;
};

std::atomic<uint64_t> g_used{0};
thread_local CudaError t_last_error = 0;

uint64_t Total() {
  static const uint64_t total = [] {
    const char* v = std::getenv("FAKE_CUDART_TOTAL");
    return v != nullptr ? std::strtoull(v, nullptr, 10) : (80ull << 30);
  }();
  return total;
}

int LogFd() {
  static const int fd = [] {
    const char* path = std::getenv("FAKE_CUDART_LOG");
    return path != nullptr ? ::open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644) : -1;
  }();
  return fd;
}

__attribute__((format(printf, 1, 2))) void Log(const char* fmt, ...) {
  const int fd = LogFd();
  if (fd < 0) return;
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  int n = std::vsnprintf(buf, sizeof(buf) - 1, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  n = n > static_cast<int>(sizeof(buf) - 2) ? static_cast<int>(sizeof(buf) - 2) : n;
  buf[n++] = '\n';
  ssize_t w = ::write(fd, buf, n);
  (void)w;
}

CudaError Fail(CudaError rc) {
  t_last_error = rc;
  return rc;
}

// Live blocks, so that freeing a pointer the fake never returned fails cleanly instead of
// reading memory in front of it.
Mutex g_live_mu;
std::unordered_set<void*>* g_live TIERMEM_PT_GUARDED_BY(g_live_mu) =
    new std::unordered_set<void*>();

void* Remember(void* p) {
  MutexLock l(g_live_mu);
  g_live->insert(p);
  return p;
}

void* Allocate(size_t size, Kind kind) {
  void* base = std::aligned_alloc(kHeader, kHeader + ((size + kHeader - 1) / kHeader) * kHeader);
  if (base == nullptr) return nullptr;
  auto* h = static_cast<Header*>(base);
  *h = Header{kMagic, size, kind};
  return Remember(static_cast<char*>(base) + kHeader);
}

Header* HeaderOf(void* p) {
  {
    MutexLock l(g_live_mu);
    if (g_live->erase(p) == 0) return nullptr;
  }
  auto* h = reinterpret_cast<Header*>(static_cast<char*>(p) - kHeader);
  return h->magic == kMagic ? h : nullptr;
}

void Forget(Header* h, void* p) {  // a HeaderOf that must not free: put it back
  (void)h;
  Remember(p);
}

CudaError DeviceAlloc(void** ptr, size_t size) {
  if (ptr == nullptr) return Fail(1);
  const uint64_t now = g_used.fetch_add(size) + size;
  if (now > Total()) {
    g_used.fetch_sub(size);
    return Fail(2);
  }
  *ptr = Allocate(size, kDevice);
  return 0;
}

CudaError FreeKind(void* p, bool device_or_managed) {
  Header* h = HeaderOf(p);
  if (h == nullptr) return Fail(1);
  if (device_or_managed ? h->kind == kPinned : h->kind != kPinned) {
    Forget(h, p);
    return Fail(1);
  }
  if (h->kind == kDevice) g_used.fetch_sub(h->size);
  h->magic = 0;
  std::free(h);
  return 0;
}

// Registered host ranges (cudaHostRegister): a small table, enough for tests.
Mutex g_reg_mu;
void* g_registered[1024] TIERMEM_GUARDED_BY(g_reg_mu);

// Kernel layouts registered by the tests.
struct KernelLayout {
  const void* func;
  int n;
  size_t sizes[32];
};
Mutex g_kernel_mu;
KernelLayout g_kernels[256] TIERMEM_GUARDED_BY(g_kernel_mu);
int g_nkernels TIERMEM_GUARDED_BY(g_kernel_mu) = 0;

// ---- fake driver functions (reached through the entry-point lookup) --------------------------

std::atomic<uint64_t> g_next_handle{0x1000};
Mutex g_handle_mu;
// (handle, size); handle 0 = free slot.
uint64_t g_handles[4096][2] TIERMEM_GUARDED_BY(g_handle_mu);

CuResult FakeCuMemCreate(CuMemHandle* handle, size_t size, const void*, unsigned long long) {
  const uint64_t now = g_used.fetch_add(size) + size;
  if (now > Total()) {
    g_used.fetch_sub(size);
    Log("cuMemCreate size=%zu rc=2", size);
    return 2;  // CUDA_ERROR_OUT_OF_MEMORY
  }
  *handle = g_next_handle.fetch_add(0x10);
  {
    MutexLock l(g_handle_mu);
    for (auto& h : g_handles) {
      if (h[0] == 0) {
        h[0] = *handle;
        h[1] = size;
        break;
      }
    }
  }
  Log("cuMemCreate size=%zu handle=0x%llx rc=0", size, *handle);
  return 0;
}

CuResult FakeCuMemRelease(CuMemHandle handle) {
  uint64_t size = 0;
  {
    MutexLock l(g_handle_mu);
    for (auto& h : g_handles) {
      if (h[0] == handle && handle != 0) {
        size = h[1];
        h[0] = 0;
        break;
      }
    }
  }
  if (size == 0) {
    Log("cuMemRelease handle=0x%llx rc=1", handle);
    return 1;
  }
  g_used.fetch_sub(size);
  Log("cuMemRelease handle=0x%llx rc=0", handle);
  return 0;
}

CuResult FakeCuMemMap(CuDevicePtr ptr, size_t size, size_t offset, CuMemHandle handle,
                      unsigned long long) {
  Log("cuMemMap ptr=0x%llx size=%zu offset=%zu handle=0x%llx rc=0", ptr, size, offset, handle);
  return 0;
}

CuResult FakeCuMemUnmap(CuDevicePtr ptr, size_t size) {
  Log("cuMemUnmap ptr=0x%llx size=%zu rc=0", ptr, size);
  return 0;
}

std::atomic<uint64_t> g_next_va{0x7f0000000000ull};

CuResult FakeCuMemAddressReserve(CuDevicePtr* ptr, size_t size, size_t, CuDevicePtr,
                                 unsigned long long) {
  *ptr = g_next_va.fetch_add((size + 0xfffff) & ~0xfffffull);
  Log("cuMemAddressReserve size=%zu ptr=0x%llx rc=0", size, *ptr);
  return 0;
}

CuResult FakeCuFuncGetParamInfo(CudaFunction f, size_t index, size_t* offset, size_t* size) {
  MutexLock l(g_kernel_mu);
  for (int k = 0; k < g_nkernels; ++k) {
    if (g_kernels[k].func != f) continue;
    if (index >= static_cast<size_t>(g_kernels[k].n)) return 1;
    size_t off = 0;
    for (size_t i = 0; i < index; ++i) off += g_kernels[k].sizes[i];
    *offset = off;
    *size = g_kernels[k].sizes[index];
    return 0;
  }
  return 1;
}

void* DriverSymbol(const char* name) {
  struct Entry {
    const char* name;
    void* fn;
  };
  static const Entry kEntries[] = {
      {"cuMemCreate", reinterpret_cast<void*>(&FakeCuMemCreate)},
      {"cuMemRelease", reinterpret_cast<void*>(&FakeCuMemRelease)},
      {"cuMemMap", reinterpret_cast<void*>(&FakeCuMemMap)},
      {"cuMemUnmap", reinterpret_cast<void*>(&FakeCuMemUnmap)},
      {"cuMemAddressReserve", reinterpret_cast<void*>(&FakeCuMemAddressReserve)},
      {"cuFuncGetParamInfo", reinterpret_cast<void*>(&FakeCuFuncGetParamInfo)},
  };
  for (const Entry& e : kEntries) {
    if (name != nullptr && std::strcmp(name, e.name) == 0) return e.fn;
  }
  return nullptr;
}

}  // namespace

// ---- the runtime API -------------------------------------------------------------------------

extern "C" {

CudaError cudaMalloc(void** ptr, size_t size) {
  const CudaError rc = DeviceAlloc(ptr, size);
  Log("cudaMalloc size=%zu ptr=%p rc=%d", size, rc == 0 ? *ptr : nullptr, rc);
  return rc;
}

CudaError cudaFree(void* ptr) {
  const CudaError rc = ptr == nullptr ? 0 : FreeKind(ptr, true);
  Log("cudaFree ptr=%p rc=%d", ptr, rc);
  return rc;
}

CudaError cudaMallocAsync(void** ptr, size_t size, CudaStream stream) {
  const CudaError rc = DeviceAlloc(ptr, size);
  Log("cudaMallocAsync size=%zu stream=%p ptr=%p rc=%d", size, stream, rc == 0 ? *ptr : nullptr,
      rc);
  return rc;
}

CudaError cudaFreeAsync(void* ptr, CudaStream stream) {
  const CudaError rc = FreeKind(ptr, true);
  Log("cudaFreeAsync ptr=%p stream=%p rc=%d", ptr, stream, rc);
  return rc;
}

CudaError cudaMallocFromPoolAsync(void** ptr, size_t size, CudaMemPool pool, CudaStream stream) {
  const CudaError rc = DeviceAlloc(ptr, size);
  Log("cudaMallocFromPoolAsync size=%zu pool=%p stream=%p ptr=%p rc=%d", size, pool, stream,
      rc == 0 ? *ptr : nullptr, rc);
  return rc;
}

CudaError cudaMallocManaged(void** ptr, size_t size, unsigned flags) {
  *ptr = Allocate(size, kManaged);
  Log("cudaMallocManaged size=%zu flags=%u ptr=%p rc=0", size, flags, *ptr);
  return 0;
}

CudaError cudaHostAlloc(void** ptr, size_t size, unsigned flags) {
  *ptr = Allocate(size, kPinned);
  Log("cudaHostAlloc size=%zu flags=%u ptr=%p rc=0", size, flags, *ptr);
  return 0;
}

CudaError cudaMallocHost(void** ptr, size_t size) {
  *ptr = Allocate(size, kPinned);
  Log("cudaMallocHost size=%zu ptr=%p rc=0", size, *ptr);
  return 0;
}

CudaError cudaFreeHost(void* ptr) {
  const CudaError rc = FreeKind(ptr, false);
  Log("cudaFreeHost ptr=%p rc=%d", ptr, rc);
  return rc;
}

CudaError cudaHostRegister(void* ptr, size_t size, unsigned flags) {
  CudaError rc = Fail(2);
  {
    MutexLock l(g_reg_mu);
    for (void*& r : g_registered) {
      if (r == nullptr) {
        r = ptr;
        rc = 0;
        break;
      }
    }
  }
  Log("cudaHostRegister ptr=%p size=%zu flags=%u rc=%d", ptr, size, flags, rc);
  return rc;
}

CudaError cudaHostUnregister(void* ptr) {
  CudaError rc = 1;
  {
    MutexLock l(g_reg_mu);
    for (void*& r : g_registered) {
      if (r == ptr && ptr != nullptr) {
        r = nullptr;
        rc = 0;
        break;
      }
    }
  }
  if (rc != 0) Fail(rc);
  Log("cudaHostUnregister ptr=%p rc=%d", ptr, rc);
  return rc;
}

CudaError cudaMemGetInfo(size_t* free, size_t* total) {
  const uint64_t used = g_used.load();
  *total = Total();
  *free = used < Total() ? Total() - used : 0;
  Log("cudaMemGetInfo free=%zu total=%zu rc=0", *free, *total);
  return 0;
}

CudaError cudaLaunchKernel(const void* func, Dim3 grid, Dim3 block, void** args, size_t shared,
                           CudaStream stream) {
  Log("cudaLaunchKernel func=%p grid=%u,%u,%u block=%u,%u,%u shared=%zu stream=%p rc=0", func,
      grid.x, grid.y, grid.z, block.x, block.y, block.z, shared, stream);
  (void)args;
  return 0;
}

CudaError cudaGetFuncBySymbol(CudaFunction* f, const void* symbol) {
  *f = const_cast<void*>(symbol);
  return 0;
}

CudaError cudaGetDevice(int* device) {
  *device = 0;
  return 0;
}

CudaError cudaStreamSynchronize(CudaStream stream) {
  Log("cudaStreamSynchronize stream=%p rc=0", stream);
  return 0;
}

CudaError cudaGetLastError() {
  const CudaError rc = t_last_error;
  t_last_error = 0;
  return rc;
}

CudaError cudaRuntimeGetVersion(int* version) {
  *version = FAKE_CUDART_MAJOR == 13 ? 13000 : 12080;
  return 0;
}

#if FAKE_CUDART_MAJOR >= 13
CudaError cudaMemAdvise(const void* ptr, size_t count, int advice, CudaMemLocation loc) {
  Log("cudaMemAdvise ptr=%p count=%zu advice=%d location=%d:%d rc=0", ptr, count, advice, loc.type,
      loc.id);
  return 0;
}
CudaError cudaMemPrefetchAsync(const void* ptr, size_t count, CudaMemLocation loc, unsigned flags,
                               CudaStream stream) {
  Log("cudaMemPrefetchAsync ptr=%p count=%zu location=%d:%d flags=%u stream=%p rc=0", ptr, count,
      loc.type, loc.id, flags, stream);
  return 0;
}
#else
// Location printed as type:id with CUDA 13's encoding, so tests read one format: a device
// ordinal d is "1:d", the CPU (cudaCpuDeviceId) is "2:0".
CudaError cudaMemAdvise(const void* ptr, size_t count, int advice, int device) {
  Log("cudaMemAdvise ptr=%p count=%zu advice=%d location=%d:%d rc=0", ptr, count, advice,
      device == -1 ? 2 : 1, device == -1 ? 0 : device);
  return 0;
}
CudaError cudaMemPrefetchAsync(const void* ptr, size_t count, int device, CudaStream stream) {
  Log("cudaMemPrefetchAsync ptr=%p count=%zu location=%d:%d flags=0 stream=%p rc=0", ptr, count,
      device == -1 ? 2 : 1, device == -1 ? 0 : device, stream);
  return 0;
}
#endif

CudaError cudaGetDriverEntryPoint(const char* symbol, void** fn, unsigned long long flags,
                                  int* status) {
  *fn = DriverSymbol(symbol);
  if (status != nullptr) *status = *fn != nullptr ? 0 : 1;  // cudaDriverEntryPointSymbolNotFound
  Log("cudaGetDriverEntryPoint symbol=%s found=%d rc=0", symbol, *fn != nullptr);
  return 0;
}

CudaError cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned version,
                                           unsigned long long flags, int* status) {
  *fn = DriverSymbol(symbol);
  if (status != nullptr) *status = *fn != nullptr ? 0 : 1;
  Log("cudaGetDriverEntryPointByVersion symbol=%s version=%u found=%d rc=0", symbol, version,
      *fn != nullptr);
  return 0;
}

CuResult cuGetProcAddress(const char* symbol, void** fn, int version, uint64_t flags) {
  *fn = DriverSymbol(symbol);
  Log("cuGetProcAddress symbol=%s found=%d rc=%d", symbol, *fn != nullptr, *fn ? 0 : 500);
  return *fn != nullptr ? 0 : 500;  // CUDA_ERROR_NOT_FOUND
}

CuResult cuGetProcAddress_v2(const char* symbol, void** fn, int version, uint64_t flags,
                             int* status) {
  *fn = DriverSymbol(symbol);
  if (status != nullptr) *status = *fn != nullptr ? 0 : 1;
  Log("cuGetProcAddress_v2 symbol=%s found=%d rc=%d", symbol, *fn != nullptr, *fn ? 0 : 500);
  return *fn != nullptr ? 0 : 500;
}

void fake_cudart_register_kernel(const void* func, int n, const size_t* sizes) {
  MutexLock l(g_kernel_mu);
  if (g_nkernels == 256 || n > 32) return;
  KernelLayout& k = g_kernels[g_nkernels++];
  k.func = func;
  k.n = n;
  for (int i = 0; i < n; ++i) k.sizes[i] = sizes[i];
}

}  // extern "C"
