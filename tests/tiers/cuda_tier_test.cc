// The CUDA device tier on a real GPU (label gpu; every case skips without one): exact budget,
// first-fit arena with coalescing, copies round-trip through the device on both lanes,
// completions fire off the CUDA callback path, bad requests fail with specific codes.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <numeric>
#include <vector>

#include "tests/support/gpu.h"
#include "tiers/cuda/cuda_tier.h"

namespace tiermem {
namespace {

// With a device present (TIERMEM_REQUIRE_GPU first), creating the tier must succeed.
std::unique_ptr<Tier> MakeTier(Bytes capacity) {
  CudaTierConfig c;
  c.capacity = capacity;
  StatusOr<std::unique_ptr<Tier>> t = NewCudaTier(c);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return t.ok() ? std::move(*t) : nullptr;
}

TEST(CudaTier, BudgetIsExactAndArenaCoalesces) {
  TIERMEM_REQUIRE_GPU();
  auto tier = MakeTier(1 * kMiB);
  ASSERT_NE(tier, nullptr);
  EXPECT_EQ(tier->kind(), TierKind::kDevice);
  EXPECT_EQ(tier->Stats().capacity, 1 * kMiB);
  auto a = tier->Allocate(1000);  // rounded to 1024
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->bytes, 1024u);
  EXPECT_NE(a->addr, nullptr);
  auto b = tier->Allocate(512 * kKiB - 1024);
  auto c = tier->Allocate(512 * kKiB);
  ASSERT_TRUE(b.ok() && c.ok());
  EXPECT_EQ(tier->Stats().used, 1 * kMiB);
  EXPECT_EQ(tier->Allocate(1).status().code(), StatusCode::kResourceExhausted);
  ASSERT_TRUE(tier->Free(*a).ok());
  ASSERT_TRUE(tier->Free(*b).ok());  // a and b merge into one 512 KiB block
  auto d = tier->Allocate(512 * kKiB);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(tier->Stats().peak, 1 * kMiB);
  EXPECT_EQ(tier->Free(*a).code(), StatusCode::kInvalidArgument);  // already freed
  ASSERT_TRUE(tier->Free(*c).ok());
  ASSERT_TRUE(tier->Free(*d).ok());
  EXPECT_EQ(tier->Stats().used, 0u);
  auto all = tier->Allocate(1 * kMiB);  // fully coalesced again
  ASSERT_TRUE(all.ok());
  ASSERT_TRUE(tier->Free(*all).ok());
  EXPECT_EQ(tier->Allocate(2 * kMiB).status().code(), StatusCode::kResourceExhausted);
}

TEST(CudaTier, FragmentedArenaSaysSo) {
  TIERMEM_REQUIRE_GPU();
  auto tier = MakeTier(4 * 256);
  ASSERT_NE(tier, nullptr);
  std::vector<Region> r;
  for (int i = 0; i < 4; ++i) r.push_back(*tier->Allocate(256));
  ASSERT_TRUE(tier->Free(r[0]).ok());
  ASSERT_TRUE(tier->Free(r[2]).ok());
  const Status s = tier->Allocate(512).status();  // 512 free in total, not contiguous
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("fragmented"), std::string::npos) << s.message();
  EXPECT_EQ(tier->Stats().used, 512u);  // the failed allocation changed nothing
}

