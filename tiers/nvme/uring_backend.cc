// The io_uring I/O backend. One ring, created and driven by one I/O thread (SINGLE_ISSUER and
// DEFER_TASKRUN where the kernel has them): every submission, completion, and buffer
// registration happens on that thread. Other threads hand ops over through a mutex-protected
// queue and wake the thread through an eventfd that the ring itself keeps a read posted on.
//
// The thread keeps the disk's queue full before it does any other work: it refills the slots
// that completions freed before it runs each completion's hook (the tier verifies a read
// there; see Run). Each request is submitted on its own, never in a plugged batch, so the disk
// sees the tier's pieces as they are, like fio's (see Refill).
//
// CQ overflow is impossible by construction: the SQ has queue_depth + 1 entries (the +1 is the
// eventfd read), at most that many requests are ever in flight, and the CQ is twice the SQ.
//
// Fixed files and fixed buffers are used when the kernel accepts them; the fixed-buffer table
// is sparse: slot 0 holds the tier's bounce pool, further slots the host memory registered
// through RegisterHostMemory (split into <= 1 GiB pieces, the kernel's per-buffer limit). An op
// whose buffer lies inside a registered range is issued as READ_FIXED / WRITE_FIXED.
// Registration refused (RLIMIT_MEMLOCK without CAP_IPC_LOCK): unregistered, logged once.
//
// Threading: Submit / RegisterHostMemory / UnregisterHostMemory are thread-safe; everything
// named *_ below that is not TIERMEM_GUARDED_BY(mu_) is owned by the I/O thread.
#include <liburing.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <deque>
#include <future>
#include <map>
#include <string>
#include <thread>

#include "base/logging.h"
#include "base/mutex.h"
#include "tiers/nvme/io_backend.h"

namespace tiermem::nvme {
namespace {

constexpr unsigned kBufferSlots = 1024;  // sparse fixed-buffer table size (64 GiB of 64 MiB slabs)
constexpr Bytes kMaxFixedBuffer = 1 * kGiB;  // kernel limit per registered buffer

Status Refused(int err, std::string_view what) {
  Status s = ErrnoToStatus(err, what);
  if (err == EPERM || err == ENOSYS || err == EACCES) return UnavailableError(s.message());
  return s;
}

class UringBackend final : public IoBackend {
 public:
  explicit UringBackend(const IoBackendConfig& config) : config_(config) {}

  ~UringBackend() override {
    if (!thread_.joinable()) return;
    {
      MutexLock lock(mu_);
      stop_ = true;
    }
    Wake();
    thread_.join();
    ::close(event_fd_);
  }

  // Starts the I/O thread and returns the ring set-up status.
  Status Start() {
    std::promise<Status> setup;
    std::future<Status> result = setup.get_future();
    thread_ = std::thread([this, &setup] { Run(&setup); });
    Status s = result.get();
    if (!s.ok()) thread_.join();
    return s;
  }

  std::string_view name() const override { return "io_uring"; }
  bool buffers_registered() const override { return buffers_registered_; }

  void Submit(IoOp* op) override {
    if (std::this_thread::get_id() == thread_id_) {
      local_.push_back(op);
      return;
    }
    bool wake;
    {
      MutexLock lock(mu_);
      queue_.push_back(op);
      wake = !wake_posted_;
      wake_posted_ = true;
    }
    if (wake) Wake();
  }

  Status RegisterHostMemory(void* addr, Bytes bytes) override {
    return OnIoThread([this, addr, bytes] { return DoRegister(addr, bytes); });
  }
  Status UnregisterHostMemory(void* addr) override {
    return OnIoThread([this, addr] { return DoUnregister(addr); });
  }

 private:
  struct FixedBuffer {
    Bytes bytes;
    int slot;
  };

  void Wake() {
    const uint64_t one = 1;
    ssize_t n;
    do {
      n = ::write(event_fd_, &one, sizeof(one));
    } while (n < 0 && errno == EINTR);
  }

  // Runs `fn` on the I/O thread and returns its result.
  Status OnIoThread(std::function<Status()> fn) {
    if (std::this_thread::get_id() == thread_id_) return fn();
    std::promise<Status> done;
    std::future<Status> result = done.get_future();
    {
      MutexLock lock(mu_);
      control_.push_back([&] { done.set_value(fn()); });
      wake_posted_ = true;
    }
    Wake();
    return result.get();
  }

