// The tier conformance suite: every Tier implementation must pass these cases. Each backend
// instantiates TierConformance with its factory in its own file (conformance_fake.cc for the
// fakes and the host tier; the NVMe and CUDA engineers add theirs to this binary).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <random>
#include <thread>

#include "chunks/mover.h"
#include "tests/tiers/conformance.h"
#include "tiers/fake/sim_device.h"
#include "tiers/host/host_tier.h"

namespace tiermem::testing {
namespace {

std::vector<char> RandomBytes(Bytes n, std::mt19937_64& rng) {
  std::vector<char> v(n);
  for (Bytes i = 0; i < n; i += 8) {  // 8 random bytes per draw
    const uint64_t x = rng();
    std::memcpy(v.data() + i, &x, std::min<Bytes>(8, n - i));
  }
  return v;
}

Status Write(Tier* t, const Region& r, Bytes off, const std::vector<char>& v) {
  return t->Copy({r, off, const_cast<char*>(v.data()), v.size(), CopyDir::kToTier})->Wait();
}

StatusOr<std::vector<char>> Read(Tier* t, const Region& r, Bytes off, Bytes n) {
  std::vector<char> v(n);
  TIERMEM_RETURN_IF_ERROR(t->Copy({r, off, v.data(), n, CopyDir::kFromTier})->Wait());
  return v;
}

void ExpectSameStats(const TierStats& a, const TierStats& b) {
  EXPECT_EQ(a.capacity, b.capacity);
  EXPECT_EQ(a.used, b.used);
  EXPECT_EQ(a.peak, b.peak);
  EXPECT_EQ(a.live_regions, b.live_regions);
  EXPECT_EQ(a.total_allocations, b.total_allocations);
}

std::unique_ptr<Tier> MakeTier(const TierFactory& f) { return f.make ? f.make() : nullptr; }

#define TIERMEM_MAKE_TIER_OR_SKIP(var)                                    \
  std::unique_ptr<Tier> var = MakeTier(GetParam());                       \
  if (var == nullptr) GTEST_SKIP() << GetParam().name << " unavailable here"

TEST_P(TierConformance, ReportsItselfAndStartsEmpty) {
  TIERMEM_MAKE_TIER_OR_SKIP(tier);
  EXPECT_FALSE(tier->name().empty());
  EXPECT_NE(tier->kind(), TierKind::kNone);
  const TierStats s = tier->Stats();
  EXPECT_EQ(s.capacity, GetParam().capacity);
  EXPECT_EQ(s.used, 0u);
  EXPECT_EQ(s.peak, 0u);
  EXPECT_EQ(s.live_regions, 0u);
  EXPECT_EQ(s.total_allocations, 0u);
  auto zero = tier->Allocate(0);
  EXPECT_EQ(zero.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(tier->Stats().total_allocations, 0u);
}

TEST_P(TierConformance, RoundTripsRandomDataAtRandomSizesAndOffsets) {
  TIERMEM_MAKE_TIER_OR_SKIP(tier);
  std::mt19937_64 rng(42);
  struct Written {
    Region region;
    Bytes offset;
    std::vector<char> data;
  };
  std::vector<Written> all;
  for (int i = 0; i < 24; ++i) {
    // Sizes from 1 byte to 2 MiB, skewed small (log-uniform).
    const Bytes size = Bytes{1} << (rng() % 22);
    const Bytes n = size + rng() % size;
    auto r = tier->Allocate(n);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_GE(r->bytes, n);
    ASSERT_NE(r->id, 0u);
    if (tier->kind() != TierKind::kNvme) {
      EXPECT_NE(r->addr, nullptr);
    }
    const Bytes off = rng() % n;
    const Bytes len = 1 + rng() % (r->bytes - off);
    Written w{*r, off, RandomBytes(len, rng)};
    ASSERT_TRUE(Write(tier.get(), w.region, w.offset, w.data).ok());
    all.push_back(std::move(w));
  }
  // Read everything back after all writes: regions don't overlap one another.
  for (const auto& w : all) {
    auto back = Read(tier.get(), w.region, w.offset, w.data.size());
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(*back, w.data) << "region " << w.region.id;
    // A sub-range read at an inner offset sees the same bytes.
    const Bytes sub = w.data.size() / 3;
    auto part = Read(tier.get(), w.region, w.offset + sub, w.data.size() - sub);
    ASSERT_TRUE(part.ok());
    EXPECT_TRUE(std::equal(part->begin(), part->end(), w.data.begin() + sub));
  }
  for (const auto& w : all) ASSERT_TRUE(tier->Free(w.region).ok());
  EXPECT_EQ(tier->Stats().used, 0u);
}

// The tier under test paired with every tier this binary has (SimDevice, host, itself), in
// both directions, through the Mover (with a host staging tier for bounced pairs).
TEST_P(TierConformance, MovesToAndFromEveryTierPairThroughTheMover) {
  TIERMEM_MAKE_TIER_OR_SKIP(tier);
  auto sim = NewSimDevice({.capacity = 64 * kMiB});
  HostTierConfig hc;
  hc.capacity = 64 * kMiB;
  hc.slot_bytes = 4 * kMiB;
  hc.slab_bytes = 16 * kMiB;
  auto host = NewHostTier(hc);
  ASSERT_TRUE(host.ok()) << host.status().ToString();
  hc.slot_bytes = 512 * kKiB;
  hc.slab_bytes = 4 * kMiB;
  auto staging = NewHostTier(hc);
  ASSERT_TRUE(staging.ok());
  auto mover = NewMover({.staging_slot_bytes = 512 * kKiB, .staging_slots = 3}, staging->get(),
                        nullptr);
  std::mt19937_64 rng(7);
  std::vector<Tier*> peers = {sim.get(), host->get(), tier.get()};
  for (Tier* peer : peers) {
    for (int dir = 0; dir < 2; ++dir) {
      Tier* src = dir == 0 ? tier.get() : peer;
      Tier* dst = dir == 0 ? peer : tier.get();
      SCOPED_TRACE(src->name() + " -> " + dst->name());
      const Bytes n = 1 * kMiB + rng() % kMiB;  // several staging pieces, ragged tail
      auto rs = src->Allocate(n + 64);
      auto rd = dst->Allocate(n + 64);
      ASSERT_TRUE(rs.ok() && rd.ok());
      const auto data = RandomBytes(n, rng);
      ASSERT_TRUE(Write(src, *rs, 64, data).ok());
      Status s = mover->Move({{src, *rs, 64}, {dst, *rd, 32}, n})->Wait();
      ASSERT_TRUE(s.ok()) << s.ToString();
      auto back = Read(dst, *rd, 32, n);
      ASSERT_TRUE(back.ok());
      EXPECT_EQ(*back, data);
      ASSERT_TRUE(src->Free(*rs).ok());
      ASSERT_TRUE(dst->Free(*rd).ok());
    }
  }
  EXPECT_EQ((*staging)->Stats().used, 0u);
  EXPECT_EQ(tier->Stats().used, 0u);
}

TEST_P(TierConformance, ManyCopiesInFlightFromSeveralThreads) {
  TIERMEM_MAKE_TIER_OR_SKIP(tier);
  constexpr int kThreads = 4, kRegionsPerThread = 8;
  std::atomic<int> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(1000 + t);
      std::vector<Region> regions;
      std::vector<std::vector<char>> data;
      std::vector<std::shared_ptr<Completion>> writes;
      for (int i = 0; i < kRegionsPerThread; ++i) {
        const Bytes n = 1 + rng() % (512 * kKiB);
        auto r = tier->Allocate(n);
        if (!r.ok()) {
          ++bad;
          return;
        }
        regions.push_back(*r);
        data.push_back(RandomBytes(n, rng));
      }
      // All writes in flight at once, then all reads.
      for (int i = 0; i < kRegionsPerThread; ++i) {
        writes.push_back(tier->Copy(
            {regions[i], 0, data[i].data(), data[i].size(), CopyDir::kToTier}));
      }
      if (!WaitAll(writes).ok()) ++bad;
      std::vector<std::vector<char>> back(kRegionsPerThread);
      std::vector<std::shared_ptr<Completion>> reads;
      for (int i = 0; i < kRegionsPerThread; ++i) {
        back[i].resize(data[i].size());
        reads.push_back(tier->Copy(
            {regions[i], 0, back[i].data(), back[i].size(), CopyDir::kFromTier}));
      }
      if (!WaitAll(reads).ok()) ++bad;
      for (int i = 0; i < kRegionsPerThread; ++i) {
        if (back[i] != data[i]) ++bad;
        if (!tier->Free(regions[i]).ok()) ++bad;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad.load(), 0);
  const TierStats s = tier->Stats();
  EXPECT_EQ(s.used, 0u);
  EXPECT_EQ(s.live_regions, 0u);
  EXPECT_EQ(s.total_allocations, static_cast<uint64_t>(kThreads * kRegionsPerThread));
}

TEST_P(TierConformance, AccountingIsExactAfterRandomAllocFree) {
  TIERMEM_MAKE_TIER_OR_SKIP(tier);
  std::mt19937_64 rng(3);
  std::map<uint64_t, Region> live;
  Bytes used = 0, peak = 0;
  uint64_t total = 0;
  for (int step = 0; step < 300; ++step) {
    if (live.empty() || rng() % 3 != 0) {
      const Bytes n = 1 + rng() % (256 * kKiB);
      auto r = tier->Allocate(n);
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      ASSERT_GE(r->bytes, n);
      ASSERT_TRUE(live.emplace(r->id, *r).second) << "region id reused while live";
      used += r->bytes;
      peak = std::max(peak, used);
      ++total;
    } else {
      auto it = live.begin();
      std::advance(it, rng() % live.size());
      ASSERT_TRUE(tier->Free(it->second).ok());
      used -= it->second.bytes;
      live.erase(it);
    }
    const TierStats s = tier->Stats();
    ASSERT_EQ(s.used, used) << "step " << step;
    ASSERT_EQ(s.peak, peak);
    ASSERT_EQ(s.live_regions, live.size());
    ASSERT_EQ(s.total_allocations, total);
    ASSERT_LE(s.used, s.capacity);
  }
  for (auto& [id, r] : live) ASSERT_TRUE(tier->Free(r).ok());
  EXPECT_EQ(tier->Stats().used, 0u);
  EXPECT_EQ(tier->Stats().peak, peak);
}

TEST_P(TierConformance, BudgetExhaustionChangesNothingAndNamesTheBytes) {
  TIERMEM_MAKE_TIER_OR_SKIP(tier);
  const Bytes cap = GetParam().capacity;
  // One byte more than the whole budget.
  const TierStats before = tier->Stats();
  auto over = tier->Allocate(cap + 1);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(over.status().message().find(std::to_string(cap)), std::string::npos)
      << over.status().message();
  EXPECT_NE(over.status().message().find("bytes"), std::string::npos);
  ExpectSameStats(tier->Stats(), before);

  // Fill the budget with 1 MiB regions, then one more is refused naming what is left.
  std::vector<Region> regions;
  for (;;) {
    auto r = tier->Allocate(1 * kMiB);
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), StatusCode::kResourceExhausted) << r.status().ToString();
      const Bytes left = cap - tier->Stats().used;
      EXPECT_NE(r.status().message().find(std::to_string(left) + " available"), std::string::npos)
          << r.status().message();
      break;
    }
    regions.push_back(*r);
    ASSERT_LE(regions.size(), cap / kMiB) << "allocated more than the budget";
  }
  ASSERT_FALSE(regions.empty());
  // What is live keeps its contents across the refusal.
  std::mt19937_64 rng(9);
  const auto data = RandomBytes(4096, rng);
  ASSERT_TRUE(Write(tier.get(), regions.front(), 0, data).ok());
  const TierStats full = tier->Stats();
  EXPECT_GT(full.used + kMiB, full.capacity);
  EXPECT_FALSE(tier->Allocate(1 * kMiB).ok());
  ExpectSameStats(tier->Stats(), full);
  auto back = Read(tier.get(), regions.front(), 0, data.size());
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, data);
  // Freeing one makes room again.
  ASSERT_TRUE(tier->Free(regions.back()).ok());
  regions.pop_back();
  auto again = tier->Allocate(1 * kMiB);
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  regions.push_back(*again);
  for (const auto& r : regions) ASSERT_TRUE(tier->Free(r).ok());
  EXPECT_EQ(tier->Stats().used, 0u);
}

