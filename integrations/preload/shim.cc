// libtiermem_preload.so: LD_PRELOAD interposition of the CUDA runtime allocation API.
//
// What it is: every exported function below has the name and ABI of a CUDA runtime (or
// driver) entry point. The dynamic linker binds the application's calls to them because a
// preloaded library comes first in the global lookup order. Each one forwards to the real
// function — found with dlsym(RTLD_NEXT), or, when the runtime was loaded with RTLD_LOCAL
// (PyTorch's wheels), in the libcudart/libcuda already loaded in the process — and records
// what happened. The shim never links libcudart: a second copy would be a second runtime.
//
// Invariants:
//  - Inert until the first interposed call whose real counterpart exists: no state, no file,
//    no output in a process that never calls CUDA. The first such call creates the Shim
//    (options, recorder, tables), prints one line and starts the flusher thread.
//  - Errors of the real runtime are returned unchanged. The only codes the shim makes up:
//    cudaErrorInitializationError when no real runtime provides the function (said once on
//    stderr), and, in offload mode, CUDA_ERROR_OUT_OF_MEMORY for a cuMemCreate past the
//    budget (managed memory cannot back a VMM handle; said once).
//  - A live allocation is in `allocs` (by address) or `handles` (cuMemCreate, by handle)
//    from its successful allocation until its free; it is removed before the real free is
//    called (so a concurrent allocation reusing the address can insert it) and put back if
//    the real free fails. device_used = sum of the device-tier entries' bytes (kDevice,
//    kVmmHandle, kDeviceManaged: what the timeline shows on the device tier);
//    budget_used (offload mode only) = sum of the kDevice/kVmmHandle entries' bytes.
//  - Offload budget: a device allocation first reserves its bytes in budget_used
//    (fetch_add); over the budget, or when the real device is full, the reservation is
//    returned and the allocation is served by cudaMallocManaged, advised to prefer host
//    memory, tracked as kOffloadManaged and registered in the AccessProfile.
//  - Kernel launches are counted in pending_launches (one relaxed fetch_add per launch);
//    the count is written as a kKernelLaunches event before the next memory event of any
//    thread and on every flush tick, so per thread the order "launches, then the allocation"
//    is exact and the sum of all intervals is exact.
//  - After fork() the child records nothing and never closes the parent's file (the child
//    shares the file offset); it only forwards.
// Hot path (record mode): one shard mutex of AllocTable, one recorder append (a per-thread
// buffer), a few relaxed atomics; no allocation (the stream label table interns a label the
// first time it sees a stream).
// Threading: every entry point is thread-safe; the Shim is created once (a function-local
// static) and never destroyed (threads may still call in during exit); the recorder is
// closed by the library destructor, after which events are dropped.
#include <dlfcn.h>
#include <fcntl.h>
#include <link.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>

#include "base/mutex.h"
#include "base/timeline.h"
#include "base/units.h"
#include "integrations/preload/access_profile.h"
#include "integrations/preload/alloc_table.h"
#include "integrations/preload/cuda_abi.h"
#include "integrations/preload/preload_options.h"

#define TIERMEM_EXPORT extern "C" __attribute__((visibility("default")))

