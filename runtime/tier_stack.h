// TierStack: the tier registry behind one session — which tiers exist, the Mover between
// them, the timeline recorder and the chunk Engine over them. Built once from the session's
// config; the one place that knows which device tier this build and machine have:
//   device   SimDevice (host memory posing as HBM) for DeviceKind::kSim (its asynchronous
//            mode for kSimAsync), the CUDA tier for kCuda, none for kHost (compute runs on
//            the CPU against chunks in place in the host tier: the host is the compute tier)
//            (this target is compiled with TIERMEM_SESSION_WITH_CUDA when CUDA is built;
//            kAuto picks CUDA when a GPU is present, else kHost);
//   host     the host tier, size classes = the chunk size and its halves; on the CUDA device
//            its slabs are registered with cudaHostRegister (NewCudaHostPinner), and with
//            NVMe as io_uring fixed buffers when mapped at creation (so are the staging
//            slots; see NvmeRegisteringPinner in the .cc);
//   nvme     the file-backed NVMe tier (io_uring or pread/pwrite) when nvme_size > 0,
//            wrapped for read-only file homes (tiers/nvme/file_homes.h: a served checkpoint
//            read in place);
//   staging  (not in host mode, which moves NVMe <-> host directly) a small host tier of
//            its own for the Mover's device<->NVMe bounce slots
//            (prefetch_depth + 2 chunks, carved out of the host budget; a move pipelines
//            I/O-sized pieces through up to io_depth slots of it: BounceMoverConfig),
//            pinned likewise;
//   timeline TimelineRecorder at config.timeline, or a temporary file removed at Close() (or,
//            for a stack never closed, at a normal process exit).
//
// Thread-safety: externally synchronized (the session's thread).
// Ownership: the stack owns everything above. Close() (or destruction) frees every region
// (engine first, after waiting for moves), then the mover, the tiers, the pinner, and last
// closes the timeline so the file is complete.
#pragma once

#include <memory>
#include <string>

#include "base/status.h"
#include "base/timeline.h"
#include "chunks/engine.h"
#include "chunks/mover.h"
#include "prof/analysis.h"
#include "runtime/config.h"
#include "runtime/layout.h"
#include "tiers/host/host_tier.h"
#include "tiers/nvme/file_homes.h"
#include "tiers/nvme/nvme_tier.h"
#include "tiers/tier.h"

namespace tiermem::session {

// What the stack is sized for: the host room of a layout (layout.h, HostRoomFor).
using StackLayout = HostRoom;

// The NVMe tier's I/O backend for the config key nvme.engine (kAuto: the tier picks).
NvmeIoBackend IoBackendOf(NvmeEngine engine);

class TierStack {
 public:
  // kUnavailable for kCuda without CUDA support or a GPU; kResourceExhausted naming the
  // minimum host budget with NVMe; kInvalidArgument naming 'nvme.path' for an NVMe directory
  // that does not exist (any more); tier and timeline errors as their factories report them.
  // Nothing is left behind on failure (a temporary timeline file is removed).
  static StatusOr<std::unique_ptr<TierStack>> Create(const SessionConfig& config,
                                                     const StackLayout& layout);
  ~TierStack();
  TierStack(const TierStack&) = delete;
  TierStack& operator=(const TierStack&) = delete;

  // kAuto resolved: kCuda when this build has CUDA and a GPU is present, else kHost; the
  // others as given (never kAuto); kCuda without either is kUnavailable saying which is
  // missing.
  static StatusOr<DeviceKind> ResolveDeviceKind(DeviceKind kind);
  static bool CudaBuilt();
  // The CUDA runtime version this build was compiled against ("13.0"), "" without CUDA.
  static std::string CudaRuntimeVersion();

  void Close();  // idempotent
  bool closed() const { return engine_ == nullptr; }

  chunks::Engine* engine() { return engine_.get(); }
  Tier* device() { return device_.get(); }  // null in host mode
  bool host_compute() const { return IsHostCompute(device_kind_); }
  const Mover* mover() const { return mover_.get(); }
  Mover* mover() { return mover_.get(); }
  Tier* host() { return host_.get(); }
  Tier* nvme() { return nvme_.get(); }  // null without NVMe
  // The NVMe tier's read-only file homes (tiers/nvme/file_homes.h); null without NVMe.
  FileHomeTier* file_homes() { return file_homes_; }
  bool cuda() const { return cuda_; }
  DeviceKind device_kind() const { return device_kind_; }  // resolved: never kAuto
  // The NVMe tier's I/O backend ("io_uring" or "posix": config key nvme.engine); "" without
  // NVMe.
  std::string io_backend() const;
  // Host memory (chunk homes, caches, staging slots) registered with the NVMe tier as io_uring
  // fixed buffers now; 0 without NVMe or with the posix engine.
  Bytes nvme_registered_bytes() const;
  // Host memory the tiers hold for themselves beside their budgets (TierStats::host_overhead
  // summed over the device, host, staging and NVMe tiers); 0 once closed.
  Bytes host_overhead() const;
  const std::string& timeline_path() const { return timeline_path_; }
  // The timeline file so far (after waiting for moves and flushing), analysed by
  // tiermem::prof — not the engine's own counters.
  StatusOr<prof::Report> TimelineReport();

 private:
  TierStack() = default;

  std::string timeline_path_;
  bool own_timeline_ = false;                   // a temporary file: removed at Close()
  std::unique_ptr<TimelineRecorder> recorder_;  // outlives everything below
  // The host tiers' pinner: nvme_pinner_ (which chains to cuda_pinner_) with NVMe, else
  // cuda_pinner_ on CUDA, else none. Both outlive the host tiers.
  std::unique_ptr<HostPinner> cuda_pinner_, nvme_pinner_;
  HostPinner* pinner_ = nullptr;
  // Destroyed after the host tiers (members are destroyed in reverse order): nvme_, device_.
  std::unique_ptr<Tier> device_, nvme_, staging_, host_;
  FileHomeTier* file_homes_ = nullptr;  // nvme_ itself, as the wrapper it is
  std::unique_ptr<Mover> mover_;
  std::unique_ptr<chunks::Engine> engine_;
  bool cuda_ = false;
  DeviceKind device_kind_ = DeviceKind::kHost;
};

}  // namespace tiermem::session
