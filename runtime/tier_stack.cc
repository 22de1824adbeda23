// TierStack: builds the tiers of one session (see tier_stack.h).
//
// Invariants: members are destroyed in the reverse order of their dependencies — the engine
// (which frees its regions after waiting for moves) before the mover, the mover before the
// tiers, the host tiers before the NVMe tier (their slabs are registered with it), the tiers
// before the pinners, all of them before the recorder is closed — both in
// Close() and when Create() fails half-way (the partially built stack is destroyed).
#include "runtime/tier_stack.h"

#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>  // std::call_once
#include <set>
#include <string>
#include <unordered_map>

#include "base/fs.h"
#include "base/logging.h"
#include "base/mutex.h"
#include "kernels/cpu/optim.h"
#include "tiers/fake/sim_device.h"
#include "tiers/nvme/nvme_tier.h"
#ifdef TIERMEM_SESSION_WITH_CUDA
#include "tiers/cuda/cuda_tier.h"
#endif

namespace tiermem::session {
namespace {

constexpr Bytes kPage = 4096;

// Temporary timelines of stacks not closed yet, removed by an atexit handler: a session that
// is never destroyed (an object a binding leaks, one kept alive by a reference cycle through
// torch's C++ objects) still leaves no file behind at a normal exit. A killed process can.
// The set and its mutex are never destroyed, so a stack closed during static destruction
// (after the handler ran) still finds them. Thread-safe.
struct TempTimelines {
  Mutex mu;
  std::set<std::string> paths TIERMEM_GUARDED_BY(mu);
};

TempTimelines& Temps() {
  static TempTimelines* t = new TempTimelines();  // leaked on purpose (the comment above)
  return *t;
}

void RemoveTempTimelinesAtExit() {
  TempTimelines& t = Temps();
  MutexLock lock(t.mu);
  for (const std::string& p : t.paths) unlink(p.c_str());
  t.paths.clear();
}

void TrackTempTimeline(const std::string& path) {
  static std::once_flag registered;
  std::call_once(registered, [] { std::atexit(RemoveTempTimelinesAtExit); });
  TempTimelines& t = Temps();
  MutexLock lock(t.mu);
  t.paths.insert(path);
}

void ForgetTempTimeline(const std::string& path) {
  TempTimelines& t = Temps();
  MutexLock lock(t.mu);
  t.paths.erase(path);
}

HostTierConfig HostConfig(Bytes capacity, Bytes slot, HostPinner* pinner) {
  HostTierConfig hc;
  hc.capacity = capacity;
  hc.slot_bytes = slot;
  hc.min_class_bytes = kPage;
  // Slabs of at most 64 MiB (whole slots), so a small budget does not fault a big slab.
  hc.slab_bytes = std::max(slot, std::min<Bytes>(AlignUp(capacity, slot), 64 * kMiB / slot * slot));
  hc.pinner = pinner;
  return hc;
}

// The host tiers' pinner when there is an NVMe tier: the slabs mapped while the stack is built
// (the staging slots and, when the training state exceeds the host budget, the whole host
// budget: both prefaulted at creation) are registered with the NVMe tier as io_uring fixed
// buffers, so that its reads and writes into chunk homes, caches and staging slots skip the
// kernel's per-I/O page pinning (what fio's --fixedbufs gives fio); every mapping also goes to
// the CUDA pinner when there is one. After Seal() (the end of TierStack::Create) nothing more
// is registered with NVMe: the NVMe tier registers on its I/O thread and waits for it, while
// the host tier calls the pinner under its lock, which a completion on that I/O thread may be
// waiting for (a bounce freeing its staging slot) — registering then could deadlock. Memory
// mapped later works unregistered. Registration is an optimization: a refusal (the posix
// engine, RLIMIT_MEMLOCK, a full buffer table) leaves the memory unregistered, logged once.
// Only the CUDA pinner's failure fails the allocation.
// Threading: the host tiers call it from any thread; the NVMe tier's registration is
// thread-safe, the state here is guarded by mu_.
class NvmeRegisteringPinner final : public HostPinner {
 public:
  NvmeRegisteringPinner(NvmeTier* nvme, HostPinner* next) : nvme_(nvme), next_(next) {}

