// SpanReader: reads byte spans of read-only files (pretrained weights: runtime/weights.h) once
// each, in large requests through the NVMe tier's I/O backends (io_uring, or the pread worker
// pool where io_uring is refused), into a bounded staging area, and hands each span's bytes to
// the caller in order while the next requests are in flight.
//
// The spans' bytes are only as aligned as the file format makes them (safetensors: 8 bytes),
// so requests cover 4096-aligned supersets and the caller is handed the part it asked for.
// Spans are gathered into requests in the order given: consecutive spans of one file whose
// gap is at most max_gap_bytes share a request (the gap is read and dropped), a span larger
// than a request is read in several, and a request never exceeds request_bytes. Files are
// opened with O_DIRECT (buffered where the file system refuses it, e.g. tmpfs: said once); the
// last bytes of a file that do not fill a block are read through a buffered descriptor. The
// staging area is `depth` buffers of request_bytes, allocated at Open (and registered as
// io_uring fixed buffers where allowed): memory stays depth x request_bytes however large the
// files or a span. Pass spans sorted by (file, offset) for sequential reads.
//
// Threading: Read runs on the caller's thread and calls the sink there; completions run on the
// backend's threads and touch only the request slots (guarded by mu_). Externally synchronized
// otherwise (one Read at a time). Ownership: the reader owns its descriptors and staging; a
// pointer handed to the sink is valid only during that call.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "base/units.h"
#include "tiers/nvme/nvme_tier.h"

namespace tiermem {
namespace nvme {
class IoBackend;
}

struct FileSpan {
  uint32_t file = 0;    // index into the paths given to Open
  uint64_t offset = 0;  // bytes
  uint64_t bytes = 0;
};

struct SpanReaderConfig {
  NvmeIoBackend io_backend = NvmeIoBackend::kAuto;
  Bytes request_bytes = 8 * kMiB;  // a multiple of 4096, at least 64 KiB
  int depth = 4;                   // requests in flight; staging = depth x request_bytes
  Bytes max_gap_bytes = 256 * kKiB;
  bool direct_io = true;
  bool register_buffers = true;  // io_uring fixed buffers for the staging area
};

class SpanReader {
 public:
  // Opens every file read-only. kNotFound / errors naming the path; kInvalidArgument for a
  // bad config; kUnavailable when io_backend is kIoUring and the kernel refuses it.
  static StatusOr<std::unique_ptr<SpanReader>> Open(const std::vector<std::string>& paths,
                                                    const SpanReaderConfig& config = {});
  ~SpanReader();
  SpanReader(const SpanReader&) = delete;
  SpanReader& operator=(const SpanReader&) = delete;

  // sink(span, at, data, n): bytes [at, at + n) of spans[span]; called in span order, each
  // span's pieces in order. A sink error stops the read (requests in flight are waited for)
  // and is returned. Read errors name the file and offset; a span past the end of its file is
  // kInvalidArgument before anything is read.
  using Sink = std::function<Status(size_t span, uint64_t at, const char* data, size_t n)>;
  Status Read(const std::vector<FileSpan>& spans, const Sink& sink);

  std::string_view io_backend() const;
  uint64_t file_bytes(uint32_t file) const { return files_[file].bytes; }
  Bytes staging_bytes() const { return staging_bytes_; }
  struct Stats {
    uint64_t requests = 0;    // I/O requests issued
    uint64_t bytes_read = 0;  // bytes they read (the spans' and the alignment around them)
  };
  Stats stats() const { return stats_; }

 private:
  struct File {
    std::string path;
    uint64_t bytes = 0;
    int fd = -1;           // O_DIRECT when `direct`
    int buffered_fd = -1;  // for the tail past the last full block
    bool direct = false;
  };
  struct Window;
  struct Slots;  // the requests in flight and their lock (span_reader.cc)
  SpanReader();
  std::vector<Window> Plan(const std::vector<FileSpan>& spans) const;
  void Issue(const Window& w, size_t slot);
  // Blocks until slot `slot`'s request completed; returns its status.
  Status Wait(size_t slot);

  SpanReaderConfig config_;
  std::vector<File> files_;
  char* staging_ = nullptr;  // depth x request_bytes, block-aligned; owned
  Bytes staging_bytes_ = 0;
  std::unique_ptr<Slots> slots_;
  std::unique_ptr<nvme::IoBackend> backend_;  // declared last: destroyed first (drains I/O)
  Stats stats_;
};

}  // namespace tiermem
