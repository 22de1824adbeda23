// NVMe tier implementation.
//
// Layout: the capacity is split over `files` scratch files, each fallocate'd up front and
// unlinked (O_TMPFILE), so running out of disk can only happen at creation. A region is one
// contiguous, block-aligned extent of one file, placed first fit by that file's
// ExtentAllocator; the BudgetAccount is charged the region's rounded size.
//
// Integrity: one CRC32C per block (block_bytes, 4 KiB by default: 4 bytes of memory per 4 KiB
// of capacity) lives in `crcs_`, indexed by global block number. A write stamps the checksums
// of the blocks it carries just before it is issued; a read verifies every block it brings in
// before any byte reaches the caller. Blocks never written still verify: fallocate'd extents
// read as zeros and every checksum starts as that of a zero block. Where the checksum work
// runs: on the threads that already touch the piece, with no hand-off of its own. A write
// piece is stamped on the I/O backend's thread just before it is issued (or on the caller's
// thread, before Copy() returns, when the copy asks for inline work: CopyRequest::inline_work,
// the Mover's bounce); a read piece is verified on the backend's thread that completes it,
// after that thread has refilled the disk's queue. A request thus crosses only the threads it
// must (caller -> I/O thread -> waiter), each byte is checksummed in one pass, and the disk
// keeps queue_depth requests while the I/O thread computes. With checksum_threads > 0 the work
// of copies without inline work goes to a pool of that many workers instead (a write piece is
// stamped there and then submitted; a read request is verified there in piece_bytes parts):
// for machines where one I/O thread cannot checksum as fast as its disks deliver. The tier's
// own bounce pieces (unaligned copies) checksum on the backend's thread. docs/nvme.md has the
// CPU cost per GB, docs/benchmarks.md ("NVMe tier vs fio") the rates.
//
// Data path: a copy whose host pointer is 4 KiB aligned and whose offset and size are whole
// blocks goes straight between the caller's memory and the file ("direct"). Anything else
// goes through piece-sized aligned bounce buffers: reads read the covering blocks and copy
// out the middle; writes that cover a block only partly read that block first
// (read-modify-write). Every copy is cut into pieces of at most piece_bytes that are issued
// together; the I/O backend keeps queue_depth of them in flight. A copy completes when all its
// pieces have, with the first failure. Direct reads may use larger pieces (read_request_bytes,
// off by default): a lone chunk's read is then a few requests the disk gets at once, like one
// large fio request, with fewer completions; each completed request is verified while the
// others are still in flight.
//
// Concurrency: copies to disjoint byte ranges may run concurrently even when they share a
// block, because a bounce piece locks the (at most two) partly covered blocks it touches, in
// ascending order, for the whole read-modify-write or read-verify. Locks and bounce buffers are
// handed over asynchronously (continuations), so neither the caller nor an I/O backend thread ever
// blocks on them; a piece takes its bounce buffer before any lock, so there is no cycle.
// Overlapping concurrent copies are the caller's bug (tiers/tier.h).
#include "tiers/nvme/nvme_tier.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <unordered_map>
#include <vector>

#include "base/crc32c.h"
#include "base/logging.h"
#include "base/mutex.h"
#include "tiers/nvme/extent_allocator.h"
#include "tiers/nvme/io_backend.h"
#include "tiers/worker_pool.h"

namespace tiermem {
namespace {

using nvme::IoOp;

constexpr Bytes kDirectAlign = 4096;  // O_DIRECT alignment of memory, offsets and lengths
constexpr Bytes kHugePage = 2 * kMiB;

std::string Hex(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", v);
  return buf;
}

// FIFO locks keyed by block number, acquired with a continuation. Thread-safe.
class BlockLocks {
 public:
  // Runs `fn` once `key` is held (now, on this thread, if it is free).
  void Acquire(uint64_t key, std::function<void()> fn) {
    {
      MutexLock lock(mu_);
      auto [it, inserted] = held_.try_emplace(key);
      if (!inserted) {
        it->second.push_back(std::move(fn));
        return;
      }
    }
    fn();
  }
  // Hands `key` to the next waiter (running it on this thread) or frees it.
  void Release(uint64_t key) {
    std::function<void()> next;
    {
      MutexLock lock(mu_);
      auto it = held_.find(key);
      if (it->second.empty()) {
        held_.erase(it);
        return;
      }
      next = std::move(it->second.front());
      it->second.pop_front();
    }
    next();
  }

