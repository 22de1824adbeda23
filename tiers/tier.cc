#include "tiers/tier.h"

namespace tiermem {

std::shared_ptr<Completion> Completion::Done(Status s) {
  auto c = Make();
  c->Complete(std::move(s));
  return c;
}

void Completion::Complete(Status s) {
  std::vector<std::function<void(const Status&)>> callbacks;
  {
    MutexLock lock(mu_);
    if (done_) return;  // a bug in the caller; keep the first status
    status_ = std::move(s);
    done_ = true;
    callbacks.swap(callbacks_);
  }
  cv_.NotifyAll();
  // status_ is immutable once done_, so reading it unlocked here is safe.
  for (auto& fn : callbacks) fn(final_status());
}

bool Completion::Poll() const {
  MutexLock lock(mu_);
  return done_;
}

Status Completion::Wait() const {
  MutexLock lock(mu_);
  while (!done_) cv_.Wait(lock);
  return status_;
}

void Completion::OnDone(std::function<void(const Status&)> fn) {
  {
    MutexLock lock(mu_);
    if (!done_) {
      callbacks_.push_back(std::move(fn));
      return;
    }
  }
  fn(final_status());
}

Status WaitAll(const std::vector<std::shared_ptr<Completion>>& completions) {
  Status first;
  for (const auto& c : completions) {
    Status s = c->Wait();
    if (first.ok() && !s.ok()) first = s;
  }
  return first;
}

Status BudgetAccount::Reserve(Bytes bytes, std::string_view tier_name) {
  MutexLock lock(mu_);
  if (bytes > capacity_ - used_) {
    return ResourceExhaustedError(std::string(tier_name) + " tier: need " + std::to_string(bytes) +
                                  " bytes, " + std::to_string(capacity_ - used_) +
                                  " available of a " + std::to_string(capacity_) + "-byte budget");
  }
  used_ += bytes;
  if (used_ > peak_) peak_ = used_;
  ++live_;
  ++total_;
  return OkStatus();
}

void BudgetAccount::Release(Bytes bytes) {
  MutexLock lock(mu_);
  used_ -= bytes;
  --live_;
}

Status MarkComputeUse(Tier& tier, const Region& region, ComputeStream stream) {
  ComputeOrdering* o = tier.ordering();
  return o == nullptr ? OkStatus() : o->ComputeUsed(region, stream);
}

Status OrderComputeAfterCopies(Tier& tier, const Region& region, ComputeStream stream) {
  ComputeOrdering* o = tier.ordering();
  return o == nullptr ? OkStatus() : o->ComputeWaits(region, stream);
}

TierStats BudgetAccount::Snapshot() const {
  MutexLock lock(mu_);
  return TierStats{capacity_, used_, peak_, live_, total_};
}

Status ValidateCopy(const CopyRequest& r, const Region& live) {
  if (!live || live.id != r.region.id) {
    return InvalidArgumentError("copy names region " + std::to_string(r.region.id) +
                                ", which is not live on this tier");
  }
  if (r.host == nullptr && r.bytes > 0) return InvalidArgumentError("copy with null host pointer");
  if (r.offset > live.bytes || r.bytes > live.bytes - r.offset) {
    return OutOfRangeError("copy [" + std::to_string(r.offset) + ", +" + std::to_string(r.bytes) +
                           ") outside region of " + std::to_string(live.bytes) + " bytes");
  }
  return OkStatus();
}

}  // namespace tiermem