TEST_P(TierConformance, FreeOfUnknownRegionIsInvalidArgumentAndChangesNothing) {
  TIERMEM_MAKE_TIER_OR_SKIP(tier);
  auto r = tier->Allocate(10000);
  ASSERT_TRUE(r.ok());
  const TierStats before = tier->Stats();
  Region bogus{r->id + 1000, r->bytes, r->addr};
  EXPECT_EQ(tier->Free(bogus).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(tier->Free(Region{}).code(), StatusCode::kInvalidArgument);
  ExpectSameStats(tier->Stats(), before);
  ASSERT_TRUE(tier->Free(*r).ok());
  // Double free.
  const TierStats after = tier->Stats();
  EXPECT_EQ(tier->Free(*r).code(), StatusCode::kInvalidArgument);
  ExpectSameStats(tier->Stats(), after);
}

TEST_P(TierConformance, OutOfBoundsAndUnknownRegionCopiesFailAndWriteNothing) {
  TIERMEM_MAKE_TIER_OR_SKIP(tier);
  auto r = tier->Allocate(8192);
  ASSERT_TRUE(r.ok());
  const Bytes size = r->bytes;
  std::mt19937_64 rng(11);
  const auto data = RandomBytes(size, rng);
  ASSERT_TRUE(Write(tier.get(), *r, 0, data).ok());
  std::vector<char> junk(size + 4096, 'x');
  const TierStats before = tier->Stats();
  // Past the end, straddling the end, and an offset beyond the region.
  EXPECT_EQ(tier->Copy({*r, 1, junk.data(), size, CopyDir::kToTier})->Wait().code(),
            StatusCode::kOutOfRange);
  EXPECT_EQ(tier->Copy({*r, size - 10, junk.data(), 11, CopyDir::kToTier})->Wait().code(),
            StatusCode::kOutOfRange);
  EXPECT_EQ(tier->Copy({*r, size + 1, junk.data(), 0, CopyDir::kToTier})->Wait().code(),
            StatusCode::kOutOfRange);
  EXPECT_EQ(tier->Copy({*r, 0, junk.data(), size + 1, CopyDir::kFromTier})->Wait().code(),
            StatusCode::kOutOfRange);
  EXPECT_EQ(tier->Copy({*r, ~Bytes{0} - 5, junk.data(), 10, CopyDir::kFromTier})->Wait().code(),
            StatusCode::kOutOfRange);
  // A region the tier doesn't know.
  Region bogus{r->id + 1000, r->bytes, r->addr};
  EXPECT_EQ(tier->Copy({bogus, 0, junk.data(), 16, CopyDir::kToTier})->Wait().code(),
            StatusCode::kInvalidArgument);
  ExpectSameStats(tier->Stats(), before);
  auto back = Read(tier.get(), *r, 0, size);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, data) << "a failed copy wrote into the region";
  // A copy to a freed region fails too.
  ASSERT_TRUE(tier->Free(*r).ok());
  EXPECT_EQ(tier->Copy({*r, 0, junk.data(), 16, CopyDir::kToTier})->Wait().code(),
            StatusCode::kInvalidArgument);
}

