// FaultInjectingTier implementation.
//
// Invariants: armed faults live in Impl under mu_ and each is consumed by exactly one
// operation (the check-and-decrement happens under mu_, so two racing copies never both take
// a one-shot fault). The wrapper keeps no per-region state: regions are the inner tier's.
// A delayed completion is the wrapper's own Completion, completed by the timer thread after
// the inner one finished; the timer thread drains every pending completion before the
// destructor returns, so no completion is lost.
#include "tiers/fake/fault_injecting.h"

#include <chrono>
#include <cstring>
#include <map>
#include <thread>
#include <vector>

#include "base/mutex.h"

namespace tiermem {

// Completes completions at deadlines. Thread-safe.
class FaultInjectingTier::Timer {
 public:
  Timer() : thread_([this] { Run(); }) {}
  ~Timer() {
    {
      MutexLock lock(mu_);
      stop_ = true;
    }
    cv_.NotifyAll();
    thread_.join();
  }
  void At(std::chrono::steady_clock::time_point when, std::shared_ptr<Completion> c, Status s) {
    {
      MutexLock lock(mu_);
      pending_.emplace(when, Item{std::move(c), std::move(s)});
    }
    cv_.NotifyAll();
  }

 private:
  struct Item {
    std::shared_ptr<Completion> done;
    Status status;
  };
  void Run() {
    MutexLock lock(mu_);
    for (;;) {
      if (pending_.empty()) {
        if (stop_) return;
        cv_.Wait(lock);
        continue;
      }
      auto first = pending_.begin();
      // On stop, fire the rest at once rather than sleeping out their delays.
      if (!stop_ && std::chrono::steady_clock::now() < first->first) {
        cv_.WaitUntil(lock, first->first);
        continue;
      }
      Item item = std::move(first->second);
      pending_.erase(first);
      lock.Unlock();
      item.done->Complete(std::move(item.status));
      lock.Lock();
    }
  }

