// TierStack: builds the tiers of one session (see tier_stack.h).
//
// Invariants: members are destroyed in the reverse order of their dependencies — the engine
// (which frees its regions after waiting for moves) before the mover, the mover before the
// tiers, the tiers before the pinner, all of them before the recorder is closed — both in
// Close() and when Create() fails half-way (the partially built stack is destroyed).
#include "runtime/session/tier_stack.h"

#include <stdlib.h>
#include <unistd.h>

#include <algorithm>

#include "kernels/cpu/optim.h"
#include "runtime/base/fs.h"
#include "tiers/fake/sim_device.h"
#include "tiers/nvme/nvme_tier.h"
#ifdef TIERMEM_SESSION_WITH_CUDA
#include "tiers/cuda/cuda_tier.h"
#endif

namespace tiermem::session {
namespace {

constexpr Bytes kPage = 4096;

HostTierConfig HostConfig(Bytes capacity, Bytes slot, HostPinner* pinner) {
  HostTierConfig hc;
  hc.capacity = capacity;
  hc.slot_bytes = slot;
  hc.min_class_bytes = kPage;
  // Slabs of at most 64 MiB (whole slots), so a small budget does not fault a big slab.
  hc.slab_bytes =
      std::max(slot, std::min<Bytes>(AlignUp(capacity, slot), 64 * kMiB / slot * slot));
  hc.pinner = pinner;
  return hc;
}

}  // namespace

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

StatusOr<std::string> TierStack::ResolveDeviceKind(const std::string& kind) {
  if (kind == "sim" || kind == "sim-async") return kind;
  if (kind != "auto" && kind != "cuda") {
    return InvalidArgumentError("device_kind must be 'auto', 'cuda', 'sim' or 'sim-async', got '" +
                                kind + "'");
  }
#ifdef TIERMEM_SESSION_WITH_CUDA
  StatusOr<int> count = CudaDeviceCount();
  if (count.ok()) return std::string("cuda");
  if (kind == "auto") return std::string("sim");
  return UnavailableError("device_kind 'cuda' (config or TIERMEM_DEVICE) but there is no CUDA "
                          "device: " + count.status().message());
#else
  if (kind == "auto") return std::string("sim");
  return UnavailableError("device_kind 'cuda' (config or TIERMEM_DEVICE) but there is no CUDA "
                          "device: this tiermem build has no CUDA support");
#endif
}

StatusOr<std::unique_ptr<TierStack>> TierStack::Create(const SessionConfig& config,
                                                       const StackLayout& layout) {
  // The process-wide knobs the config carries: log level, CPU kernel threads and ISA.
  SetLogLevel(config.log_level);
  kernels::SetKernelThreads(config.cpu_threads);
  if (config.kernel_isa != "auto") {
    TIERMEM_ASSIGN_OR_RETURN(const kernels::Isa isa, kernels::ParseIsa(config.kernel_isa));
    TIERMEM_RETURN_IF_ERROR(kernels::SetKernelIsa(isa).WithContext("kernel_isa"));
  }
  TIERMEM_ASSIGN_OR_RETURN(const std::string device, ResolveDeviceKind(config.device_kind));

  std::unique_ptr<TierStack> s(new TierStack());
  if (config.timeline.empty()) {
    const char* tmp = getenv("TMPDIR");
    std::string tmpl = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") +
                       "/tiermem-XXXXXX.tmt";
    const int fd = mkstemps(tmpl.data(), 4);
    if (fd < 0) return IOError("cannot create a temporary timeline file " + tmpl);
    close(fd);
    s->timeline_path_ = tmpl;
    s->own_timeline_ = true;
  } else {
    s->timeline_path_ = config.timeline;
    Status made = MakeDirs(DirName(config.timeline));
    if (!made.ok()) return InvalidArgumentError("config 'timeline': " + made.message());
  }
  // From here on a failure destroys `s`, whose destructor removes a temporary timeline.
  TIERMEM_ASSIGN_OR_RETURN(s->recorder_, TimelineRecorder::Open(s->timeline_path_));
  if (device == "cuda") {
#ifdef TIERMEM_SESSION_WITH_CUDA
    CudaTierConfig cc;
    cc.capacity = config.device_budget;
    TIERMEM_ASSIGN_OR_RETURN(s->device_, NewCudaTier(cc));
    s->pinner_ = NewCudaHostPinner();
    s->cuda_ = true;
#endif
  } else {
    SimDeviceConfig dc;
    dc.capacity = config.device_budget;
    dc.async = device == "sim-async";
    s->device_ = NewSimDevice(dc);
  }
  s->device_kind_ = device;
  const Bytes slot = AlignUp(std::max<Bytes>(layout.chunk_bytes, kPage), kPage);
  Bytes staging_bytes = 0;
  if (config.nvme_size > 0) {
    staging_bytes = slot * static_cast<Bytes>(config.prefetch_depth + 2);
    // Besides the staging slots, room to cache NVMe-homed chunks on the host: the optimizer
    // step holds one chunk group's chunks there at once (the reserve). Below that every home
    // would go to NVMe and the first step would fail half-way through the groups.
    const Bytes room = std::max(slot, layout.host_reserve);
    if (staging_bytes + room > config.host_budget) {
      return ResourceExhaustedError(
          "host budget of " + std::to_string(config.host_budget) +
          " bytes is below the minimum of " + std::to_string(staging_bytes + room) +
          " bytes with NVMe: " + std::to_string(staging_bytes) +
          " for the staging slots of device<->NVMe moves plus " + std::to_string(room) +
          " to hold one chunk group's NVMe-homed chunks during the optimizer step (chunks of " +
          std::to_string(slot) + " bytes; the chunk size follows the device budget, or set "
          "chunk_size)");
    }
    TIERMEM_ASSIGN_OR_RETURN(s->staging_,
                             NewHostTier(HostConfig(staging_bytes, slot, s->pinner_.get())));
  }
  if (config.host_budget <= staging_bytes) {
    return ResourceExhaustedError("host budget of " + std::to_string(config.host_budget) +
                                  " bytes leaves no room for chunks");
  }
  TIERMEM_ASSIGN_OR_RETURN(
      s->host_,
      NewHostTier(HostConfig(config.host_budget - staging_bytes, slot, s->pinner_.get())));
  if (config.nvme_size > 0) {
    NvmeTierConfig nc;
    nc.dir = config.nvme_path;
    TIERMEM_ASSIGN_OR_RETURN(nc.engine, ParseNvmeEngine(config.nvme_engine));
    nc.queue_depth = config.io_depth;
    nc.capacity = AlignUp(config.nvme_size, nc.block_bytes);
    TIERMEM_ASSIGN_OR_RETURN(s->nvme_, NewNvmeTier(nc));
  }
  MoverConfig mc;
  mc.staging_slot_bytes = slot;
  mc.staging_slots = 1;
  s->mover_ = NewMover(mc, s->staging_.get(), s->recorder_.get());
  engine::EngineConfig cfg;
  cfg.prefetch_depth = config.prefetch_depth;
  cfg.write_behind = config.write_behind;
  cfg.host_reserve_bytes = layout.host_reserve;
  TIERMEM_ASSIGN_OR_RETURN(
      s->engine_,
      engine::Engine::Create(cfg,
                             engine::EngineTiers{s->device_.get(), s->host_.get(), s->nvme_.get()},
                             s->mover_.get(), s->recorder_.get()));
  return s;
}

TierStack::~TierStack() { Close(); }

void TierStack::Close() {
  engine_.reset();
  mover_.reset();
  nvme_.reset();
  host_.reset();
  staging_.reset();
  device_.reset();
  pinner_.reset();
  if (recorder_) {
    recorder_->Close().IgnoreError();
    recorder_.reset();
  }
  if (own_timeline_) {
    unlink(timeline_path_.c_str());
    own_timeline_ = false;
  }
}

std::string TierStack::nvme_engine() const {
  if (nvme_ == nullptr) return "";
  auto* t = dynamic_cast<NvmeTier*>(nvme_.get());
  return t ? std::string(t->engine_name()) : "";
}

StatusOr<prof::Report> TierStack::TimelineReport() {
  if (!recorder_) return FailedPreconditionError("tiermem session is closed");
  if (engine_) TIERMEM_RETURN_IF_ERROR(engine_->Synchronize());
  TIERMEM_RETURN_IF_ERROR(recorder_->Flush());
  return prof::AnalyzeFile(timeline_path_);
}

}  // namespace tiermem::session