// ---- ordering against compute (tiers/tier.h) ----------------------------------------------

#define TIERMEM_MAKE_ORDERED_TIER_OR_SKIP(tier, harness)                                 \
  TIERMEM_MAKE_TIER_OR_SKIP(tier);                                                       \
  if (!GetParam().make_compute) {                                                        \
    EXPECT_EQ(tier->ordering(), nullptr) << "a tier with ordering needs a harness here"; \
    GTEST_SKIP() << GetParam().name << " has no compute ordering";                       \
  }                                                                                      \
  ASSERT_NE(tier->ordering(), nullptr);                                                  \
  std::unique_ptr<ComputeHarness> harness = GetParam().make_compute();                   \
  if (harness == nullptr) GTEST_SKIP() << "no compute stream here"

TEST_P(TierConformance, WithoutOrderingTheHelpersAreNoOps) {
  TIERMEM_MAKE_TIER_OR_SKIP(tier);
  if (tier->ordering() != nullptr) GTEST_SKIP() << "has ordering (the cases below)";
  auto r = tier->Allocate(4096);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(MarkComputeUse(*tier, *r, ComputeStream{12345}).ok());
  EXPECT_TRUE(OrderComputeAfterCopies(*tier, *r, ComputeStream{12345}).ok());
  ASSERT_TRUE(tier->Free(*r).ok());
}

