// MemNvme: an in-memory tier posing as NVMe, for fast tests of code above the tiers.
//
// Like the real NVMe tier it is not byte-addressable (Region.addr == nullptr), rounds regions
// up to 4 KiB blocks, charges a byte budget, and completes copies asynchronously (on one
// worker thread, in submission order). No files, no checksums, no alignment rules.
//
// Threading: thread-safe. Completions fire on the worker thread.
#pragma once

#include <memory>

#include "tiers/tier.h"

namespace tiermem {

struct MemNvmeConfig {
  Bytes capacity = 1 * kGiB;
  Bytes block_bytes = 4 * kKiB;  // allocation granularity
};

// Caller owns the result.
std::unique_ptr<Tier> NewMemNvme(const MemNvmeConfig& config);

}  // namespace tiermem