  Status SetUp() {
    event_fd_ = ::eventfd(0, EFD_CLOEXEC);
    if (event_fd_ < 0) return ErrnoToStatus(errno, "eventfd");
    const unsigned entries = static_cast<unsigned>(config_.queue_depth) + 1;
    io_uring_params p{};
    p.flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN | IORING_SETUP_CQSIZE;
    p.cq_entries = 2 * entries;
    int ret = io_uring_queue_init_params(entries, &ring_, &p);
    if (ret == -EINVAL) {  // an older kernel without SINGLE_ISSUER / DEFER_TASKRUN
      p = io_uring_params{};
      p.flags = IORING_SETUP_CQSIZE;
      p.cq_entries = 2 * entries;
      ret = io_uring_queue_init_params(entries, &ring_, &p);
    }
    if (ret < 0) return Refused(-ret, "io_uring_queue_init");
    ring_ok_ = true;
    if (p.sq_entries < entries || p.cq_entries < p.sq_entries) {
      return InternalError("io_uring: ring smaller than asked (" + std::to_string(p.sq_entries) +
                           " SQ entries for a depth of " + std::to_string(config_.queue_depth) +
                           ")");
    }
    if (config_.register_files && !config_.fds.empty()) {
      ret = io_uring_register_files(&ring_, config_.fds.data(),
                                    static_cast<unsigned>(config_.fds.size()));
      if (ret == 0) {
        fixed_files_ = true;
      } else {
        LogOnce(LogLevel::kWarn, "nvme: fixed files refused",
                "nvme tier: io_uring refused fixed files (" +
                    ErrnoToStatus(-ret, "register").message() + "); using plain file descriptors");
      }
    }
    if (config_.register_buffers) {
      ret = io_uring_register_buffers_sparse(&ring_, kBufferSlots);
      if (ret == 0) {
        sparse_table_ = true;
        for (int s = kBufferSlots - 1; s >= 1; --s) free_slots_.push_back(s);
        if (config_.bounce != nullptr && config_.bounce_bytes > 0 &&
            config_.bounce_bytes <= kMaxFixedBuffer) {
          iovec iov{config_.bounce, config_.bounce_bytes};
          ret = io_uring_register_buffers_update_tag(&ring_, 0, &iov, nullptr, 1);
          if (ret >= 0) {
            fixed_.emplace(reinterpret_cast<uintptr_t>(config_.bounce),
                           FixedBuffer{config_.bounce_bytes, 0});
            buffers_registered_ = true;
          } else {
            sparse_table_ = false;  // refused once: no fixed buffers for this ring
          }
        }
      }
      if (ret < 0) {
        LogOnce(LogLevel::kWarn, "nvme: fixed buffers refused",
                "nvme tier: io_uring refused registered buffers (" +
                    ErrnoToStatus(-ret, "register_buffers").message() +
                    "; RLIMIT_MEMLOCK too low?); using unregistered buffers");
      }
    }
    return OkStatus();
  }

  Status DoRegister(void* addr, Bytes bytes) {
    if (!sparse_table_) {
      return UnavailableError("nvme tier: io_uring registered buffers are unavailable");
    }
    const uintptr_t base = reinterpret_cast<uintptr_t>(addr);
    if (host_groups_.count(base)) {
      return AlreadyExistsError("nvme tier: host memory at " + std::to_string(base) +
                                " is already registered");
    }
    std::vector<int> slots;
    for (Bytes off = 0; off < bytes; off += kMaxFixedBuffer) {
      const Bytes len = std::min(kMaxFixedBuffer, bytes - off);
      if (free_slots_.empty()) {
        ReleaseSlots(slots);
        return ResourceExhaustedError("nvme tier: all " + std::to_string(kBufferSlots) +
                                      " io_uring buffer slots are in use");
      }
      const int slot = free_slots_.back();
      iovec iov{static_cast<char*>(addr) + off, len};
      const int ret = io_uring_register_buffers_update_tag(&ring_, slot, &iov, nullptr, 1);
      if (ret < 0) {
        ReleaseSlots(slots);
        return ErrnoToStatus(-ret, "nvme tier: registering " + std::to_string(bytes) +
                                       " bytes of host memory with io_uring");
      }
      free_slots_.pop_back();
      slots.push_back(slot);
      fixed_.emplace(base + off, FixedBuffer{len, slot});
    }
    host_groups_.emplace(base, std::move(slots));
    return OkStatus();
  }

  Status DoUnregister(void* addr) {
    auto it = host_groups_.find(reinterpret_cast<uintptr_t>(addr));
    if (it == host_groups_.end()) {
      return NotFoundError("nvme tier: host memory at " +
                           std::to_string(reinterpret_cast<uintptr_t>(addr)) +
                           " is not registered");
    }
    ReleaseSlots(it->second);
    host_groups_.erase(it);
    return OkStatus();
  }