 private:
  Mutex mu_;
  // A key is held iff present; the deque holds its waiters.
  std::unordered_map<uint64_t, std::deque<std::function<void()>>> held_ TIERMEM_GUARDED_BY(mu_);
};

// Fixed set of aligned buffers, handed out with a continuation. Thread-safe.
class BouncePool {
 public:
  BouncePool(int count, Bytes each) : bytes_(each * count) {
    // Huge pages where the kernel allows: a piece is then a few DMA segments, not one per
    // 4 KiB page (virtio-blk, for one, splits requests of more than 254 segments).
    const Bytes rounded = AlignUp(bytes_, kHugePage);
    base_ = static_cast<char*>(std::aligned_alloc(kHugePage, rounded));
    if (base_ != nullptr) {
      (void)::madvise(base_, rounded, MADV_HUGEPAGE);
      std::memset(base_, 0, bytes_);  // fault it in once
      for (int i = count - 1; i >= 0; --i) free_.push_back(base_ + i * each);
    }
  }
  ~BouncePool() { std::free(base_); }
  bool ok() const { return base_ != nullptr; }
  char* base() const { return base_; }
  Bytes bytes() const { return bytes_; }

  void Acquire(std::function<void(char*)> fn) {
    char* buf;
    {
      MutexLock lock(mu_);
      if (free_.empty()) {
        waiters_.push_back(std::move(fn));
        return;
      }
      buf = free_.back();
      free_.pop_back();
    }
    fn(buf);
  }
  void Release(char* buf) {
    std::function<void(char*)> next;
    {
      MutexLock lock(mu_);
      if (waiters_.empty()) {
        free_.push_back(buf);
        return;
      }
      next = std::move(waiters_.front());
      waiters_.pop_front();
    }
    next(buf);
  }

 private:
  const Bytes bytes_;
  char* base_ = nullptr;
  Mutex mu_;
  std::vector<char*> free_ TIERMEM_GUARDED_BY(mu_);
  std::deque<std::function<void(char*)>> waiters_ TIERMEM_GUARDED_BY(mu_);
};

// One Copy() call: its pieces report here; the last one completes the Completion.
struct Request {
  std::shared_ptr<Completion> done;
  uint64_t region_id = 0;
  int file = 0;
  uint64_t base = 0;  // the region's offset in its file, bytes
  CopyDir dir = CopyDir::kToTier;
  char* host = nullptr;
  Bytes offset = 0;
  Bytes bytes = 0;
  bool inline_work = false;  // CopyRequest::inline_work: checksums without the worker pool
  std::atomic<int> pending{0};
  std::function<void()> on_done;  // runs after `done` completes (the tier's drain count)
  Mutex mu;
  Status first TIERMEM_GUARDED_BY(mu);

  void PieceDone(const Status& s) {
    if (!s.ok()) {
      MutexLock lock(mu);
      if (first.ok()) first = s;
    }
    if (pending.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      Status result;
      {
        MutexLock lock(mu);
        result = first;
      }
      done->Complete(std::move(result));
      on_done();
    }
  }
};

// The verification parts of one direct read request: the last part to finish reports.
// Thread-safe.
class PartTally {
 public:
  explicit PartTally(int parts) : pending_(parts) {}
  // Records one part's result; true for the last part.
  bool PartDone(const Status& s) {
    MutexLock lock(mu_);
    if (!s.ok() && first_.ok()) first_ = s;
    return --pending_ == 0;
  }
  Status first() const {
    MutexLock lock(mu_);
    return first_;
  }

 private:
  mutable Mutex mu_;
  int pending_ TIERMEM_GUARDED_BY(mu_);
  Status first_ TIERMEM_GUARDED_BY(mu_);  // first failing part's status
};

class NvmeTierImpl;

// A piece that goes through a bounce buffer; [a, e) are block-aligned region offsets.
struct BouncePiece {
  enum class Stage : uint8_t { kRead, kRmwHead, kRmwTail, kWrite };
  std::shared_ptr<Request> req;
  uint64_t a = 0, e = 0;    // block-aligned range this piece transfers, region offsets
  uint64_t u0 = 0, u1 = 0;  // the caller's bytes inside it, region offsets
  uint64_t keys[2] = {0, 0};
  int nkeys = 0;
  bool head_partial = false, tail_partial = false;
  char* buf = nullptr;
  Stage stage = Stage::kRead;
  IoOp op;
};

class NvmeTierImpl final : public NvmeTier {
 public:
  struct File {
    int fd = -1;
    Bytes bytes = 0;
    uint64_t first_block = 0;  // global index of this file's first checksum block
  };

  explicit NvmeTierImpl(const NvmeTierConfig& config)
      : config_(config),
        block_(config.block_bytes),
        budget_(config.capacity),
        tear_after_(config.tear_next_write_after_bytes) {}

