// The pread/pwrite I/O backend: a small pool of worker threads, each taking one op at a time from a
// FIFO and transferring it with blocking calls. In-flight ops = busy workers <= pool size.
// Used where io_uring is refused (container seccomp profiles) or with nvme.engine "posix".
//
// Threading: Submit is thread-safe; prepare/complete run on the workers.
#include <unistd.h>

#include <cerrno>
#include <deque>
#include <string>
#include <thread>

#include "base/mutex.h"
#include "tiers/nvme/io_backend.h"

namespace tiermem::nvme {
namespace {

class PosixBackend final : public IoBackend {
 public:
  explicit PosixBackend(const IoBackendConfig& config) : fds_(config.fds) {
    int n = config.posix_threads > 0 ? config.posix_threads : config.queue_depth;
    if (n < 1) n = 1;
    if (n > 16 && config.posix_threads == 0) n = 16;
    for (int i = 0; i < n; ++i) workers_.emplace_back([this] { Run(); });
  }
  ~PosixBackend() override {
    {
      MutexLock lock(mu_);
      stop_ = true;
    }
    cv_.NotifyAll();
    for (auto& t : workers_) t.join();
  }

  std::string_view name() const override { return "posix"; }

  void Submit(IoOp* op) override {
    MutexLock lock(mu_);  // notify under the lock: see WorkerPool::Push
    queue_.push_back(op);
    cv_.NotifyOne();
  }

 private:
  void Run() {
    for (;;) {
      IoOp* op;
      {
        MutexLock lock(mu_);
        while (!stop_ && queue_.empty()) cv_.Wait(lock);
        if (queue_.empty()) return;  // stopping and drained
        op = queue_.front();
        queue_.pop_front();
      }
      Transfer(*op);
    }
  }

  void Transfer(IoOp& op) {
    if (!op.prepared) {
      op.prepared = true;
      if (op.prepare) op.prepare(op);
    }
    const int fd = fds_[op.file];
    while (op.done < op.len) {
      const ssize_t n = op.write
                            ? ::pwrite(fd, op.buf + op.done, op.len - op.done, op.offset + op.done)
                            : ::pread(fd, op.buf + op.done, op.len - op.done, op.offset + op.done);
      if (n < 0) {
        const int err = errno;
        if (err == EINTR || err == EAGAIN) continue;
        op.complete(op, ErrnoToStatus(err, Context(op)));
        return;
      }
      if (n == 0) {  // EOF on a read: the file is preallocated, so this is a device problem
        op.complete(op, IOError(Context(op) + ": unexpected end of file"));
        return;
      }
      op.done += static_cast<uint32_t>(n);
    }
    op.complete(op, OkStatus());
  }

  static std::string Context(const IoOp& op) {
    return std::string(op.write ? "pwrite" : "pread") + " of " + std::to_string(op.len) +
           " bytes at file " + std::to_string(op.file) + " offset " + std::to_string(op.offset);
  }

  const std::vector<int> fds_;
  Mutex mu_;
  CondVar cv_;
  std::deque<IoOp*> queue_ TIERMEM_GUARDED_BY(mu_);
  bool stop_ TIERMEM_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace

std::unique_ptr<IoBackend> NewPosixBackend(const IoBackendConfig& config) {
  return std::make_unique<PosixBackend>(config);
}

}  // namespace tiermem::nvme
