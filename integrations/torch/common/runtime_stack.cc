// RuntimeStack: builds the tier stack of one initialized model (see runtime_stack.h).
//
// Invariants: members are destroyed in the reverse order of their dependencies — the engine
// (which frees its regions after waiting for moves) before the mover, the mover before the
// tiers, the tiers before the recorder is closed — both in Close() and when Create() fails
// half-way (the partially built stack is simply destroyed).
#include "integrations/torch/common/runtime_stack.h"

#include <algorithm>

#include "kernels/cpu/optim.h"
#include "runtime/base/options.h"
#include "tiers/fake/sim_device.h"
#include "tiers/host/host_tier.h"
#include "tiers/nvme/nvme_tier.h"
#ifdef TIERMEM_TORCH_WITH_CUDA
#include "tiers/cuda/cuda_tier.h"
#endif

namespace tiermem::torch_common {
namespace {

constexpr Bytes kPage = 4096;
Bytes AlignUp(Bytes n, Bytes a) { return (n + a - 1) / a * a; }

HostTierConfig HostConfig(Bytes capacity, Bytes slot) {
  HostTierConfig hc;
  hc.capacity = capacity;
  hc.slot_bytes = slot;
  hc.min_class_bytes = kPage;
  // Slabs of at most 64 MiB (whole slots), so a small budget does not fault a big slab.
  hc.slab_bytes =
      std::max(slot, std::min<Bytes>(AlignUp(capacity, slot), 64 * kMiB / slot * slot));
  return hc;
}

}  // namespace

bool RuntimeStack::CudaBuilt() {
#ifdef TIERMEM_TORCH_WITH_CUDA
  return true;
#else
  return false;
#endif
}

StatusOr<std::unique_ptr<RuntimeStack>> RuntimeStack::Create(const StackConfig& config) {
  // The knobs no config key carries come from the TIERMEM_* environment (runtime/base/
  // options.h), read once per stack: log level, NVMe engine and queue depth, CPU kernel
  // threads and ISA. A bad value fails here, naming the variable, before anything is built.
  TIERMEM_ASSIGN_OR_RETURN(const Options env, ParseOptions(Options{}));
  SetLogLevel(env.log_level);
  kernels::SetKernelThreads(env.cpu_threads);
  if (env.kernel_isa != "auto") {
    TIERMEM_ASSIGN_OR_RETURN(const kernels::Isa isa, kernels::ParseIsa(env.kernel_isa));
    TIERMEM_RETURN_IF_ERROR(kernels::SetKernelIsa(isa).WithContext("TIERMEM_KERNEL_ISA"));
  }
  std::unique_ptr<RuntimeStack> s(new RuntimeStack());
  s->timeline_path_ = config.timeline_path;
  TIERMEM_ASSIGN_OR_RETURN(s->recorder_, TimelineRecorder::Open(config.timeline_path));
  if (config.device == "cuda") {
#ifdef TIERMEM_TORCH_WITH_CUDA
    CudaTierConfig cc;
    cc.capacity = config.device_budget;
    TIERMEM_ASSIGN_OR_RETURN(s->device_, NewCudaTier(cc));
    s->cuda_ = true;
#else
    return UnavailableError("no CUDA device: this tiermem build has no CUDA support");
#endif
  } else if (config.device == "sim") {
    SimDeviceConfig dc;
    dc.capacity = config.device_budget;
    s->device_ = NewSimDevice(dc);
  } else {
    return InvalidArgumentError("device must be 'sim' or 'cuda', got '" + config.device + "'");
  }
  const Bytes slot = AlignUp(std::max<Bytes>(config.chunk_bytes, kPage), kPage);
  Bytes staging_bytes = 0;
  if (config.nvme_size > 0) {
    staging_bytes = slot * static_cast<Bytes>(config.prefetch_depth + 2);
    if (staging_bytes + slot > config.host_budget) {
        return ResourceExhaustedError(
          "host budget of " + std::to_string(config.host_budget) +
          " bytes is below the minimum of " + std::to_string(staging_bytes + slot) +
          " bytes with NVMe (staging slots for device<->NVMe moves plus one chunk)");
    }
    TIERMEM_ASSIGN_OR_RETURN(s->staging_, NewHostTier(HostConfig(staging_bytes, slot)));
  }
  if (config.host_budget <= staging_bytes) {
    return ResourceExhaustedError("host budget of " + std::to_string(config.host_budget) +
                                  " bytes leaves no room for chunks");
  }
  TIERMEM_ASSIGN_OR_RETURN(s->host_,
                           NewHostTier(HostConfig(config.host_budget - staging_bytes, slot)));
  if (config.nvme_size > 0) {
    NvmeTierConfig nc;
    nc.dir = config.nvme_path;
    TIERMEM_ASSIGN_OR_RETURN(nc.engine, ParseNvmeEngine(env.nvme_engine));
    nc.queue_depth = env.io_depth;
    nc.capacity = AlignUp(config.nvme_size, nc.block_bytes);
    TIERMEM_ASSIGN_OR_RETURN(s->nvme_, NewNvmeTier(nc));
  }
  MoverConfig mc;
  mc.staging_slot_bytes = slot;
  mc.staging_slots = 1;
  s->mover_ = NewMover(mc, s->staging_.get(), s->recorder_.get());
  engine::EngineConfig cfg;
  cfg.prefetch_depth = config.prefetch_depth;
  cfg.host_reserve_bytes = config.host_reserve;
  TIERMEM_ASSIGN_OR_RETURN(
      s->engine_,
      engine::Engine::Create(cfg,
                             engine::EngineTiers{s->device_.get(), s->host_.get(), s->nvme_.get()},
                             s->mover_.get(), s->recorder_.get()));
  return s;
}

RuntimeStack::~RuntimeStack() { Close(); }

void RuntimeStack::Close() {
  engine_.reset();
  mover_.reset();
  nvme_.reset();
  host_.reset();
  staging_.reset();
  device_.reset();
  if (recorder_) recorder_->Close().IgnoreError();
}

StatusOr<engine::Engine*> RuntimeStack::Live() {
  if (!engine_) return FailedPreconditionError("tiermem runtime is closed");
  return engine_.get();
}

std::string RuntimeStack::nvme_engine() const {
  if (nvme_ == nullptr) return "";
  auto* t = dynamic_cast<NvmeTier*>(nvme_.get());
  return t ? std::string(t->engine_name()) : "";
}

StatusOr<prof::Report> RuntimeStack::TimelineReport() {
  if (engine_) TIERMEM_RETURN_IF_ERROR(engine_->Synchronize());
  if (!recorder_) return FailedPreconditionError("tiermem runtime has no timeline");
  TIERMEM_RETURN_IF_ERROR(recorder_->Flush());
  return prof::AnalyzeFile(timeline_path_);
}

}  // namespace tiermem::torch_common