  void ReleaseSlots(const std::vector<int>& slots) {
    for (int slot : slots) {
      iovec empty{nullptr, 0};
      (void)io_uring_register_buffers_update_tag(&ring_, slot, &empty, nullptr, 1);
      for (auto f = fixed_.begin(); f != fixed_.end(); ++f) {
        if (f->second.slot == slot) {
          fixed_.erase(f);
          break;
        }
      }
      free_slots_.push_back(slot);
    }
  }

  // Fixed-buffer slot containing [buf, buf + len), or -1.
  int FindFixed(const char* buf, uint32_t len) const {
    if (fixed_.empty()) return -1;
    const uintptr_t p = reinterpret_cast<uintptr_t>(buf);
    auto it = fixed_.upper_bound(p);
    if (it == fixed_.begin()) return -1;
    --it;
    if (p + len <= it->first + it->second.bytes) return it->second.slot;
    return -1;
  }

  void ArmWake() {
    io_uring_sqe* sqe = GetSqe();
    io_uring_prep_read(sqe, event_fd_, &wake_counter_, sizeof(wake_counter_), 0);
    io_uring_sqe_set_data(sqe, nullptr);  // nullptr tags the eventfd read
  }

  io_uring_sqe* GetSqe() {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    while (sqe == nullptr) {  // cannot happen with the accounting above; flush and retry
      io_uring_submit(&ring_);
      sqe = io_uring_get_sqe(&ring_);
    }
    return sqe;
  }

  // Prepares `op` (its `prepare` hook, once) and queues its SQE; false when there is nothing
  // left to transfer (the op completed here).
  bool Issue(IoOp* op) {
    if (!op->prepared) {
      op->prepared = true;
      if (op->prepare) op->prepare(*op);
    }
    if (op->done >= op->len) {
      op->complete(*op, OkStatus());
      return false;
    }
    io_uring_sqe* sqe = GetSqe();
    char* buf = op->buf + op->done;
    const uint32_t n = op->len - op->done;
    const uint64_t off = op->offset + op->done;
    const int fd = fixed_files_ ? op->file : config_.fds[op->file];
    const int slot = FindFixed(buf, n);
    if (op->write) {
      if (slot >= 0) {
        io_uring_prep_write_fixed(sqe, fd, buf, n, off, slot);
      } else {
        io_uring_prep_write(sqe, fd, buf, n, off);
      }
    } else {
      if (slot >= 0) {
        io_uring_prep_read_fixed(sqe, fd, buf, n, off, slot);
      } else {
        io_uring_prep_read(sqe, fd, buf, n, off);
      }
    }
    if (fixed_files_) sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data(sqe, op);
    ++in_flight_;
    return true;
  }

  // Issues queued ops while fewer than queue_depth are in flight. Each goes to the kernel on
  // its own, as fio's default does (iodepth_batch_submit=1): the kernel plugs a submission of
  // more than two SQEs, and the block layer then merges adjacent pieces into larger requests,
  // fewer of them in flight (measured: 1 MiB pieces became 1.6-2.7 MiB requests).
  void Refill() {
    while (in_flight_ < config_.queue_depth && !local_.empty()) {
      IoOp* op = local_.front();
      local_.pop_front();
      if (Issue(op)) io_uring_submit(&ring_);
    }
  }

  // Moves ops other threads submitted into local_.
  void TakeSubmitted() {
    MutexLock lock(mu_);
    while (!queue_.empty()) {
      local_.push_back(queue_.front());
      queue_.pop_front();
    }
  }

  // Takes every CQE. Ops to retry (EINTR/EAGAIN) or to continue (a short transfer) go back to
  // the front of local_; the others land in `finished` with their result, to be completed
  // once the disk's queue is refilled. Returns whether the eventfd read completed.
  bool Reap(std::vector<std::pair<IoOp*, int>>* finished) {
    unsigned head;
    unsigned seen = 0;
    io_uring_cqe* cqe;
    bool woken = false;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      ++seen;
      auto* op = static_cast<IoOp*>(io_uring_cqe_get_data(cqe));
      if (op == nullptr) {
        woken = true;
        continue;
      }
      --in_flight_;
      const int res = cqe->res;
      if (res == -EINTR || res == -EAGAIN) {
        local_.push_front(op);
      } else if (res > 0 && op->done + static_cast<uint32_t>(res) < op->len) {
        op->done += static_cast<uint32_t>(res);
        local_.push_front(op);  // short transfer: resubmit the remainder first
      } else {
        finished->emplace_back(op, res);
      }
    }
    io_uring_cq_advance(&ring_, seen);
    return woken;
  }

  // Completes a reaped op (its `complete` hook: for a read, the tier's verification).
  void Complete(IoOp* op, int res) {
    if (res < 0) {
      op->complete(*op, ErrnoToStatus(-res, Context(*op)));
    } else if (res == 0) {
      op->complete(*op, IOError(Context(*op) + ": no progress (unexpected end of file)"));
    } else {
      op->done += static_cast<uint32_t>(res);
      op->complete(*op, OkStatus());
    }
  }

