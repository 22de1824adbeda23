// WorkerPool: a FIFO of jobs served by a fixed set of threads (the host tier's memcpy workers,
// the mover's host<->host lanes, SimDevice's copy lanes, the NVMe tier's checksum workers). With one thread, jobs run in submission order.
// Threading: thread-safe. The destructor runs every job already pushed, then joins.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tiermem {

class WorkerPool {
 public:
  explicit WorkerPool(int threads) {
    for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Run(); });
  }
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;
  ~WorkerPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  void Push(std::function<void()> job) {
    // Notified under the lock: a job may complete the last copy of a tier and let its owner
    // destroy this pool while the pushing thread would otherwise still be notifying.
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(std::move(job));
    cv_.notify_one();
  }

 private:
  void Run() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stop_ || !jobs_.empty(); });
        if (jobs_.empty()) return;  // stopping and drained
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;  // GUARDED_BY(mu_)
  bool stop_ = false;                       // GUARDED_BY(mu_)
  std::vector<std::thread> threads_;        // last: started once the fields above exist
};

}  // namespace tiermem