  ~NvmeTierImpl() override {
    {  // Copies still in flight (a caller bug) finish first: their pieces use everything below.
      MutexLock lock(drain_mu_);
      while (requests_in_flight_ != 0) drain_cv_.Wait(lock);
    }
    checksum_pool_.reset();
    backend_.reset();
    for (File& f : files_) {
      if (f.fd >= 0) ::close(f.fd);
    }
  }

  Status Init();

  TierKind kind() const override { return TierKind::kNvme; }
  std::string name() const override { return "nvme-" + std::string(backend_->name()); }
  std::string_view io_backend_name() const override { return backend_->name(); }
  TierStats Stats() const override {
    TierStats st = budget_.Snapshot();
    st.host_overhead = host_overhead_;
    return st;
  }

  StatusOr<Region> Allocate(Bytes bytes) override;
  Status Free(const Region& region) override;
  std::shared_ptr<Completion> Copy(const CopyRequest& request) override;

  Status RegisterHostMemory(void* addr, Bytes bytes) override {
    return backend_->RegisterHostMemory(addr, bytes);
  }
  Status UnregisterHostMemory(void* addr) override { return backend_->UnregisterHostMemory(addr); }

  StatusOr<FileLocation> LocateForTest(const Region& region, Bytes offset) const override {
    MutexLock lock(mu_);
    auto it = regions_.find(region.id);
    if (it == regions_.end() || offset >= it->second.region.bytes) {
      return InvalidArgumentError("nvme tier: no byte " + std::to_string(offset) + " in region " +
                                  std::to_string(region.id));
    }
    const File& f = files_[it->second.file];
    return FileLocation{"/proc/self/fd/" + std::to_string(f.fd), it->second.base + offset};
  }

 private:
  struct Live {
    Region region;
    int file = 0;
    uint64_t base = 0;  // offset in the file, bytes
  };

  Status CreateFile(int index, Bytes bytes);

  // Checksums of the blocks of [file_offset, +len) in `data` become the expected ones.
  void Stamp(int file, uint64_t file_offset, const char* data, uint64_t len) {
    uint64_t blk = files_[file].first_block + file_offset / block_;
    for (uint64_t o = 0; o < len; o += block_, ++blk) {
      // Relaxed: the Completion's mutex orders a write's stamps before any later reader.
      crcs_[blk].store(Crc32c(data + o, block_), std::memory_order_relaxed);
    }
  }
  // Checks the blocks of region bytes [region_offset, +len) held in `data`.
  Status Verify(const Request& r, uint64_t region_offset, const char* data, uint64_t len) const {
    uint64_t blk = files_[r.file].first_block + (r.base + region_offset) / block_;
    for (uint64_t o = 0; o < len; o += block_, ++blk) {
      const uint32_t want = crcs_[blk].load(std::memory_order_relaxed);
      const uint32_t got = Crc32c(data + o, block_);
      if (want != got) {
        return DataLossError("nvme tier: checksum mismatch in region " +
                             std::to_string(r.region_id) + " at offset " +
                             std::to_string(region_offset + o) + " (" + std::to_string(block_) +
                             "-byte block at file " + std::to_string(r.file) + " offset " +
                             std::to_string(r.base + region_offset + o) + "): expected crc32c " +
                             Hex(want) + ", read " + Hex(got) + "; the block is torn or corrupted");
      }
    }
    return OkStatus();
  }
  // The write-side `prepare` hook: stamps checksums, then applies the torn-write test hook.
  void PrepareWrite(IoOp& op) {
    Stamp(op.file, op.offset, op.buf, op.len);
    if (tear_after_.load(std::memory_order_relaxed) != 0) {
      const Bytes after = tear_after_.exchange(0);
      if (after != 0 && after < op.len) {
        op.len = static_cast<uint32_t>(after / kDirectAlign * kDirectAlign);
      }
    }
  }

  void StartDirect(const std::shared_ptr<Request>& r, uint64_t off, uint64_t len);
  void StartBounce(BouncePiece* p);
  void LockFrom(BouncePiece* p, int i);
  void Issue(BouncePiece* p, BouncePiece::Stage stage, uint64_t off, uint64_t len);
  void OnBounceIo(BouncePiece* p, Status s);
  void WriteBounce(BouncePiece* p);
  void FinishBounce(BouncePiece* p, const Status& s);

  const NvmeTierConfig config_;
  const Bytes block_;
  BudgetAccount budget_;
  std::atomic<Bytes> tear_after_;                  // the torn-write hook; 0 = off
  std::vector<File> files_;                        // fixed after Init
  std::unique_ptr<std::atomic<uint32_t>[]> crcs_;  // per global block
  // Host memory held for the tier's own use (set by Init): the checksum table and the bounce
  // pool, as allocated.
  Bytes host_overhead_ = 0;
  BlockLocks locks_;
  std::unique_ptr<BouncePool> bounce_;
  std::unique_ptr<nvme::IoBackend> backend_;
  std::unique_ptr<WorkerPool> checksum_pool_;  // checksum_threads > 0 only

