// I/O backends of the NVMe tier (internal header): they execute primitive, already aligned
// file reads and writes (IoOp) and report each one's final Status exactly once.
//
// A backend owns the retry policy: short reads/writes are resubmitted for the remainder,
// EINTR/EAGAIN are retried, and everything else becomes a Status through ErrnoToStatus. It
// never has more than its queue depth of operations in flight; further Submit()s wait in its
// queue (Submit itself never blocks on I/O).
//
// Ownership: the submitter owns each IoOp and keeps it alive until `complete` has been called;
// `complete` may delete it. `prepare` (optional) runs on the backend's thread just before the
// op is first issued (the tier computes write checksums there, off the caller's thread).
// `prepare` and `complete` run on backend threads, must not block, and may Submit() more ops.
// They may compute (the tier checksums a piece there, in one pass over its bytes): the
// io_uring backend runs `complete` only after it has refilled the queue with waiting ops, and
// the posix backend runs both on the worker that transfers the op.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "base/units.h"

namespace tiermem::nvme {

struct IoOp {
  int file = 0;         // index into the backend's file table
  uint64_t offset = 0;  // file offset, bytes
  char* buf = nullptr;  // host buffer (aligned for O_DIRECT by the submitter)
  uint32_t len = 0;     // bytes; prepare may shrink it (torn-write hook); 0 completes at once
  bool write = false;
  std::function<void(IoOp&)> prepare;
  std::function<void(IoOp&, Status)> complete;  // required
  // Backend-private progress.
  uint32_t done = 0;  // bytes transferred so far
  bool prepared = false;
};

class IoBackend {
 public:
  virtual ~IoBackend() = default;             // waits for every submitted op to complete
  virtual std::string_view name() const = 0;  // "io_uring" or "posix"
  // Queues `op`. Thread-safe.
  virtual void Submit(IoOp* op) = 0;
  // Makes [addr, addr + bytes) usable as fixed buffers (io_uring); no-op for posix.
  virtual Status RegisterHostMemory(void* addr, Bytes bytes) { return OkStatus(); }
  virtual Status UnregisterHostMemory(void* addr) { return OkStatus(); }
  // True when the backend registered the buffers it was given at creation.
  virtual bool buffers_registered() const { return false; }
};

struct IoBackendConfig {
  std::vector<int> fds;          // the tier's files (the backend does not own them)
  int queue_depth = 8;           // max ops in flight
  int posix_threads = 0;         // posix: workers (0 = queue_depth, at most 16)
  bool register_files = true;    // io_uring: fixed files
  bool register_buffers = true;  // io_uring: fixed buffers
  char* bounce = nullptr;        // io_uring: the tier's bounce pool, registered as a buffer
  Bytes bounce_bytes = 0;
};

std::unique_ptr<IoBackend> NewPosixBackend(const IoBackendConfig& config);

// Probes and sets up io_uring. kUnavailable when the kernel refuses it (EPERM, ENOSYS, or the
// build has no liburing); the tier then falls back to posix (nvme.engine "auto").
StatusOr<std::unique_ptr<IoBackend>> NewUringBackend(const IoBackendConfig& config);

}  // namespace tiermem::nvme
