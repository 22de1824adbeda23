// RuntimeStack: the tiers, Mover, timeline recorder and chunk Engine behind one initialized
// model, shared by the Python extension (tiermem._C) and the LibTorch API
// (tiermem::torch::Engine). Torch-free, so it compiles in seconds and both front-ends build
// the same stack:
//   device  SimDevice (host memory posing as HBM) for "sim", or the CUDA tier for "cuda"
//           (only when built with CUDA and a GPU is present; kUnavailable otherwise);
//   host    the pinned host tier, size classes = the chunk size and its halves;
//   nvme    the file-backed NVMe tier (io_uring or pread/pwrite) when nvme_size > 0;
//   staging a small host tier of its own for the Mover's device<->NVMe bounce slots
//           (prefetch_depth + 2 slots, carved out of the host budget);
//   timeline TimelineRecorder::Open(timeline_path): every alloc/free/move/stall/moment.
//
// Thread-safety: externally synchronized (the training thread).
// Ownership: the stack owns everything above; Close() (or destruction) frees every region,
// then closes the timeline so the file is complete.
#pragma once

#include <memory>
#include <string>

#include "runtime/base/status.h"
#include "runtime/base/timeline.h"
#include "runtime/engine/engine.h"
#include "runtime/mover.h"
#include "tiers/tier.h"
#include "runtime/prof/analysis.h"

namespace tiermem::torch_common {

struct StackConfig {
  Bytes device_budget = 0;
  Bytes host_budget = 0;
  std::string nvme_path;  // directory; used when nvme_size > 0
  Bytes nvme_size = 0;    // 0 = no NVMe tier
  int prefetch_depth = 4;
  Bytes host_reserve = 0;  // host bytes never used for homes (caches of NVMe chunks)
  Bytes chunk_bytes = 0;   // the largest chunk; sizes the host slots and staging slots
  std::string timeline_path;
  std::string device = "sim";  // "sim" or "cuda"
};

class RuntimeStack {
 public:
  // kInvalidArgument for a bad device name; kResourceExhausted naming the minimum host
  // budget with NVMe; kUnavailable for "cuda" without CUDA support; tier and timeline errors
  // as their factories report them. Nothing is left behind on failure.
  static StatusOr<std::unique_ptr<RuntimeStack>> Create(const StackConfig& config);
  ~RuntimeStack();
  RuntimeStack(const RuntimeStack&) = delete;
  RuntimeStack& operator=(const RuntimeStack&) = delete;

  // Frees every region and closes the timeline (complete file). Idempotent.
  void Close();

  // kFailedPrecondition after Close().
  StatusOr<engine::Engine*> Live();
  bool cuda() const { return cuda_; }
  std::string nvme_engine() const;  // "" without NVMe
  const std::string& timeline_path() const { return timeline_path_; }
  // The timeline file so far (after waiting for moves and flushing), analysed by
  // tiermem::prof — not the engine's own counters.
  StatusOr<prof::Report> TimelineReport();

  static bool CudaBuilt();

 private:
  RuntimeStack() = default;

  std::string timeline_path_;
  std::unique_ptr<TimelineRecorder> recorder_;  // outlives everything below
  std::unique_ptr<Tier> device_, staging_, host_, nvme_;
  std::unique_ptr<Mover> mover_;
  std::unique_ptr<engine::Engine> engine_;
  bool cuda_ = false;
};

}  // namespace tiermem::torch_common