  static std::string Context(const IoOp& op) {
    return std::string("io_uring ") + (op.write ? "write" : "read") + " of " +
           std::to_string(op.len - op.done) + " bytes at file " + std::to_string(op.file) +
           " offset " + std::to_string(op.offset + op.done);
  }

  // The I/O thread. Each turn: take submitted ops and control calls, fill the queue, wait for
  // a completion and reap every CQE; then, before each completion's work (a read's
  // verification), take the ops submitted meanwhile and refill the queue, so the disk has
  // queue_depth requests while this thread computes and a waiting op waits for one
  // completion's work at most.
  void Run(std::promise<Status>* setup) {
    thread_id_ = std::this_thread::get_id();
    Status s = SetUp();
    if (!s.ok()) {
      if (ring_ok_) io_uring_queue_exit(&ring_);
      if (event_fd_ >= 0) ::close(event_fd_);
      event_fd_ = -1;
      setup->set_value(s);
      return;
    }
    setup->set_value(OkStatus());
    ArmWake();
    std::vector<std::pair<IoOp*, int>> finished;
    for (;;) {
      std::deque<std::function<void()>> control;
      bool stop;
      {
        MutexLock lock(mu_);
        wake_posted_ = false;
        while (!queue_.empty()) {
          local_.push_back(queue_.front());
          queue_.pop_front();
        }
        control.swap(control_);
        stop = stop_;
      }
      for (auto& fn : control) fn();
      Refill();
      if (stop && in_flight_ == 0 && local_.empty()) {
        MutexLock lock(mu_);
        if (queue_.empty() && control_.empty()) break;
        continue;
      }
      int ret = io_uring_submit_and_wait(&ring_, 1);
      if (ret < 0 && ret != -EINTR && ret != -EAGAIN && ret != -EBUSY) {
        TIERMEM_LOG(kError) << ErrnoToStatus(-ret, "io_uring_submit_and_wait").ToString();
      }
      finished.clear();
      if (Reap(&finished)) ArmWake();
      for (auto& [op, res] : finished) {
        TakeSubmitted();
        Refill();
        Complete(op, res);
      }
    }
    // Drop the ring's file references now: the ring itself is torn down asynchronously by
    // the kernel, and the unlinked files' space should be free when the tier is gone.
    if (fixed_files_) (void)io_uring_unregister_files(&ring_);
    if (sparse_table_ || buffers_registered_) (void)io_uring_unregister_buffers(&ring_);
    io_uring_queue_exit(&ring_);
  }

  const IoBackendConfig config_;
  std::thread thread_;
  std::thread::id thread_id_;  // set by the I/O thread before the set-up promise is fulfilled
  int event_fd_ = -1;
  uint64_t wake_counter_ = 0;  // the eventfd read's target; written by the kernel

  Mutex mu_;
  std::deque<IoOp*> queue_ TIERMEM_GUARDED_BY(mu_);
  std::deque<std::function<void()>> control_ TIERMEM_GUARDED_BY(mu_);
  bool wake_posted_ TIERMEM_GUARDED_BY(mu_) = false;
  bool stop_ TIERMEM_GUARDED_BY(mu_) = false;

  // Owned by the I/O thread.
  io_uring ring_{};
  bool ring_ok_ = false;
  bool fixed_files_ = false;
  bool sparse_table_ = false;
  bool buffers_registered_ = false;  // written before the set-up promise, read-only after
  std::deque<IoOp*> local_;
  int in_flight_ = 0;
  std::map<uintptr_t, FixedBuffer> fixed_;             // start address -> registered range
  std::map<uintptr_t, std::vector<int>> host_groups_;  // RegisterHostMemory base -> slots
  std::vector<int> free_slots_;
};

// One probe per process: can this process create a ring at all?
Status ProbeOnce() {
  static const Status probed = [] {
    io_uring ring;
    const int ret = io_uring_queue_init(2, &ring, 0);
    if (ret < 0) return Refused(-ret, "io_uring_queue_init (probe)");
    io_uring_queue_exit(&ring);
    return OkStatus();
  }();
  return probed;
}

}  // namespace

StatusOr<std::unique_ptr<IoBackend>> NewUringBackend(const IoBackendConfig& config) {
  TIERMEM_RETURN_IF_ERROR(ProbeOnce());
  auto backend = std::make_unique<UringBackend>(config);
  TIERMEM_RETURN_IF_ERROR(backend->Start());
  return std::unique_ptr<IoBackend>(std::move(backend));
}

}  // namespace tiermem::nvme