TEST(CudaTier, CopiesRoundTripOnBothLanes) {
  TIERMEM_REQUIRE_GPU();
  auto tier = MakeTier(64 * kMiB);
  ASSERT_NE(tier, nullptr);
  const Bytes n = 8 * kMiB + 13;
  auto r = tier->Allocate(n);
  ASSERT_TRUE(r.ok());
  std::vector<unsigned char> src(n), dst(n, 0);
  for (Bytes i = 0; i < n; ++i) src[i] = static_cast<unsigned char>(i * 131 + 7);
  ASSERT_TRUE(tier->Copy({*r, 0, src.data(), n, CopyDir::kToTier})->Wait().ok());
  ASSERT_TRUE(tier->Copy({*r, 0, dst.data(), n, CopyDir::kFromTier})->Wait().ok());
  EXPECT_EQ(src, dst);
  // Offset copies, many in flight, completing in order on each lane.
  std::vector<std::shared_ptr<Completion>> done;
  std::vector<unsigned char> part(4096);
  for (int i = 0; i < 64; ++i) {
    std::fill(part.begin(), part.end(), static_cast<unsigned char>(i));
    // Host memory must stay untouched until completion: wait for each upload.
    ASSERT_TRUE(tier->Copy({*r, Bytes(i) * 4096, part.data(), 4096, CopyDir::kToTier})->Wait().ok());
  }
  std::vector<unsigned char> back(64 * 4096);
  for (int i = 0; i < 64; ++i) {
    done.push_back(tier->Copy({*r, Bytes(i) * 4096, back.data() + i * 4096, 4096, CopyDir::kFromTier}));
  }
  ASSERT_TRUE(WaitAll(done).ok());
  for (int i = 0; i < 64 * 4096; ++i) ASSERT_EQ(back[i], static_cast<unsigned char>(i / 4096)) << i;
  ASSERT_TRUE(tier->Free(*r).ok());
}

TEST(CudaTier, CompletionCallbacksMayCallTheTier) {
  TIERMEM_REQUIRE_GPU();
  auto tier = MakeTier(1 * kMiB);
  ASSERT_NE(tier, nullptr);
  auto r = tier->Allocate(4096);
  ASSERT_TRUE(r.ok());
  std::vector<unsigned char> host(4096, 1), back(4096, 0);
  auto up = tier->Copy({*r, 0, host.data(), 4096, CopyDir::kToTier});
  auto second = Completion::Make();
  up->OnDone([&](const Status& s) {
    // Runs on the lane thread, not in a CUDA host callback: CUDA calls are allowed here.
    auto c = tier->Copy({*r, 0, back.data(), 4096, CopyDir::kFromTier});
    c->OnDone([second](const Status& s2) { second->Complete(s2); });
  });
  ASSERT_TRUE(second->Wait().ok());
  EXPECT_EQ(host, back);
  ASSERT_TRUE(tier->Free(*r).ok());
}

TEST(CudaTier, BadRequestsFailWithSpecificCodes) {
  TIERMEM_REQUIRE_GPU();
  auto tier = MakeTier(1 * kMiB);
  ASSERT_NE(tier, nullptr);
  auto r = tier->Allocate(4096);
  ASSERT_TRUE(r.ok());
  std::vector<unsigned char> host(8192);
  EXPECT_EQ(tier->Copy({*r, 4000, host.data(), 200, CopyDir::kToTier})->Wait().code(),
            StatusCode::kOutOfRange);
  Region bogus{9999, 4096, r->addr};
  EXPECT_EQ(tier->Copy({bogus, 0, host.data(), 16, CopyDir::kToTier})->Wait().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(tier->Free(bogus).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(tier->Allocate(0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(tier->Copy({*r, 0, host.data(), 0, CopyDir::kToTier})->Wait().ok());
  ASSERT_TRUE(tier->Free(*r).ok());
}

TEST(CudaTier, HostRegistrationPinsAndUnpins) {
  TIERMEM_REQUIRE_GPU();
  std::vector<unsigned char> buf(1 * kMiB);
  {
    auto reg = CudaHostRegistration::Make(buf.data(), buf.size());
    ASSERT_TRUE(reg.ok()) << reg.status().ToString();
    EXPECT_EQ(CudaHostRegister(buf.data(), buf.size()).code(), StatusCode::kAlreadyExists);
  }  // unregistered here
  EXPECT_EQ(CudaHostUnregister(buf.data()).code(), StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace tiermem
