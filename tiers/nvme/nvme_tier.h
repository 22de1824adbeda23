// The NVMe tier: regions inside preallocated scratch files on a local filesystem, read and
// written with O_DIRECT through io_uring (or a pread/pwrite worker pool where io_uring is
// refused), with a CRC32C per block so that a torn or corrupted block is reported as
// kDataLoss, never returned as garbage. Not byte-addressable: Region.addr is nullptr.
//
//   auto tier = NewNvmeTier({.dir = "/mnt/nvme/scratch", .capacity = 64 * kGiB});
//
// Host memory beside the budget (Stats().host_overhead): 4 bytes of checksum per block of
// capacity (1 MiB per GiB at 4 KiB blocks) and the bounce pool (bounce_buffers x piece_bytes).
//
// Threading: thread-safe (see tiers/tier.h). Completions fire on the I/O backend's threads.
// Ownership: the caller owns the tier; it deletes its files (they are unlinked at creation).
#pragma once

#include <memory>
#include <string>

#include "tiers/tier.h"

namespace tiermem {

enum class NvmeIoBackend : uint8_t {
  kAuto = 0,     // io_uring if the kernel allows it, else posix (logged once)
  kIoUring = 1,  // io_uring or fail with kUnavailable
  kPosix = 2,    // pread/pwrite worker pool
};
StatusOr<NvmeIoBackend> ParseNvmeIoBackend(std::string_view name);  // "auto", "io_uring", "posix"

struct NvmeTierConfig {
  std::string dir;     // existing writable directory on the target filesystem
  Bytes capacity = 0;  // the budget; bytes preallocated (a multiple of block_bytes)
  int files = 1;       // scratch files the capacity is split over (1..64)
  NvmeIoBackend io_backend = NvmeIoBackend::kAuto;
  int queue_depth = 8;           // max I/Os in flight (1..4096)
  Bytes piece_bytes = 1 * kMiB;  // large copies are split into pieces of this size
  // Aligned reads go to the file in requests of max(piece_bytes, this) bytes (0 = piece_bytes):
  // at 4 MiB a lone 16 MiB chunk is 4 requests, all in flight at once, not 16 at depth 8. Off
  // by default: it measured no faster on the development VM (docs/benchmarks.md, issue 32). A
  // multiple of block_bytes.
  Bytes read_request_bytes = 0;
  int bounce_buffers = 0;        // piece-sized aligned bounce buffers (0 = queue_depth)
  Bytes block_bytes = 4 * kKiB;  // allocation, checksum and read-modify-write unit
  int posix_threads = 0;         // posix backend workers (0 = queue_depth, at most 16)
  // CRC32C workers for aligned copies without inline work. 0: none; the checksums run on the
  // I/O backend's threads (no hand-off per piece). N > 0: a pool of N threads, for machines
  // where one I/O thread cannot checksum at the disks' rate (reads verified in piece_bytes
  // parts, spread over the pool).
  int checksum_threads = 0;
  bool register_buffers = true;  // io_uring fixed buffers (falls back when refused)
  bool register_files = true;    // io_uring fixed files
  bool direct_io = true;         // O_DIRECT (buffered only if the filesystem refuses it)
  // Test hook: the first write issued after creation writes only its first
  // AlignDown(n, 4096) bytes (0 = off) while recording checksums of all of it, like a
  // device that lost power mid-write; the copy still reports success.
  Bytes tear_next_write_after_bytes = 0;
};

// The NVMe tier's interface beyond Tier.
class NvmeTier : public Tier {
 public:
  // Lets io_uring use [addr, addr + bytes) (e.g. a host tier's slab) as fixed buffers for
  // copies whose host pointer lies inside it. The memory must outlive the registration.
  // Posix backend: OK, no effect. kUnavailable when registered buffers were refused at
  // creation; kResourceExhausted when this registration is refused (RLIMIT_MEMLOCK). Copies
  // work either way (unregistered).
  virtual Status RegisterHostMemory(void* addr, Bytes bytes) = 0;
  // Undoes RegisterHostMemory(addr, ...). No copy using the range may be in flight.
  virtual Status UnregisterHostMemory(void* addr) = 0;
  // "io_uring" or "posix".
  virtual std::string_view io_backend_name() const = 0;

  // For tests: where byte `offset` of `region` lives: a path that opens the backing file
  // (/proc/self/fd/N; the file itself is unlinked) and the byte's offset in that file.
  struct FileLocation {
    std::string path;
    uint64_t file_offset = 0;
  };
  virtual StatusOr<FileLocation> LocateForTest(const Region& region, Bytes offset) const = 0;
};

// Creates the files (fallocate'd, unlinked) and starts the I/O backend. Errors: missing directory
// kNotFound; not a directory or not writable kFailedPrecondition; not enough free space
// kResourceExhausted naming the path, the bytes asked for and the bytes free; bad config
// kInvalidArgument; io_backend = kIoUring refused: kUnavailable.
StatusOr<std::unique_ptr<NvmeTier>> OpenNvmeTier(const NvmeTierConfig& config);
StatusOr<std::unique_ptr<Tier>> NewNvmeTier(const NvmeTierConfig& config);

}  // namespace tiermem