namespace tiermem::preload {
namespace {

// ---- output --------------------------------------------------------------------------------

// One line on stderr, written with one write(2) (no allocation, no stdio locks).
__attribute__((format(printf, 1, 2))) void Say(const char* fmt, ...) {
  char buf[1024];
  int n = std::snprintf(buf, sizeof(buf), "tiermem preload: ");
  va_list ap;
  va_start(ap, fmt);
  int m = std::vsnprintf(buf + n, sizeof(buf) - n - 1, fmt, ap);
  va_end(ap);
  n = std::min<int>(n + std::max(m, 0), sizeof(buf) - 2);
  buf[n++] = '\n';
  ssize_t w = ::write(2, buf, n);
  (void)w;
}

// Says `fmt` the first time `flag` is seen unset.
#define TIERMEM_SAY_ONCE(...)                                               \
  do {                                                                      \
    static std::atomic<bool> said_{false};                                  \
    if (!said_.exchange(true, std::memory_order_relaxed)) Say(__VA_ARGS__); \
  } while (0)

// ---- finding the real entry points ---------------------------------------------------------

struct FindLib {
  const char* prefix;  // "libcudart.so" or "libcuda.so"
  char path[4096];
  bool found;
};

int FindLoaded(dl_phdr_info* info, size_t, void* data) {
  auto* f = static_cast<FindLib*>(data);
  const char* name = info->dlpi_name;
  if (name == nullptr || name[0] == '\0') return 0;
  const char* base = std::strrchr(name, '/');
  base = base == nullptr ? name : base + 1;
  if (std::strncmp(base, f->prefix, std::strlen(f->prefix)) != 0) return 0;
  std::snprintf(f->path, sizeof(f->path), "%s", name);
  f->found = true;
  return 1;
}

enum class Lib { kCudart, kCuda };

void* LookupReal(const char* name, Lib lib) {
  if (void* p = dlsym(RTLD_NEXT, name)) return p;
  FindLib f{lib == Lib::kCudart ? "libcudart.so" : "libcuda.so", {}, false};
  dl_iterate_phdr(FindLoaded, &f);
  if (!f.found) return nullptr;
  void* h = dlopen(f.path, RTLD_LAZY | RTLD_NOLOAD);
  if (h == nullptr) return nullptr;
  void* p = dlsym(h, name);
  dlclose(h);  // drops the reference RTLD_NOLOAD took; the library stays loaded
  return p;
}

template <typename Fn>
Fn Resolve(std::atomic<void*>* slot, const char* name, Lib lib) {
  void* p = slot->load(std::memory_order_acquire);
  if (p == nullptr) {
    p = LookupReal(name, lib);
    if (p != nullptr) slot->store(p, std::memory_order_release);
  }
  return reinterpret_cast<Fn>(p);
}

// The real `name` of type `Fn` (nullptr when no loaded library provides it).
#define TIERMEM_REAL(name, Fn, lib)           \
  ([]() {                                     \
    static std::atomic<void*> slot_{nullptr}; \
    return Resolve<Fn>(&slot_, #name, lib);   \
  }())
#define REAL_RT(name) TIERMEM_REAL(name, name##Fn_, Lib::kCudart)

using cudaMallocFn_ = CudaMallocFn;
using cudaFreeFn_ = CudaFreeFn;
using cudaMallocAsyncFn_ = CudaMallocAsyncFn;
using cudaFreeAsyncFn_ = CudaFreeAsyncFn;
using cudaMallocFromPoolAsyncFn_ = CudaMallocFromPoolAsyncFn;
using cudaMallocManagedFn_ = CudaMallocManagedFn;
using cudaHostAllocFn_ = CudaHostAllocFn;
using cudaMallocHostFn_ = CudaMallocHostFn;
using cudaFreeHostFn_ = CudaFreeHostFn;
using cudaHostRegisterFn_ = CudaHostRegisterFn;
using cudaHostUnregisterFn_ = CudaHostUnregisterFn;
using cudaMemGetInfoFn_ = CudaMemGetInfoFn;
using cudaLaunchKernelFn_ = CudaLaunchKernelFn;
using cudaGetDriverEntryPointFn_ = CudaGetDriverEntryPointFn;
using cudaGetDriverEntryPointByVersionFn_ = CudaGetDriverEntryPointByVersionFn;
using cudaGetLastErrorFn_ = CudaGetLastErrorFn;
using cudaGetDeviceFn_ = CudaGetDeviceFn;
using cudaRuntimeGetVersionFn_ = CudaRuntimeGetVersionFn;
using cudaGetFuncBySymbolFn_ = CudaGetFuncBySymbolFn;
using cudaStreamSynchronizeFn_ = CudaError (*)(CudaStream);
using cudaMemAdviseFn_ = void*;
using cudaMemPrefetchAsyncFn_ = void*;

// Driver functions the application obtained through an entry-point lookup: the real pointer
// is kept here and the application gets the wrapper.
std::atomic<void*> g_cuMemCreate{nullptr}, g_cuMemRelease{nullptr}, g_cuMemMap{nullptr},
    g_cuMemUnmap{nullptr}, g_cuMemAddressReserve{nullptr};

// ---- per-stream labels ---------------------------------------------------------------------

// Stream -> interned label "stream 0x...". Lock-free lookup; the first sighting of a stream
// interns its label under mu_ (the one allocation, once per stream). Thread-safe.
class StreamLabels {
 public:
  uint32_t Get(TimelineRecorder* rec, CudaStream stream) {
    const uint64_t key = reinterpret_cast<uint64_t>(stream) + 1;  // nonzero for stream 0
    const size_t home = (key * 0x9E3779B97F4A7C15ull) >> 56;
    for (size_t i = 0; i < kSlots; ++i) {
      const size_t s = (home + i) % kSlots;
      const uint64_t k = keys_[s].load(std::memory_order_acquire);
      if (k == key) return labels_[s];
      if (k == 0) return Insert(rec, key, stream, home);
    }
    return Intern(rec, stream);  // table full: correct, just slower
  }

 private:
  static constexpr size_t kSlots = 256;
  static uint32_t Intern(TimelineRecorder* rec, CudaStream stream) {
    char text[40];
    std::snprintf(text, sizeof(text), "stream %p", stream);
    if (stream == nullptr) std::snprintf(text, sizeof(text), "stream 0x0");
    return rec->InternLabel(text);
  }
  uint32_t Insert(TimelineRecorder* rec, uint64_t key, CudaStream stream, size_t home) {
    std::lock_guard<std::mutex> l(mu_);
    for (size_t i = 0; i < kSlots; ++i) {
      const size_t s = (home + i) % kSlots;
      const uint64_t k = keys_[s].load(std::memory_order_acquire);
      if (k == key) return labels_[s];
      if (k == 0) {
        labels_[s] = Intern(rec, stream);
        keys_[s].store(key, std::memory_order_release);  // publishes labels_[s]
        return labels_[s];
      }
    }
    return Intern(rec, stream);
  }
  std::mutex mu_;
  std::atomic<uint64_t> keys_[kSlots] = {};
  uint32_t labels_[kSlots] = {};  // written once under mu_ before its key is published
};

// ---- kernel parameter layouts (offload prefetch) -------------------------------------------

// kernel -> the sizes of its parameters, from cuFuncGetParamInfo. Thread-safe (mu_).
class KernelParams {
 public:
  static constexpr int kMaxParams = 32;
  struct Info {
    const void* func = nullptr;
    int n = -1;  // -1: unknown (no param info): the launch is not profiled
    uint16_t size[kMaxParams] = {};
  };
  // Copies the layout of `func` into *out, querying it the first time.
  void Get(const void* func, Info* out) {
    const size_t slot = (reinterpret_cast<uintptr_t>(func) >> 4) % kSlots;
    MutexLock l(mu_);
    Info& e = table_[slot];
    if (e.func != func) e = Query(func);
    *out = e;
  }

 private:
  static constexpr size_t kSlots = 1024;
  static Info Query(const void* func);
  Mutex mu_;
  Info table_[kSlots] TIERMEM_GUARDED_BY(mu_);
};

// ---- the shim ------------------------------------------------------------------------------

struct Shim {
  PreloadOptions opt;
  bool tracking = false;            // recording or offloading
  TimelineRecorder* rec = nullptr;  // owned, never destroyed (see the file comment)
  std::string timeline_path;
  AllocTable* allocs = nullptr;   // owned, never destroyed
  AllocTable* handles = nullptr;  // owned, never destroyed
  AccessProfile* profile = nullptr;
  KernelParams* params = nullptr;
  StreamLabels streams;
  int runtime_version = 0;
  uint32_t label_managed = 0, label_registered = 0, label_vmm = 0, label_offload = 0;

  std::atomic<uint64_t> device_used{0}, device_peak{0};
  std::atomic<uint64_t> budget_used{0};                    // offload mode only
  std::atomic<uint64_t> managed_used{0}, managed_peak{0};  // offload fallback
  std::atomic<uint64_t> host_used{0}, host_peak{0};
  std::atomic<uint64_t> pending_launches{0}, launches{0}, intervals{0};
  std::atomic<uint64_t> offload_allocs{0}, prefetches{0}, prefetch_bytes{0};
  std::atomic<uint64_t> vmm_maps{0}, vmm_unmaps{0}, vmm_reserves{0};
  std::atomic<bool> closed{false};
};

std::atomic<bool> g_forked_child{false};
std::atomic<Shim*> g_shim{nullptr};  // set once the Shim exists (read by the destructor)

// Relaxed: the counters are statistics and the budget check; no other data is published
// through them.
void RaisePeak(std::atomic<uint64_t>* peak, uint64_t now) {
  uint64_t p = peak->load(std::memory_order_relaxed);
  while (now > p && !peak->compare_exchange_weak(p, now, std::memory_order_relaxed)) {
  }
}

void AddUsed(std::atomic<uint64_t>* used, std::atomic<uint64_t>* peak, uint64_t n) {
  RaisePeak(peak, used->fetch_add(n, std::memory_order_relaxed) + n);
}

void EmitLaunches(Shim& s) {
  const uint64_t n = s.pending_launches.exchange(0, std::memory_order_relaxed);
  if (n == 0) return;
  s.launches.fetch_add(n, std::memory_order_relaxed);
  Event e;
  e.type = EventType::kKernelLaunches;
  e.id = s.intervals.fetch_add(1, std::memory_order_relaxed) + 1;
  e.bytes = n;
  s.rec->Record(e);
}

void RecordEvent(Shim& s, EventType type, TierKind tier, uint64_t id, uint64_t bytes,
                 uint32_t label = 0, uint8_t flags = kFlagNone, TierKind tier2 = TierKind::kNone) {
  if (s.rec == nullptr) return;
  if (s.pending_launches.load(std::memory_order_relaxed) != 0) EmitLaunches(s);
  Event e;
  e.type = type;
  e.tier = tier;
  e.tier2 = tier2;
  e.id = id;
  e.bytes = bytes;
  e.label = label;
  e.flags = flags;
  s.rec->Record(e);
}

void* Flusher(void* arg) {
  Shim& s = *static_cast<Shim*>(arg);
  const timespec tick{s.opt.flush_ms / 1000, (s.opt.flush_ms % 1000) * 1000000L};
  while (!s.closed.load(std::memory_order_acquire) && !g_forked_child.load()) {
    nanosleep(&tick, nullptr);
    if (s.closed.load(std::memory_order_acquire) || g_forked_child.load()) break;
    EmitLaunches(s);
    s.rec->Flush().IgnoreError();
  }
  return nullptr;
}

// Claims the timeline path. With TIERMEM_PRELOAD_EXCLUSIVE (set by `tiermem run`, which
// removes the file first), the first process of the run gets the path and every other one
// "<stem>.<pid>.tmt", so processes of one job never overwrite each other.
std::string ClaimTimelinePath(const std::string& path, bool exclusive) {
  if (!exclusive) return path;
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd >= 0) {
    ::close(fd);
    return path;
  }
  std::string stem = path, ext;
  const size_t dot = path.rfind('.');
  if (dot != std::string::npos && path.find('/', dot) == std::string::npos) {
    stem = path.substr(0, dot);
    ext = path.substr(dot);
  }
  return stem + "." + std::to_string(::getpid()) + ext;
}

Shim* CreateShim() {
  auto* s = new Shim();  // never deleted
  auto opt = ParsePreloadOptions(ProcessEnv());
  if (!opt.ok()) {
    Say("%s; the shim only forwards (nothing is recorded or offloaded)",
        opt.status().ToString().c_str());
    return s;
  }
  s->opt = *opt;
  if (auto* version = REAL_RT(cudaRuntimeGetVersion)) version(&s->runtime_version);
  if (!s->opt.timeline_path.empty()) {
    s->timeline_path =
        ClaimTimelinePath(ExpandPid(s->opt.timeline_path, ::getpid()), s->opt.exclusive);
    auto rec = TimelineRecorder::Open(s->timeline_path);
    if (rec.ok()) {
      s->rec = rec->release();
    } else {
      Say("cannot record the timeline: %s; continuing without it", rec.status().ToString().c_str());
    }
  }
  s->tracking = s->rec != nullptr || s->opt.offload;
  if (s->tracking) {
    auto a = AllocTable::Create(s->opt.max_allocs);
    auto h = AllocTable::Create(AllocTable::kShards * 1024);
    if (!a.ok() || !h.ok()) {
      Say("%s; the shim only forwards", (a.ok() ? h.status() : a.status()).ToString().c_str());
      s->tracking = false;
      if (s->rec != nullptr) s->rec->Close().IgnoreError();
      s->rec = nullptr;
      return s;
    }
    s->allocs = a->release();
    s->handles = h->release();
  }
  if (s->opt.offload && s->opt.prefetch) {
    s->profile = new AccessProfile(s->opt.ahead, s->opt.prefetch_max, 65536);
    s->params = new KernelParams();
  }
  if (s->rec != nullptr) {
    s->label_managed = s->rec->InternLabel("cudaMallocManaged");
    s->label_registered = s->rec->InternLabel("cudaHostRegister");
    s->label_vmm = s->rec->InternLabel("cuMemCreate");
    s->label_offload = s->rec->InternLabel("offload: managed, past the device budget");
    if (s->opt.offload)
      RecordEvent(*s, EventType::kBudget, TierKind::kDevice, 0, s->opt.device_budget);
  }
  if (!s->opt.quiet && s->tracking) {
    std::string offload = "off";
    if (s->opt.offload) {
      offload = "device budget " + FormatBytes(s->opt.device_budget) +
                (s->opt.prefetch ? ", profile-driven prefetch" : ", plain unified memory");
    }
    Say("active in pid %d (CUDA runtime %d): timeline %s; offload %s", ::getpid(),
        s->runtime_version, s->rec ? s->timeline_path.c_str() : "(none)", offload.c_str());
  }
  if (s->rec != nullptr && s->opt.flush_ms > 0) {
    pthread_t t;
    if (pthread_create(&t, nullptr, Flusher, s) == 0) pthread_detach(t);
  }
  pthread_atfork(nullptr, nullptr, [] { g_forked_child.store(true); });
  g_shim.store(s, std::memory_order_release);
  return s;
}

// The Shim, or nullptr in a forked child / when the shim has nothing to do.
Shim* Active() {
  if (g_forked_child.load(std::memory_order_relaxed)) return nullptr;
  static Shim* shim = CreateShim();
  return shim->tracking ? shim : nullptr;
}

__attribute__((destructor)) void ShimFini() {
  Shim* s = g_shim.load(std::memory_order_acquire);
  if (s == nullptr || g_forked_child.load() || s->closed.exchange(true)) return;
  if (s->rec != nullptr) {
    EmitLaunches(*s);
    Status st = s->rec->Close();
    if (!st.ok()) Say("timeline %s: %s", s->timeline_path.c_str(), st.ToString().c_str());
  }
  if (s->opt.quiet || !s->tracking) return;
  Say("pid %d: device peak %s, pinned host peak %s, %llu kernel launches; timeline %s", ::getpid(),
      FormatBytes(s->device_peak.load()).c_str(), FormatBytes(s->host_peak.load()).c_str(),
      // Without a timeline the launches are never moved out of pending_launches.
      static_cast<unsigned long long>(s->launches.load() + s->pending_launches.load()),
      s->rec ? s->timeline_path.c_str() : "(none)");
  if (s->opt.offload && s->offload_allocs.load() > 0) {
    Say("offload: the job needed more than the %s device budget: %llu allocations (peak %s) "
        "were served from managed memory (slower); %llu prefetches issued (%s)",
        FormatBytes(s->opt.device_budget).c_str(),
        static_cast<unsigned long long>(s->offload_allocs.load()),
        FormatBytes(s->managed_peak.load()).c_str(),
        static_cast<unsigned long long>(s->prefetches.load()),
        FormatBytes(s->prefetch_bytes.load()).c_str());
  }
}

// ---- shared paths --------------------------------------------------------------------------

#define TIERMEM_NO_RUNTIME(name)                                                 \
  do {                                                                           \
    TIERMEM_SAY_ONCE(                                                            \
        "%s called, but no CUDA runtime (libcudart) is loaded in this process; " \
        "returning cudaErrorInitializationError",                                \
        name);                                                                   \
    return kCudaErrorInitializationError;                                        \
  } while (0)

void Track(Shim& s, void* p, uint64_t bytes, AllocKind kind, uint32_t label) {
  if (!s.allocs->Insert(reinterpret_cast<uint64_t>(p), AllocInfo{bytes, label, kind})) {
    TIERMEM_SAY_ONCE(
        "more live allocations than TIERMEM_PRELOAD_MAX_ALLOCS=%zu can track; "
        "their frees appear as unmatched in the timeline (raise it)",
        s.opt.max_allocs);
  }
}

TierKind TierOf(AllocKind k) {
  return k == AllocKind::kHostPinned || k == AllocKind::kHostRegistered ||
                 k == AllocKind::kOffloadManaged
             ? TierKind::kHost
             : TierKind::kDevice;
}

uint8_t FlagsOf(AllocKind k) {
  return k == AllocKind::kDeviceManaged || k == AllocKind::kOffloadManaged ? kFlagManaged
                                                                           : kFlagNone;
}

void Untracked(Shim& s, AllocKind kind, uint64_t bytes) {
  switch (kind) {
    case AllocKind::kDevice:
    case AllocKind::kVmmHandle:
      s.device_used.fetch_sub(bytes, std::memory_order_relaxed);
      if (s.opt.offload) s.budget_used.fetch_sub(bytes, std::memory_order_relaxed);
      break;
    case AllocKind::kOffloadManaged:
      s.managed_used.fetch_sub(bytes, std::memory_order_relaxed);
      break;
    case AllocKind::kHostPinned:
    case AllocKind::kHostRegistered:
      s.host_used.fetch_sub(bytes, std::memory_order_relaxed);
      break;
    case AllocKind::kDeviceManaged:
      s.device_used.fetch_sub(bytes, std::memory_order_relaxed);
      break;
  }
}

// The ABI of cudaMemAdvise / cudaMemPrefetchAsync changed in CUDA 13 (see cuda_abi.h).
CudaError AdvisePreferHost(Shim& s, void* p, size_t bytes) {
  void* fn = TIERMEM_REAL(cudaMemAdvise, void*, Lib::kCudart);
  if (fn == nullptr) return kCudaErrorInitializationError;
  if (s.runtime_version >= 13000) {
    return reinterpret_cast<CudaMemAdvise13Fn>(fn)(p, bytes, kCudaMemAdviseSetPreferredLocation,
                                                   CudaMemLocation{kCudaMemLocationTypeHost, 0});
  }
  return reinterpret_cast<CudaMemAdvise12Fn>(fn)(p, bytes, kCudaMemAdviseSetPreferredLocation,
                                                 kCudaCpuDeviceId);
}

CudaError PrefetchToDevice(Shim& s, uint64_t start, uint64_t bytes, int device, CudaStream stream) {
  void* fn = TIERMEM_REAL(cudaMemPrefetchAsync, void*, Lib::kCudart);
  if (fn == nullptr) return kCudaErrorInitializationError;
  const void* p = reinterpret_cast<const void*>(start);
  if (s.runtime_version >= 13000) {
    return reinterpret_cast<CudaMemPrefetch13Fn>(fn)(
        p, bytes, CudaMemLocation{kCudaMemLocationTypeDevice, device}, 0, stream);
  }
  return reinterpret_cast<CudaMemPrefetch12Fn>(fn)(p, bytes, device, stream);
}

// Offload fallback: `bytes` of managed memory preferring the host, in place of a device
// allocation. Returns the managed allocation's error unchanged if it fails.
CudaError ServeFromManaged(Shim& s, void** ptr, size_t bytes, CudaStream stream) {
  auto managed = REAL_RT(cudaMallocManaged);
  if (managed == nullptr) TIERMEM_NO_RUNTIME("cudaMallocManaged");
  const CudaError rc = managed(ptr, bytes, kCudaMemAttachGlobal);
  if (rc != kCudaSuccess) return rc;
  const CudaError adv = AdvisePreferHost(s, *ptr, bytes);
  if (adv != kCudaSuccess) {
    TIERMEM_SAY_ONCE(
        "offload: cudaMemAdvise(SetPreferredLocation, host) failed with error %d; "
        "managed allocations keep the driver's default placement",
        adv);
    if (auto last = REAL_RT(cudaGetLastError)) last();
  }
  if (s.offload_allocs.fetch_add(1, std::memory_order_relaxed) == 0 && !s.opt.quiet) {
    Say("offload: the %s device budget is reached; further device allocations are served "
        "from managed memory (the job runs slower)",
        FormatBytes(s.opt.device_budget).c_str());
  }
  Track(s, *ptr, bytes, AllocKind::kOffloadManaged, s.label_offload);
  AddUsed(&s.managed_used, &s.managed_peak, bytes);
  if (s.profile != nullptr && !s.profile->AddRange(reinterpret_cast<uint64_t>(*ptr), bytes)) {
    TIERMEM_SAY_ONCE("offload: more than 65536 managed ranges; later ones are not prefetched");
  }
  (void)stream;
  RecordEvent(s, EventType::kAlloc, TierKind::kHost, reinterpret_cast<uint64_t>(*ptr), bytes,
              s.label_offload, kFlagManaged);
  return kCudaSuccess;
}

// cudaMalloc / cudaMallocAsync / cudaMallocFromPoolAsync: `real` performs the real call.
template <typename RealCall>
CudaError DeviceAlloc(Shim* s, void** ptr, size_t bytes, bool stream_ordered, CudaStream stream,
                      RealCall real) {
  if (s == nullptr) return real();
  const uint32_t label = stream_ordered && s->rec ? s->streams.Get(s->rec, stream) : 0;
  bool reserved = false;
  if (s->opt.offload) {
    const uint64_t now = s->budget_used.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    reserved = now <= s->opt.device_budget;
    if (!reserved) {
      s->budget_used.fetch_sub(bytes, std::memory_order_relaxed);
      return ServeFromManaged(*s, ptr, bytes, stream);
    }
  }
  const CudaError rc = real();
  if (rc != kCudaSuccess) {
    if (reserved) s->budget_used.fetch_sub(bytes, std::memory_order_relaxed);
    if (rc == kCudaErrorMemoryAllocation && s->opt.offload) {
      // The device is full before the budget is: serve it from managed memory, and clear the
      // error the runtime keeps for cudaGetLastError (the caller got success).
      if (auto last = REAL_RT(cudaGetLastError)) last();
      return ServeFromManaged(*s, ptr, bytes, stream);
    }
    if (rc == kCudaErrorMemoryAllocation)
      RecordEvent(*s, EventType::kOom, TierKind::kDevice, 0, bytes);
    return rc;
  }
  AddUsed(&s->device_used, &s->device_peak, bytes);
  Track(*s, *ptr, bytes, AllocKind::kDevice, label);
  RecordEvent(*s, EventType::kAlloc, TierKind::kDevice, reinterpret_cast<uint64_t>(*ptr), bytes,
              label);
  return kCudaSuccess;
}

// cudaFree / cudaFreeAsync / cudaFreeHost / cudaHostUnregister.
template <typename RealCall>
CudaError Release(Shim* s, void* p, TierKind default_tier, RealCall real) {
  if (s == nullptr || p == nullptr) return real(p);
  AllocInfo info;
  const bool known = s->allocs->Remove(reinterpret_cast<uint64_t>(p), &info);
  const CudaError rc = real(p);
  if (rc != kCudaSuccess) {
    if (known) s->allocs->Insert(reinterpret_cast<uint64_t>(p), info);
    return rc;
  }
  if (!known) {
    RecordEvent(*s, EventType::kFree, default_tier, reinterpret_cast<uint64_t>(p), 0);
    return rc;
  }
  Untracked(*s, info.kind, info.bytes);
  if (info.kind == AllocKind::kOffloadManaged && s->profile != nullptr) {
    s->profile->RemoveRange(reinterpret_cast<uint64_t>(p));
  }
  RecordEvent(*s, EventType::kFree, TierOf(info.kind), reinterpret_cast<uint64_t>(p), info.bytes,
              info.label, FlagsOf(info.kind));
  return rc;
}

// A stream-ordered free of memory the offload mode served from managed memory: managed
// memory cannot be freed stream-ordered, so wait for the stream and free it synchronously.
bool IsOffloadManaged(Shim* s, void* p) {
  AllocInfo info;
  return s != nullptr && s->opt.offload && s->allocs->Find(reinterpret_cast<uint64_t>(p), &info) &&
         info.kind == AllocKind::kOffloadManaged;
}

CudaError HostAlloc(Shim* s, void** ptr, size_t bytes, AllocKind kind, CudaError rc) {
  if (s == nullptr || rc != kCudaSuccess) return rc;
  const uint32_t label = kind == AllocKind::kHostRegistered ? s->label_registered : 0;
  Track(*s, *ptr, bytes, kind, label);
  AddUsed(&s->host_used, &s->host_peak, bytes);
  RecordEvent(*s, EventType::kAlloc, TierKind::kHost, reinterpret_cast<uint64_t>(*ptr), bytes,
              label);
  return rc;
}

KernelParams::Info KernelParams::Query(const void* func) {
  Info info;
  info.func = func;
  auto by_symbol = REAL_RT(cudaGetFuncBySymbol);
  static std::atomic<void*> param_info{nullptr};
  if (param_info.load() == nullptr) {
    void* fn = nullptr;
    int status = 0;
    if (auto bv = REAL_RT(cudaGetDriverEntryPointByVersion)) {
      if (bv("cuFuncGetParamInfo", &fn, 12040, 0, &status) != kCudaSuccess) fn = nullptr;
    } else if (auto ep = REAL_RT(cudaGetDriverEntryPoint)) {
      if (ep("cuFuncGetParamInfo", &fn, 0, &status) != kCudaSuccess) fn = nullptr;
    }
    param_info.store(fn);
  }
  auto get = reinterpret_cast<CuFuncGetParamInfoFn>(param_info.load());
  CudaFunction f = nullptr;
  if (by_symbol == nullptr || get == nullptr || by_symbol(&f, func) != kCudaSuccess) {
    TIERMEM_SAY_ONCE(
        "offload: no kernel parameter info (cudaGetFuncBySymbol + "
        "cuFuncGetParamInfo need CUDA >= 12.4); launches are not profiled and "
        "offloaded memory is not prefetched (plain unified memory)");
    if (auto last = REAL_RT(cudaGetLastError)) last();
    return info;
  }
  info.n = 0;
  for (int i = 0; i < kMaxParams; ++i) {
    size_t offset = 0, size = 0;
    if (get(f, i, &offset, &size) != kCuSuccess) break;
    info.size[info.n++] = static_cast<uint16_t>(std::min<size_t>(size, 0xffff));
  }
  return info;
}

// Offload: profile the launch and issue the prefetches the profile predicts.
void ProfileLaunch(Shim& s, const void* func, void** args, CudaStream stream) {
  if (s.profile->ranges() == 0 || args == nullptr) return;
  KernelParams::Info info;
  s.params->Get(func, &info);
  if (info.n <= 0) return;
  constexpr int kMaxWords = 64;
  uint64_t words[kMaxWords];
  int nw = 0;
  for (int i = 0; i < info.n && nw < kMaxWords; ++i) {
    // Pointers may sit inside by-value structs (PyTorch passes arrays of data pointers), so
    // every aligned 8-byte word of a parameter is a candidate.
    const auto* bytes = static_cast<const unsigned char*>(args[i]);
    for (size_t off = 0; off + 8 <= info.size[i] && nw < kMaxWords; off += 8) {
      std::memcpy(&words[nw++], bytes + off, 8);
    }
  }
  PrefetchRequest req[AccessProfile::kMaxPrefetches];
  const int n = s.profile->OnLaunch(reinterpret_cast<uint64_t>(func), words, nw, req);
  if (n == 0) return;
  int device = 0;
  if (auto get = REAL_RT(cudaGetDevice)) get(&device);
  const uint32_t label = s.rec ? s.streams.Get(s.rec, stream) : 0;
  for (int i = 0; i < n; ++i) {
    const CudaError rc = PrefetchToDevice(s, req[i].start, req[i].bytes, device, stream);
    if (rc != kCudaSuccess) {
      TIERMEM_SAY_ONCE("offload: cudaMemPrefetchAsync failed with error %d; continuing without it",
                       rc);
      if (auto last = REAL_RT(cudaGetLastError)) last();
      continue;
    }
    s.prefetches.fetch_add(1, std::memory_order_relaxed);
    s.prefetch_bytes.fetch_add(req[i].bytes, std::memory_order_relaxed);
    RecordEvent(s, EventType::kPrefetch, TierKind::kHost, req[i].base, req[i].bytes, label,
                kFlagManaged, TierKind::kDevice);
  }
}

// ---- driver functions reached through the entry-point lookup ------------------------------

CuResult WrapCuMemCreate(CuMemHandle* handle, size_t size, const void* prop,
                         unsigned long long flags) noexcept {
  auto real = reinterpret_cast<CuMemCreateFn>(g_cuMemCreate.load(std::memory_order_acquire));
  Shim* s = Active();
  if (s == nullptr) return real(handle, size, prop, flags);
  if (s->opt.offload) {
    const uint64_t now = s->budget_used.fetch_add(size, std::memory_order_relaxed) + size;
    if (now > s->opt.device_budget) {
      s->budget_used.fetch_sub(size, std::memory_order_relaxed);
      TIERMEM_SAY_ONCE(
          "offload: cuMemCreate (CUDA virtual memory, e.g. PyTorch "
          "expandable_segments) past the device budget cannot be served from "
          "managed memory; returning CUDA_ERROR_OUT_OF_MEMORY (turn "
          "expandable_segments off to offload)");
      RecordEvent(*s, EventType::kOom, TierKind::kDevice, 0, size, s->label_vmm);
      return kCuErrorOutOfMemory;
    }
  }
  const CuResult rc = real(handle, size, prop, flags);
  if (rc != kCuSuccess) {
    if (s->opt.offload) s->budget_used.fetch_sub(size, std::memory_order_relaxed);
    if (rc == kCuErrorOutOfMemory)
      RecordEvent(*s, EventType::kOom, TierKind::kDevice, 0, size, s->label_vmm);
    return rc;
  }
  AddUsed(&s->device_used, &s->device_peak, size);
  if (!s->handles->Insert(*handle, AllocInfo{size, s->label_vmm, AllocKind::kVmmHandle})) {
    TIERMEM_SAY_ONCE("too many live cuMemCreate handles to track; their releases appear unmatched");
  }
  RecordEvent(*s, EventType::kAlloc, TierKind::kDevice, *handle, size, s->label_vmm);
  return rc;
}

CuResult WrapCuMemRelease(CuMemHandle handle) noexcept {
  auto real = reinterpret_cast<CuMemReleaseFn>(g_cuMemRelease.load(std::memory_order_acquire));
  Shim* s = Active();
  if (s == nullptr) return real(handle);
  AllocInfo info;
  const bool known = s->handles->Remove(handle, &info);
  const CuResult rc = real(handle);
  if (rc != kCuSuccess) {
    if (known) s->handles->Insert(handle, info);
    return rc;
  }
  if (known) Untracked(*s, info.kind, info.bytes);
  RecordEvent(*s, EventType::kFree, TierKind::kDevice, handle, known ? info.bytes : 0,
              s->label_vmm);
  return rc;
}

CuResult WrapCuMemMap(CuDevicePtr ptr, size_t size, size_t offset, CuMemHandle handle,
                      unsigned long long flags) noexcept {
  if (Shim* s = Active()) s->vmm_maps.fetch_add(1, std::memory_order_relaxed);
  return reinterpret_cast<CuMemMapFn>(g_cuMemMap.load())(ptr, size, offset, handle, flags);
}

CuResult WrapCuMemUnmap(CuDevicePtr ptr, size_t size) noexcept {
  if (Shim* s = Active()) s->vmm_unmaps.fetch_add(1, std::memory_order_relaxed);
  return reinterpret_cast<CuMemUnmapFn>(g_cuMemUnmap.load())(ptr, size);
}

CuResult WrapCuMemAddressReserve(CuDevicePtr* ptr, size_t size, size_t alignment, CuDevicePtr addr,
                                 unsigned long long flags) noexcept {
  if (Shim* s = Active()) s->vmm_reserves.fetch_add(1, std::memory_order_relaxed);
  return reinterpret_cast<CuMemAddressReserveFn>(g_cuMemAddressReserve.load())(ptr, size, alignment,
                                                                               addr, flags);
}

// If `symbol` is one of the wrapped driver functions and the lookup found it, keeps the real
// pointer and hands out the wrapper instead.
void WrapDriverSymbol(const char* symbol, void** fn) {
  if (symbol == nullptr || fn == nullptr || *fn == nullptr) return;
  struct Wrapped {
    const char* name;
    std::atomic<void*>* real;
    void* wrapper;
  };
  static const Wrapped kWrapped[] = {
      {"cuMemCreate", &g_cuMemCreate, reinterpret_cast<void*>(&WrapCuMemCreate)},
      {"cuMemRelease", &g_cuMemRelease, reinterpret_cast<void*>(&WrapCuMemRelease)},
      {"cuMemMap", &g_cuMemMap, reinterpret_cast<void*>(&WrapCuMemMap)},
      {"cuMemUnmap", &g_cuMemUnmap, reinterpret_cast<void*>(&WrapCuMemUnmap)},
      {"cuMemAddressReserve", &g_cuMemAddressReserve,
       reinterpret_cast<void*>(&WrapCuMemAddressReserve)},
  };
  for (const Wrapped& w : kWrapped) {
    if (std::strcmp(symbol, w.name) != 0) continue;
    if (*fn == w.wrapper) return;  // already ours (a lookup through a wrapped lookup)
    w.real->store(*fn, std::memory_order_release);
    *fn = w.wrapper;
    return;
  }
}

}  // namespace
}  // namespace tiermem::preload

