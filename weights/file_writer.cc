// FileWriter and CommitFile (see file_writer.h).
#include "weights/file_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <future>
#include <utility>

#include "base/crc32c.h"
#include "base/fs.h"

namespace tiermem::weights {
namespace {

Status PWriteAll(int fd, const char* p, size_t n, uint64_t off, const std::string& path) {
  while (n > 0) {
    const ssize_t w = pwrite(fd, p, n, static_cast<off_t>(off));
    if (w < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, "writing " + path);
    }
    p += w;
    n -= static_cast<size_t>(w);
    off += static_cast<uint64_t>(w);
  }
  return OkStatus();
}

}  // namespace

StatusOr<std::unique_ptr<FileWriter>> FileWriter::Create(const std::string& path, bool want_direct,
                                                         Bytes buffer_bytes, bool crc) {
  if (buffer_bytes == 0 || buffer_bytes % kBlock != 0) {
    return InvalidArgumentError("file writer: buffer of " + std::to_string(buffer_bytes) +
                                " bytes is not a multiple of " + std::to_string(kBlock));
  }
  const int flags = O_CREAT | O_WRONLY | O_TRUNC | O_CLOEXEC;
  int fd = want_direct ? open(path.c_str(), flags | O_DIRECT, 0644) : -1;
  const bool direct = fd >= 0;
  // EINVAL is how a file system refuses O_DIRECT: buffered then.
  if (fd < 0 && (!want_direct || errno == EINVAL)) fd = open(path.c_str(), flags, 0644);
  if (fd < 0) return ErrnoToStatus(errno, "creating " + path);
  char* buf = static_cast<char*>(std::aligned_alloc(kBlock, buffer_bytes));
  char* spare = static_cast<char*>(std::aligned_alloc(kBlock, buffer_bytes));
  if (buf == nullptr || spare == nullptr) {
    close(fd);
    std::free(buf);
    std::free(spare);
    return ResourceExhaustedError("file writer: no memory for two " + std::to_string(buffer_bytes) +
                                  "-byte buffers");
  }
  return std::unique_ptr<FileWriter>(
      new FileWriter(path, fd, direct, buf, spare, buffer_bytes, crc));
}

FileWriter::FileWriter(std::string path, int fd, bool direct, char* buf, char* spare,
                       Bytes buffer_bytes, bool crc)
    : path_(std::move(path)),
      fd_(fd),
      direct_(direct),
      buf_(buf),
      spare_(spare),
      buffer_bytes_(buffer_bytes),
      crc_on_(crc) {}

FileWriter::~FileWriter() {
  Drain().IgnoreError();  // the thread writes into spare_ and fd_ until then
  if (fd_ >= 0) close(fd_);
  std::free(buf_);
  std::free(spare_);
}

Status FileWriter::Drain() {
  if (!pending_.valid()) return OkStatus();
  return pending_.get();
}

Status FileWriter::Put(const void* data, size_t n) {
  if (finished_) return FailedPreconditionError("file writer: Put after Finish on " + path_);
  if (crc_on_) crc_ = Crc32c(data, n, crc_);
  const char* c = static_cast<const char*>(data);
  while (n > 0) {
    const size_t k = std::min<size_t>(n, buffer_bytes_ - used_);
    std::memcpy(buf_ + used_, c, k);
    used_ += k;
    c += k;
    n -= k;
    if (used_ == buffer_bytes_) TIERMEM_RETURN_IF_ERROR(Flush(buffer_bytes_));
  }
  return OkStatus();
}

StatusOr<std::span<char>> FileWriter::Space(size_t want) {
  if (finished_) return FailedPreconditionError("file writer: Space after Finish on " + path_);
  // used_ < buffer_bytes_ always: a full buffer is flushed at once.
  return std::span<char>(buf_ + used_, std::max<size_t>(1, std::min(want, buffer_bytes_ - used_)));
}

Status FileWriter::Commit(size_t n) {
  if (finished_) return FailedPreconditionError("file writer: Commit after Finish on " + path_);
  if (n > buffer_bytes_ - used_) {
    return InvalidArgumentError("file writer: Commit of " + std::to_string(n) + " bytes, " +
                                std::to_string(buffer_bytes_ - used_) + " were free");
  }
  if (crc_on_) crc_ = Crc32c(buf_ + used_, n, crc_);
  used_ += n;
  if (used_ == buffer_bytes_) return Flush(buffer_bytes_);
  return OkStatus();
}

uint32_t FileWriter::TakeCrc() {
  const uint32_t c = crc_;
  crc_ = 0;
  return c;
}

Status FileWriter::Flush(size_t n) {
  TIERMEM_RETURN_IF_ERROR(Drain());  // spare_ is free again
  std::swap(buf_, spare_);
  pending_ = std::async(std::launch::async, [fd = fd_, p = spare_, n, off = offset_, path = path_] {
    return PWriteAll(fd, p, n, off, path);
  });
  offset_ += n;
  used_ = 0;
  return OkStatus();
}

Status FileWriter::Finish() {
  if (finished_) return OkStatus();
  finished_ = true;
  if (used_ == 0) return Drain();
  const uint64_t size = offset_ + used_;  // Flush moves offset_ and clears used_
  const size_t padded = direct_ ? AlignUp(used_, kBlock) : used_;
  std::memset(buf_ + used_, 0, padded - used_);
  const size_t used = used_;
  TIERMEM_RETURN_IF_ERROR(Flush(padded));
  TIERMEM_RETURN_IF_ERROR(Drain());
  if (padded != used && ftruncate(fd_, static_cast<off_t>(size)) != 0) {
    return ErrnoToStatus(errno, "truncating " + path_);
  }
  offset_ = size;
  return OkStatus();
}

Status FileWriter::Rewrite(uint64_t offset, const void* data, size_t n) {
  if (!finished_) return FailedPreconditionError("file writer: Rewrite before Finish");
  TIERMEM_RETURN_IF_ERROR(Drain());
  if (!direct_) return PWriteAll(fd_, static_cast<const char*>(data), n, offset, path_);
  if (offset % kBlock != 0 || n % kBlock != 0) {
    return InvalidArgumentError("file writer: an O_DIRECT rewrite must be block-aligned");
  }
  for (size_t done = 0; done < n;) {  // through the aligned buffer
    const size_t k = std::min<size_t>(n - done, buffer_bytes_);
    std::memcpy(buf_, static_cast<const char*>(data) + done, k);
    TIERMEM_RETURN_IF_ERROR(PWriteAll(fd_, buf_, k, offset + done, path_));
    done += k;
  }
  return OkStatus();
}

Status FileWriter::Close() {
  if (fd_ < 0) return OkStatus();
  Status s = Drain();
  if (fsync(fd_) != 0 && s.ok()) s = ErrnoToStatus(errno, "fsync " + path_);
  if (close(fd_) != 0 && s.ok()) s = ErrnoToStatus(errno, "closing " + path_);
  fd_ = -1;
  return s;
}

Status CommitFile(const std::string& tmp, const std::string& path) {
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    unlink(tmp.c_str());
    return ErrnoToStatus(err, "renaming " + tmp + " to " + path);
  }
  std::string dir = DirName(path);
  if (dir.empty()) dir = ".";
  const int dfd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    fsync(dfd);  // best effort: the rename is durable once the directory is
    close(dfd);
  }
  return OkStatus();
}

}  // namespace tiermem::weights
