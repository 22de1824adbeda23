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
#include <tuple>
#include <vector>

#include "integrations/torch/csrc/collectives.h"
#include "runtime/session.h"
#include "runtime/unit_protocol.h"

namespace tiermem::torch_ext {

// A scratch or spill region as Python holds it: (id, bytes, address; 0 for a spill).
using RegionToken = std::tuple<uint64_t, uint64_t, uintptr_t>;

// Hidden, as pybind11 declares its own types: it holds Python objects.
class __attribute__((visibility("hidden"))) PySession {
 public:
  // `sharding`: None, or (world, rank, collectives) with a Python collectives object.
  PySession(const session::SessionConfig& config, std::vector<session::TensorSpec> specs,
            const pybind11::object& sharding);
  ~PySession();

  // A 1-D view of the chunk memory at `addr` (group `group`'s chunk of `kind` on `where`).
  torch::Tensor View(void* addr, size_t group, chunks::ChunkKind kind, TierKind where) const;
  // A scratch region of `bytes` (sharded gathers) as (token, uint8 view); FreeScratch(token).
  pybind11::tuple AllocateScratch(TierKind where, uint64_t bytes);
  void FreeScratch(TierKind where, const RegionToken& token);
  // An NVMe region for spilled activations as a token (id, bytes, 0); StartSpillCopy moves
  // bytes between it and host scratch (a token AllocateScratch(host) returned).
  pybind11::tuple AllocateSpill(uint64_t bytes);
  void FreeSpill(const RegionToken& token);
  // Starts the copy; the returned Pending's wait() (without the GIL) raises its error.
  std::shared_ptr<Completion> StartSpillCopy(const RegionToken& spill, uint64_t spill_offset,
                                             const RegionToken& host, uint64_t host_offset,
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
  // `global_stats`: None, or (sum of squares, overflow) of the whole model's gradients (a
  // sharded binding's all-reduce of every rank's grad_stats()).
  pybind11::dict Step(const std::vector<session::GroupHyper>& hyper,
                      const pybind11::object& global_stats);
  // The hyper-parameters the next step() will pass (speculative steps,
  // runtime/optimizer_stepper.h).
  void SetStepHyper(std::vector<session::GroupHyper> hyper);
  pybind11::tuple GradStats();
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
  static Region FromToken(const RegionToken& token);
  static uint32_t ClassOf(int64_t cls);
  int64_t Numel(size_t t) const;

  std::unique_ptr<PyCollectives> collectives_;  // outlives s_ (declared first)
  std::unique_ptr<session::Session> s_;
  std::unique_ptr<session::UnitProtocol> protocol_;  // over s_ (declared after: destroyed first)
};

}  // namespace tiermem::torch_ext
