// SpanReader (see span_reader.h).
//
// A Read is a sequence of windows: aligned file ranges of at most request_bytes, each carrying
// the parts of spans it covers. Window i uses staging slot i % depth; windows are issued up to
// `depth` ahead of the one being delivered, and slot i % depth is issued again only after
// window i was delivered, so a slot's bytes are never overwritten while the sink reads them.
// A window is one or two backend ops: the O_DIRECT part up to the file's last full block, and
// a buffered read of the bytes past it (an O_DIRECT read across the end of a file comes back
// short, which the backends treat as an error). Each slot counts its ops still in flight; the
// completion of the last one wakes the reader. A Read returns only when no op it issued is in
// flight, also on error.
#include "tiers/nvme/span_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>

#include "base/logging.h"
#include "base/mutex.h"
#include "tiers/nvme/io_backend.h"

namespace tiermem {
namespace {

constexpr uint64_t kAlign = 4096;

uint64_t AlignDown(uint64_t n) { return n / kAlign * kAlign; }

}  // namespace

struct SpanReader::Window {
  struct Part {
    size_t span = 0;
    uint64_t at = 0;      // byte of the span
    uint64_t offset = 0;  // byte of the window
    uint64_t n = 0;
  };
  uint32_t file = 0;
  uint64_t start = 0;  // block-aligned file offset of the slot's first byte
  uint64_t end = 0;    // file offset past the last byte a part needs
  std::vector<Part> parts;
};

// Per staging slot: its ops (written by Issue before they are submitted, then by the backend
// until they complete), the ops still in flight and the first error.
struct SpanReader::Slots {
  explicit Slots(size_t n) : ops(n), pending(n, 0), status(n) {}
  std::vector<std::array<nvme::IoOp, 2>> ops;  // sized once: the backend holds their addresses
  Mutex mu;
  CondVar cv;
  std::vector<int> pending TIERMEM_GUARDED_BY(mu);
  std::vector<Status> status TIERMEM_GUARDED_BY(mu);
};

SpanReader::SpanReader() = default;

SpanReader::~SpanReader() {
  backend_.reset();  // waits for every op in flight before the buffers and files go
  for (File& f : files_) {
    if (f.fd >= 0) close(f.fd);
    if (f.buffered_fd >= 0 && f.buffered_fd != f.fd) close(f.buffered_fd);
  }
  std::free(staging_);
}

StatusOr<std::unique_ptr<SpanReader>> SpanReader::Open(const std::vector<std::string>& paths,
                                                       const SpanReaderConfig& config) {
  if (config.request_bytes < 64 * kKiB || config.request_bytes > 1 * kGiB ||
      config.request_bytes % kAlign != 0 || config.depth < 1 || config.depth > 256) {
    return InvalidArgumentError(
        "span reader: request_bytes must be a multiple of 4096 in [64 KiB, 1 GiB] and depth in "
        "1..256");
  }
  std::unique_ptr<SpanReader> r(new SpanReader());
  r->config_ = config;
  for (const std::string& path : paths) {
    File f;
    f.path = path;
    f.fd = config.direct_io ? open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT) : -1;
    f.direct = f.fd >= 0;
    if (config.direct_io && !f.direct && errno == EINVAL) {
      LogOnce(LogLevel::kWarn, "span reader: no O_DIRECT",
              "reading " + path +
                  ": the file system refuses O_DIRECT; reading through the page "
                  "cache");
    }
    f.buffered_fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (f.buffered_fd < 0) {
      const int err = errno;
      if (f.fd >= 0) close(f.fd);
      return ErrnoToStatus(err, "opening " + path);
    }
    if (!f.direct) f.fd = f.buffered_fd;
    struct stat st;
    const int rc = fstat(f.buffered_fd, &st);
    f.bytes = rc == 0 ? static_cast<uint64_t>(st.st_size) : 0;
    r->files_.push_back(f);  // the destructor closes it from here on
    if (rc != 0) return ErrnoToStatus(errno, "stat " + path);
  }
  r->staging_bytes_ = config.request_bytes * static_cast<Bytes>(config.depth);
  r->staging_ = static_cast<char*>(std::aligned_alloc(kAlign, r->staging_bytes_));
  if (r->staging_ == nullptr) {
    return ResourceExhaustedError("span reader: no memory for " +
                                  std::to_string(r->staging_bytes_) + " bytes of staging");
  }
  r->slots_ = std::make_unique<Slots>(static_cast<size_t>(config.depth));
  nvme::IoBackendConfig ec;
  for (const File& f : r->files_) {
    ec.fds.push_back(f.fd);
    ec.fds.push_back(f.buffered_fd);
  }
  ec.queue_depth = 2 * config.depth;  // a window is at most two ops
  ec.posix_threads = config.depth;
  ec.register_buffers = config.register_buffers;
  ec.bounce = r->staging_;
  ec.bounce_bytes = r->staging_bytes_;
  if (config.io_backend != NvmeIoBackend::kPosix) {
    StatusOr<std::unique_ptr<nvme::IoBackend>> uring = nvme::NewUringBackend(ec);
    if (uring.ok()) {
      r->backend_ = std::move(uring).value();
    } else if (config.io_backend == NvmeIoBackend::kIoUring) {
      return uring.status().WithContext("span reader (engine=io_uring)");
    } else {
      LogOnce(LogLevel::kWarn, "span reader: io_uring refused",
              "span reader: io_uring unavailable (" + uring.status().ToString() +
                  "); reading with pread");
    }
  }
  if (r->backend_ == nullptr) r->backend_ = nvme::NewPosixBackend(ec);
  return r;
}

