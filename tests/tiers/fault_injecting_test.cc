// FaultInjectingTier: each fault yields its specific code, fires once, and leaves every other
// region (and the faulted region's untouched bytes) intact.
#include "tiers/fake/fault_injecting.h"

#include <gtest/gtest.h>

#include <cerrno>
#include <chrono>
#include <random>
#include <thread>

#include "tiers/fake/sim_device.h"
#include "tiers/host/host_tier.h"

namespace tiermem {
namespace {

std::vector<char> Pattern(Bytes n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<char> v(n);
  for (auto& c : v) c = static_cast<char>(rng());
  return v;
}

std::vector<char> Read(Tier* t, const Region& r, Bytes off, Bytes n) {
  std::vector<char> v(n);
  Status s = t->Copy({r, off, v.data(), n, CopyDir::kFromTier})->Wait();
  EXPECT_TRUE(s.ok()) << s.ToString();
  return v;
}

Status Write(Tier* t, const Region& r, Bytes off, std::vector<char>& v) {
  return t->Copy({r, off, v.data(), v.size(), CopyDir::kToTier})->Wait();
}

std::unique_ptr<Tier> MakeHost() {
  HostTierConfig c;
  c.capacity = 16 * kMiB;
  c.slot_bytes = 1 * kMiB;
  c.slab_bytes = 4 * kMiB;
  auto t = NewHostTier(c);
  EXPECT_TRUE(t.ok());
  return std::move(t).value();
}

// Each fault test runs over a device-like (SimDevice) and a host inner tier.
class FaultInjectingTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    tier_ = NewFaultInjectingTier(GetParam() ? MakeHost() : NewSimDevice({.capacity = 16 * kMiB}));
    auto a = tier_->Allocate(64 * kKiB);
    auto b = tier_->Allocate(64 * kKiB);
    ASSERT_TRUE(a.ok() && b.ok());
    a_ = *a;
    b_ = *b;
    data_a_ = Pattern(a_.bytes, 1);
    data_b_ = Pattern(b_.bytes, 2);
    ASSERT_TRUE(Write(tier_.get(), a_, 0, data_a_).ok());
    ASSERT_TRUE(Write(tier_.get(), b_, 0, data_b_).ok());
  }
  void ExpectIntact() {
    EXPECT_EQ(Read(tier_.get(), a_, 0, a_.bytes), data_a_);
    EXPECT_EQ(Read(tier_.get(), b_, 0, b_.bytes), data_b_);
  }

  std::unique_ptr<FaultInjectingTier> tier_;
  Region a_, b_;
  std::vector<char> data_a_, data_b_;
};

TEST_P(FaultInjectingTest, FailNextAllocationsIsResourceExhaustedAndCounted) {
  const TierStats before = tier_->Stats();
  tier_->FailNextAllocations(2);
  for (int i = 0; i < 2; ++i) {
    auto r = tier_->Allocate(4096);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted);
    EXPECT_NE(r.status().message().find("4096 bytes"), std::string::npos) << r.status().message();
  }
  EXPECT_EQ(tier_->Stats().total_allocations, before.total_allocations);
  EXPECT_EQ(tier_->Stats().used, before.used);
  auto r = tier_->Allocate(4096);  // the third one goes through
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(tier_->faults_fired(), 2u);
  ASSERT_TRUE(tier_->Free(*r).ok());
  ExpectIntact();
}

TEST_P(FaultInjectingTest, EnospcAndEioOnWriteMapToTheirCodesAndWriteNothing) {
  auto junk = Pattern(1000, 9);
  tier_->FailNextWrite(ENOSPC);
  EXPECT_EQ(Write(tier_.get(), a_, 10, junk).code(), StatusCode::kResourceExhausted);
  tier_->FailNextWrite(EIO);
  Status s = Write(tier_.get(), a_, 10, junk);
  EXPECT_EQ(s.code(), StatusCode::kIOError);
  EXPECT_NE(s.message().find("fault injected"), std::string::npos) << s.message();
  ExpectIntact();  // reads are not affected by write faults
  EXPECT_EQ(tier_->faults_fired(), 2u);
  // One-shot: the next write works.
  ASSERT_TRUE(Write(tier_.get(), a_, 10, junk).ok());
  EXPECT_EQ(Read(tier_.get(), a_, 10, junk.size()), junk);
}

TEST_P(FaultInjectingTest, EioOnReadLeavesTheBufferAndTheRegionAlone) {
  tier_->FailNextRead(EIO);
  std::vector<char> buf(4096, 'z');
  EXPECT_EQ(tier_->Copy({a_, 0, buf.data(), buf.size(), CopyDir::kFromTier})->Wait().code(),
            StatusCode::kIOError);
  EXPECT_EQ(buf, std::vector<char>(4096, 'z'));
  ExpectIntact();
}

