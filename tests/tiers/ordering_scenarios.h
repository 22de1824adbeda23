// The ordering contract of tiers/tier.h ("Ordering against compute") as three scenarios, each
// a race that a tier without the right wait loses: compute queued on a stream that runs late
// (a ComputeHarness), and copies that may land late. Each returns the number of bytes that
// came out wrong (0 = ordered) or the first error. Used by the conformance suite (every tier
// with ComputeOrdering and a harness) and by sim_device_test, which also proves, with
// SimDeviceConfig::drop_waits_for_test, that each scenario notices the wait it is about.
#pragma once

#include <cstring>
#include <memory>
#include <vector>

#include "tiers/tier.h"

namespace tiermem::testing {

// Device work on a compute stream the tier does not own: a SimStream on SimDevice, a CUDA
// stream with tiny kernels on the CUDA tier. Each call enqueues and returns at once; the work
// starts after `delay_us` of device time (a busy kernel on CUDA, a sleep on a SimStream).
class ComputeHarness {
 public:
  virtual ~ComputeHarness() = default;
  virtual ComputeStream stream() = 0;
  virtual void Fill(void* dst, Bytes n, uint8_t value, uint64_t delay_us) = 0;
  virtual void CopyWithin(void* dst, const void* src, Bytes n, uint64_t delay_us) = 0;
  virtual Status Synchronize() = 0;
};

inline Bytes CountNot(const std::vector<uint8_t>& v, uint8_t want) {
  Bytes bad = 0;
  for (uint8_t b : v) bad += b != want;
  return bad;
}

// Compute writes a region late; a copy out issued after ComputeUsed must see those bytes.
inline StatusOr<Bytes> CopyOutAfterCompute(Tier& tier, ComputeHarness& h, Bytes n) {
  TIERMEM_ASSIGN_OR_RETURN(Region r, tier.Allocate(n));
  std::vector<uint8_t> zeros(n, 0), out(n, 0x11);
  TIERMEM_RETURN_IF_ERROR(tier.Copy({r, 0, zeros.data(), n, CopyDir::kToTier})->Wait());
  TIERMEM_RETURN_IF_ERROR(OrderComputeAfterCopies(tier, r, h.stream()));
  h.Fill(r.addr, n, 0xAB, 30'000);
  TIERMEM_RETURN_IF_ERROR(MarkComputeUse(tier, r, h.stream()));
  Status s = tier.Copy({r, 0, out.data(), n, CopyDir::kFromTier})->Wait();
  TIERMEM_RETURN_IF_ERROR(h.Synchronize());
  TIERMEM_RETURN_IF_ERROR(tier.Free(r));
  TIERMEM_RETURN_IF_ERROR(s);
  return CountNot(out, 0xAB);
}

// A copy in may land late; compute queued after ComputeWaits must read the new bytes.
inline StatusOr<Bytes> ComputeAfterCopyIn(Tier& tier, ComputeHarness& h, Bytes n) {
  TIERMEM_ASSIGN_OR_RETURN(Region src, tier.Allocate(n));
  TIERMEM_ASSIGN_OR_RETURN(Region dst, tier.Allocate(n));
  std::vector<uint8_t> old(n, 0x22), fresh(n, 0xCD), out(n, 0);
  TIERMEM_RETURN_IF_ERROR(tier.Copy({src, 0, old.data(), n, CopyDir::kToTier})->Wait());
  auto in = tier.Copy({src, 0, fresh.data(), n, CopyDir::kToTier});  // not waited for
  TIERMEM_RETURN_IF_ERROR(OrderComputeAfterCopies(tier, src, h.stream()));
  TIERMEM_RETURN_IF_ERROR(OrderComputeAfterCopies(tier, dst, h.stream()));
  h.CopyWithin(dst.addr, src.addr, n, 0);
  TIERMEM_RETURN_IF_ERROR(MarkComputeUse(tier, src, h.stream()));
  TIERMEM_RETURN_IF_ERROR(MarkComputeUse(tier, dst, h.stream()));
  Status s = tier.Copy({dst, 0, out.data(), n, CopyDir::kFromTier})->Wait();
  TIERMEM_RETURN_IF_ERROR(h.Synchronize());
  TIERMEM_RETURN_IF_ERROR(in->Wait());
  TIERMEM_RETURN_IF_ERROR(tier.Free(src));
  TIERMEM_RETURN_IF_ERROR(tier.Free(dst));
  TIERMEM_RETURN_IF_ERROR(s);
  return CountNot(out, 0xCD);
}

// Compute still reads a region when it is freed and its memory handed to a new region; a
// copy into the new region must not overwrite what that compute reads.
inline StatusOr<Bytes> ReuseAfterFreeWaitsForCompute(Tier& tier, ComputeHarness& h, Bytes n) {
  TIERMEM_ASSIGN_OR_RETURN(Region a, tier.Allocate(n));
  TIERMEM_ASSIGN_OR_RETURN(Region keep, tier.Allocate(n));
  std::vector<uint8_t> va(n, 0x5A), vb(n, 0xB5), out(n, 0), check(n, 0);
  TIERMEM_RETURN_IF_ERROR(tier.Copy({a, 0, va.data(), n, CopyDir::kToTier})->Wait());
  TIERMEM_RETURN_IF_ERROR(OrderComputeAfterCopies(tier, a, h.stream()));
  TIERMEM_RETURN_IF_ERROR(OrderComputeAfterCopies(tier, keep, h.stream()));
  h.CopyWithin(keep.addr, a.addr, n, 30'000);  // reads `a` late
  TIERMEM_RETURN_IF_ERROR(MarkComputeUse(tier, a, h.stream()));
  TIERMEM_RETURN_IF_ERROR(MarkComputeUse(tier, keep, h.stream()));
  TIERMEM_RETURN_IF_ERROR(tier.Free(a));
  TIERMEM_ASSIGN_OR_RETURN(Region b, tier.Allocate(n));  // typically a's memory again
  Status s = tier.Copy({b, 0, vb.data(), n, CopyDir::kToTier})->Wait();
  if (s.ok()) s = tier.Copy({keep, 0, out.data(), n, CopyDir::kFromTier})->Wait();
  if (s.ok()) s = tier.Copy({b, 0, check.data(), n, CopyDir::kFromTier})->Wait();
  TIERMEM_RETURN_IF_ERROR(h.Synchronize());
  TIERMEM_RETURN_IF_ERROR(tier.Free(b));
  TIERMEM_RETURN_IF_ERROR(tier.Free(keep));
  TIERMEM_RETURN_IF_ERROR(s);
  return CountNot(out, 0x5A) + CountNot(check, 0xB5);
}

}  // namespace tiermem::testing