  Mutex drain_mu_;
  CondVar drain_cv_;
  uint64_t requests_in_flight_ TIERMEM_GUARDED_BY(drain_mu_) = 0;

  mutable Mutex mu_;
  // Per file (files_[i]'s extents); the vector is filled once by Init.
  std::vector<std::unique_ptr<nvme::ExtentAllocator>> extents_ TIERMEM_GUARDED_BY(mu_);
  std::unordered_map<uint64_t, Live> regions_ TIERMEM_GUARDED_BY(mu_);
  uint64_t next_id_ TIERMEM_GUARDED_BY(mu_) = 1;
};

Status NvmeTierImpl::CreateFile(int index, Bytes bytes) {
  const std::string& dir = config_.dir;
  int flags = O_RDWR | O_CLOEXEC | (config_.direct_io ? O_DIRECT : 0);
  int fd = ::open(dir.c_str(), flags | O_TMPFILE, 0600);
  if (fd < 0 && errno == EINVAL && config_.direct_io) {
    // EINVAL is how a filesystem refuses O_DIRECT (or O_TMPFILE): try each without it.
    fd = ::open(dir.c_str(), (flags & ~O_DIRECT) | O_TMPFILE, 0600);
    if (fd >= 0) {
      ::close(fd);
      fd = -1;
      errno = EINVAL;  // O_TMPFILE works, so O_DIRECT is what was refused
      flags &= ~O_DIRECT;
      LogOnce(LogLevel::kWarn, "nvme: no O_DIRECT",
              "nvme tier: the filesystem of '" + dir + "' refuses O_DIRECT; using buffered I/O");
      fd = ::open(dir.c_str(), flags | O_TMPFILE, 0600);
    }
  }
  if (fd < 0 && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL)) {
    // No O_TMPFILE on this filesystem: create a named file and unlink it at once.
    std::string path = dir + "/tiermem-nvme-XXXXXX";
    const int tmp = ::mkstemp(path.data());
    if (tmp < 0) return ErrnoToStatus(errno, "nvme tier: creating a scratch file in '" + dir + "'");
    ::close(tmp);
    fd = ::open(path.c_str(), flags, 0600);
    if (fd < 0 && errno == EINVAL && (flags & O_DIRECT)) {
      flags &= ~O_DIRECT;
      LogOnce(LogLevel::kWarn, "nvme: no O_DIRECT",
              "nvme tier: the filesystem of '" + dir + "' refuses O_DIRECT; using buffered I/O");
      fd = ::open(path.c_str(), flags, 0600);
    }
    const int open_errno = errno;
    ::unlink(path.c_str());
    errno = open_errno;
  }
  if (fd < 0) return ErrnoToStatus(errno, "nvme tier: creating a scratch file in '" + dir + "'");
  File& f = files_[index];
  f.fd = fd;
  f.bytes = bytes;
  int ret;
  do {
    ret = ::fallocate(fd, 0, 0, static_cast<off_t>(bytes));
  } while (ret != 0 && errno == EINTR);
  if (ret != 0) {
    const int err = errno;
    if (err == EOPNOTSUPP) {
      LogOnce(LogLevel::kWarn, "nvme: no fallocate",
              "nvme tier: the filesystem of '" + dir +
                  "' has no fallocate; the scratch files are sparse and may hit ENOSPC later");
      if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
        return ErrnoToStatus(errno, "nvme tier: sizing a scratch file in '" + dir + "'");
      }
    } else if (err == ENOSPC || err == EDQUOT) {
      struct statvfs vfs {};
      const Bytes free_bytes =
          ::statvfs(dir.c_str(), &vfs) == 0 ? static_cast<Bytes>(vfs.f_bavail) * vfs.f_frsize : 0;
      // ErrnoToStatus makes ENOSPC/EDQUOT kResourceExhausted.
      return ErrnoToStatus(err, "nvme tier: preallocating " + std::to_string(bytes) +
                                    " bytes in '" + dir + "' (" + std::to_string(free_bytes) +
                                    " bytes free)");
    } else {
      return ErrnoToStatus(
          err, "nvme tier: preallocating " + std::to_string(bytes) + " bytes in '" + dir + "'");
    }
  }
  return OkStatus();
}

