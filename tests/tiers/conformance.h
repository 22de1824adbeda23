// The tier conformance suite's parameter: one factory per tier under test. The TEST_P cases
// live in conformance_test.cc; each backend instantiates the suite in its own file, linked
// into the same `tier_conformance_test` binary:
//
//   INSTANTIATE_TEST_SUITE_P(Nvme, TierConformance,
//       ::testing::Values(TierFactory{"nvme_io_uring", [] { return ...; }}),
//       TierFactoryName);
#pragma once

#include <functional>
#include <memory>
#include <ostream>
#include <string>

#include <gtest/gtest.h>

#include "tests/tiers/ordering_scenarios.h"
#include "tiers/tier.h"

namespace tiermem::testing {

struct TierFactory {
  std::string name;  // [A-Za-z0-9_] only (gtest parameter name)
  // Returns a fresh tier with a capacity of at least 64 MiB, or nullptr when the backend is
  // unavailable here (the test then GTEST_SKIPs).
  std::function<std::unique_ptr<Tier>()> make;
  // Capacity the factory configured (the suite checks budget exhaustion against it).
  Bytes capacity = 64 * kMiB;
  // A compute stream for the ordering cases (tiers with ComputeOrdering); null: the tier has
  // no ordering, and the suite checks that ordering() is null and the helpers are no-ops.
  std::function<std::unique_ptr<ComputeHarness>()> make_compute = nullptr;
};

// gtest prints a failing case's parameter with this (the name, not the struct's bytes).
inline void PrintTo(const TierFactory& factory, std::ostream* os) { *os << factory.name; }

inline std::string TierFactoryName(const ::testing::TestParamInfo<TierFactory>& info) {
  return info.param.name;
}

class TierConformance : public ::testing::TestWithParam<TierFactory> {};

}  // namespace tiermem::testing
