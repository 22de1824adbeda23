// Host tier: pinned host DRAM, NUMA-local to the GPU, carved from large faulted-once slabs.
//
// Memory comes from large anonymous mmap'd *slabs* (default 256 MiB) that are bound to the
// NUMA node nearest the GPU (hwloc, given the GPU's PCI bus id; the node of the calling CPU
// when none is given), backed by transparent huge pages when the kernel offers them
// (MADV_HUGEPAGE), faulted in once when the slab is created (MADV_POPULATE_WRITE, or a touch
// per page on kernels without it), mlock'ed when the process may lock that much (otherwise a
// one-time log line and plain pageable memory), and handed to an optional HostPinner (the
// CUDA tier registers them with cudaHostRegister; the NVMe tier may register them as io_uring
// fixed buffers). A slab is never returned to the system before the tier is destroyed, so
// steady-state allocation does no syscalls.
//
// Slab memory never exceeds the budget (rounded up to a huge page): the last slab is only the
// rest of it. Each slab is cut into fixed-size slots of one *size class*: `slot_bytes` (the
// engine's chunk size) and its halves down to `min_class_bytes`. An allocation of
// n <= slot_bytes bytes gets a slot of the smallest class >= n; a slab whose slots are all free
// goes back to a pool of empty slabs that any class (whose slot fits in it) may take. An allocation
// above slot_bytes (an odd size) gets a dedicated mapping, with the same NUMA/huge-page/lock/pin
// treatment, unmapped at Free. Region.bytes is the class size (or the page-rounded mapping size)
// and is what the budget is charged with, exactly.
//
// Copy() is a memcpy on one of `copy_threads` worker threads; completions fire there.
// Threading: thread-safe. Ownership: the caller owns the tier; the pinner must outlive it.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "tiers/tier.h"

namespace tiermem {

// Hook through which another component pins host memory for its device (cudaHostRegister) or
// registers it for I/O. Called for every slab and dedicated mapping the host tier creates,
// before any region in it is handed out, and Unregister before the memory is unmapped.
// Implementations must be thread-safe.
class HostPinner {
 public:
  virtual ~HostPinner() = default;
  // A failure fails the allocation (or tier creation) that needed the memory.
  virtual Status Register(void* addr, Bytes bytes) = 0;
  virtual void Unregister(void* addr) = 0;
};

struct HostTierConfig {
  Bytes capacity = 8 * kGiB;          // the budget (> 0)
  Bytes slot_bytes = 64 * kMiB;       // largest size class; multiple of 4 KiB
  Bytes min_class_bytes = 64 * kKiB;  // smallest size class; multiple of 4 KiB, <= slot_bytes
  Bytes slab_bytes = 256 * kMiB;      // bytes per slab (rounded up to a multiple of slot_bytes)
  Bytes prefault_bytes = 0;           // slabs created (faulted, locked, pinned) at creation
  std::string gpu_pci_bus_id;         // "0000:65:00.0": bind near this GPU; "" = near caller
  int numa_node = -1;                 // >= 0 overrides the hwloc lookup
  bool huge_pages = true;             // MADV_HUGEPAGE on slabs (2 MiB-aligned)
  bool lock_memory = true;            // mlock when allowed
  int copy_threads = 2;               // memcpy workers for Copy() (>= 1)
  HostPinner* pinner = nullptr;       // optional; must outlive the tier
};

// One mapped range of host memory backing the tier (a slab or a dedicated mapping).
struct HostRange {
  void* addr = nullptr;
  Bytes bytes = 0;
  bool dedicated = false;  // a mapping for one odd-size region (goes away at its Free)
};

// The host tier's extra surface beyond Tier. Thread-safe.
class HostTier : public Tier {
 public:
  // The slabs and dedicated mappings mapped now, in creation order (for fixed-buffer
  // registration: call after creating the tier with prefault_bytes = the pool size).
  virtual std::vector<HostRange> Ranges() const = 0;
  virtual int numa_node() const = 0;       // the node memory is bound to; -1 = no binding
  virtual bool memory_locked() const = 0;  // false once mlock was refused
  virtual Bytes mapped_bytes() const = 0;  // sum of Ranges() sizes
};

// Validates the config (kInvalidArgument naming the field), finds the NUMA node and creates
// the prefaulted slabs. Caller owns the result.
StatusOr<std::unique_ptr<Tier>> NewHostTier(const HostTierConfig& config);

// The HostTier behind `tier` if it is one (not through wrappers), else nullptr.
HostTier* AsHostTier(Tier* tier);

// The NUMA node nearest the GPU with the given PCI bus id ("" = nearest the calling CPU), or
// -1 when the machine has no NUMA information. Malformed id: kInvalidArgument; unknown to
// hwloc (e.g. a container without sysfs PCI): falls back to the caller's node, logged once.
StatusOr<int> NearestNumaNode(const std::string& gpu_pci_bus_id);

}  // namespace tiermem