// ---- the interposed entry points -----------------------------------------------------------

using namespace tiermem::preload;  // NOLINT: the exported C names below are the API

TIERMEM_EXPORT CudaError cudaMalloc(void** ptr, size_t size) noexcept {
  auto real = REAL_RT(cudaMalloc);
  if (real == nullptr) TIERMEM_NO_RUNTIME("cudaMalloc");
  return DeviceAlloc(Active(), ptr, size, false, nullptr, [&] { return real(ptr, size); });
}

TIERMEM_EXPORT CudaError cudaMallocAsync(void** ptr, size_t size, CudaStream stream) noexcept {
  auto real = REAL_RT(cudaMallocAsync);
  if (real == nullptr) TIERMEM_NO_RUNTIME("cudaMallocAsync");
  return DeviceAlloc(Active(), ptr, size, true, stream, [&] { return real(ptr, size, stream); });
}

TIERMEM_EXPORT CudaError cudaMallocFromPoolAsync(void** ptr, size_t size, CudaMemPool pool,
                                                 CudaStream stream) noexcept {
  auto real = REAL_RT(cudaMallocFromPoolAsync);
  if (real == nullptr) TIERMEM_NO_RUNTIME("cudaMallocFromPoolAsync");
  return DeviceAlloc(Active(), ptr, size, true, stream,
                     [&] { return real(ptr, size, pool, stream); });
}