  Status Register(void* addr, Bytes bytes) override {
    if (next_ != nullptr) TIERMEM_RETURN_IF_ERROR(next_->Register(addr, bytes));
    {
      MutexLock lock(mu_);
      if (sealed_) return OkStatus();
    }
    const Status s = nvme_->RegisterHostMemory(addr, bytes);
    if (s.ok()) {
      MutexLock lock(mu_);
      registered_.emplace(addr, bytes);
      total_ += bytes;
    } else if (s.code() != StatusCode::kUnavailable) {  // kUnavailable: posix or refused at start
      LogOnce(LogLevel::kWarn, "nvme: host slab not registered",
              "nvme tier: host memory left unregistered for io_uring (" + s.message() +
                  "); its copies take the kernel's page-pinning path");
    }
    return OkStatus();
  }

  // From now on memory is no longer registered with NVMe (see above); unregistering goes on.
  void Seal() {
    MutexLock lock(mu_);
    sealed_ = true;
  }

  Bytes registered_bytes() const {
    MutexLock lock(mu_);
    return total_;
  }

  void Unregister(void* addr) override {
    bool was = false;
    {
      MutexLock lock(mu_);
      auto it = registered_.find(addr);
      if (it != registered_.end()) {
        was = true;
        total_ -= it->second;
        registered_.erase(it);
      }
    }
    if (was) nvme_->UnregisterHostMemory(addr).IgnoreError();
    if (next_ != nullptr) next_->Unregister(addr);
  }