Status NvmeTierImpl::Init() {
  const NvmeTierConfig& c = config_;
  if (c.block_bytes == 0 || c.block_bytes % kDirectAlign != 0) {
    return InvalidArgumentError("nvme tier: block_bytes must be a positive multiple of 4096 (got " +
                                std::to_string(c.block_bytes) + ")");
  }
  if (c.capacity == 0 || c.capacity % c.block_bytes != 0) {
    return InvalidArgumentError("nvme tier: capacity must be a positive multiple of " +
                                std::to_string(c.block_bytes) + " bytes (got " +
                                std::to_string(c.capacity) + ")");
  }
  if (c.files < 1 || c.files > 64 || c.capacity / c.block_bytes < static_cast<Bytes>(c.files)) {
    return InvalidArgumentError(
        "nvme tier: files must be in 1..64 and at most one per block (got " +
        std::to_string(c.files) + ")");
  }
  if (c.queue_depth < 1 || c.queue_depth > 4096) {
    return InvalidArgumentError("nvme tier: queue_depth must be in 1..4096 (got " +
                                std::to_string(c.queue_depth) + ")");
  }
  if (c.piece_bytes == 0 || c.piece_bytes % c.block_bytes != 0 || c.piece_bytes > 256 * kMiB) {
    return InvalidArgumentError(
        "nvme tier: piece_bytes must be a multiple of block_bytes, at most "
        "256 MiB (got " +
        std::to_string(c.piece_bytes) + ")");
  }
  if (c.read_request_bytes % c.block_bytes != 0 || c.read_request_bytes > 256 * kMiB) {
    return InvalidArgumentError(
        "nvme tier: read_request_bytes must be a multiple of block_bytes, "
        "at most 256 MiB (got " +
        std::to_string(c.read_request_bytes) + ")");
  }
  if (c.bounce_buffers < 0 || c.bounce_buffers > 4096 || c.posix_threads < 0 ||
      c.posix_threads > 256 || c.checksum_threads < 0 || c.checksum_threads > 64) {
    return InvalidArgumentError(
        "nvme tier: bounce_buffers must be in 0..4096, posix_threads "
        "in 0..256 and checksum_threads in 0..64");
  }
  if (c.dir.empty()) return InvalidArgumentError("nvme tier: no directory given");

  struct stat st {};
  if (::stat(c.dir.c_str(), &st) != 0) {
    return ErrnoToStatus(errno, "nvme tier: directory '" + c.dir + "'");
  }
  if (!S_ISDIR(st.st_mode)) {
    return FailedPreconditionError("nvme tier: '" + c.dir + "' is not a directory");
  }
  if (::access(c.dir.c_str(), W_OK | X_OK) != 0) {
    return ErrnoToStatus(errno, "nvme tier: directory '" + c.dir + "' is not writable");
  }
  struct statvfs vfs {};
  if (::statvfs(c.dir.c_str(), &vfs) != 0) {
    return ErrnoToStatus(errno, "nvme tier: statvfs of '" + c.dir + "'");
  }
  if (vfs.f_flag & ST_RDONLY) {
    return FailedPreconditionError("nvme tier: directory '" + c.dir +
                                   "' is on a read-only filesystem");
  }
  const Bytes free_bytes = static_cast<Bytes>(vfs.f_bavail) * vfs.f_frsize;
  if (c.capacity > free_bytes) {
    return ResourceExhaustedError("nvme tier: cannot preallocate " + std::to_string(c.capacity) +
                                  " bytes in '" + c.dir + "': only " + std::to_string(free_bytes) +
                                  " bytes free");
  }

  // Files: equal shares of whole blocks; the last takes the remainder.
  files_.resize(c.files);
  const uint64_t blocks = c.capacity / block_;
  const uint64_t per_file = blocks / c.files;
  uint64_t first = 0;
  std::vector<std::unique_ptr<nvme::ExtentAllocator>> extents;
  for (int i = 0; i < c.files; ++i) {
    const uint64_t n = i + 1 == c.files ? blocks - first : per_file;
    TIERMEM_RETURN_IF_ERROR(CreateFile(i, n * block_));
    files_[i].first_block = first;
    extents.push_back(std::make_unique<nvme::ExtentAllocator>(n * block_, block_));
    first += n;
  }
  {
    MutexLock lock(mu_);  // not shared yet; the lock is for the analysis
    extents_ = std::move(extents);
  }
  crcs_ = std::make_unique<std::atomic<uint32_t>[]>(blocks);
  {
    std::vector<char> zeros(block_, 0);
    const uint32_t zero_crc = Crc32c(zeros.data(), block_);
    for (uint64_t b = 0; b < blocks; ++b) crcs_[b].store(zero_crc, std::memory_order_relaxed);
  }

  const int nbounce = c.bounce_buffers > 0 ? c.bounce_buffers : c.queue_depth;
  bounce_ = std::make_unique<BouncePool>(nbounce, c.piece_bytes);
  if (!bounce_->ok()) {
    return ResourceExhaustedError("nvme tier: cannot allocate " + std::to_string(bounce_->bytes()) +
                                  " bytes of bounce buffers");
  }
  host_overhead_ = blocks * sizeof(uint32_t) + AlignUp(bounce_->bytes(), kHugePage);

  nvme::IoBackendConfig ec;
  for (const File& f : files_) ec.fds.push_back(f.fd);
  ec.queue_depth = c.queue_depth;
  ec.posix_threads = c.posix_threads;
  ec.register_files = c.register_files;
  ec.register_buffers = c.register_buffers;
  ec.bounce = bounce_->base();
  ec.bounce_bytes = bounce_->bytes();
  if (c.io_backend != NvmeIoBackend::kPosix) {
    auto uring = nvme::NewUringBackend(ec);
    if (uring.ok()) {
      backend_ = std::move(uring).value();
    } else if (c.io_backend == NvmeIoBackend::kIoUring) {
      return uring.status().WithContext("nvme tier (engine=io_uring)");
    } else {
      LogOnce(LogLevel::kWarn, "nvme: io_uring refused",
              "nvme tier: io_uring unavailable (" + uring.status().ToString() +
                  "); using the pread/pwrite engine");
    }
  }
  if (backend_ == nullptr) backend_ = nvme::NewPosixBackend(ec);
  if (c.checksum_threads > 0) checksum_pool_ = std::make_unique<WorkerPool>(c.checksum_threads);
  return OkStatus();
}

