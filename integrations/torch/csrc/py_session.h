// The Python face of session::Session (bound as tiermem._C.Session by session.cc). Views are
// made here; everything else forwards.
//
// Chunk memory reaches Python as 1-D tensors made with torch::from_blob over the region's
// address (CPU tensors on SimDevice and host, CUDA tensors on the CUDA tier): they do not own
// the memory and are valid only while the chunk stays acquired (the Python layer drops every
// view on release).
//
// Threading: externally synchronized (the training thread); the GIL is held except inside the
// optimizer step and the kernels.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "integrations/torch/csrc/collectives.h"
#include "runtime/session.h"
#include "runtime/unit_protocol.h"

namespace tiermem::torch_ext {

// A scratch region and its uint8 view (bound as Scratch: records.cc). The view does not own
// the memory: it is valid until the region is freed.
struct Scratch {
  Region region;
  torch::Tensor view;
};

// How a session is sharded (bound as Sharding): `collectives` is the Python collectives
// object (integrations/torch/csrc/collectives.h wraps it). Hidden, as PySession: it holds a
// Python object.
struct __attribute__((visibility("hidden"))) Sharding {
  int world = 1;
  int rank = 0;
  pybind11::object collectives;
};

// Hidden, as pybind11 declares its own types: it holds Python objects.
class __attribute__((visibility("hidden"))) PySession {
 public:
  // `sharding`: null when the session is not sharded.
  PySession(const session::SessionConfig& config, std::vector<session::TensorSpec> specs,
            const Sharding* sharding);
  ~PySession();

  // A 1-D view of the chunk memory at `addr` (group `group`'s chunk of `kind` on `where`).
  torch::Tensor View(void* addr, size_t group, chunks::ChunkKind kind, TierKind where) const;
  // A scratch region of `bytes` (sharded gathers, activation bounces) and its view;
  // FreeScratch(where, its region).
  Scratch AllocateScratch(TierKind where, uint64_t bytes);
  void FreeScratch(TierKind where, const Region& region);
  // An NVMe region for spilled activations; StartSpillCopy moves bytes between it and host
  // scratch (the region of an AllocateScratch(host)).
  Region AllocateSpill(uint64_t bytes);
  void FreeSpill(const Region& region);
  // Starts the copy; the returned Pending's wait() (without the GIL) raises its error.
  std::shared_ptr<Completion> StartSpillCopy(const Region& spill, uint64_t spill_offset,
                                             const Region& host, uint64_t host_offset,
                                             uint64_t bytes, bool to_nvme);
  // `cls` >= 0: acquired as a member of that class (an expert chosen by the routing).
  torch::Tensor Acquire(size_t group, chunks::ChunkKind kind, TierKind where, int64_t cls);
  // For a caller about to write into (part of) the chunk: a lazily zero chunk landing on the
  // device is zeroed here by torch on the compute device.
  torch::Tensor AcquireForWrite(size_t group, chunks::ChunkKind kind, TierKind where, int64_t cls);

  torch::Tensor ReadParam(size_t t);
  void WriteParam(size_t t, const torch::Tensor& v);
  torch::Tensor ReadTensor(size_t t, chunks::ChunkKind kind);
  void WriteTensor(size_t t, chunks::ChunkKind kind, const torch::Tensor& v);
  void SetHasGrad(const std::vector<bool>& flags);
  // `global_stats`: null, or the whole model's gradient stats (a sharded binding's all-reduce
  // of every rank's grad_stats()).
  session::StepResult Step(const std::vector<session::GroupHyper>& hyper,
                           const kernels::GradStats* global_stats);
  // The hyper-parameters the next step() will pass (speculative steps,
  // runtime/optimizer_stepper.h).
  void SetStepHyper(std::vector<session::GroupHyper> hyper);
  kernels::GradStats GradStats();
  // Group g's layout (bound as ChunkGroup: records.cc); ValueError for an unknown group.
  const session::ChunkGroup& Group(size_t g) const;
  // Tensor t's pieces in element order (bound as Piece); ValueError for an unknown tensor.
  const std::vector<session::Piece>& Place(size_t t) const;

  session::Session& s() { return *s_; }
  const session::Session& s() const { return *s_; }
  session::UnitProtocol& protocol() { return *protocol_; }
  // Closes the session, then lets go of the Python collectives (and so of its process
  // group): a group kept alive until interpreter exit takes its threads down during
  // finalization, which aborts the process.
  void Close();

 private:
  static uint32_t ClassOf(int64_t cls);
  int64_t Numel(size_t t) const;

  std::unique_ptr<PyCollectives> collectives_;  // outlives s_ (declared first)
  std::unique_ptr<session::Session> s_;
  std::unique_ptr<session::UnitProtocol> protocol_;  // over s_ (declared after: destroyed first)
};

}  // namespace tiermem::torch_ext
