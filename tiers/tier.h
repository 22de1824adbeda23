// The Tier interface: a store of byte regions with a budget.
//
// A tier is a handful of required operations: allocate/free a region, start an async copy
// between a region and host-addressable memory (completing into a Completion), and stats.
// Byte-addressable tiers (device, host) expose each region's address; NVMe does not.
// Copies between two non-host tiers (device <-> NVMe) are the mover's job (chunks/mover.h),
// which bounces them through pinned host memory; a tier only ever copies to/from host memory.
//
// Accounting invariant (checked by the conformance suite): Stats().used is the sum of the
// sizes of live regions as allocated (after the tier's rounding), never above capacity;
// peak is the maximum `used` ever reached; Allocate over budget returns kResourceExhausted
// naming the bytes requested and the bytes available, and changes nothing.
//
// Threading: every Tier implementation is thread-safe. Completions may fire on any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "base/mutex.h"
#include "base/status.h"
#include "base/units.h"

namespace tiermem {

// A region of a tier. A value type; the tier owns the memory. Valid until Free().
struct Region {
  uint64_t id = 0;       // unique within its tier for the tier's lifetime; 0 = invalid
  Bytes bytes = 0;       // usable size (>= requested)
  void* addr = nullptr;  // base address where the tier is byte-addressable, else nullptr
  explicit operator bool() const { return id != 0; }
};

struct TierStats {
  Bytes capacity = 0;  // the budget
  Bytes used = 0;      // bytes in live regions
  Bytes peak = 0;      // max of used
  uint64_t live_regions = 0;
  uint64_t total_allocations = 0;  // successful Allocate calls
  // Host memory the tier holds for itself outside its budget: bounce buffers and checksum
  // tables (NVMe), memory mapped beyond the budget (host). What a user adds to the budgets to
  // size the machine (the runtime's fixed overhead: docs/engine.md).
  Bytes host_overhead = 0;
};

// The completion of one async operation. Thread-safe; shared by the issuer and the tier.
class Completion {
 public:
  Completion() = default;
  Completion(const Completion&) = delete;
  Completion& operator=(const Completion&) = delete;

  static std::shared_ptr<Completion> Make() { return std::make_shared<Completion>(); }
  // An already-completed one (for synchronous failures / no-op copies).
  static std::shared_ptr<Completion> Done(Status s);

  // Marks done with `s` and runs callbacks (on this thread). Must be called exactly once.
  void Complete(Status s);
  bool Poll() const;  // done yet?
  // Blocks until done; returns the operation's status.
  Status Wait() const;
  // Runs `fn(status)` when done: immediately (on this thread) if already done, else on the
  // completing thread. `fn` must be cheap and must not block.
  void OnDone(std::function<void(const Status&)> fn);

 private:
  // status_ once done_ was seen true (under mu_): it never changes again, so no lock.
  const Status& final_status() const TIERMEM_NO_THREAD_SAFETY_ANALYSIS { return status_; }