TIERMEM_EXPORT CudaError cudaFree(void* ptr) noexcept {
  auto real = REAL_RT(cudaFree);
  if (real == nullptr) TIERMEM_NO_RUNTIME("cudaFree");
  return Release(Active(), ptr, tiermem::TierKind::kDevice, real);
}

TIERMEM_EXPORT CudaError cudaFreeAsync(void* ptr, CudaStream stream) noexcept {
  auto real = REAL_RT(cudaFreeAsync);
  if (real == nullptr) TIERMEM_NO_RUNTIME("cudaFreeAsync");
  Shim* s = Active();
  if (IsOffloadManaged(s, ptr)) {
    auto sync = REAL_RT(cudaStreamSynchronize);
    auto free = REAL_RT(cudaFree);
    if (sync == nullptr || free == nullptr) TIERMEM_NO_RUNTIME("cudaStreamSynchronize/cudaFree");
    const CudaError rc = sync(stream);
    if (rc != kCudaSuccess) return rc;
    return Release(s, ptr, tiermem::TierKind::kDevice, free);
  }
  return Release(s, ptr, tiermem::TierKind::kDevice, [&](void* p) { return real(p, stream); });
}

TIERMEM_EXPORT CudaError cudaMallocManaged(void** ptr, size_t size, unsigned flags) noexcept {
  auto real = REAL_RT(cudaMallocManaged);
  if (real == nullptr) TIERMEM_NO_RUNTIME("cudaMallocManaged");
  const CudaError rc = real(ptr, size, flags);
  Shim* s = Active();
  if (s == nullptr || rc != kCudaSuccess) return rc;
  Track(*s, *ptr, size, AllocKind::kDeviceManaged, s->label_managed);
  AddUsed(&s->device_used, &s->device_peak, size);
  RecordEvent(*s, tiermem::EventType::kAlloc, tiermem::TierKind::kDevice,
              reinterpret_cast<uint64_t>(*ptr), size, s->label_managed, tiermem::kFlagManaged);
  return rc;
}

