// Mutex, MutexLock and CondVar: std::mutex and std::condition_variable with the thread-safety
// annotations of base/thread_annotations.h, so that clang -Wthread-safety checks every
// TIERMEM_GUARDED_BY member against the locks actually held. Same cost as the std types: each
// is a thin inline wrapper around one of them.
//
//   Mutex       a capability ("mutex"): what TIERMEM_GUARDED_BY names. Thread-safe.
//   MutexLock   holds a Mutex for its scope (std::lock_guard); Unlock() / Lock() drop and
//               retake it mid-scope where one must (the analysis follows both). Owned by the
//               thread that made it.
//   CondVar     waits with a MutexLock held (std::condition_variable). Thread-safe. There is
//               no predicate overload: write `while (!ready_) cv_.Wait(lock);` in the function
//               that holds the lock, so the analysis sees `ready_` read under it.
//
// Compiles as C++17 too (tiers/tier.h is included by CUDA sources).
#pragma once

#include <cassert>
#include <chrono>
#include <condition_variable>
#include <mutex>

#include "base/thread_annotations.h"

namespace tiermem {

class CondVar;

class TIERMEM_CAPABILITY("mutex") Mutex {
 public:
  constexpr Mutex() noexcept = default;  // constant-initialized as a global, like std::mutex
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() TIERMEM_ACQUIRE() { mu_.lock(); }
  void Unlock() TIERMEM_RELEASE() { mu_.unlock(); }

 private:
  friend class CondVar;
  std::mutex mu_;
};

class TIERMEM_SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) TIERMEM_ACQUIRE(mu) : mu_(mu) { mu_.Lock(); }
  ~MutexLock() TIERMEM_RELEASE() {
    if (locked_) mu_.Unlock();
  }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

  // Drops the mutex until Lock(); the destructor then releases only what is held.
  void Unlock() TIERMEM_RELEASE() {
    assert(locked_);
    mu_.Unlock();
    locked_ = false;
  }
  void Lock() TIERMEM_ACQUIRE() {
    assert(!locked_);
    mu_.Lock();
    locked_ = true;
  }

 private:
  friend class CondVar;
  Mutex& mu_;
  bool locked_ = true;
};

class CondVar {
 public:
  CondVar() = default;
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  // Releases the lock's mutex, blocks until notified (or spuriously), retakes it. The lock
  // must be held; it is held again on return.
  void Wait(MutexLock& lock) {
    std::unique_lock<std::mutex> native = Adopt(lock);
    cv_.wait(native);
    native.release();  // the MutexLock owns the mutex again
  }
  // As Wait, but also returns at `deadline`: std::cv_status::timeout if it passed.
  std::cv_status WaitUntil(MutexLock& lock, std::chrono::steady_clock::time_point deadline) {
    std::unique_lock<std::mutex> native = Adopt(lock);
    const std::cv_status status = cv_.wait_until(native, deadline);
    native.release();
    return status;
  }

  void NotifyOne() noexcept { cv_.notify_one(); }
  void NotifyAll() noexcept { cv_.notify_all(); }

 private:
  // A unique_lock over the held std::mutex without locking it again, so the wait runs on
  // std::condition_variable itself (not the slower condition_variable_any).
  static std::unique_lock<std::mutex> Adopt(MutexLock& lock) {
    assert(lock.locked_);
    return std::unique_lock<std::mutex>(lock.mu_.mu_, std::adopt_lock);
  }

  std::condition_variable cv_;
};

}  // namespace tiermem