StatusOr<Region> NvmeTierImpl::Allocate(Bytes bytes) {
  if (bytes == 0) return InvalidArgumentError("nvme tier: allocation of 0 bytes");
  if (bytes > config_.capacity) {
    return budget_.Reserve(bytes, "nvme");  // fails with the standard over-budget message
  }
  const Bytes rounded = AlignUp(bytes, block_);
  MutexLock lock(mu_);
  const TierStats stats = budget_.Snapshot();
  if (rounded > stats.capacity - stats.used) return budget_.Reserve(rounded, "nvme");
  for (size_t i = 0; i < files_.size(); ++i) {
    std::optional<uint64_t> off = extents_[i]->Allocate(rounded);
    if (!off) continue;
    // Cannot fail: every Reserve/Release happens under mu_ and the check above passed.
    TIERMEM_RETURN_IF_ERROR(budget_.Reserve(rounded, "nvme"));
    Live live{Region{next_id_++, rounded, nullptr}, static_cast<int>(i), *off};
    regions_.emplace(live.region.id, live);
    return live.region;
  }
  Bytes largest = 0;
  for (const auto& e : extents_) largest = std::max(largest, e->largest_free_extent());
  return ResourceExhaustedError(
      "nvme tier: need a contiguous " + std::to_string(rounded) + " bytes; the budget has " +
      std::to_string(stats.capacity - stats.used) + " bytes free but the largest free extent is " +
      std::to_string(largest) + " bytes (fragmented)");
}

Status NvmeTierImpl::Free(const Region& region) {
  MutexLock lock(mu_);
  auto it = regions_.find(region.id);
  if (it == regions_.end()) {
    return InvalidArgumentError("nvme tier: free of unknown region " + std::to_string(region.id));
  }
  const Live live = it->second;
  regions_.erase(it);
  extents_[live.file]->Free(live.base, live.region.bytes);
  budget_.Release(live.region.bytes);
  return OkStatus();
}

