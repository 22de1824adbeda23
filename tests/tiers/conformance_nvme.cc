// Instantiates the tier conformance suite (conformance_test.cc) for the NVMe tier's two
// engines (io_uring also with its checksums on a worker pool) and the in-memory NVMe fake. The
// file tiers write their scratch files into gtest's temp directory; a factory returns nullptr
// (the suite skips) when io_uring is refused here.
#include <string>

#include "tests/tiers/conformance.h"
#include "tiers/fake/mem_nvme.h"
#include "tiers/nvme/nvme_tier.h"

namespace tiermem::testing {
namespace {

constexpr Bytes kCapacity = 64 * kMiB;

std::unique_ptr<Tier> MakeNvme(NvmeIoBackend engine, int checksum_threads = 0) {
  NvmeTierConfig config;
  config.dir = ::testing::TempDir();
  config.capacity = kCapacity;
  config.io_backend = engine;
  config.checksum_threads = checksum_threads;
  auto tier = NewNvmeTier(config);
  if (!tier.ok()) {
    // Only "io_uring refused by this kernel" is a skip; anything else is a real failure.
    EXPECT_EQ(tier.status().code(), StatusCode::kUnavailable) << tier.status().ToString();
    return nullptr;
  }
  return std::move(tier).value();
}

INSTANTIATE_TEST_SUITE_P(
    Nvme, TierConformance,
    ::testing::Values(
        TierFactory{"nvme_io_uring", [] { return MakeNvme(NvmeIoBackend::kIoUring); }, kCapacity},
        TierFactory{"nvme_posix", [] { return MakeNvme(NvmeIoBackend::kPosix); }, kCapacity},
        TierFactory{"nvme_io_uring_pool",
                    [] { return MakeNvme(NvmeIoBackend::kIoUring, /*checksum_threads=*/2); },
                    kCapacity},
        TierFactory{"mem_nvme", [] { return NewMemNvme({.capacity = kCapacity}); }, kCapacity}),
    TierFactoryName);

}  // namespace
}  // namespace tiermem::testing
