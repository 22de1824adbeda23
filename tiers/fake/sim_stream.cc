// SimStream implementation: a one-thread WorkerPool is the stream's FIFO. Live streams are
// registered in a process-wide set so that FromHandle can refuse a stale or bogus handle
// instead of dereferencing it.
#include "tiers/fake/sim_stream.h"

#include <chrono>
#include <thread>
#include <unordered_set>

namespace tiermem {
namespace {

struct Registry {
  Mutex mu;
  std::unordered_set<const SimStream*> live TIERMEM_GUARDED_BY(mu);
};

Registry& Streams() {
  static Registry registry;
  return registry;
}

}  // namespace

SimStream::SimStream(uint64_t delay_ns) : delay_ns_(delay_ns) {
  Registry& r = Streams();
  MutexLock lock(r.mu);
  r.live.insert(this);
}

SimStream::~SimStream() {
  {
    Registry& r = Streams();
    MutexLock lock(r.mu);
    r.live.erase(this);
  }
  Synchronize().IgnoreError();  // the pool drains too; this just makes it explicit
}

SimStream* SimStream::FromHandle(ComputeStream stream) {
  auto* s = reinterpret_cast<SimStream*>(stream.handle);
  Registry& r = Streams();
  MutexLock lock(r.mu);
  return r.live.count(s) != 0 ? s : nullptr;
}

void SimStream::Enqueue(std::function<void()> work) {
  pool_.Push([this, work = std::move(work)] {
    if (delay_ns_ > 0) std::this_thread::sleep_for(std::chrono::nanoseconds(delay_ns_));
    work();
  });
}

std::shared_ptr<Completion> SimStream::Record() {
  auto c = Completion::Make();
  pool_.Push([c] { c->Complete(OkStatus()); });
  return c;
}

void SimStream::WaitFor(std::shared_ptr<Completion> c) {
  if (c == nullptr) return;
  pool_.Push([this, c = std::move(c)] {
    Status s = c->Wait();
    if (!s.ok()) {
      MutexLock lock(mu_);
      if (broken_.ok()) broken_ = s.WithContext("sim stream: a waited-for copy failed");
    }
  });
}

Status SimStream::Synchronize() {
  Status s = Record()->Wait();
  MutexLock lock(mu_);
  return broken_.ok() ? s : broken_;
}

}  // namespace tiermem