std::shared_ptr<Completion> NvmeTierImpl::Copy(const CopyRequest& req) {
  Live live;
  {
    MutexLock lock(mu_);
    auto it = regions_.find(req.region.id);
    if (it != regions_.end()) live = it->second;
  }
  Status valid = ValidateCopy(req, live.region);
  if (!valid.ok()) return Completion::Done(valid.WithContext("nvme tier"));
  auto done = Completion::Make();
  if (req.bytes == 0) {
    done->Complete(OkStatus());
    return done;
  }
  auto r = std::make_shared<Request>();
  r->done = done;
  {
    MutexLock lock(drain_mu_);
    ++requests_in_flight_;
  }
  r->on_done = [this] {
    MutexLock lock(drain_mu_);
    if (--requests_in_flight_ == 0) drain_cv_.NotifyAll();
  };
  r->region_id = live.region.id;
  r->file = live.file;
  r->base = live.base;
  r->dir = req.dir;
  r->host = static_cast<char*>(req.host);
  r->offset = req.offset;
  r->bytes = req.bytes;
  r->inline_work = req.inline_work;
  const Bytes piece = config_.piece_bytes;
  const bool direct = reinterpret_cast<uintptr_t>(req.host) % kDirectAlign == 0 &&
                      req.offset % block_ == 0 && req.bytes % block_ == 0;
  if (direct) {
    const Bytes request =
        req.dir == CopyDir::kFromTier ? std::max(piece, config_.read_request_bytes) : piece;
    const uint64_t end = req.offset + req.bytes;
    r->pending.store(static_cast<int>((req.bytes + request - 1) / request));
    for (uint64_t off = req.offset; off < end; off += request) {
      StartDirect(r, off, std::min<uint64_t>(request, end - off));
    }
    return done;
  }
  const uint64_t a = req.offset / block_ * block_;
  const uint64_t e = AlignUp(req.offset + req.bytes, block_);
  std::vector<BouncePiece*> pieces;
  for (uint64_t pa = a; pa < e; pa += piece) {
    auto* p = new BouncePiece;
    p->req = r;
    p->a = pa;
    p->e = std::min<uint64_t>(pa + piece, e);
    p->u0 = std::max<uint64_t>(p->a, req.offset);
    p->u1 = std::min<uint64_t>(p->e, req.offset + req.bytes);
    // Only a piece's first and last block can be partly covered.
    p->head_partial = p->u0 > p->a || p->u1 < p->a + block_;
    p->tail_partial = p->u1 < p->e || p->u0 > p->e - block_;
    const uint64_t first_block = files_[r->file].first_block + (r->base + p->a) / block_;
    const uint64_t last_block = files_[r->file].first_block + (r->base + p->e) / block_ - 1;
    if (p->head_partial) p->keys[p->nkeys++] = first_block;
    if (p->tail_partial && (last_block != first_block || !p->head_partial)) {
      p->keys[p->nkeys++] = last_block;
    }
    p->op.file = r->file;
    p->op.complete = [this, p](IoOp&, Status s) { OnBounceIo(p, std::move(s)); };
    pieces.push_back(p);
  }
  r->pending.store(static_cast<int>(pieces.size()));
  for (BouncePiece* p : pieces) StartBounce(p);
  return done;
}

void NvmeTierImpl::StartDirect(const std::shared_ptr<Request>& r, uint64_t off, uint64_t len) {
  auto* op = new IoOp;
  op->file = r->file;
  op->offset = r->base + off;
  op->buf = r->host + (off - r->offset);
  op->len = static_cast<uint32_t>(len);
  op->write = r->dir == CopyDir::kToTier;
  if (op->write) {
    op->complete = [r](IoOp& o, Status s) {
      r->PieceDone(s);
      delete &o;  // nothing touches `o` or this lambda's captures after this
    };
    if (r->inline_work) {  // stamped here, on the caller's thread
      PrepareWrite(*op);
      backend_->Submit(op);
      return;
    }
    if (checksum_pool_ == nullptr) {  // stamped on the backend's thread, just before issue
      op->prepare = [this](IoOp& o) { PrepareWrite(o); };
      backend_->Submit(op);
      return;
    }
    checksum_pool_->Push([this, op] {
      PrepareWrite(*op);
      backend_->Submit(op);
    });
  } else {
    op->complete = [this, r, off](IoOp& o, Status s) {
      if (!s.ok() || r->inline_work || checksum_pool_ == nullptr) {
        // Verified here, on the backend's completing thread (after it refilled the queue).
        if (s.ok()) s = Verify(*r, off, o.buf, o.len);
        r->PieceDone(s);
        delete &o;
        return;
      }
      // Verified in piece-sized parts, so a large request's check spreads over the workers.
      // The request counts as one piece of `r`: its parts report to a shared tally, and the
      // last part to finish reports the request's first failure.
      const Bytes part = config_.piece_bytes;
      const int parts = static_cast<int>((o.len + part - 1) / part);
      if (parts == 1) {
        IoOp* done_op = &o;
        checksum_pool_->Push([this, r, off, done_op] {
          r->PieceDone(Verify(*r, off, done_op->buf, done_op->len));
          delete done_op;
        });
        return;
      }
      auto tally = std::make_shared<PartTally>(parts);
      for (int i = 0; i < parts; ++i) {
        const uint64_t at = static_cast<uint64_t>(i) * part;
        const char* buf = o.buf + at;
        const uint64_t len = std::min<uint64_t>(part, o.len - at);
        checksum_pool_->Push([this, r, tally, off, at, buf, len] {
          if (tally->PartDone(Verify(*r, off + at, buf, len))) r->PieceDone(tally->first());
        });
      }
      delete &o;  // the parts hold what they need; nothing touches `o` after this
    };
    backend_->Submit(op);
  }
}

void NvmeTierImpl::StartBounce(BouncePiece* p) {
  bounce_->Acquire([this, p](char* buf) {
    p->buf = buf;
    LockFrom(p, 0);
  });
}