TEST_P(FaultInjectingTest, ShortWriteWritesOnlyTheHeadAndIsIOError) {
  auto junk = Pattern(8192, 5);
  tier_->ShortNextWrite(1000);
  Status s = Write(tier_.get(), a_, 100, junk);
  EXPECT_EQ(s.code(), StatusCode::kIOError);
  EXPECT_NE(s.message().find("short write"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("1000 of 8192"), std::string::npos) << s.message();
  auto expect = data_a_;
  std::copy(junk.begin(), junk.begin() + 1000, expect.begin() + 100);
  EXPECT_EQ(Read(tier_.get(), a_, 0, a_.bytes), expect);  // head written, tail not
  EXPECT_EQ(Read(tier_.get(), b_, 0, b_.bytes), data_b_);
}

TEST_P(FaultInjectingTest, ShortReadFillsOnlyTheHead) {
  tier_->ShortNextRead(10);
  std::vector<char> buf(100, 'q');
  Status s = tier_->Copy({a_, 0, buf.data(), buf.size(), CopyDir::kFromTier})->Wait();
  EXPECT_EQ(s.code(), StatusCode::kIOError);
  EXPECT_NE(s.message().find("short read"), std::string::npos);
  EXPECT_TRUE(std::equal(buf.begin(), buf.begin() + 10, data_a_.begin()));
  EXPECT_EQ(std::vector<char>(buf.begin() + 10, buf.end()), std::vector<char>(90, 'q'));
  ExpectIntact();
}

TEST_P(FaultInjectingTest, DelayedCompletionArrivesLateWithTheRightStatus) {
  tier_->DelayNextCompletions(1, 60);
  std::vector<char> buf(4096);
  const auto t0 = std::chrono::steady_clock::now();
  auto c = tier_->Copy({a_, 0, buf.data(), buf.size(), CopyDir::kFromTier});
  ASSERT_TRUE(c->Wait().ok());
  EXPECT_GE(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(60));
  EXPECT_TRUE(std::equal(buf.begin(), buf.end(), data_a_.begin()));
  // A delayed failure keeps its code.
  tier_->DelayNextCompletions(1, 10);
  tier_->FailNextRead(EIO);
  EXPECT_EQ(tier_->Copy({a_, 0, buf.data(), 16, CopyDir::kFromTier})->Wait().code(),
            StatusCode::kIOError);
  // Only one copy was delayed each time: the next one is not.
  EXPECT_TRUE(tier_->Copy({a_, 0, buf.data(), 16, CopyDir::kFromTier})->Wait().ok());
  ExpectIntact();
}

TEST_P(FaultInjectingTest, CorruptFlipsExactlyTheRangeAndNothingElse) {
  ASSERT_TRUE(tier_->Corrupt(a_, 500, 300).ok());
  auto expect = data_a_;
  for (Bytes i = 500; i < 800; ++i) expect[i] = static_cast<char>(expect[i] ^ 0xff);
  EXPECT_EQ(Read(tier_.get(), a_, 0, a_.bytes), expect);
  EXPECT_EQ(Read(tier_.get(), b_, 0, b_.bytes), data_b_);
  // Bad targets get specific codes and corrupt nothing.
  EXPECT_EQ(tier_->Corrupt(a_, a_.bytes - 1, 2).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(tier_->Corrupt(Region{999, 10, nullptr}, 0, 1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(Read(tier_.get(), a_, 0, a_.bytes), expect);
}

TEST_P(FaultInjectingTest, ClearFaultsDisarmsEverything) {
  tier_->FailNextAllocations(5);
  tier_->FailNextWrite(EIO);
  tier_->FailNextRead(EIO);
  tier_->ShortNextWrite(1);
  tier_->DelayNextCompletions(3, 1000);
  tier_->ClearFaults();
  auto r = tier_->Allocate(100);
  ASSERT_TRUE(r.ok());
  auto junk = Pattern(100, 3);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_TRUE(Write(tier_.get(), *r, 0, junk).ok());
  EXPECT_EQ(Read(tier_.get(), *r, 0, 100), junk);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(900));
  EXPECT_EQ(tier_->faults_fired(), 0u);
  ASSERT_TRUE(tier_->Free(*r).ok());
}

INSTANTIATE_TEST_SUITE_P(Inner, FaultInjectingTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) {
                           return i.param ? std::string("host") : std::string("sim_device");
                         });

// Faults from several threads at once: each armed one-shot fault fires exactly once.
TEST(FaultInjecting, OneShotFaultsFireOnceUnderConcurrency) {
  auto tier = NewFaultInjectingTier(NewSimDevice({.capacity = 64 * kMiB}));
  auto r = tier->Allocate(1 * kMiB);
  ASSERT_TRUE(r.ok());
  tier->FailNextWrite(EIO);
  std::vector<char> buf(1024, 'a');
  std::vector<std::shared_ptr<Completion>> all;
  std::mutex mu;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 16; ++i) {
        auto c = tier->Copy({*r, Bytes(1024) * (t * 16 + i), buf.data(), 1024, CopyDir::kToTier});
        std::lock_guard<std::mutex> lock(mu);
        all.push_back(c);
      }
    });
  }
  for (auto& th : threads) th.join();
  int failed = 0;
  for (auto& c : all) failed += c->Wait().ok() ? 0 : 1;
  EXPECT_EQ(failed, 1);
  EXPECT_EQ(tier->faults_fired(), 1u);
}

}  // namespace
}  // namespace tiermem
