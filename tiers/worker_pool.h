// WorkerPool: a FIFO of jobs served by a fixed set of threads (the host tier's memcpy workers,
// the mover's host<->host lanes, SimDevice's copy lanes, the NVMe tier's checksum workers). With
// one thread, jobs run in submission order. Threading: thread-safe. The destructor runs every job
// already pushed, then joins.
#pragma once

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "base/mutex.h"

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
      MutexLock lock(mu_);
      stop_ = true;
    }
    cv_.NotifyAll();
    for (auto& t : threads_) t.join();
  }

  void Push(std::function<void()> job) {
    // Notified under the lock: a job may complete the last copy of a tier and let its owner
    // destroy this pool while the pushing thread would otherwise still be notifying.
    MutexLock lock(mu_);
    jobs_.push_back(std::move(job));
    cv_.NotifyOne();
  }

 private:
  void Run() {
    for (;;) {
      std::function<void()> job;
      {
        MutexLock lock(mu_);
        while (!stop_ && jobs_.empty()) cv_.Wait(lock);
        if (jobs_.empty()) return;  // stopping and drained
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }

  Mutex mu_;
  CondVar cv_;
  std::deque<std::function<void()>> jobs_ TIERMEM_GUARDED_BY(mu_);
  bool stop_ TIERMEM_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;  // last: started once the fields above exist
};

}  // namespace tiermem