std::string_view SpanReader::io_backend() const { return backend_->name(); }

std::vector<SpanReader::Window> SpanReader::Plan(const std::vector<FileSpan>& spans) const {
  std::vector<Window> out;
  const uint64_t r = config_.request_bytes;
  for (size_t i = 0; i < spans.size(); ++i) {
    const FileSpan& s = spans[i];
    uint64_t pos = s.offset;
    const uint64_t end = s.offset + s.bytes;
    while (pos < end) {
      Window* w = out.empty() ? nullptr : &out.back();
      const bool joins = w != nullptr && w->file == s.file && pos >= w->end &&
                         pos - w->end <= config_.max_gap_bytes && pos < w->start + r;
      if (!joins) {
        out.push_back(Window{s.file, AlignDown(pos), pos, {}});
        w = &out.back();
      }
      const uint64_t n = std::min(end, w->start + r) - pos;
      w->parts.push_back({i, pos - s.offset, pos - w->start, n});
      w->end = pos + n;
      pos += n;
    }
  }
  return out;
}

void SpanReader::Issue(const Window& w, size_t slot) {
  const File& f = files_[w.file];
  char* buf = staging_ + slot * config_.request_bytes;
  // The O_DIRECT part ends on a block boundary, at most at the file's last full block; the
  // rest (if any) is read buffered, exactly.
  const uint64_t direct_end =
      f.direct ? std::min(AlignUp(w.end, kAlign), AlignDown(f.bytes)) : w.start;
  struct Piece {
    int fd;
    uint64_t offset, len;
  };
  Piece pieces[2];
  int n = 0;
  if (direct_end > w.start) {
    pieces[n++] = {static_cast<int>(2 * w.file), w.start, direct_end - w.start};
  }
  const uint64_t rest = std::max(direct_end, w.start);
  if (w.end > rest) pieces[n++] = {static_cast<int>(2 * w.file + 1), rest, w.end - rest};
  {
    MutexLock lock(slots_->mu);
    slots_->pending[slot] = n;
    slots_->status[slot] = OkStatus();
  }
  for (int k = 0; k < n; ++k) {
    nvme::IoOp& op = slots_->ops[slot][k];
    op = nvme::IoOp{};
    op.file = pieces[k].fd;
    op.offset = pieces[k].offset;
    op.buf = buf + (pieces[k].offset - w.start);
    op.len = static_cast<uint32_t>(pieces[k].len);
    op.complete = [this, slot, path = &f.path](nvme::IoOp&, Status s) {
      MutexLock lock(slots_->mu);
      if (!s.ok() && slots_->status[slot].ok()) {
        slots_->status[slot] = s.WithContext("reading " + *path);
      }
      if (--slots_->pending[slot] == 0) slots_->cv.NotifyAll();
    };
    ++stats_.requests;
    stats_.bytes_read += pieces[k].len;
  }
  for (int k = 0; k < n; ++k) backend_->Submit(&slots_->ops[slot][k]);
}

Status SpanReader::Wait(size_t slot) {
  MutexLock lock(slots_->mu);
  while (slots_->pending[slot] > 0) slots_->cv.Wait(lock);
  return slots_->status[slot];
}

Status SpanReader::Read(const std::vector<FileSpan>& spans, const Sink& sink) {
  for (size_t i = 0; i < spans.size(); ++i) {
    const FileSpan& s = spans[i];
    if (s.file >= files_.size() || s.offset + s.bytes > files_[s.file].bytes ||
        s.offset + s.bytes < s.offset) {
      return InvalidArgumentError(
          "span reader: span " + std::to_string(i) + " (" + std::to_string(s.bytes) + " bytes at " +
          std::to_string(s.offset) + ") is outside " +
          (s.file < files_.size()
               ? files_[s.file].path + " (" + std::to_string(files_[s.file].bytes) + " bytes)"
               : "the files given"));
    }
  }
  const std::vector<Window> windows = Plan(spans);
  const size_t depth = static_cast<size_t>(config_.depth);
  size_t issued = 0;
  Status s;
  for (size_t i = 0; i < windows.size() && s.ok(); ++i) {
    while (issued < windows.size() && issued < i + depth) {
      Issue(windows[issued], issued % depth);
      ++issued;
    }
    s = Wait(i % depth);
    const char* buf = staging_ + (i % depth) * config_.request_bytes;
    for (const Window::Part& p : windows[i].parts) {
      if (!s.ok()) break;
      s = sink(p.span, p.at, buf + p.offset, static_cast<size_t>(p.n));
    }
  }
  for (size_t i = 0; i < issued; ++i) Wait(i % depth).IgnoreError();  // none left in flight
  return s;
}

}  // namespace tiermem
