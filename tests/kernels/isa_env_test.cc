// The environment overrides, read once at first use: this binary runs with
// TIERMEM_KERNEL_ISA=scalar and TIERMEM_CPU_THREADS=1 (set by tests/kernels/CMakeLists.txt).
#include <gtest/gtest.h>

#include "kernels/cpu/optim.h"

namespace tiermem::kernels {
namespace {

TEST(IsaEnv, EnvironmentPicksTheIsaAndThreads) {
  EXPECT_EQ(KernelIsa(), Isa::kScalar) << IsaName(KernelIsa());
  EXPECT_EQ(KernelThreads(), 1);
  // The programmatic override still works afterwards.
  if (BestSupportedIsa() != Isa::kScalar) {
    ASSERT_TRUE(SetKernelIsa(BestSupportedIsa()).ok());
    EXPECT_EQ(KernelIsa(), BestSupportedIsa());
  }
}

}  // namespace
}  // namespace tiermem::kernels
