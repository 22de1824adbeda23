// The timeline recorder. Invariants:
//  - Each recording thread owns one ThreadBuffer per recorder, holding up to kEventsPerBlock
//    events laid out as a ready-to-write events block (16-byte block header + 8-byte prefix +
//    40-byte events), so a full buffer is written with one write(2) and no copy.
//  - A buffer's events are in that thread's recording order; blocks reach the file whole, one
//    at a time (file_mu_), so the file is always header + complete blocks + at most one torn
//    block at the end (a killed process).
//  - A label block is written before InternLabel returns its id, hence before any events block
//    that can reference it.
//  - Lock order: registry_mu_ -> ThreadBuffer::mu -> file_mu_; labels_mu_ -> file_mu_.
//  - closed_ is set before Close takes each buffer's mutex, and Record checks it under that
//    mutex, so no event is appended after its buffer's final flush.
// The first write error is sticky: later writes are skipped and Flush/Close return it.
#include "base/timeline.h"

#include <fcntl.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "base/crc32c.h"
#include "base/mutex.h"
#include "base/timeline_format.h"

namespace tiermem {
namespace {

namespace fmt = timeline_format;

constexpr size_t kEventsPerBlock = 2048;
constexpr size_t kEventsOffset = fmt::kBlockHeaderBytes + fmt::kEventsPrefixBytes;
constexpr size_t kBufferBytes = kEventsOffset + kEventsPerBlock * sizeof(Event);

void PutU32(unsigned char* p, uint32_t v) { std::memcpy(p, &v, 4); }
void PutU64(unsigned char* p, uint64_t v) { std::memcpy(p, &v, 8); }

// Fills the 16-byte block header in front of `payload_bytes` bytes of payload at p + 16.
void SealBlock(unsigned char* p, uint32_t kind, uint32_t payload_bytes) {
  PutU32(p, kind);
  PutU32(p + 4, payload_bytes);
  PutU32(p + 8, Crc32c(p + fmt::kBlockHeaderBytes, payload_bytes));
  PutU32(p + 12, Crc32c(p, 12));
}

// Each recorder gets a process-unique serial, so a thread's cache entry for a destroyed
// recorder can never match a new one allocated at the same address.
std::atomic<uint64_t> g_next_serial{1};

struct ThreadBuffer {
  Mutex mu;
  uint32_t thread_index = 0;
  size_t count TIERMEM_GUARDED_BY(mu) = 0;
  alignas(64) unsigned char data[kBufferBytes] TIERMEM_GUARDED_BY(mu);
};

// A tiny per-thread cache: recorder serial -> this thread's buffer in that recorder.
struct TlsSlot {
  uint64_t serial = 0;
  ThreadBuffer* buffer = nullptr;
};
constexpr int kTlsSlots = 4;
thread_local TlsSlot tls_slots[kTlsSlots];
thread_local int tls_next_slot = 0;

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

class FileTimelineRecorder final : public TimelineRecorder {
 public:
  FileTimelineRecorder(int fd, const Clock* clock)
      : fd_(fd), clock_(clock), serial_(g_next_serial.fetch_add(1, std::memory_order_relaxed)) {}
  ~FileTimelineRecorder() override { Close().IgnoreError(); }

  Status WriteHeader() {
    unsigned char h[fmt::kHeaderBytes] = {};
    std::memcpy(h, fmt::kMagic, 8);
    PutU32(h + 8, fmt::kVersion);
    PutU32(h + 12, fmt::kHeaderBytes);
    PutU64(h + 16, clock_->NowNs());
    timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    PutU64(h + 24, static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + ts.tv_nsec);
    PutU32(h + 32, 0);
    PutU32(h + 36, Crc32c(h, 36));
    MutexLock l(file_mu_);
    WriteLocked(h, sizeof(h));
    blocks_written_ = 0;  // the header is not a block
    return status_;
  }

  uint32_t InternLabel(std::string_view text) override {
    MutexLock l(labels_mu_);
    auto it = labels_.find(text);
    if (it != labels_.end()) return it->second;
    uint32_t id = next_label_++;
    labels_.emplace(std::string(text), id);
    if (text.size() > fmt::kMaxPayloadBytes - 4) text = text.substr(0, fmt::kMaxPayloadBytes - 4);
    std::vector<unsigned char> block(fmt::kBlockHeaderBytes + 4 + text.size());
    PutU32(block.data() + fmt::kBlockHeaderBytes, id);
    std::memcpy(block.data() + fmt::kBlockHeaderBytes + 4, text.data(), text.size());
    SealBlock(block.data(), fmt::kBlockLabel, static_cast<uint32_t>(4 + text.size()));
    MutexLock fl(file_mu_);
    if (fd_ >= 0) WriteLocked(block.data(), block.size());
    return id;
  }

  void Record(Event e) override {
    ThreadBuffer* b = BufferForThisThread();
    if (e.ts_ns == 0) e.ts_ns = clock_->NowNs();
    MutexLock l(b->mu);
    // Relaxed is enough: Close sets closed_ before taking b->mu, so b->mu orders the two.
    if (closed_.load(std::memory_order_relaxed)) return;
    std::memcpy(b->data + kEventsOffset + b->count * sizeof(Event), &e, sizeof(Event));
    if (++b->count == kEventsPerBlock) WriteBufferLocked(b);
  }