TIERMEM_EXPORT CudaError cudaHostAlloc(void** ptr, size_t size, unsigned flags) noexcept {
  auto real = REAL_RT(cudaHostAlloc);
  if (real == nullptr) TIERMEM_NO_RUNTIME("cudaHostAlloc");
  return HostAlloc(Active(), ptr, size, AllocKind::kHostPinned, real(ptr, size, flags));
}

TIERMEM_EXPORT CudaError cudaMallocHost(void** ptr, size_t size) noexcept {
  auto real = REAL_RT(cudaMallocHost);
  if (real == nullptr) TIERMEM_NO_RUNTIME("cudaMallocHost");
  return HostAlloc(Active(), ptr, size, AllocKind::kHostPinned, real(ptr, size));
}

TIERMEM_EXPORT CudaError cudaFreeHost(void* ptr) noexcept {
  auto real = REAL_RT(cudaFreeHost);
  if (real == nullptr) TIERMEM_NO_RUNTIME("cudaFreeHost");
  return Release(Active(), ptr, tiermem::TierKind::kHost, real);
}

TIERMEM_EXPORT CudaError cudaHostRegister(void* ptr, size_t size, unsigned flags) noexcept {
  auto real = REAL_RT(cudaHostRegister);
  if (real == nullptr) TIERMEM_NO_RUNTIME("cudaHostRegister");
  void* p = ptr;
  return HostAlloc(Active(), &p, size, AllocKind::kHostRegistered, real(ptr, size, flags));
}