TEST_P(TierConformance, CopyOutWaitsForTheComputeThatWroteTheRegion) {
  TIERMEM_MAKE_ORDERED_TIER_OR_SKIP(tier, harness);
  for (int round = 0; round < 3; ++round) {
    auto bad = CopyOutAfterCompute(*tier, *harness, 4 * kMiB);
    ASSERT_TRUE(bad.ok()) << bad.status().ToString();
    EXPECT_EQ(*bad, 0u) << "round " << round << ": the copy read before the compute wrote";
  }
  EXPECT_EQ(tier->Stats().used, 0u);
}

TEST_P(TierConformance, ComputeAfterComputeWaitsReadsTheCopiedBytes) {
  TIERMEM_MAKE_ORDERED_TIER_OR_SKIP(tier, harness);
  for (int round = 0; round < 3; ++round) {
    auto bad = ComputeAfterCopyIn(*tier, *harness, 4 * kMiB);
    ASSERT_TRUE(bad.ok()) << bad.status().ToString();
    EXPECT_EQ(*bad, 0u) << "round " << round << ": compute read before the copy landed";
  }
}

TEST_P(TierConformance, ReusedMemoryIsWrittenOnlyAfterQueuedComputeReadIt) {
  TIERMEM_MAKE_ORDERED_TIER_OR_SKIP(tier, harness);
  for (int round = 0; round < 3; ++round) {
    auto bad = ReuseAfterFreeWaitsForCompute(*tier, *harness, 4 * kMiB);
    ASSERT_TRUE(bad.ok()) << bad.status().ToString();
    EXPECT_EQ(*bad, 0u) << "round " << round << ": a copy overwrote memory compute still read";
  }
  EXPECT_EQ(tier->Stats().used, 0u);
}

TEST_P(TierConformance, OrderingOfAnUnknownRegionIsInvalidArgument) {
  TIERMEM_MAKE_ORDERED_TIER_OR_SKIP(tier, harness);
  auto r = tier->Allocate(4096);
  ASSERT_TRUE(r.ok());
  Region bogus{r->id + 1000, r->bytes, r->addr};
  EXPECT_EQ(MarkComputeUse(*tier, bogus, harness->stream()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(OrderComputeAfterCopies(*tier, bogus, harness->stream()).code(),
            StatusCode::kInvalidArgument);
  ASSERT_TRUE(tier->Free(*r).ok());
  EXPECT_EQ(MarkComputeUse(*tier, *r, harness->stream()).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tiermem::testing