  Status Flush() override {
    MutexLock rl(registry_mu_);
    for (auto& b : buffers_) {
      MutexLock l(b->mu);
      if (b->count > 0) WriteBufferLocked(b.get());
    }
    MutexLock fl(file_mu_);
    return status_;
  }

  Status Close() override {
    MutexLock cl(close_mu_);
    if (closed_.exchange(true, std::memory_order_relaxed)) return close_status_;
    Status flushed = Flush();
    MutexLock fl(file_mu_);
    unsigned char end[fmt::kBlockHeaderBytes + 16];
    PutU64(end + fmt::kBlockHeaderBytes, events_written_);
    PutU64(end + fmt::kBlockHeaderBytes + 8, blocks_written_ + 1);
    SealBlock(end, fmt::kBlockEnd, 16);
    WriteLocked(end, sizeof(end));
    if (::close(fd_) != 0 && status_.ok()) status_ = ErrnoToStatus(errno, "timeline: close");
    fd_ = -1;
    close_status_ = status_;
    return close_status_;
  }

  const Clock* clock() const override { return clock_; }

 private:
  ThreadBuffer* BufferForThisThread() {
    for (TlsSlot& s : tls_slots) {
      if (s.serial == serial_) return s.buffer;
    }
    ThreadBuffer* b;
    {
      MutexLock l(registry_mu_);
      auto [it, inserted] = by_thread_.try_emplace(std::this_thread::get_id(), nullptr);
      if (inserted) {
        buffers_.push_back(std::make_unique<ThreadBuffer>());
        buffers_.back()->thread_index = static_cast<uint32_t>(buffers_.size() - 1);
        it->second = buffers_.back().get();
      }
      b = it->second;
    }
    tls_slots[tls_next_slot] = {serial_, b};
    tls_next_slot = (tls_next_slot + 1) % kTlsSlots;
    return b;
  }

  void WriteBufferLocked(ThreadBuffer* b) TIERMEM_REQUIRES(b->mu) {
    const uint32_t count = static_cast<uint32_t>(b->count);
    PutU32(b->data + fmt::kBlockHeaderBytes, b->thread_index);
    PutU32(b->data + fmt::kBlockHeaderBytes + 4, count);
    const uint32_t payload = static_cast<uint32_t>(fmt::kEventsPrefixBytes + count * sizeof(Event));
    SealBlock(b->data, fmt::kBlockEvents, payload);
    b->count = 0;
    MutexLock fl(file_mu_);
    if (fd_ < 0) return;
    WriteLocked(b->data, fmt::kBlockHeaderBytes + payload);
    if (status_.ok()) events_written_ += count;
  }

  // Writes the whole range or records the first error.
  void WriteLocked(const void* data, size_t n) TIERMEM_REQUIRES(file_mu_) {
    if (!status_.ok() || fd_ < 0) return;
    const auto* p = static_cast<const unsigned char*>(data);
    while (n > 0) {
      ssize_t w = ::write(fd_, p, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        status_ = ErrnoToStatus(errno, "timeline: write");
        return;
      }
      p += w;
      n -= static_cast<size_t>(w);
    }
    ++blocks_written_;
  }

  int fd_ TIERMEM_GUARDED_BY(file_mu_);  // -1 once closed
  const Clock* clock_;                   // not owned
  const uint64_t serial_;
  std::atomic<bool> closed_{false};

  Mutex close_mu_;
  Status close_status_ TIERMEM_GUARDED_BY(close_mu_);

  Mutex registry_mu_;
  std::vector<std::unique_ptr<ThreadBuffer>> buffers_ TIERMEM_GUARDED_BY(registry_mu_);
  std::unordered_map<std::thread::id, ThreadBuffer*> by_thread_ TIERMEM_GUARDED_BY(registry_mu_);

  Mutex labels_mu_;
  std::unordered_map<std::string, uint32_t, StringHash, std::equal_to<>> labels_
      TIERMEM_GUARDED_BY(labels_mu_);
  uint32_t next_label_ TIERMEM_GUARDED_BY(labels_mu_) = 1;

  Mutex file_mu_;
  Status status_ TIERMEM_GUARDED_BY(file_mu_);  // first write error
  uint64_t events_written_ TIERMEM_GUARDED_BY(file_mu_) = 0;
  uint64_t blocks_written_ TIERMEM_GUARDED_BY(file_mu_) = 0;
};

}  // namespace

StatusOr<std::unique_ptr<TimelineRecorder>> TimelineRecorder::Open(const std::string& path,
                                                                   const Clock* clock) {
  if (clock == nullptr) clock = Clock::Real();
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoToStatus(errno, "timeline: open " + path);
  auto rec = std::make_unique<FileTimelineRecorder>(fd, clock);
  TIERMEM_RETURN_IF_ERROR(rec->WriteHeader());
  return std::unique_ptr<TimelineRecorder>(std::move(rec));
}

}  // namespace tiermem