TIERMEM_EXPORT CudaError cudaHostUnregister(void* ptr) noexcept {
  auto real = REAL_RT(cudaHostUnregister);
  if (real == nullptr) TIERMEM_NO_RUNTIME("cudaHostUnregister");
  return Release(Active(), ptr, tiermem::TierKind::kHost, real);
}

TIERMEM_EXPORT CudaError cudaMemGetInfo(size_t* free, size_t* total) noexcept {
  auto real = REAL_RT(cudaMemGetInfo);
  if (real == nullptr) TIERMEM_NO_RUNTIME("cudaMemGetInfo");
  const CudaError rc = real(free, total);
  Shim* s = Active();
  if (s == nullptr || !s->opt.offload || rc != kCudaSuccess || free == nullptr ||
      total == nullptr) {
    return rc;
  }
  // Report the budget, so frameworks size their caches to it.
  const uint64_t budget = s->opt.device_budget;
  const uint64_t used = std::min<uint64_t>(s->budget_used.load(std::memory_order_relaxed), budget);
  *total = std::min<uint64_t>(*total, budget);
  *free = std::min<uint64_t>(*free, budget - used);
  return rc;
}

TIERMEM_EXPORT CudaError cudaLaunchKernel(const void* func, Dim3 grid, Dim3 block, void** args,
                                          size_t shared_mem, CudaStream stream) noexcept {
  auto real = REAL_RT(cudaLaunchKernel);
  if (real == nullptr) TIERMEM_NO_RUNTIME("cudaLaunchKernel");
  if (Shim* s = Active()) {
    // Relaxed: a count, read only by exchange; per-thread order with the next memory event
    // comes from that thread's own program order.
    s->pending_launches.fetch_add(1, std::memory_order_relaxed);
    if (s->profile != nullptr) ProfileLaunch(*s, func, args, stream);
  }
  return real(func, grid, block, args, shared_mem, stream);
}

