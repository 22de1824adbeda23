// A host tier for tests: `capacity` bytes in slabs of 16 slots of `slot` bytes, without huge
// pages (the engine and expert-cache tests' tiers).
#pragma once

#include <gtest/gtest.h>

#include <memory>

#include "tiers/host/host_tier.h"

namespace tiermem::testing {

inline std::unique_ptr<Tier> TestHostTier(Bytes capacity, Bytes slot) {
  HostTierConfig hc;
  hc.capacity = capacity;
  hc.slot_bytes = slot;
  hc.min_class_bytes = slot;
  hc.slab_bytes = 16 * slot;
  hc.huge_pages = false;
  auto t = NewHostTier(hc);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return std::move(t).value();
}

}  // namespace tiermem::testing
