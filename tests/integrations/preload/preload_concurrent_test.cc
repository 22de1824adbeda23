// Concurrency (ctest label `concurrent`, run under TSan by scripts/test.sh): many threads
// allocating and freeing through the shim while its flusher thread writes the timeline, and
// the shim's tables used from many threads directly.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "integrations/preload/access_profile.h"
#include "integrations/preload/alloc_table.h"
#include "tests/integrations/preload/preload_support.h"

namespace tiermem::preload {
namespace {

TEST(PreloadConcurrent, ManyThreadsThroughTheShimStayConsistent) {
  const std::string dir = testing::ScratchDir();
  const int threads = 8, iters = 2000;
  // A 5 ms flush tick: the flusher thread writes blocks while the threads record.
  testing::Output o = testing::RunShell(testing::PreloadEnv() + " TIERMEM_PRELOAD_TIMELINE=" + dir +
                                   "/t.tmt TIERMEM_PRELOAD_FLUSH_MS=5 " +
                                   testing::TestProbe(12) + " threads " + std::to_string(threads) + " " +
                                   std::to_string(iters));
  ASSERT_EQ(o.code, 0) << o.out;
  EXPECT_EQ(testing::Value(o.out, "failures"), "0");
  nlohmann::json r = testing::ProfReport(dir + "/t.tmt");
  ASSERT_FALSE(r.is_null());
  EXPECT_EQ(r["file"]["complete"], true);
  EXPECT_EQ(r["tiers"]["device"]["allocs"], 2 * threads * iters);
  EXPECT_EQ(r["tiers"]["device"]["frees"], 2 * threads * iters);
  EXPECT_EQ(r["tiers"]["device"]["end_bytes"], 0);
  EXPECT_EQ(r["unmatched"]["frees"], 0);
  EXPECT_EQ(r["kernel_launches"]["total"], threads * iters);
  // At most every thread's two live blocks at once: sum over t of 768 * (t + 1).
  EXPECT_LE(r["tiers"]["device"]["peak"]["bytes"].get<uint64_t>(), 768u * 36);
  EXPECT_GE(r["tiers"]["device"]["peak"]["bytes"].get<uint64_t>(), 768u);
}

TEST(PreloadConcurrent, AllocTableKeepsEveryThreadsEntries) {
  auto t = AllocTable::Create(1 << 14);
  ASSERT_TRUE(t.ok());
  std::vector<std::thread> pool;
  std::atomic<int> errors{0};
  for (int th = 0; th < 4; ++th) {
    pool.emplace_back([&, th] {
      for (int round = 0; round < 200; ++round) {
        for (uint64_t i = 1; i <= 500; ++i) {
          const uint64_t key = (i << 16) | (static_cast<uint64_t>(th) << 8);
          if (!(*t)->Insert(key, AllocInfo{i, 0, AllocKind::kDevice})) ++errors;
        }
        for (uint64_t i = 1; i <= 500; ++i) {
          AllocInfo info;
          const uint64_t key = (i << 16) | (static_cast<uint64_t>(th) << 8);
          if (!(*t)->Remove(key, &info) || info.bytes != i) ++errors;
        }
      }
    });
  }
  for (auto& th : pool) th.join();
  EXPECT_EQ(errors.load(), 0);
}

TEST(PreloadConcurrent, AccessProfileTakesLaunchesAndRangesFromManyThreads) {
  AccessProfile p(4, 1 << 20, 1024);
  std::vector<std::thread> pool;
  std::atomic<int> prefetches{0};
  for (int th = 0; th < 4; ++th) {
    pool.emplace_back([&, th] {
      const uint64_t base = 0x100000ull * (th + 1);
      for (int i = 0; i < 2000; ++i) {
        if (i % 100 == 0) p.AddRange(base + (i / 100) * 0x1000, 0x1000);
        PrefetchRequest out[AccessProfile::kMaxPrefetches];
        uint64_t arg = base + (i % 20) * 0x1000;
        prefetches += p.OnLaunch(i % 7, &arg, 1, out);
        if (i % 100 == 99) p.RemoveRange(base + (i / 100) * 0x1000);
      }
    });
  }
  for (auto& th : pool) th.join();
  EXPECT_EQ(p.ranges(), 0u);
  EXPECT_GT(prefetches.load(), 0);
}

}  // namespace
}  // namespace tiermem::preload