TIERMEM_EXPORT CudaError cudaGetDriverEntryPoint(const char* symbol, void** fn,
                                                 unsigned long long flags, int* status) noexcept {
  auto real = REAL_RT(cudaGetDriverEntryPoint);
  if (real == nullptr) TIERMEM_NO_RUNTIME("cudaGetDriverEntryPoint");
  const CudaError rc = real(symbol, fn, flags, status);
  if (rc == kCudaSuccess) WrapDriverSymbol(symbol, fn);
  return rc;
}

TIERMEM_EXPORT CudaError cudaGetDriverEntryPointByVersion(const char* symbol, void** fn,
                                                          unsigned version,
                                                          unsigned long long flags,
                                                          int* status) noexcept {
  auto real = REAL_RT(cudaGetDriverEntryPointByVersion);
  if (real == nullptr) TIERMEM_NO_RUNTIME("cudaGetDriverEntryPointByVersion");
  const CudaError rc = real(symbol, fn, version, flags, status);
  if (rc == kCudaSuccess) WrapDriverSymbol(symbol, fn);
  return rc;
}

TIERMEM_EXPORT CuResult cuGetProcAddress(const char* symbol, void** fn, int version,
                                         uint64_t flags) noexcept {
  auto real = TIERMEM_REAL(cuGetProcAddress, CuGetProcAddressV1Fn, Lib::kCuda);
  if (real == nullptr) {
    TIERMEM_SAY_ONCE("cuGetProcAddress called, but no CUDA driver (libcuda) is loaded");
    return kCuErrorNotInitialized;
  }
  const CuResult rc = real(symbol, fn, version, flags);
  if (rc == kCuSuccess) WrapDriverSymbol(symbol, fn);
  return rc;
}

TIERMEM_EXPORT CuResult cuGetProcAddress_v2(const char* symbol, void** fn, int version,
                                            uint64_t flags, int* status) noexcept {
  auto real = TIERMEM_REAL(cuGetProcAddress_v2, CuGetProcAddressV2Fn, Lib::kCuda);
  if (real == nullptr) {
    TIERMEM_SAY_ONCE("cuGetProcAddress_v2 called, but no CUDA driver (libcuda) is loaded");
    return kCuErrorNotInitialized;
  }
  const CuResult rc = real(symbol, fn, version, flags, status);
  if (rc == kCuSuccess) WrapDriverSymbol(symbol, fn);
  return rc;
}
