// Sharding: how a session's chunk groups are split across the ranks of a data-parallel job
// (session.h, "Sharding"), and Collectives, how those ranks exchange bytes. The bindings
// implement Collectives over torch.distributed — Gloo on CPU, NCCL on GPUs — so the core never
// moves bytes between processes itself; it calls them only to read whole tensors (state,
// checkpoints), while the bindings' hot path (gathering a unit's parameters, reduce-scattering
// its gradients) calls torch.distributed directly on chunk views.
//
// Every call is collective: every rank makes the same calls in the same order (as with
// torch.distributed itself); a rank that does not times out in the binding's process group.
// Thread-safety: called from the session's thread only.
#pragma once

#include "base/status.h"
#include "base/units.h"

namespace tiermem::session {

class Collectives {
 public:
  virtual ~Collectives() = default;
  // `full` (world x `bytes`, host memory) receives every rank's `shard` (`bytes`, host memory),
  // in rank order. Blocking.
  virtual Status AllGather(const void* shard, void* full, Bytes bytes) = 0;
};

struct Sharding {
  int world = 1;                       // ranks sharing the model (1: not sharded)
  int rank = 0;                        // this process's rank, 0 <= rank < world
  Collectives* collectives = nullptr;  // required when world > 1; must outlive the session
};

}  // namespace tiermem::session
