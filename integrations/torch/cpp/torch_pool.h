// The CPU optimizer kernels' tiles on torch's intra-op thread pool (kernels::ParallelFor),
// for both bindings (the Python extension and the LibTorch API).
//
// A step called from the thread that runs torch's ops uses the threads those ops just used
// instead of waking oneTBB's workers beside them: torch's libgomp workers keep spinning for a
// while after each op, so two pools on the same cores take turns (docs/kernels.md). Used only
// while both agree on the thread count (at::get_num_threads() and the kernels' cpu_threads);
// otherwise the kernels keep their own pool. Results are the same bits either way.
//
// at::parallel_for is inline: its `#pragma omp parallel` is compiled into whoever includes
// this header, which must be built with -fopenmp (integrations/torch/CMakeLists.txt); without
// it the loop silently runs on one thread (Width() tells).
//
// Threading: ForThisThread and SetEnabled may be called from any thread.
#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <mutex>
#include <set>
#include <thread>

#include "kernels/cpu/optim.h"

namespace tiermem::torch_pool {

class TorchPool final : public kernels::ParallelFor {
 public:
  void Run(size_t n, const std::function<void(size_t, size_t)>& body) const override {
    at::parallel_for(0, static_cast<int64_t>(n), 1, [&](int64_t b, int64_t e) {
      body(static_cast<size_t>(b), static_cast<size_t>(e));
    });
  }
};

inline std::atomic<bool> g_enabled{true};

// On by default; off: the kernels' own pool for every call.
inline void SetEnabled(bool on) { g_enabled.store(on, std::memory_order_relaxed); }
inline bool Enabled() { return g_enabled.load(std::memory_order_relaxed); }

// The pool for the kernel calls this thread makes now (for kernels::ScopedParallelFor):
// torch's when enabled and the thread counts agree, else null (oneTBB).
inline const kernels::ParallelFor* ForThisThread() {
  static const TorchPool pool;
  if (!Enabled()) return nullptr;
  return at::get_num_threads() == kernels::KernelThreads() ? &pool : nullptr;
}

// How many distinct threads torch's pool runs 64 tiles on (tests: the -fopenmp build).
inline size_t Width() {
  std::mutex mu;
  std::set<std::thread::id> ids;
  TorchPool().Run(64, [&](size_t, size_t) {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    std::lock_guard<std::mutex> lock(mu);
    ids.insert(std::this_thread::get_id());
  });
  return ids.size();
}

}  // namespace tiermem::torch_pool