void NvmeTierImpl::LockFrom(BouncePiece* p, int i) {
  if (i == p->nkeys) {
    if (p->req->dir == CopyDir::kFromTier) {
      Issue(p, BouncePiece::Stage::kRead, p->a, p->e - p->a);
    } else if (p->head_partial) {
      Issue(p, BouncePiece::Stage::kRmwHead, p->a, block_);
    } else if (p->tail_partial) {
      Issue(p, BouncePiece::Stage::kRmwTail, p->e - block_, block_);
    } else {
      WriteBounce(p);
    }
    return;
  }
  locks_.Acquire(p->keys[i], [this, p, i] { LockFrom(p, i + 1); });
}

void NvmeTierImpl::Issue(BouncePiece* p, BouncePiece::Stage stage, uint64_t off, uint64_t len) {
  p->stage = stage;
  IoOp& op = p->op;
  op.offset = p->req->base + off;
  op.buf = p->buf + (off - p->a);
  op.len = static_cast<uint32_t>(len);
  op.write = stage == BouncePiece::Stage::kWrite;
  op.done = 0;
  op.prepared = false;
  if (op.write) {
    op.prepare = [this](IoOp& o) { PrepareWrite(o); };
  } else {
    op.prepare = nullptr;
  }
  backend_->Submit(&op);
}

void NvmeTierImpl::WriteBounce(BouncePiece* p) {
  const Request& r = *p->req;
  std::memcpy(p->buf + (p->u0 - p->a), r.host + (p->u0 - r.offset), p->u1 - p->u0);
  Issue(p, BouncePiece::Stage::kWrite, p->a, p->e - p->a);
}

void NvmeTierImpl::OnBounceIo(BouncePiece* p, Status s) {
  const Request& r = *p->req;
  switch (p->stage) {
    case BouncePiece::Stage::kRead:
      if (s.ok()) s = Verify(r, p->a, p->buf, p->e - p->a);
      if (s.ok()) std::memcpy(r.host + (p->u0 - r.offset), p->buf + (p->u0 - p->a), p->u1 - p->u0);
      FinishBounce(p, s);
      return;
    case BouncePiece::Stage::kRmwHead:
      if (s.ok()) s = Verify(r, p->a, p->buf, block_);
      if (!s.ok()) break;
      if (p->tail_partial && p->e - block_ != p->a) {
        Issue(p, BouncePiece::Stage::kRmwTail, p->e - block_, block_);
      } else {
        WriteBounce(p);
      }
      return;
    case BouncePiece::Stage::kRmwTail:
      if (s.ok()) s = Verify(r, p->e - block_, p->buf + (p->e - block_ - p->a), block_);
      if (!s.ok()) break;
      WriteBounce(p);
      return;
    case BouncePiece::Stage::kWrite:
      break;
  }
  if (!s.ok() && p->stage != BouncePiece::Stage::kWrite) {
    s = s.WithContext("read-modify-write of a partly covered block");
  }
  FinishBounce(p, s);
}

void NvmeTierImpl::FinishBounce(BouncePiece* p, const Status& s) {
  std::shared_ptr<Request> r = std::move(p->req);
  char* buf = p->buf;
  const int nkeys = p->nkeys;
  const uint64_t keys[2] = {p->keys[0], p->keys[1]};
  delete p;  // `p->op.complete` is running us: nothing touches p or its lambda after this
  for (int i = nkeys - 1; i >= 0; --i) locks_.Release(keys[i]);
  bounce_->Release(buf);
  r->PieceDone(s);
}

}  // namespace

StatusOr<NvmeIoBackend> ParseNvmeIoBackend(std::string_view name) {
  if (name == "auto") return NvmeIoBackend::kAuto;
  if (name == "io_uring") return NvmeIoBackend::kIoUring;
  if (name == "posix") return NvmeIoBackend::kPosix;
  return InvalidArgumentError("nvme engine must be auto, io_uring or posix (got '" +
                              std::string(name) + "')");
}

StatusOr<std::unique_ptr<NvmeTier>> OpenNvmeTier(const NvmeTierConfig& config) {
  auto tier = std::make_unique<NvmeTierImpl>(config);
  TIERMEM_RETURN_IF_ERROR(tier->Init());
  return std::unique_ptr<NvmeTier>(std::move(tier));
}

StatusOr<std::unique_ptr<Tier>> NewNvmeTier(const NvmeTierConfig& config) {
  TIERMEM_ASSIGN_OR_RETURN(std::unique_ptr<NvmeTier> tier, OpenNvmeTier(config));
  return std::unique_ptr<Tier>(std::move(tier));
}

}  // namespace tiermem
