// FileHomeTier (see file_homes.h).
#include "tiers/nvme/file_homes.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <numeric>
#include <tuple>

namespace tiermem {
namespace {

int64_t MtimeNs(const struct stat& st) {
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

}  // namespace

FileHomeTier::FileHomeTier(std::unique_ptr<NvmeTier> inner, const FileHomesConfig& config)
    : inner_(std::move(inner)), config_(config) {}

FileHomeTier::~FileHomeTier() {
  pool_.reset();  // every read pushed has run
  for (File& f : files_) {
    if (f.fd >= 0) close(f.fd);
  }
}

StatusOr<uint32_t> FileHomeTier::OpenFiles(const std::vector<std::string>& paths,
                                           const std::vector<uint64_t>& expected_bytes) {
  if (!files_.empty()) {
    return FailedPreconditionError(
        "nvme file homes: a tier serves one set of files in place ("
        "already " +
        files_[0].path + ")");
  }
  if (paths.size() != expected_bytes.size()) {
    return InvalidArgumentError("nvme file homes: one expected size per file");
  }
  std::vector<File> files;
  Status s;
  for (size_t i = 0; i < paths.size() && s.ok(); ++i) {
    File f;
    f.path = paths[i];
    f.fd = open(f.path.c_str(), O_RDONLY | O_CLOEXEC);
    struct stat st {};
    if (f.fd < 0 || fstat(f.fd, &st) != 0) {
      s = ErrnoToStatus(errno, "nvme file homes: opening " + f.path);
    } else if (static_cast<uint64_t>(st.st_size) != expected_bytes[i]) {
      s = InvalidArgumentError("nvme file homes: " + f.path + " is " + std::to_string(st.st_size) +
                               " bytes, its header says " + std::to_string(expected_bytes[i]));
    }
    f.bytes = static_cast<uint64_t>(st.st_size);
    f.inode = st.st_ino;
    f.mtime_ns = MtimeNs(st);
    files.push_back(f);
  }
  if (!s.ok()) {
    for (File& f : files) {
      if (f.fd >= 0) close(f.fd);
    }
    return s;
  }
  files_ = std::move(files);
  // The readers (and their staging) are opened by the first read that needs each: not while
  // the load that called this still holds its own reader's staging.
  readers_.resize(static_cast<size_t>(std::max(1, config_.threads)));
  {
    MutexLock lock(mu_);
    free_readers_.resize(readers_.size());
    std::iota(free_readers_.begin(), free_readers_.end(), 0);
  }
  pool_ = std::make_unique<WorkerPool>(static_cast<int>(readers_.size()));
  return 0;
}

StatusOr<Region> FileHomeTier::AddFileHome(Bytes bytes, std::vector<FileHomeSpan> spans) {
  if (bytes == 0) return InvalidArgumentError("nvme file homes: a home of 0 bytes");
  Bytes at = 0;
  for (const FileHomeSpan& s : spans) {
    if (s.file >= files_.size()) {
      return InvalidArgumentError("nvme file homes: no file " + std::to_string(s.file));
    }
    if (s.offset < at || s.bytes > bytes || s.offset > bytes - s.bytes ||
        s.file_offset > files_[s.file].bytes || s.bytes > files_[s.file].bytes - s.file_offset) {
      return InvalidArgumentError("nvme file homes: span of " + std::to_string(s.bytes) +
                                  " bytes at " + std::to_string(s.file_offset) + " of " +
                                  files_[s.file].path + " to region byte " +
                                  std::to_string(s.offset) + " overlaps or overruns");
    }
    at = s.offset + s.bytes;
  }
  auto home = std::make_shared<Home>();
  home->bytes = bytes;
  home->spans = std::move(spans);
  MutexLock lock(mu_);
  const uint64_t id = next_id_++;
  homes_.emplace(id, std::move(home));
  home_bytes_ += bytes;
  return Region{id, bytes, nullptr};
}

std::string FileHomeTier::file_path(uint32_t file) const {
  return file < files_.size() ? files_[file].path : "";
}

Status FileHomeTier::Free(const Region& region) {
  if (!IsFileHome(region)) return inner_->Free(region);
  MutexLock lock(mu_);
  auto it = homes_.find(region.id);
  if (it == homes_.end()) {
    return InvalidArgumentError("nvme file homes: no region " + std::to_string(region.id));
  }
  home_bytes_ -= it->second->bytes;
  homes_.erase(it);
  return OkStatus();
}

Status FileHomeTier::CheckFile(const File& f) const {
  struct stat st {};
  if (fstat(f.fd, &st) != 0) return ErrnoToStatus(errno, "nvme file homes: " + f.path);
  struct stat by_path {};
  const bool replaced = stat(f.path.c_str(), &by_path) != 0 || by_path.st_ino != f.inode;
  if (static_cast<uint64_t>(st.st_size) == f.bytes && MtimeNs(st) == f.mtime_ns && !replaced) {
    return OkStatus();
  }
  std::string what = replaced ? "was replaced or removed"
                     : static_cast<uint64_t>(st.st_size) != f.bytes
                         ? "changed size (" + std::to_string(f.bytes) + " bytes then, " +
                               std::to_string(st.st_size) + " now)"
                         : "was modified (its mtime changed)";
  return DataLossError("nvme file homes: " + f.path + ", read in place, " + what +
                       " since it was opened: its bytes are no longer the ones validated "
                       "(restart serving from the new file)");
}

Status FileHomeTier::ReadHome(const Home& home, Bytes offset, char* host, Bytes n) {
  // The spans [offset, offset + n) covers, clipped, and the gaps between them zeroed.
  std::vector<FileSpan> spans;
  std::vector<char*> dst;
  std::vector<uint8_t> touched(files_.size(), 0);
  Bytes at = offset;
  const Bytes end = offset + n;
  for (const FileHomeSpan& s : home.spans) {
    const Bytes lo = std::max(offset, s.offset), hi = std::min(end, s.offset + s.bytes);
    if (lo >= hi) continue;
    if (lo > at) std::memset(host + (at - offset), 0, lo - at);
    spans.push_back({s.file, s.file_offset + (lo - s.offset), hi - lo});
    dst.push_back(host + (lo - offset));
    touched[s.file] = 1;
    at = hi;
  }
  if (end > at) std::memset(host + (at - offset), 0, end - at);
  if (spans.empty()) return OkStatus();
  for (uint32_t f = 0; f < files_.size(); ++f) {
    if (touched[f]) TIERMEM_RETURN_IF_ERROR(CheckFile(files_[f]));
  }
  // In file order for sequential requests; the sink puts each span's bytes where they go.
  std::vector<size_t> order(spans.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::tie(spans[a].file, spans[a].offset) < std::tie(spans[b].file, spans[b].offset);
  });
  std::vector<FileSpan> sorted;
  for (size_t i : order) sorted.push_back(spans[i]);
  size_t reader = 0;
  {
    MutexLock lock(mu_);
    reader = free_readers_.back();  // as many readers as workers: one is free
    free_readers_.pop_back();
  }
  Status s;
  if (readers_[reader] == nullptr) {  // this job holds the slot: no one else touches it
    std::vector<std::string> paths;
    for (const File& f : files_) paths.push_back(f.path);
    SpanReaderConfig rc;
    rc.io_backend = config_.io_backend;
    rc.request_bytes = config_.request_bytes;
    rc.depth = config_.depth;
    StatusOr<std::unique_ptr<SpanReader>> opened = SpanReader::Open(paths, rc);
    if (opened.ok()) {
      readers_[reader] = std::move(*opened);
      MutexLock lock(mu_);
      staging_bytes_ += readers_[reader]->staging_bytes();
    } else {
      s = opened.status();
    }
  }
  SpanReader::Stats before, after;
  if (s.ok()) {
    SpanReader& r = *readers_[reader];
    before = r.stats();
    s = r.Read(sorted, [&](size_t i, uint64_t pos, const char* data, size_t k) {
      std::memcpy(dst[order[i]] + pos, data, k);
      return OkStatus();
    });
    after = r.stats();
  }
  {
    MutexLock lock(mu_);
    free_readers_.push_back(reader);
    ++reads_;
    requests_ += after.requests - before.requests;
    bytes_read_ += after.bytes_read - before.bytes_read;
  }
  TIERMEM_RETURN_IF_ERROR(s);
  // A change during the read: the bytes may mix old and new.
  for (uint32_t f = 0; f < files_.size(); ++f) {
    if (touched[f]) TIERMEM_RETURN_IF_ERROR(CheckFile(files_[f]));
  }
  return OkStatus();
}

std::shared_ptr<Completion> FileHomeTier::Copy(const CopyRequest& request) {
  if (!IsFileHome(request.region)) return inner_->Copy(request);
  std::shared_ptr<const Home> home;
  {
    MutexLock lock(mu_);
    auto it = homes_.find(request.region.id);
    if (it != homes_.end()) home = it->second;
  }
  if (home == nullptr) {
    return Completion::Done(
        InvalidArgumentError("nvme file homes: no region " + std::to_string(request.region.id)));
  }
  if (request.dir == CopyDir::kToTier) {
    const std::string file =
        home->spans.empty() ? "" : " (" + files_[home->spans[0].file].path + ")";
    return Completion::Done(
        FailedPreconditionError("nvme file homes: region " + std::to_string(request.region.id) +
                                " is a checkpoint file read in place" + file +
                                ": it is read-only and never written (serving only)"));
  }
  if (Status v = ValidateCopy(request, Region{request.region.id, home->bytes}); !v.ok()) {
    return Completion::Done(v);
  }
  auto done = Completion::Make();
  char* host = static_cast<char*>(request.host);
  const Bytes offset = request.offset, n = request.bytes;
  pool_->Push(
      [this, home, host, offset, n, done] { done->Complete(ReadHome(*home, offset, host, n)); });
  return done;
}

TierStats FileHomeTier::Stats() const {
  TierStats st = inner_->Stats();
  MutexLock lock(mu_);
  st.host_overhead += staging_bytes_;
  return st;
}

FileHomeTier::FileHomeStats FileHomeTier::file_home_stats() const {
  MutexLock lock(mu_);
  return {homes_.size(), home_bytes_, reads_, requests_, bytes_read_};
}

StatusOr<NvmeTier::FileLocation> FileHomeTier::LocateForTest(const Region& region,
                                                             Bytes offset) const {
  if (!IsFileHome(region)) return inner_->LocateForTest(region, offset);
  MutexLock lock(mu_);
  auto it = homes_.find(region.id);
  if (it == homes_.end()) return InvalidArgumentError("nvme file homes: unknown region");
  for (const FileHomeSpan& s : it->second->spans) {
    if (offset >= s.offset && offset < s.offset + s.bytes) {
      return FileLocation{files_[s.file].path, s.file_offset + (offset - s.offset)};
    }
  }
  return NotFoundError("nvme file homes: byte " + std::to_string(offset) + " is padding");
}

StatusOr<std::unique_ptr<FileHomeTier>> OpenNvmeTierWithFileHomes(const NvmeTierConfig& config) {
  TIERMEM_ASSIGN_OR_RETURN(std::unique_ptr<NvmeTier> inner, OpenNvmeTier(config));
  FileHomesConfig fc;
  fc.io_backend = config.io_backend;
  return std::make_unique<FileHomeTier>(std::move(inner), fc);
}

}  // namespace tiermem
