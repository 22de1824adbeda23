// AccessProfile: the offload mode's access-driven prefetch logic (DeepUM-style correlation,
// at kernel-launch granularity), kept free of CUDA so it is tested directly.
//
// It knows the managed ranges the shim created past the device budget, and sees every kernel
// launch as (kernel, pointer-sized argument values). A launch "touches" a managed range when
// one of its argument values points into it. The profile learns, for each launch key
// (kernel + the ranges it touches), which ranges the next `ahead` launches touch; when a key
// is seen again (a later iteration of the same loop), OnLaunch returns those successors as
// prefetches, so the shim can issue cudaMemPrefetchAsync on the launching stream before the
// kernels that need them run. The first pass through a loop is the warm-up: no key has
// successors yet, so nothing is prefetched.
//
// Prefetch extent: from the touched address to the end of its range, at most `max_bytes`
// (the argument says where a tensor starts, not how long it is).
// A range prefetched less than 2*ahead launches ago is not prefetched again.
// Storage is fixed at Create (no allocation per launch); a full range table refuses
// AddRange (the range is then simply never prefetched), the successor table is
// direct-mapped (a colliding key replaces the older one).
// Thread-safety: thread-safe (one mutex). Ownership: caller owns the profile.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "base/mutex.h"

namespace tiermem::preload {

struct PrefetchRequest {
  uint64_t base = 0;   // the range's base address (its id in the timeline)
  uint64_t start = 0;  // first byte to prefetch
  uint64_t bytes = 0;
};

class AccessProfile {
 public:
  static constexpr int kMaxAhead = 16;
  static constexpr int kMaxTouched = 8;     // ranges remembered per launch
  static constexpr int kMaxSuccessors = 8;  // ranges remembered per key
  static constexpr int kMaxPrefetches = kMaxSuccessors;

  // `ahead` in [1, kMaxAhead]; `max_ranges` managed ranges at most.
  AccessProfile(int ahead, uint64_t max_bytes, size_t max_ranges);

  // False when the range table is full.
  bool AddRange(uint64_t base, uint64_t bytes);
  void RemoveRange(uint64_t base);
  size_t ranges() const;

  // One kernel launch. Fills out[0..n) with the prefetches to issue now and returns n
  // (at most kMaxPrefetches).
  int OnLaunch(uint64_t kernel, const uint64_t* args, int nargs, PrefetchRequest* out);

 private:
  struct Range {
    uint64_t base, end;
    uint64_t last_prefetch;  // launch number of the last prefetch, 0 = never
  };
  struct Touch {
    uint64_t base, offset;
  };
  struct Entry {
    uint64_t key = 0;
    int n = 0;
    Touch succ[kMaxSuccessors];
  };
  Range* FindLocked(uint64_t addr) TIERMEM_REQUIRES(mu_);

  const int ahead_;
  const uint64_t max_bytes_;
  const size_t max_ranges_;
  mutable Mutex mu_;
  std::vector<Range> ranges_ TIERMEM_GUARDED_BY(mu_);         // sorted by base, capacity reserved
  std::vector<Entry> table_ TIERMEM_GUARDED_BY(mu_);          // direct-mapped by key
  uint64_t history_[kMaxAhead] TIERMEM_GUARDED_BY(mu_) = {};  // keys of the last `ahead` launches
  uint64_t launches_ TIERMEM_GUARDED_BY(mu_) = 0;
};

}  // namespace tiermem::preload
