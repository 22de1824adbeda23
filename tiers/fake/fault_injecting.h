// FaultInjectingTier: wraps any Tier and injects the failures real tiers produce, on demand.
//
// Faults are armed by the test, consumed by the next matching operation, and apply to that
// operation only; everything else is forwarded to the inner tier unchanged (same region ids,
// same stats), so a wrapper with nothing armed behaves exactly like its inner tier.
//   FailNextAllocations(n)    the next n Allocate calls return kResourceExhausted.
//   FailNextWrite(errno)      the next kToTier copy completes with ErrnoToStatus(errno)
//                             (ENOSPC -> kResourceExhausted, EIO -> kIOError), writing nothing.
//   FailNextRead(errno)       the same for the next kFromTier copy (nothing is read).
//   ShortNextWrite(n)         the next kToTier copy writes only its first n bytes and completes
//   ShortNextRead(n)          kIOError "short write" / "short read"; the tail is untouched.
//                             (A copy of n bytes or fewer is not short; the fault waits.)
//   DelayNextCompletions(k,ms) the next k copies complete ms milliseconds after the inner copy.
//   Corrupt(region,off,n)     flips (XOR 0xFF) n bytes of a live region: in place for host
//                             regions, through the inner tier's Copy (read, flip, write back)
//                             for device and NVMe regions, which the CPU may not address.
// Counters say how many faults fired, so a test can assert that its fault was consumed.
//
// Threading: thread-safe. Delayed completions fire on the wrapper's timer thread.
// Ownership: the wrapper owns the inner tier.
#pragma once

#include <memory>

#include "tiers/tier.h"

namespace tiermem {

class FaultInjectingTier final : public Tier {
 public:
  explicit FaultInjectingTier(std::unique_ptr<Tier> inner);
  ~FaultInjectingTier() override;

  void FailNextAllocations(int n);
  void FailNextWrite(int err);
  void FailNextRead(int err);
  void ShortNextWrite(Bytes bytes_written);
  void ShortNextRead(Bytes bytes_read);
  void DelayNextCompletions(int copies, int delay_ms);
  // Synchronous. kInvalidArgument for an unknown region, kOutOfRange past its end.
  Status Corrupt(const Region& region, Bytes offset, Bytes bytes);
  // Disarms everything not yet consumed.
  void ClearFaults();
  uint64_t faults_fired() const;

  Tier* inner() const { return inner_.get(); }

  TierKind kind() const override;
  std::string name() const override;
  StatusOr<Region> Allocate(Bytes bytes) override;
  Status Free(const Region& region) override;
  std::shared_ptr<Completion> Copy(const CopyRequest& request) override;
  TierStats Stats() const override;
  // The inner tier's ordering, unchanged (faults are injected into copies only).
  ComputeOrdering* ordering() override { return inner_->ordering(); }

 private:
  class Timer;
  struct Impl;
  std::unique_ptr<Tier> inner_;
  std::unique_ptr<Impl> impl_;
};

// Caller owns the result.
std::unique_ptr<FaultInjectingTier> NewFaultInjectingTier(std::unique_ptr<Tier> inner);

}  // namespace tiermem
