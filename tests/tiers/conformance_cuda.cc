// The tier conformance suite over the CUDA tier (skips without a GPU: the factory returns
// nullptr). Linked into tier_conformance_test when CUDA is enabled.
#include "tests/tiers/conformance.h"
#include "tests/tiers/cuda_compute_harness.h"
#include "tiers/cuda/cuda_tier.h"

namespace tiermem::testing {
namespace {

std::unique_ptr<Tier> MakeCudaTier() {
  CudaTierConfig config;
  config.capacity = 64 * kMiB;
  StatusOr<std::unique_ptr<Tier>> tier = NewCudaTier(config);
  return tier.ok() ? std::move(*tier) : nullptr;
}

INSTANTIATE_TEST_SUITE_P(Cuda, TierConformance,
                         ::testing::Values(TierFactory{"cuda", MakeCudaTier, 64 * kMiB,
                                                       NewCudaComputeHarness}),
                         TierFactoryName);

}  // namespace
}  // namespace tiermem::testing