  Mutex mu_;
  CondVar cv_;
  std::multimap<std::chrono::steady_clock::time_point, Item> pending_ TIERMEM_GUARDED_BY(mu_);
  bool stop_ TIERMEM_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

struct FaultInjectingTier::Impl {
  mutable Mutex mu;
  int fail_allocs TIERMEM_GUARDED_BY(mu) = 0;
  int write_errno TIERMEM_GUARDED_BY(mu) = 0;  // 0 = not armed
  int read_errno TIERMEM_GUARDED_BY(mu) = 0;
  int64_t short_write TIERMEM_GUARDED_BY(mu) = -1;  // bytes to write; -1 = not armed
  int64_t short_read TIERMEM_GUARDED_BY(mu) = -1;
  int delay_copies TIERMEM_GUARDED_BY(mu) = 0;
  int delay_ms TIERMEM_GUARDED_BY(mu) = 0;
  uint64_t fired TIERMEM_GUARDED_BY(mu) = 0;
  Timer timer;
};

FaultInjectingTier::FaultInjectingTier(std::unique_ptr<Tier> inner)
    : inner_(std::move(inner)), impl_(std::make_unique<Impl>()) {}

// The inner tier goes first: destroying it drains its copies, whose callbacks may still hand
// delayed completions to the timer; then the timer fires whatever is pending at once.
FaultInjectingTier::~FaultInjectingTier() {
  inner_.reset();
  impl_.reset();
}

void FaultInjectingTier::FailNextAllocations(int n) {
  MutexLock lock(impl_->mu);
  impl_->fail_allocs = n;
}
void FaultInjectingTier::FailNextWrite(int err) {
  MutexLock lock(impl_->mu);
  impl_->write_errno = err;
}
void FaultInjectingTier::FailNextRead(int err) {
  MutexLock lock(impl_->mu);
  impl_->read_errno = err;
}
void FaultInjectingTier::ShortNextWrite(Bytes bytes_written) {
  MutexLock lock(impl_->mu);
  impl_->short_write = static_cast<int64_t>(bytes_written);
}
void FaultInjectingTier::ShortNextRead(Bytes bytes_read) {
  MutexLock lock(impl_->mu);
  impl_->short_read = static_cast<int64_t>(bytes_read);
}
void FaultInjectingTier::DelayNextCompletions(int copies, int delay_ms) {
  MutexLock lock(impl_->mu);
  impl_->delay_copies = copies;
  impl_->delay_ms = delay_ms;
}
void FaultInjectingTier::ClearFaults() {
  MutexLock lock(impl_->mu);
  impl_->fail_allocs = 0;
  impl_->write_errno = impl_->read_errno = 0;
  impl_->short_write = impl_->short_read = -1;
  impl_->delay_copies = 0;
}
uint64_t FaultInjectingTier::faults_fired() const {
  MutexLock lock(impl_->mu);
  return impl_->fired;
}

TierKind FaultInjectingTier::kind() const { return inner_->kind(); }
std::string FaultInjectingTier::name() const { return "fault-injecting(" + inner_->name() + ")"; }
TierStats FaultInjectingTier::Stats() const { return inner_->Stats(); }
Status FaultInjectingTier::Free(const Region& region) { return inner_->Free(region); }

StatusOr<Region> FaultInjectingTier::Allocate(Bytes bytes) {
  {
    MutexLock lock(impl_->mu);
    if (impl_->fail_allocs > 0) {
      --impl_->fail_allocs;
      ++impl_->fired;
      return ResourceExhaustedError("fault injected: allocation of " + std::to_string(bytes) +
                                    " bytes on " + inner_->name() + " refused");
    }
  }
  return inner_->Allocate(bytes);
}

std::shared_ptr<Completion> FaultInjectingTier::Copy(const CopyRequest& request) {
  const bool write = request.dir == CopyDir::kToTier;
  int err = 0;
  int64_t short_bytes = -1;
  int delay_ms = 0;
  {
    MutexLock lock(impl_->mu);
    int& armed_err = write ? impl_->write_errno : impl_->read_errno;
    int64_t& armed_short = write ? impl_->short_write : impl_->short_read;
    if (armed_err != 0) {
      err = armed_err;
      armed_err = 0;
      ++impl_->fired;
    } else if (armed_short >= 0 && static_cast<Bytes>(armed_short) < request.bytes) {
      short_bytes = armed_short;
      armed_short = -1;
      ++impl_->fired;
    }
    if (impl_->delay_copies > 0) {
      --impl_->delay_copies;
      delay_ms = impl_->delay_ms;
      ++impl_->fired;
    }
  }
  const std::string what = std::string(write ? "write" : "read") + " of " +
                           std::to_string(request.bytes) + " bytes, region " +
                           std::to_string(request.region.id) + " of " + inner_->name();
  std::shared_ptr<Completion> inner_done;
  Status override_status;  // OK = keep the inner status
  if (err != 0) {
    inner_done = Completion::Done(ErrnoToStatus(err, "fault injected: " + what));
  } else if (short_bytes >= 0) {
    CopyRequest partial = request;
    partial.bytes = static_cast<Bytes>(short_bytes);
    inner_done = inner_->Copy(partial);
    override_status = IOError(std::string("fault injected: short ") + (write ? "write" : "read") +
                              ": " + std::to_string(short_bytes) + " of " +
                              std::to_string(request.bytes) + " bytes (" + what + ")");
  } else {
    inner_done = inner_->Copy(request);
  }
  if (delay_ms == 0 && override_status.ok()) return inner_done;

  auto done = Completion::Make();
  Impl* impl = impl_.get();
  inner_done->OnDone([done, impl, delay_ms, override_status](const Status& s) {
    Status final_status = s.ok() ? override_status : s;
    if (delay_ms == 0) {
      done->Complete(std::move(final_status));
    } else {
      impl->timer.At(std::chrono::steady_clock::now() + std::chrono::milliseconds(delay_ms), done,
                     std::move(final_status));
    }
  });
  return done;
}

Status FaultInjectingTier::Corrupt(const Region& region, Bytes offset, Bytes bytes) {
  if (bytes == 0) return OkStatus();
  // Reading through the inner tier validates the region (live, in bounds) for every kind.
  std::vector<unsigned char> buf(bytes);
  TIERMEM_RETURN_IF_ERROR(
      inner_->Copy({region, offset, buf.data(), bytes, CopyDir::kFromTier})->Wait());
  {
    MutexLock lock(impl_->mu);
    ++impl_->fired;
  }
  if (inner_->kind() == TierKind::kHost && region.addr != nullptr) {
    auto* p = static_cast<unsigned char*>(region.addr) + offset;
    for (Bytes i = 0; i < bytes; ++i) p[i] ^= 0xff;
    return OkStatus();
  }
  for (auto& b : buf) b ^= 0xff;
  return inner_->Copy({region, offset, buf.data(), bytes, CopyDir::kToTier})->Wait();
}

std::unique_ptr<FaultInjectingTier> NewFaultInjectingTier(std::unique_ptr<Tier> inner) {
  return std::make_unique<FaultInjectingTier>(std::move(inner));
}

}  // namespace tiermem
