// FileHomeTier: the NVMe tier plus read-only *file homes* — regions whose bytes are spans of
// existing files (a served checkpoint's tensors, read in place: runtime/weights.h), never a
// copy in the tier's own files.
//
// It wraps an NvmeTier and forwards every call on the tier's own regions to it unchanged; a
// file home is a region of this tier too (an id of its own range, Region.addr nullptr, not
// counted in the budget: its bytes are the user's files, not the tier's), so the chunk engine
// and the mover treat it like any NVMe region. A file home is a scatter list: the region's
// byte ranges and the file spans that hold them (bytes of the region no span covers read as
// zeros, e.g. a chunk's padding). Reading part of a home reads the spans it covers through a
// SpanReader (tiers/nvme/span_reader.h: O_DIRECT, 4096-aligned superset requests, io_uring or
// the pread pool, nearby spans merged into one request) on one of `threads` workers, and copies
// the requested bytes into the host memory given.
//
// Read-only: a copy into a file home completes with kFailedPrecondition naming the file (the
// files are opened O_RDONLY; nothing is ever written to them). What protects the bytes read: a
// checkpoint has no checksums, so each file's size, inode and modification time are recorded
// at OpenFiles (the caller validated its header against that size) and checked before and after
// every read: a file truncated, rewritten or replaced under a serving session makes the read
// fail with kDataLoss naming it, never hand back other bytes as the validated ones (a change
// that keeps size, inode and mtime — a deliberate touch -r — is not detected).
//
// Host memory beside the budget (Stats().host_overhead, added to the NVMe tier's): the
// readers' staging, threads x depth x request_bytes (16 MiB by default), each reader's from
// its first read on.
//
// Threading: thread-safe (tiers/tier.h); reads of file homes complete on the workers.
// Ownership: owns the wrapped tier, the descriptors and the readers; a file home must not be
// freed while a copy of it is in flight (like any region).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tiers/nvme/nvme_tier.h"
#include "tiers/nvme/span_reader.h"
#include "tiers/worker_pool.h"

namespace tiermem {

// One byte range of a file home: region bytes [offset, offset + bytes) are file `file`'s
// bytes [file_offset, file_offset + bytes).
struct FileHomeSpan {
  uint32_t file = 0;  // index from OpenFiles
  uint64_t file_offset = 0;
  Bytes offset = 0;
  Bytes bytes = 0;
};

struct FileHomesConfig {
  NvmeIoBackend io_backend = NvmeIoBackend::kAuto;
  int threads = 2;                 // reads of file homes in flight at once
  Bytes request_bytes = 4 * kMiB;  // each reader's requests (SpanReaderConfig)
  int depth = 2;                   // each reader's requests in flight
};

class FileHomeTier final : public NvmeTier {
 public:
  FileHomeTier(std::unique_ptr<NvmeTier> inner, const FileHomesConfig& config);
  ~FileHomeTier() override;

  // Opens `paths` read-only for file homes and records each one's size, inode and mtime;
  // `expected_bytes[i]` is the size the caller validated (a different size: kInvalidArgument
  // naming the file). Returns the index of the first. One set of files per tier: a second call
  // is kFailedPrecondition. kNotFound / I/O errors naming the path.
  StatusOr<uint32_t> OpenFiles(const std::vector<std::string>& paths,
                               const std::vector<uint64_t>& expected_bytes);
  // A read-only region of `bytes` made of `spans` (in region order, not overlapping, each
  // inside its file and the region). kInvalidArgument otherwise.
  StatusOr<Region> AddFileHome(Bytes bytes, std::vector<FileHomeSpan> spans);
  bool IsFileHome(const Region& region) const { return region.id >= kFirstFileHomeId; }
  // The path of file `file` ("" if unknown).
  std::string file_path(uint32_t file) const;
  struct FileHomeStats {
    uint64_t homes = 0;       // live file homes
    Bytes home_bytes = 0;     // their bytes
    uint64_t reads = 0;       // copies out of file homes
    uint64_t requests = 0;    // the readers' I/O requests
    uint64_t bytes_read = 0;  // the bytes they read (alignment around the spans included)
  };
  FileHomeStats file_home_stats() const;

  // ---- Tier, forwarded to the wrapped tier for its own regions ----
  TierKind kind() const override { return inner_->kind(); }
  std::string name() const override { return inner_->name(); }
  StatusOr<Region> Allocate(Bytes bytes) override { return inner_->Allocate(bytes); }
  Status Free(const Region& region) override;
  std::shared_ptr<Completion> Copy(const CopyRequest& request) override;
  TierStats Stats() const override;
  Status RegisterHostMemory(void* addr, Bytes bytes) override {
    return inner_->RegisterHostMemory(addr, bytes);
  }
  Status UnregisterHostMemory(void* addr) override { return inner_->UnregisterHostMemory(addr); }
  std::string_view io_backend_name() const override { return inner_->io_backend_name(); }
  StatusOr<FileLocation> LocateForTest(const Region& region, Bytes offset) const override;

 private:
  // File home ids start here (the wrapped tier counts its own up from 1).
  static constexpr uint64_t kFirstFileHomeId = uint64_t{1} << 62;
  struct Home {
    Bytes bytes = 0;
    std::vector<FileHomeSpan> spans;
  };
  struct File {
    std::string path;
    int fd = -1;  // O_RDONLY, for the checks
    uint64_t bytes = 0, inode = 0;
    int64_t mtime_ns = 0;
  };
  // kDataLoss naming the file when `f` is no longer as recorded.
  Status CheckFile(const File& f) const;
  // Copies bytes [offset, offset + n) of `home` into `host` (the worker's job).
  Status ReadHome(const Home& home, Bytes offset, char* host, Bytes n);

  const std::unique_ptr<NvmeTier> inner_;
  const FileHomesConfig config_;
  mutable Mutex mu_;
  std::vector<File> files_;  // set once by OpenFiles, then read-only
  std::map<uint64_t, std::shared_ptr<const Home>> homes_ TIERMEM_GUARDED_BY(mu_);
  uint64_t next_id_ TIERMEM_GUARDED_BY(mu_) = kFirstFileHomeId;
  Bytes home_bytes_ TIERMEM_GUARDED_BY(mu_) = 0;
  uint64_t reads_ TIERMEM_GUARDED_BY(mu_) = 0;
  // One reader per worker: a job takes a free slot (as many as workers, so one is free) and
  // opens its reader at its first read; a slot is touched only by the job holding it.
  std::vector<std::unique_ptr<SpanReader>> readers_;  // sized once by OpenFiles
  std::vector<size_t> free_readers_ TIERMEM_GUARDED_BY(mu_);
  uint64_t requests_ TIERMEM_GUARDED_BY(mu_) = 0, bytes_read_ TIERMEM_GUARDED_BY(mu_) = 0;
  Bytes staging_bytes_ TIERMEM_GUARDED_BY(mu_) = 0;
  std::unique_ptr<WorkerPool> pool_;  // last: destroyed first (runs the jobs pushed, joins)
};

// The NVMe tier of `config` wrapped for file homes (OpenNvmeTier's errors).
StatusOr<std::unique_ptr<FileHomeTier>> OpenNvmeTierWithFileHomes(const NvmeTierConfig& config);

}  // namespace tiermem