  mutable Mutex mu_;
  mutable CondVar cv_;
  bool done_ TIERMEM_GUARDED_BY(mu_) = false;
  Status status_ TIERMEM_GUARDED_BY(mu_);  // final once done_
  std::vector<std::function<void(const Status&)>> callbacks_ TIERMEM_GUARDED_BY(mu_);
};

// Waits for all; returns the first failure (or OK).
Status WaitAll(const std::vector<std::shared_ptr<Completion>>& completions);

enum class CopyDir : uint8_t {
  kToTier = 0,    // host memory -> region
  kFromTier = 1,  // region -> host memory
};

struct CopyRequest {
  Region region;         // a live region of this tier
  Bytes offset = 0;      // byte offset inside the region
  void* host = nullptr;  // host memory; must stay valid (and untouched) until completion
  Bytes bytes = 0;       // offset + bytes <= region.bytes
  CopyDir dir = CopyDir::kToTier;
  // The copy's own CPU work (the NVMe tier's checksums) may run on the threads that drive it —
  // the caller's, before Copy() returns, for a write; the I/O completion's for a read —
  // instead of being handed to a worker pool: one thread hand-off less per piece, and a write
  // checksums bytes the caller just wrote while they are still in its cache. For callers that
  // are copy-pipeline workers themselves (the Mover's bounce); never set it on a compute
  // thread. A hint: tiers without such work ignore it.
  bool inline_work = false;
};

// ---- Ordering against compute (an optional capability of device tiers) -----------------
//
// A device's copies run asynchronously with respect to the compute that uses its regions
// (torch's kernels, queued on a CUDA stream the tier does not own). A tier that can order the
// two implements ComputeOrdering; every region then carries
//   - its last *compute use* (ComputeUsed): a copy into or out of the region issued later
//     waits for that work (a write-back never reads grads before the kernel that writes them
//     has run), and so does every copy into memory the region occupied after it is freed and
//     handed to another region (a prefetch never overwrites weights queued kernels still read:
//     the fence travels with the memory, like c10's record_stream);
//   - its last *copy in*: ComputeWaits makes work queued on a stream from now on wait for it.
// Waits are device-side where the device has them (cudaStreamWaitEvent; a copy lane's own
// thread on SimDevice): the calling thread does not block, except for kHostStream below.
//
// A ComputeStream is opaque to generic code: a cudaStream_t on the CUDA tier (0 = the legacy
// default stream), a SimStream (tiers/fake/sim_stream.h) on SimDevice, where 0 (kHostStream)
// is compute that runs on the calling thread at the call (CPU tensors): its work is done when
// ComputeUsed is called (nothing to record), and ComputeWaits blocks the caller until the
// region's copies in have landed.
struct ComputeStream {
  uintptr_t handle = 0;
  // (Spelled out: headers also compile as CUDA C++17.)
  bool operator==(const ComputeStream& o) const { return handle == o.handle; }
  bool operator!=(const ComputeStream& o) const { return handle != o.handle; }
};
inline constexpr ComputeStream kHostStream{};

class ComputeOrdering {
 public:
  virtual ~ComputeOrdering() = default;
  // Work queued on `stream` so far reads or writes `region`. kInvalidArgument for an unknown
  // region; a device error otherwise.
  virtual Status ComputeUsed(const Region& region, ComputeStream stream) = 0;
  // Work queued on `stream` from now on runs after every copy into `region` issued so far
  // (and after the compute fences its memory inherited). kInvalidArgument for an unknown
  // region; the copy's error when the caller had to wait for it and it failed.
  virtual Status ComputeWaits(const Region& region, ComputeStream stream) = 0;
};

class Tier {
 public:
  virtual ~Tier() = default;
  virtual TierKind kind() const = 0;
  virtual std::string name() const = 0;  // "sim-device", "host", "nvme-io_uring", ...

  // Allocates a region of at least `bytes` (> 0). Over budget: kResourceExhausted.
  virtual StatusOr<Region> Allocate(Bytes bytes) = 0;
  // Frees a live region. Freeing an unknown region is kInvalidArgument (and changes nothing).
  // The caller must not free a region with copies in flight.
  virtual Status Free(const Region& region) = 0;
  // Starts an async copy. Invalid requests (bad region, out of bounds) complete with
  // kInvalidArgument/kOutOfRange; I/O failures with kIOError/kDataLoss.
  virtual std::shared_ptr<Completion> Copy(const CopyRequest& request) = 0;
  virtual TierStats Stats() const = 0;
  // The tier's ordering against compute, or nullptr when it needs none (host memory and NVMe
  // are only touched by the CPU after a copy's completion fired). Owned by the tier.
  virtual ComputeOrdering* ordering() { return nullptr; }
};

// The two ordering calls for any tier: no-ops (OK) on a tier without ComputeOrdering.
Status MarkComputeUse(Tier& tier, const Region& region, ComputeStream stream);
Status OrderComputeAfterCopies(Tier& tier, const Region& region, ComputeStream stream);

// Shared budget/peak bookkeeping for tier implementations. Thread-safe.
class BudgetAccount {
 public:
  explicit BudgetAccount(Bytes capacity) : capacity_(capacity) {}
  // Reserves `bytes` or returns kResourceExhausted ("<tier>: need N bytes, M available of C").
  Status Reserve(Bytes bytes, std::string_view tier_name);
  void Release(Bytes bytes);
  TierStats Snapshot() const;

 private:
  mutable Mutex mu_;
  const Bytes capacity_;
  Bytes used_ TIERMEM_GUARDED_BY(mu_) = 0;
  Bytes peak_ TIERMEM_GUARDED_BY(mu_) = 0;
  uint64_t live_ TIERMEM_GUARDED_BY(mu_) = 0;
  uint64_t total_ TIERMEM_GUARDED_BY(mu_) = 0;
};

// Checks a CopyRequest against its region's bounds (shared by all tiers).
Status ValidateCopy(const CopyRequest& request, const Region& live_region);

}  // namespace tiermem
