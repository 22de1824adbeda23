// SimStream: a simulated device compute stream, so the ordering contract of tiers/tier.h
// ("Ordering against compute") is testable without a GPU.
//
// Work enqueued on a stream runs later, in order, on the stream's own thread, each item after
// `delay_ns` of wall time — the host runs ahead of the "device" as it does ahead of a GPU, so
// a missing wait reads or writes memory at the wrong time. Record() is cudaEventRecord (a
// Completion that fires once everything enqueued before it ran); WaitFor() is
// cudaStreamWaitEvent (work enqueued later runs after `c` completes). A waited-for completion
// that fails makes the stream *broken*, like a sticky CUDA error: later work still runs (so
// fences fire and nothing hangs), and Synchronize() returns that first failure.
//
// handle() is the ComputeStream a SimDevice's ComputeOrdering takes; FromHandle() turns one
// back into the stream, or nullptr when no live SimStream has that handle.
//
// Threading: thread-safe. Ownership: the destructor runs everything already enqueued, then
// joins; a SimDevice whose regions the stream's work touches must outlive that work.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

#include "base/mutex.h"
#include "tiers/tier.h"
#include "tiers/worker_pool.h"

namespace tiermem {

class SimStream {
 public:
  explicit SimStream(uint64_t delay_ns = 0);
  ~SimStream();
  SimStream(const SimStream&) = delete;
  SimStream& operator=(const SimStream&) = delete;

  // Runs `work` on the stream's thread after the work enqueued before it (and `delay_ns`).
  void Enqueue(std::function<void()> work);
  // Completes when everything enqueued so far has run.
  std::shared_ptr<Completion> Record();
  // Work enqueued from now on runs after `c` completes.
  void WaitFor(std::shared_ptr<Completion> c);
  // Blocks until everything enqueued so far has run; the first failure of a waited-for
  // completion (the stream is broken from then on), else OK.
  Status Synchronize();

  ComputeStream handle() const { return ComputeStream{reinterpret_cast<uintptr_t>(this)}; }
  static SimStream* FromHandle(ComputeStream stream);

 private:
  const uint64_t delay_ns_;
  Mutex mu_;
  Status broken_ TIERMEM_GUARDED_BY(mu_);  // the first failed wait
  WorkerPool pool_{1};                     // last: drained and joined first
};

}  // namespace tiermem
