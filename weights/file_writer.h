// Writing a large file sequentially and durably: the session's checkpoints and exported
// weights (shard_writer.h) stream through it, a model larger than RAM included.
//
// FileWriter gathers the bytes Put into one block-aligned buffer and writes it at
// block-aligned offsets, through O_DIRECT when the file system allows it — the page cache's
// write-back plus fsync is what bounds buffered writes of large files, at a fraction of the
// disk's rate — and buffered otherwise (tmpfs refuses O_DIRECT). Double-buffered: a full
// buffer is written on a thread of its own while the caller fills the other one (an export
// reads the tiers while the disk writes), so a write error shows at the next flush, Finish,
// Rewrite or Close. Finish() writes the last
// partial block zero-padded and cuts the file back to its true size. A running CRC32C over
// what was Put is kept when asked for. CommitFile then makes a finished temporary file the real
// one: fsync, rename, fsync of the directory — so a crash leaves either the old file or the
// whole new one under the final name, never a torn one.
//
// Thread-safety: externally synchronized. Ownership: the writer owns its descriptor (closed by
// Close or the destructor) and its buffer.
#pragma once

#include <cstdint>
#include <future>
#include <memory>
#include <span>
#include <string>

#include "base/status.h"
#include "base/units.h"

namespace tiermem::weights {

class FileWriter {
 public:
  static constexpr uint64_t kBlock = 4096;  // O_DIRECT alignment of offsets, lengths, memory

  // Creates (or truncates) `path`, with O_DIRECT when `want_direct` and the file system
  // allows it. `buffer_bytes` (a multiple of kBlock): bytes per write. Errors name the path.
  static StatusOr<std::unique_ptr<FileWriter>> Create(const std::string& path, bool want_direct,
                                                      Bytes buffer_bytes = 8 * kMiB,
                                                      bool crc = false);
  ~FileWriter();
  FileWriter(const FileWriter&) = delete;
  FileWriter& operator=(const FileWriter&) = delete;

  // Appends `n` bytes.
  Status Put(const void* data, size_t n);
  // Writing in place instead of Put, with no copy: the free end of the buffer (at least one
  // byte, at most `want`), to be filled and then appended with Commit(n), n <= its size.
  // Space changes nothing (a Put may follow instead); anything else between the two
  // invalidates the span. kFailedPrecondition after Finish.
  StatusOr<std::span<char>> Space(size_t want);
  Status Commit(size_t n);
  // The CRC32C of the bytes Put since the last call (0 unless created with crc).
  uint32_t TakeCrc();
  // Writes what is buffered (the last block zero-padded, then cut back). Put after Finish is
  // kFailedPrecondition.
  Status Finish();
  // Overwrites [offset, offset + n) of what Finish wrote (a header whose values were known only
  // at the end); with O_DIRECT both must be multiples of kBlock.
  Status Rewrite(uint64_t offset, const void* data, size_t n);
  // fsync and close. Idempotent.
  Status Close();

  const std::string& path() const { return path_; }
  bool direct() const { return direct_; }
  uint64_t bytes() const { return offset_ + used_; }  // Put so far

 private:
  FileWriter(std::string path, int fd, bool direct, char* buf, char* spare, Bytes buffer_bytes,
             bool crc);
  Status Flush(size_t n);

  // Waits for the write in flight, if any; its status.
  Status Drain();

  std::string path_;
  int fd_ = -1;
  bool direct_ = false;
  char* buf_ = nullptr;    // block-aligned, buffer_bytes_ long, being filled; owned
  char* spare_ = nullptr;  // the other one: written by `pending_` while it is valid; owned
  // The write of `spare_` in flight (std::async): its thread touches only `spare_`, the
  // descriptor and copies of the rest, and Drain's get() orders it before the next use.
  std::future<Status> pending_;
  Bytes buffer_bytes_ = 0;
  size_t used_ = 0;      // bytes in buf_
  uint64_t offset_ = 0;  // file offset of buf_[0]
  bool crc_on_ = false;
  uint32_t crc_ = 0;
  bool finished_ = false;
};

// Makes the finished, closed file `tmp` the file `path`: rename (atomic) and fsync of the
// directory. kIOError naming the paths; `tmp` is removed on failure.
Status CommitFile(const std::string& tmp, const std::string& path);

}  // namespace tiermem::weights
