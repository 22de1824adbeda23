#include <chrono>
#include <cstring>
#include <vector>

#include <gtest/gtest.h>

#include "runtime/base/clock.h"
#include "tiers/fake/sim_device.h"

namespace tiermem {
namespace {

TEST(SimDevice, BudgetAlignmentAndAccounting) {
  auto dev = NewSimDevice({.capacity = 4096, .alignment = 256});
  auto a = dev->Allocate(100);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->bytes, 256u);
  EXPECT_EQ(dev->Stats().used, 256u);
  auto b = dev->Allocate(4096);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(b.status().message().find("need 4096 bytes, 3840 available"), std::string::npos)
      << b.status().message();
  EXPECT_EQ(dev->Stats().used, 256u);
  ASSERT_TRUE(dev->Free(*a).ok());
  EXPECT_EQ(dev->Stats().used, 0u);
  EXPECT_EQ(dev->Stats().peak, 256u);
  EXPECT_EQ(dev->Free(*a).code(), StatusCode::kInvalidArgument);
}

TEST(SimDevice, CopyRoundTripAndBounds) {
  auto dev = NewSimDevice({.capacity = 1 << 20});
  auto r = dev->Allocate(1000);
  ASSERT_TRUE(r.ok());
  std::vector<char> src(1000), dst(1000, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<char>(i * 7 + 3);
  ASSERT_TRUE(dev->Copy({*r, 0, src.data(), 1000, CopyDir::kToTier})->Wait().ok());
  ASSERT_TRUE(dev->Copy({*r, 10, dst.data(), 990, CopyDir::kFromTier})->Wait().ok());
  EXPECT_EQ(std::memcmp(dst.data(), src.data() + 10, 990), 0);
  EXPECT_EQ(dev->Copy({*r, 1000, dst.data(), 100, CopyDir::kFromTier})->Wait().code(),
            StatusCode::kOutOfRange);
  Region bogus{999, 10, nullptr};
  EXPECT_EQ(dev->Copy({bogus, 0, dst.data(), 1, CopyDir::kFromTier})->Wait().code(),
            StatusCode::kInvalidArgument);
}

TEST(SimDevice, FreedBlocksAreReusedUnderTheSameBudget) {
  auto dev = NewSimDevice({.capacity = 8192, .alignment = 256});
  auto a = dev->Allocate(4096);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(dev->Free(*a).ok());
  EXPECT_EQ(dev->Stats().used, 0u);
  auto b = dev->Allocate(4000);  // same rounded size: the freed block, charged again
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->bytes, 4096u);
  EXPECT_NE(b->id, a->id);
  EXPECT_EQ(dev->Stats().used, 4096u);
  EXPECT_EQ(dev->Free(*a).code(), StatusCode::kInvalidArgument);  // the old id stays dead
  auto c = dev->Allocate(4096);  // a fresh block: the budget still caps the total
  ASSERT_TRUE(c.ok());
  EXPECT_NE(c->addr, b->addr);
  EXPECT_EQ(dev->Allocate(256).status().code(), StatusCode::kResourceExhausted);
  std::vector<char> src(4096, 5), dst(4096, 0);
  ASSERT_TRUE(dev->Copy({*b, 0, src.data(), 4096, CopyDir::kToTier})->Wait().ok());
  ASSERT_TRUE(dev->Copy({*b, 0, dst.data(), 4096, CopyDir::kFromTier})->Wait().ok());
  EXPECT_EQ(dst, src);
  ASSERT_TRUE(dev->Free(*b).ok());
  ASSERT_TRUE(dev->Free(*c).ok());
  EXPECT_EQ(dev->Stats().used, 0u);
}

TEST(SimDevice, BandwidthModelSlowsCopies) {
  // 1 MiB at 100 MiB/s must take >= 10 ms of wall time.
  auto dev = NewSimDevice({.capacity = 4 << 20, .h2d_bytes_per_s = 100.0 * (1 << 20)});
  auto r = dev->Allocate(1 << 20);
  ASSERT_TRUE(r.ok());
  std::vector<char> src(1 << 20, 1);
  const uint64_t t0 = Clock::Real()->NowNs();
  ASSERT_TRUE(dev->Copy({*r, 0, src.data(), src.size(), CopyDir::kToTier})->Wait().ok());
  EXPECT_GE(Clock::Real()->NowNs() - t0, 10'000'000u);
}

}  // namespace
}  // namespace tiermem