 private:
  NvmeTier* const nvme_;
  HostPinner* const next_;
  mutable Mutex mu_;
  std::unordered_map<void*, Bytes> registered_ TIERMEM_GUARDED_BY(mu_);
  Bytes total_ TIERMEM_GUARDED_BY(mu_) = 0;
  bool sealed_ TIERMEM_GUARDED_BY(mu_) = false;
};

}  // namespace

NvmeIoBackend IoBackendOf(NvmeEngine e) {
  switch (e) {
    case NvmeEngine::kIoUring:
      return NvmeIoBackend::kIoUring;
    case NvmeEngine::kPosix:
      return NvmeIoBackend::kPosix;
    case NvmeEngine::kAuto:
      break;
  }
  return NvmeIoBackend::kAuto;
}

bool TierStack::CudaBuilt() {
#ifdef TIERMEM_SESSION_WITH_CUDA
  return true;
#else
  return false;
#endif
}

std::string TierStack::CudaRuntimeVersion() {
#ifdef TIERMEM_SESSION_WITH_CUDA
  const int v = CudaRuntimeBuildVersion();
  return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
#else
  return "";
#endif
}

StatusOr<DeviceKind> TierStack::ResolveDeviceKind(DeviceKind kind) {
  if (kind != DeviceKind::kAuto && !IsCuda(kind)) return kind;
#ifdef TIERMEM_SESSION_WITH_CUDA
  StatusOr<int> count = CudaDeviceCount();
  if (count.ok()) return DeviceKind::kCuda;
  if (kind == DeviceKind::kAuto) return DeviceKind::kHost;
  return UnavailableError(
      "device_kind 'cuda' (config or TIERMEM_DEVICE) but there is no CUDA "
      "device: " +
      count.status().message());
#else
  if (kind == DeviceKind::kAuto) return DeviceKind::kHost;
  return UnavailableError(
      "device_kind 'cuda' (config or TIERMEM_DEVICE) but there is no CUDA "
      "device: this tiermem build has no CUDA support");
#endif
}

StatusOr<std::unique_ptr<TierStack>> TierStack::Create(const SessionConfig& config,
                                                       const StackLayout& layout) {
  // The process-wide knobs the config carries: log level, CPU kernel threads and ISA.
  SetLogLevel(config.log_level);
  kernels::SetKernelThreads(config.cpu_threads);
  if (const std::optional<kernels::Isa> isa = KernelIsaOf(config.kernel_isa)) {
    TIERMEM_RETURN_IF_ERROR(kernels::SetKernelIsa(*isa).WithContext("kernel_isa"));
  }
  TIERMEM_ASSIGN_OR_RETURN(const DeviceKind device, ResolveDeviceKind(config.device_kind));

  std::unique_ptr<TierStack> s(new TierStack());
  if (config.timeline.empty()) {
    const char* tmp = getenv("TMPDIR");
    std::string tmpl =
        std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/tiermem-XXXXXX.tmt";
    const int fd = mkstemps(tmpl.data(), 4);
    if (fd < 0) return IOError("cannot create a temporary timeline file " + tmpl);
    close(fd);
    s->timeline_path_ = tmpl;
    s->own_timeline_ = true;
    TrackTempTimeline(tmpl);
  } else {
    s->timeline_path_ = config.timeline;
    Status made = MakeDirs(DirName(config.timeline));
    if (!made.ok()) return InvalidArgumentError("config 'timeline': " + made.message());
  }
  // From here on a failure destroys `s`, whose destructor removes a temporary timeline.
  TIERMEM_ASSIGN_OR_RETURN(s->recorder_, TimelineRecorder::Open(s->timeline_path_));
  if (IsCuda(device)) {
#ifdef TIERMEM_SESSION_WITH_CUDA
    CudaTierConfig cc;
    cc.capacity = config.device_budget;
    TIERMEM_ASSIGN_OR_RETURN(s->device_, NewCudaTier(cc));
    s->cuda_pinner_ = NewCudaHostPinner();
    s->pinner_ = s->cuda_pinner_.get();
    s->cuda_ = true;
#endif
  } else if (IsSimulated(device)) {
    SimDeviceConfig dc;
    dc.capacity = config.device_budget;
    dc.async = IsAsyncSim(device);
    s->device_ = NewSimDevice(dc);
  }
  s->device_kind_ = device;
  const Bytes slot = AlignUp(std::max<Bytes>(layout.chunk_bytes, kPage), kPage);
  Bytes staging_bytes = 0;
  const bool host_compute = IsHostCompute(device);  // no device tier: NVMe <-> host directly
  if (config.nvme_size > 0) {
    TIERMEM_RETURN_IF_ERROR(CheckNvmePath(config));
    staging_bytes = host_compute ? 0 : slot * static_cast<Bytes>(config.prefetch_depth + 2);
    // Besides the staging slots, room to cache NVMe-homed chunks on the host: the optimizer
    // step holds one chunk group's chunks there at once (the reserve). Below that every home
    // would go to NVMe and the first step would fail half-way through the groups.
    const Bytes room = std::max(slot, layout.host_reserve);
    if (staging_bytes + room > config.host_budget) {
      const std::string why =
          host_compute
              ? std::to_string(room) +
                    " to hold the NVMe-homed chunks that compute and the "
                    "optimizer step use at once (chunks of " +
                    std::to_string(slot) +
                    " bytes; in host mode the chunk size follows the host budget, or set "
                    "chunk_size)"
              : std::to_string(staging_bytes) +
                    " for the staging slots of device<->NVMe moves plus " + std::to_string(room) +
                    " to hold one chunk group's NVMe-homed chunks during the optimizer step "
                    "(chunks of " +
                    std::to_string(slot) +
                    " bytes; the chunk size follows the "
                    "device budget, or set chunk_size)";
      const std::string reserve =
          config.host_reserve > 0
              ? " (of them host_reserve's " + std::to_string(config.host_reserve) + ")"
              : "";
      return ResourceExhaustedError("host budget of " + std::to_string(config.host_budget) +
                                    " bytes is below the minimum of " +
                                    std::to_string(staging_bytes + room) + " bytes" + reserve +
                                    " with NVMe: " + why);
    }
    // The NVMe tier before the host tiers, so that their slabs are registered with it as they
    // are mapped (NvmeRegisteringPinner); it is destroyed after them.
    NvmeTierConfig nc;
    nc.dir = config.nvme_path;
    nc.io_backend = IoBackendOf(config.nvme_engine);
    nc.queue_depth = config.io_depth;
    nc.piece_bytes = config.io_piece;
    nc.capacity = AlignUp(config.nvme_size, nc.block_bytes);
    // Wrapped for read-only file homes (a served checkpoint read in place: runtime/weights.h).
    TIERMEM_ASSIGN_OR_RETURN(std::unique_ptr<FileHomeTier> nvme, OpenNvmeTierWithFileHomes(nc));
    s->file_homes_ = nvme.get();
    s->nvme_ = std::move(nvme);
    if (auto* nvme = dynamic_cast<NvmeTier*>(s->nvme_.get())) {
      s->nvme_pinner_ = std::make_unique<NvmeRegisteringPinner>(nvme, s->cuda_pinner_.get());
      s->pinner_ = s->nvme_pinner_.get();
    }
    if (!host_compute) {
      HostTierConfig staging = HostConfig(staging_bytes, slot, s->pinner_);
      staging.prefault_bytes = staging_bytes;  // mapped (and registered) now
      TIERMEM_ASSIGN_OR_RETURN(s->staging_, NewHostTier(staging));
    }
  }
  if (config.host_budget <= staging_bytes) {
    return ResourceExhaustedError("host budget of " + std::to_string(config.host_budget) +
                                  " bytes leaves no room for chunks");
  }
  HostTierConfig host = HostConfig(config.host_budget - staging_bytes, slot, s->pinner_);
  host.prefault_bytes = std::min(layout.host_prefault, host.capacity);
  TIERMEM_ASSIGN_OR_RETURN(s->host_, NewHostTier(host));
  if (s->nvme_pinner_) static_cast<NvmeRegisteringPinner*>(s->nvme_pinner_.get())->Seal();
  // A bounced move (device <-> NVMe) pipelines I/O-sized pieces through several staging
  // slots (BounceMoverConfig), so the device copy of one piece overlaps the NVMe I/O of others
  // and a lone move keeps the disk's queue full.
  MoverConfig mc = BounceMoverConfig(slot, config.io_piece, config.io_depth);
  s->mover_ = NewMover(mc, s->staging_.get(), s->recorder_.get());
  chunks::EngineConfig cfg;
  cfg.prefetch_depth = config.prefetch_depth;
  cfg.lookahead = config.prefetch_lookahead == PrefetchLookahead::kDepth ? chunks::Lookahead::kDepth
                                                                         : chunks::Lookahead::kRoom;
  cfg.write_behind = config.write_behind;
  cfg.host_reserve_bytes = layout.host_reserve;
  if (layout.host_homes_first > 0 && s->nvme_ != nullptr) {
    const Bytes cap = s->host_->Stats().capacity;
    const Bytes homes = layout.host_homes_first + slot;  // slack: homes round to slots
    if (cap > homes) cfg.host_reserve_bytes = std::max(cfg.host_reserve_bytes, cap - homes);
  }
  TIERMEM_ASSIGN_OR_RETURN(
      s->engine_, chunks::Engine::Create(
                      cfg, chunks::EngineTiers{s->device_.get(), s->host_.get(), s->nvme_.get()},
                      s->mover_.get(), s->recorder_.get()));
  return s;
}

Bytes TierStack::host_overhead() const {
  Bytes total = 0;
  for (const Tier* t : {device_.get(), host_.get(), staging_.get(), nvme_.get()}) {
    if (t != nullptr) total += t->Stats().host_overhead;
  }
  return total;
}

TierStack::~TierStack() { Close(); }

void TierStack::Close() {
  engine_.reset();
  mover_.reset();
  host_.reset();  // unregisters its slabs from the NVMe tier and the CUDA pinner
  staging_.reset();
  file_homes_ = nullptr;
  nvme_.reset();
  device_.reset();
  pinner_ = nullptr;
  nvme_pinner_.reset();
  cuda_pinner_.reset();
  if (recorder_) {
    recorder_->Close().IgnoreError();
    recorder_.reset();
  }
  if (own_timeline_) {
    unlink(timeline_path_.c_str());
    ForgetTempTimeline(timeline_path_);
    own_timeline_ = false;
  }
}

Bytes TierStack::nvme_registered_bytes() const {
  return nvme_pinner_
             ? static_cast<const NvmeRegisteringPinner*>(nvme_pinner_.get())->registered_bytes()
             : 0;
}

std::string TierStack::io_backend() const {
  if (nvme_ == nullptr) return "";
  auto* t = dynamic_cast<NvmeTier*>(nvme_.get());
  return t ? std::string(t->io_backend_name()) : "";
}

StatusOr<prof::Report> TierStack::TimelineReport() {
  if (!recorder_) return FailedPreconditionError("tiermem session is closed");
  if (engine_) TIERMEM_RETURN_IF_ERROR(engine_->Synchronize());
  TIERMEM_RETURN_IF_ERROR(recorder_->Flush());
  return prof::AnalyzeFile(timeline_path_);
}

}  // namespace tiermem::session
