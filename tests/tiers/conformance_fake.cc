// Instantiates the tier conformance suite for the tiers that exist on every machine:
// SimDevice, the host tier, and FaultInjectingTier (nothing armed) over each.
#include "tests/tiers/conformance.h"
#include "tests/tiers/sim_compute_harness.h"
#include "tiers/fake/fault_injecting.h"
#include "tiers/fake/sim_device.h"
#include "tiers/host/host_tier.h"

namespace tiermem::testing {
namespace {

constexpr Bytes kCapacity = 64 * kMiB;

std::unique_ptr<Tier> MakeSim() { return NewSimDevice({.capacity = kCapacity}); }
std::unique_ptr<Tier> MakeSimAsync() {
  return NewSimDevice({.capacity = kCapacity, .async = true, .async_max_delay_ns = 2'000'000});
}
std::unique_ptr<ComputeHarness> MakeSimCompute() { return std::make_unique<SimComputeHarness>(); }

std::unique_ptr<Tier> MakeHost() {
  HostTierConfig c;
  c.capacity = kCapacity;
  c.slot_bytes = 2 * kMiB;  // so the suite's sizes hit slots, several classes and dedicated maps
  c.min_class_bytes = 4 * kKiB;
  c.slab_bytes = 16 * kMiB;
  auto t = NewHostTier(c);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(t).value() : nullptr;
}

INSTANTIATE_TEST_SUITE_P(
    Fakes, TierConformance,
    ::testing::Values(
        TierFactory{"sim_device", MakeSim, kCapacity, MakeSimCompute},
        TierFactory{"sim_device_async", MakeSimAsync, kCapacity, MakeSimCompute},
        TierFactory{"host", MakeHost, kCapacity},
        TierFactory{"fault_injecting_sim_device",
                    [] { return std::unique_ptr<Tier>(NewFaultInjectingTier(MakeSim())); },
                    kCapacity, MakeSimCompute},
        TierFactory{"fault_injecting_host",
                    [] { return std::unique_ptr<Tier>(NewFaultInjectingTier(MakeHost())); },
                    kCapacity}),
    TierFactoryName);

}  // namespace
}  // namespace tiermem::testing
