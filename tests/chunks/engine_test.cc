#include "chunks/engine.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <random>
#include <string>

#include "base/sanitizers.h"
#include "base/timeline.h"
#include "chunks/mover.h"
#include "tiers/fake/fault_injecting.h"
#include "tiers/fake/mem_nvme.h"
#include "tiers/fake/sim_device.h"
#include "tiers/host/host_tier.h"
#include "tiers/nvme/nvme_tier.h"
#include "prof/analysis.h"
#include "tests/support/host_tier.h"

namespace tiermem::chunks {
namespace {

constexpr Bytes kChunk = 4096;

// Always least-recently-used, ignoring any recorded order: the baseline for Belady.
class LruOnly final : public EvictionPolicy {
 public:
  size_t ChooseVictim(std::span<const EvictionCandidate> c) override {
    size_t best = 0;
    for (size_t i = 1; i < c.size(); ++i) {
      if (c[i].last_use < c[best].last_use) best = i;
    }
    return best;
  }
};

std::unique_ptr<Tier> HostTierOf(Bytes capacity) {
  return testing::TestHostTier(capacity, kChunk);
}

// The real components: SimDevice, the host tier, the in-memory NVMe fake, the Mover (with its
// own staging pool for device<->NVMe bounces) and the binary timeline recorder.
struct Rig {
  explicit Rig(Bytes device, Bytes host, Bytes nvme = 0, EngineConfig cfg = {},
               std::unique_ptr<EvictionPolicy> policy = nullptr, double h2d_bw = 0,
               bool faulty_device = false) {
    path = ::testing::TempDir() + "engine_test_" +
           ::testing::UnitTest::GetInstance()->current_test_info()->name() + ".tmt";
    auto r = TimelineRecorder::Open(path);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    rec = std::move(r).value();
    SimDeviceConfig dc;
    dc.capacity = device;
    dc.h2d_bytes_per_s = h2d_bw;
    dev = NewSimDevice(dc);
    if (faulty_device) {
      auto f = std::make_unique<FaultInjectingTier>(std::move(dev));
      faults = f.get();
      dev = std::move(f);
    }
    host_tier = HostTierOf(host);
    staging = HostTierOf(4 * kChunk);
    if (nvme) nvme_tier = NewMemNvme(MemNvmeConfig{nvme});
    MoverConfig mc;
    mc.staging_slot_bytes = kChunk;
    mc.staging_slots = 1;
    mover = NewMover(mc, staging.get(), rec.get());
    auto e = Engine::Create(cfg, EngineTiers{dev.get(), host_tier.get(), nvme_tier.get()},
                            mover.get(), rec.get(), std::move(policy));
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    engine = std::move(e).value();
  }
  ~Rig() {
    engine.reset();
    std::remove(path.c_str());
  }

  // The timeline written so far, analysed by tiermem::prof (not the engine's counters).
  prof::Report Report() {
    EXPECT_TRUE(engine->Synchronize().ok());
    EXPECT_TRUE(rec->Flush().ok());
    auto r = prof::AnalyzeFile(path);
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    return r.ok() ? *r : prof::Report{};
  }
  std::vector<Event> Events() {
    std::vector<Event> out;
    EXPECT_TRUE(rec->Flush().ok());
    EXPECT_TRUE(prof::ForEachOrdered(path, [&](const TimelineEntry& e) {
                  out.push_back(e.event);
                }).ok());
    return out;
  }
  static Bytes Moved(const prof::Report& r, TierKind src, TierKind dst) {
    for (const prof::MoveStats& m : r.moves) {
      if (m.src == src && m.dst == dst) return m.bytes;
    }
    return 0;
  }

  // Fills chunk `id` (through the host) with bytes derived from `seed`.
  void Fill(ChunkId id, uint8_t seed) {
    auto p = engine->Acquire(id, TierKind::kHost);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    auto* b = static_cast<uint8_t*>(*p);
    for (Bytes i = 0; i < engine->ChunkBytes(id); ++i) b[i] = static_cast<uint8_t>(seed + i * 7);
    ASSERT_TRUE(engine->Release(id, true).ok());
  }
  static bool Holds(const void* p, Bytes n, uint8_t seed) {
    auto* b = static_cast<const uint8_t*>(p);
    for (Bytes i = 0; i < n; ++i) {
      if (b[i] != static_cast<uint8_t>(seed + i * 7)) return false;
    }
    return true;
  }

  std::string path;
  std::unique_ptr<TimelineRecorder> rec;
  std::unique_ptr<Tier> dev, host_tier, staging, nvme_tier;
  std::unique_ptr<Mover> mover;
  std::unique_ptr<Engine> engine;
  FaultInjectingTier* faults = nullptr;  // the device's wrapper when faulty_device
};

ChunkId Add(Rig& r, Category cat = Category::kParam) {
  auto id = r.engine->AddChunk(kChunk, cat);
  EXPECT_TRUE(id.ok()) << id.status().ToString();
  return *id;
}

TEST(Engine, ReadAtAndWriteAtUseTheResidentCopyWithoutMovingIt) {
  Rig r(kChunk, 16 * kChunk, 16 * kChunk);
  ChunkId a = Add(r), z = Add(r);
  auto on_nvme = r.engine->AddChunk(kChunk, Category::kOptimState, TierKind::kNvme);
  ASSERT_TRUE(on_nvme.ok());
  r.Fill(a, 1);
  // Pinned on the device, modified there: ReadAt sees the device bytes, nothing moves.
  auto pa = r.engine->Acquire(a, TierKind::kDevice);
  ASSERT_TRUE(pa.ok());
  static_cast<uint8_t*>(*pa)[100] = 0xAB;
  const Bytes h2d = Rig::Moved(r.Report(), TierKind::kHost, TierKind::kDevice);
  uint8_t buf[64];
  ASSERT_TRUE(r.engine->ReadAt(a, 90, buf, 20).ok());
  EXPECT_EQ(buf[10], 0xAB);
  EXPECT_EQ(buf[0], static_cast<uint8_t>(1 + 90 * 7));
  // WriteAt into the pinned device copy: it becomes dirty, and the eviction writes it home.
  const uint8_t w[3] = {7, 8, 9};
  ASSERT_TRUE(r.engine->WriteAt(a, 4000, w, 3).ok());
  EXPECT_EQ(static_cast<uint8_t*>(*pa)[4001], 8);
  EXPECT_EQ(r.engine->Resident(a), TierKind::kDevice);
  ASSERT_TRUE(r.engine->Release(a, false).ok());
  EXPECT_TRUE(r.engine->Dirty(a));
  EXPECT_EQ(Rig::Moved(r.Report(), TierKind::kHost, TierKind::kDevice), h2d);
  auto ph = r.engine->Acquire(a, TierKind::kHost);  // back home: the write-back carries it
  ASSERT_TRUE(ph.ok());
  EXPECT_EQ(static_cast<uint8_t*>(*ph)[4002], 9);
  EXPECT_EQ(static_cast<uint8_t*>(*ph)[100], 0xAB);
  ASSERT_TRUE(r.engine->Release(a, false).ok());
  // A lazily zero chunk reads zeros; a write makes it real.
  std::memset(buf, 0x55, sizeof(buf));
  ASSERT_TRUE(r.engine->ReadAt(z, 0, buf, 64).ok());
  EXPECT_TRUE(std::all_of(buf, buf + 64, [](uint8_t b) { return b == 0; }));
  ASSERT_TRUE(r.engine->WriteAt(z, 10, w, 3).ok());
  ASSERT_TRUE(r.engine->ReadAt(z, 8, buf, 6).ok());
  EXPECT_EQ(buf[0], 0);
  EXPECT_EQ(buf[2], 7);
  EXPECT_EQ(buf[5], 0);
  // An NVMe-homed chunk, unaligned.
  ASSERT_TRUE(r.engine->WriteAt(*on_nvme, 1001, w, 3).ok());
  ASSERT_TRUE(r.engine->ReadAt(*on_nvme, 1000, buf, 5).ok());
  EXPECT_EQ(buf[1], 7);
  EXPECT_EQ(buf[3], 9);
  EXPECT_EQ(buf[4], 0);
  EXPECT_EQ(r.engine->ReadAt(a, kChunk - 2, buf, 3).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(r.engine->WriteAt(a, kChunk + 1, w, 0).code(), StatusCode::kOutOfRange);
}

TEST(Engine, AcquireOnDeviceCarriesDataAndWriteBackOnEviction) {
  Rig r(kChunk, 16 * kChunk);
  ChunkId a = Add(r), b = Add(r), c = Add(r);
  r.Fill(a, 1);
  r.Fill(b, 2);
  r.Fill(c, 3);
  auto pa = r.engine->Acquire(a, TierKind::kDevice);
  ASSERT_TRUE(pa.ok());
  EXPECT_EQ(r.engine->Resident(a), TierKind::kDevice);
  EXPECT_TRUE(Rig::Holds(*pa, kChunk, 1));
  static_cast<uint8_t*>(*pa)[5] = 0xAB;  // modify on device
  ASSERT_TRUE(r.engine->Release(a, true).ok());
  EXPECT_TRUE(r.engine->Dirty(a));
  // b needs the device: a (dirty) is written back and evicted; c then evicts clean b.
  ASSERT_TRUE(r.engine->Acquire(b, TierKind::kDevice).ok());
  ASSERT_TRUE(r.engine->Release(b, false).ok());
  ASSERT_TRUE(r.engine->Acquire(c, TierKind::kDevice).ok());
  ASSERT_TRUE(r.engine->Release(c, false).ok());
  EXPECT_EQ(r.engine->Resident(a), TierKind::kHost);
  auto ha = r.engine->Acquire(a, TierKind::kHost);
  ASSERT_TRUE(ha.ok());
  EXPECT_EQ(static_cast<uint8_t*>(*ha)[5], 0xAB);
  EXPECT_EQ(static_cast<uint8_t*>(*ha)[6], static_cast<uint8_t>(1 + 6 * 7));
  ASSERT_TRUE(r.engine->Release(a, false).ok());
  const EngineStats s = r.engine->Stats();
  EXPECT_EQ(s.bytes_moved[0][1], kChunk);  // one write-back device->host
  EXPECT_EQ(s.bytes_moved[1][0], 3 * kChunk);
  EXPECT_EQ(s.evictions, 2u);
  EXPECT_EQ(s.clean_evictions, 1u);
}

TEST(Engine, CleanEvictionMovesNoBytesAndIsMarkedCleanInTimeline) {
  Rig r(kChunk, 8 * kChunk);
  ChunkId a = Add(r), b = Add(r);
  r.Fill(a, 1);
  r.Fill(b, 2);
  ASSERT_TRUE(r.engine->Acquire(a, TierKind::kDevice).ok());
  ASSERT_TRUE(r.engine->Release(a, false).ok());
  auto pb = r.engine->Acquire(b, TierKind::kDevice);
  ASSERT_TRUE(pb.ok());
  EXPECT_TRUE(Rig::Holds(*pb, kChunk, 2));
  ASSERT_TRUE(r.engine->Release(b, false).ok());
  const EngineStats s = r.engine->Stats();
  EXPECT_EQ(s.bytes_moved[0][1], 0u);
  EXPECT_EQ(s.clean_evictions, 1u);
  int clean_frees = 0;
  for (const Event& e : r.Events()) {
    if (e.type == EventType::kFree && e.tier == TierKind::kDevice && e.chunk == a) {
      EXPECT_TRUE(e.flags & kFlagClean);
      ++clean_frees;
    }
  }
  EXPECT_EQ(clean_frees, 1);
}

TEST(Engine, BudgetNeverExceededAndDataIntactUnderRandomAccess) {
  EngineConfig cfg;
  cfg.prefetch_depth = 3;
  Rig r(5 * kChunk, 64 * kChunk, 0, cfg);
  std::vector<ChunkId> ids;
  for (int i = 0; i < 12; ++i) {
    ids.push_back(Add(r));
    r.Fill(ids.back(), static_cast<uint8_t>(i * 13));
  }
  std::vector<uint8_t> seed(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) seed[i] = static_cast<uint8_t>(i * 13);
  std::mt19937 rng(42);
  // Iterations repeat one access sequence (so the recorded order is followed: Belady +
  // prefetch), with a random divergence in the last one.
  std::vector<int> seq;
  for (int k = 0; k < 40; ++k) seq.push_back(static_cast<int>(rng() % ids.size()));
  for (int it = 0; it < 4; ++it) {
    r.engine->BeginIteration();
    if (it == 3) std::swap(seq[3], seq[20]);
    for (size_t k = 0; k < seq.size(); ++k) {
      const int i = seq[k];
      // Sometimes hold two chunks at once.
      const int j = seq[(k + 1) % seq.size()];
      auto p = r.engine->Acquire(ids[i], TierKind::kDevice);
      ASSERT_TRUE(p.ok()) << p.status().ToString();
      ASSERT_TRUE(Rig::Holds(*p, kChunk, seed[i])) << "chunk " << i;
      if (j != i) {
        auto q = r.engine->Acquire(ids[j], TierKind::kDevice);
        ASSERT_TRUE(q.ok()) << q.status().ToString();
        ASSERT_TRUE(Rig::Holds(*q, kChunk, seed[j]));
        ASSERT_TRUE(r.engine->Release(ids[j], false).ok());
      }
      // Rewrite chunk i with a new seed on the device half the time.
      const bool write = (k % 2) == 0;
      if (write) {
        seed[i] = static_cast<uint8_t>(seed[i] + 1);
        auto* b = static_cast<uint8_t*>(*p);
        for (Bytes x = 0; x < kChunk; ++x) b[x] = static_cast<uint8_t>(seed[i] + x * 7);
      }
      ASSERT_TRUE(r.engine->Release(ids[i], write).ok());
    }
  }
  ASSERT_TRUE(r.engine->Synchronize().ok());
  for (size_t i = 0; i < ids.size(); ++i) {
    auto p = r.engine->Acquire(ids[i], TierKind::kHost);
    ASSERT_TRUE(p.ok());
    EXPECT_TRUE(Rig::Holds(*p, kChunk, seed[i])) << "chunk " << i;
    ASSERT_TRUE(r.engine->Release(ids[i], false).ok());
  }
  const prof::Report rep = r.Report();
  const prof::TierStats& dev = rep.tiers[static_cast<int>(TierKind::kDevice)];
  EXPECT_EQ(dev.budget_bytes, 5 * kChunk);
  EXPECT_LE(dev.peak.bytes, 5 * kChunk);  // the peak over every moment of the timeline
  EXPECT_GE(dev.peak.bytes, 4 * kChunk);  // the budget was actually used
  EXPECT_GT(r.engine->Stats().prefetches, 0u);
  // The timeline's copies agree with the engine's own count.
  const EngineStats s = r.engine->Stats();
  EXPECT_EQ(Rig::Moved(rep, TierKind::kHost, TierKind::kDevice), s.bytes_moved[1][0]);
  EXPECT_EQ(Rig::Moved(rep, TierKind::kDevice, TierKind::kHost), s.bytes_moved[0][1]);
}

// Cyclic A B C D with room for 3: LRU misses all 4 every iteration; farthest-next-use, once
// the order is recorded, misses 2.
Bytes FetchesInSecondIteration(std::unique_ptr<EvictionPolicy> policy) {
  EngineConfig cfg;
  cfg.prefetch_depth = 0;
  Rig r(3 * kChunk, 16 * kChunk, 0, cfg, std::move(policy));
  std::vector<ChunkId> ids;
  for (int i = 0; i < 4; ++i) {
    ids.push_back(Add(r));
    r.Fill(ids.back(), static_cast<uint8_t>(i));
  }
  Bytes before = 0;
  for (int it = 0; it < 2; ++it) {
    r.engine->BeginIteration();
    if (it == 1) before = r.engine->Stats().bytes_moved[1][0];
    for (ChunkId id : ids) {
      EXPECT_TRUE(r.engine->Acquire(id, TierKind::kDevice).ok());
      EXPECT_TRUE(r.engine->Release(id, false).ok());
    }
  }
  return r.engine->Stats().bytes_moved[1][0] - before;
}

TEST(Engine, FarthestNextUseBeatsLruOnRecordedOrder) {
  EXPECT_EQ(FetchesInSecondIteration(std::make_unique<LruOnly>()), 4 * kChunk);
  EXPECT_EQ(FetchesInSecondIteration(nullptr), 2 * kChunk);
}

TEST(Engine, PrefetchRunsAheadOnRecordedOrder) {
  EngineConfig cfg;
  cfg.prefetch_depth = 2;
  Rig r(3 * kChunk, 16 * kChunk, 0, cfg, nullptr, /*h2d_bw=*/1e8);
  std::vector<ChunkId> ids;
  for (int i = 0; i < 6; ++i) {
    ids.push_back(Add(r));
    r.Fill(ids.back(), static_cast<uint8_t>(i + 100));
  }
  for (int it = 0; it < 2; ++it) {
    r.engine->BeginIteration();
    for (size_t i = 0; i < ids.size(); ++i) {
      auto p = r.engine->Acquire(ids[i], TierKind::kDevice);
      ASSERT_TRUE(p.ok());
      EXPECT_TRUE(Rig::Holds(*p, kChunk, static_cast<uint8_t>(i + 100)));
      ASSERT_TRUE(r.engine->Release(ids[i], false).ok());
    }
  }
  EXPECT_GE(r.engine->Stats().prefetches, 4u);
  {
    const prof::Report rep = r.Report();
    for (TierKind k : {TierKind::kDevice, TierKind::kHost}) {
      const prof::TierStats& t = rep.tiers[static_cast<int>(k)];
      EXPECT_GT(t.peak.bytes, 0u);
      EXPECT_LE(t.peak.bytes, t.budget_bytes) << TierKindName(k);
    }
  }
}

// Cyclic order (serving): 6 chunks acquired in the same order every iteration, room for 3,
// lookahead 2. Cyclic, the window runs into the next iteration, so from the second one on
// every acquire was prefetched; without it the first of each iteration is fetched
// synchronously (the check can fail). The room lookahead always takes the order to repeat.
uint64_t PrefetchesInThirdIteration(bool cyclic, Lookahead lookahead = Lookahead::kDepth) {
  EngineConfig cfg;
  cfg.prefetch_depth = 2;
  cfg.lookahead = lookahead;
  Rig r(3 * kChunk, 16 * kChunk, 0, cfg);
  r.engine->SetCyclic(cyclic);
  std::vector<ChunkId> ids;
  r.engine->SetTracing(false);  // the fills are not part of the order
  for (int i = 0; i < 6; ++i) {
    ids.push_back(Add(r));
    r.Fill(ids.back(), static_cast<uint8_t>(i + 40));
  }
  r.engine->SetTracing(true);
  uint64_t before = 0;
  for (int it = 0; it < 3; ++it) {
    r.engine->BeginIteration();
    if (it == 2) before = r.engine->Stats().prefetches;
    for (size_t i = 0; i < ids.size(); ++i) {
      auto p = r.engine->Acquire(ids[i], TierKind::kDevice);
      EXPECT_TRUE(p.ok());
      if (p.ok()) {
        EXPECT_TRUE(Rig::Holds(*p, kChunk, static_cast<uint8_t>(i + 40)));
      }
      EXPECT_TRUE(r.engine->Release(ids[i], false).ok());
    }
  }
  const prof::Report rep = r.Report();
  const prof::TierStats& dev = rep.tiers[static_cast<int>(TierKind::kDevice)];
  EXPECT_LE(dev.peak.bytes, dev.budget_bytes);
  EXPECT_EQ(r.engine->Stats().diverged, 0u);
  return r.engine->Stats().prefetches - before;
}

// Accesses of the recorded order that do not come (a deferred optimizer update that ran early)
// are skipped without leaving the order; the order is kept once, and a second skipping
// iteration adopts the new one. An acquire far from the expected one still diverges.
TEST(Engine, FollowingSkipsAccessesThatDidNotComeAndKeepsTheOrderOnce) {
  EngineConfig cfg;
  cfg.prefetch_depth = 2;
  Rig r(3 * kChunk, 64 * kChunk, 0, cfg);
  std::vector<ChunkId> ids;
  r.engine->SetTracing(false);
  for (int i = 0; i < 40; ++i) ids.push_back(Add(r));
  r.engine->SetTracing(true);
  auto iteration = [&](const std::vector<size_t>& which) {
    r.engine->BeginIteration();
    for (size_t i : which) {
      ASSERT_TRUE(r.engine->Acquire(ids[i], TierKind::kDevice).ok());
      ASSERT_TRUE(r.engine->Release(ids[i], false).ok());
    }
  };
  const std::vector<size_t> full = {0, 1, 2, 3, 4, 5, 6, 7};
  const std::vector<size_t> without = {0, 1, 4, 5, 6, 7};  // 2 and 3 did not come
  iteration(full);
  iteration(full);
  EXPECT_EQ(r.engine->Stats().resynced, 0u);
  iteration(without);
  EXPECT_EQ(r.engine->Stats().resynced, 1u);
  iteration(full);  // the order was kept: followed exactly
  EXPECT_EQ(r.engine->Stats().resynced, 1u);
  iteration(without);
  iteration(without);  // skipped twice in a row: the new order is adopted...
  iteration(without);  // ...and followed exactly
  EXPECT_EQ(r.engine->Stats().resynced, 3u);
  EXPECT_EQ(r.engine->Stats().diverged, 0u);
  std::vector<size_t> far = {0};
  for (size_t i = 39; i > 0; --i) far.push_back(i);  // 39 is beyond the window: diverges
  iteration(far);
  EXPECT_EQ(r.engine->Stats().diverged, 1u);
}

TEST(Engine, CyclicOrderPrefetchesAcrossTheIterationBoundary) {
  EXPECT_EQ(PrefetchesInThirdIteration(true), 6u);
  EXPECT_EQ(PrefetchesInThirdIteration(false), 5u);
  EXPECT_EQ(PrefetchesInThirdIteration(false, Lookahead::kRoom), 6u);
}

// External host bytes (activations offloaded from the device) take host budget from the
// caches of NVMe-homed chunks — a dirty one is written home first, so no value is lost — never
// from homes: a request the homes leave no room for is refused before anything moves, naming
// the host budget needed; the timeline shows them as host `activation` bytes.
TEST(Engine, ExternalHostBytesEvictHostCachesNeverHomes) {
  Rig r(4 * kChunk, 6 * kChunk, 16 * kChunk);
  std::vector<ChunkId> homed, deep;
  for (int i = 0; i < 2; ++i) {
    auto id = r.engine->AddChunk(kChunk, Category::kParam, TierKind::kHost);
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    homed.push_back(*id);
  }
  for (int i = 0; i < 3; ++i) {
    auto id = r.engine->AddChunk(kChunk, Category::kOptimState, TierKind::kNvme);
    ASSERT_TRUE(id.ok()) << id.status().ToString();
    deep.push_back(*id);
    r.Fill(*id, static_cast<uint8_t>(10 + i));  // cached on the host, dirty
  }
  EXPECT_EQ(r.host_tier->Stats().used, 5 * kChunk);
  ASSERT_TRUE(r.engine->SetExternalBytes(TierKind::kHost, 2 * kChunk).ok());
  EXPECT_EQ(r.engine->external_bytes(TierKind::kHost), 2 * kChunk);
  EXPECT_LE(r.host_tier->Stats().used, 4 * kChunk);
  EXPECT_EQ(r.engine->Resident(homed[0]), TierKind::kHost);
  EXPECT_EQ(r.engine->Resident(homed[1]), TierKind::kHost);
  // The homes and the external bytes leave no room: refused, nothing evicted.
  const uint64_t evictions = r.engine->Stats().evictions;
  Status s = r.engine->SetExternalBytes(TierKind::kHost, 5 * kChunk);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("host budget must be at least " + std::to_string(7 * kChunk)),
            std::string::npos) << s.message();
  EXPECT_EQ(r.engine->Stats().evictions, evictions);
  EXPECT_EQ(r.engine->external_bytes(TierKind::kHost), 2 * kChunk);
  // Every value survives (the evicted cache was written to NVMe first).
  for (int i = 0; i < 3; ++i) {
    auto p = r.engine->Acquire(deep[i], TierKind::kHost);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    EXPECT_TRUE(Rig::Holds(*p, kChunk, static_cast<uint8_t>(10 + i))) << i;
    ASSERT_TRUE(r.engine->Release(deep[i], false).ok());
  }
  EXPECT_LE(r.host_tier->Stats().used, 4 * kChunk);
  // The device tier is separate, and no other tier has external bytes.
  EXPECT_EQ(r.engine->external_device_bytes(), 0u);
  EXPECT_EQ(r.engine->SetExternalBytes(TierKind::kNvme, kChunk).code(),
            StatusCode::kInvalidArgument);
  ASSERT_TRUE(r.engine->SetExternalBytes(TierKind::kHost, 0).ok());
  const prof::Report rep = r.Report();
  EXPECT_EQ(rep.tiers[static_cast<int>(TierKind::kHost)]
                .categories[static_cast<int>(Category::kActivation)]
                .peak.bytes,
            2 * kChunk);
}

// External device bytes (a served model's KV cache) take budget from the chunks: setting them
// evicts unpinned chunks, later allocations use only what is left, the timeline shows them as
// device `activation` bytes, and a request the pinned chunks leave no room for fails with the
// bytes named and changes nothing.
TEST(Engine, ExternalDeviceBytesCountInTheBudget) {
  Rig r(4 * kChunk, 16 * kChunk);
  std::vector<ChunkId> ids;
  for (int i = 0; i < 6; ++i) {
    ids.push_back(Add(r));
    r.Fill(ids.back(), static_cast<uint8_t>(i));
  }
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(r.engine->Acquire(ids[i], TierKind::kDevice).ok());
    ASSERT_TRUE(r.engine->Release(ids[i], false).ok());
  }
  EXPECT_EQ(r.dev->Stats().used, 4 * kChunk);
  ASSERT_TRUE(r.engine->SetExternalDeviceBytes(2 * kChunk).ok());
  EXPECT_EQ(r.engine->external_device_bytes(), 2 * kChunk);
  EXPECT_LE(r.dev->Stats().used, 2 * kChunk);
  EXPECT_EQ(r.engine->Stats().evictions, 2u);
  // Two chunks pinned fill what is left; a third cannot be placed.
  ASSERT_TRUE(r.engine->Acquire(ids[4], TierKind::kDevice).ok());
  ASSERT_TRUE(r.engine->Acquire(ids[5], TierKind::kDevice).ok());
  auto third = r.engine->Acquire(ids[0], TierKind::kDevice);
  ASSERT_FALSE(third.ok());
  EXPECT_EQ(third.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(third.status().message().find("non-chunk device memory"), std::string::npos)
      << third.status().message();
  // More external bytes than the pinned chunks leave: refused, nothing changes.
  Status s = r.engine->SetExternalDeviceBytes(3 * kChunk);
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("at least " + std::to_string(5 * kChunk) + " bytes"),
            std::string::npos) << s.message();
  EXPECT_EQ(r.engine->external_device_bytes(), 2 * kChunk);
  // Refused before evicting anything: an unpinned chunk stays where it is.
  ASSERT_TRUE(r.engine->Release(ids[5], false).ok());
  const uint64_t evictions = r.engine->Stats().evictions;
  EXPECT_EQ(r.engine->SetExternalDeviceBytes(4 * kChunk).code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(r.engine->Resident(ids[5]), TierKind::kDevice);
  EXPECT_EQ(r.engine->Stats().evictions, evictions);
  ASSERT_TRUE(r.engine->Release(ids[4], false).ok());
  ASSERT_TRUE(r.engine->SetExternalDeviceBytes(3 * kChunk).ok());
  auto p = r.engine->Acquire(ids[0], TierKind::kDevice);
  ASSERT_TRUE(p.ok());
  EXPECT_TRUE(Rig::Holds(*p, kChunk, 0));
  ASSERT_TRUE(r.engine->Release(ids[0], false).ok());
  ASSERT_TRUE(r.engine->SetExternalDeviceBytes(0).ok());
  const prof::Report rep = r.Report();
  const prof::TierStats& dev = rep.tiers[static_cast<int>(TierKind::kDevice)];
  EXPECT_EQ(dev.categories[static_cast<int>(Category::kActivation)].peak.bytes, 3 * kChunk);
  EXPECT_EQ(dev.peak.bytes, 4 * kChunk);  // chunks + external, never above the budget
  EXPECT_LE(dev.peak.bytes, dev.budget_bytes);
}

// Write-behind: in an iteration that follows the recorded order, a chunk released modified
// and not needed again soon is written home in the background, so its eviction later is
// clean (no write-back stall) and the data is intact; with write-behind off the same run
// stalls on evict write-backs (the check can fail).
TEST(Engine, WriteBehindMakesLaterEvictionsCleanAndKeepsTheData) {
  for (bool on : {true, false}) {
    SCOPED_TRACE(on ? "write-behind on" : "write-behind off");
    EngineConfig cfg;
    cfg.prefetch_depth = 1;
    cfg.write_behind = on;
    Rig r(2 * kChunk, 16 * kChunk, 0, cfg);
    std::vector<ChunkId> ids;
    for (int i = 0; i < 6; ++i) ids.push_back(Add(r));
    for (int it = 0; it < 3; ++it) {
      r.engine->BeginIteration();
      for (size_t i = 0; i < ids.size(); ++i) {
        auto p = r.engine->Acquire(ids[i], TierKind::kDevice);
        ASSERT_TRUE(p.ok()) << p.status().ToString();
        if (it > 0) {
          ASSERT_TRUE(Rig::Holds(*p, kChunk, static_cast<uint8_t>(10 * it + i - 10)))
              << "iteration " << it << " chunk " << i;
        }
        auto* b = static_cast<uint8_t*>(*p);
        for (Bytes k = 0; k < kChunk; ++k) b[k] = static_cast<uint8_t>(10 * it + i + k * 7);
        ASSERT_TRUE(r.engine->Release(ids[i], true).ok());
      }
    }
    // Home copies hold the last values once everything is written.
    ASSERT_TRUE(r.engine->Flush().ok());
    for (size_t i = 0; i < ids.size(); ++i) {
      auto p = r.engine->Acquire(ids[i], TierKind::kHost);
      ASSERT_TRUE(p.ok());
      EXPECT_TRUE(Rig::Holds(*p, kChunk, static_cast<uint8_t>(20 + i)));
      ASSERT_TRUE(r.engine->Release(ids[i], false).ok());
    }
    const EngineStats st = r.engine->Stats();
    // Every chunk is modified each time it is used: an eviction is clean only because its
    // write-back already happened in the background.
    if (on) {
      EXPECT_GE(st.write_behinds, 8u);  // iterations 2 and 3 follow the recorded order
      EXPECT_GE(st.clean_evictions, 8u);
    } else {
      EXPECT_EQ(st.write_behinds, 0u);
      EXPECT_EQ(st.clean_evictions, 0u);
    }
    // The same bytes reach home either way (each modified copy written once).
    EXPECT_EQ(Rig::Moved(r.Report(), TierKind::kDevice, TierKind::kHost),
              st.bytes_moved[0][1]);
  }
}

// A write-behind that fails (the device read of the copy fails) loses nothing: the cached copy
// stays, still dirty; whatever waits for it gets the error naming the background write-back;
// the data is then written home by the next flush.
TEST(Engine, FailedWriteBehindKeepsTheDirtyCopyAndReportsTheError) {
  EngineConfig cfg;
  cfg.prefetch_depth = 1;
  // Room for 3 of the 4 chunks: the first pass evicts, so the second writes behind.
  Rig r(3 * kChunk, 16 * kChunk, 0, cfg, nullptr, 0, /*faulty_device=*/true);
  std::vector<ChunkId> ids;
  for (int i = 0; i < 4; ++i) ids.push_back(Add(r));
  auto pass = [&](uint8_t seed, bool arm) -> Status {
    r.engine->BeginIteration();
    for (size_t i = 0; i < ids.size(); ++i) {
      auto p = r.engine->Acquire(ids[i], TierKind::kDevice);
      if (!p.ok()) return p.status();
      auto* b = static_cast<uint8_t*>(*p);
      for (Bytes k = 0; k < kChunk; ++k) b[k] = static_cast<uint8_t>(seed + i + k * 7);
      if (arm && i == 3) r.faults->FailNextRead(EIO);  // the write-behind's read
      Status s = r.engine->Release(ids[i], true);
      if (!s.ok()) return s;
    }
    return OkStatus();
  };
  ASSERT_TRUE(pass(1, false).ok());  // records the order; evicts
  const uint64_t before = r.engine->Stats().write_behinds;
  // The last chunk's write-behind fails in the background; the flush waits for it and gets
  // the error. (An eviction that finds a failed write-behind finished retries synchronously.)
  ASSERT_TRUE(pass(50, true).ok());
  EXPECT_GT(r.engine->Stats().write_behinds, before);
  EXPECT_EQ(r.faults->faults_fired(), 1u);
  Status err = r.engine->Flush();
  EXPECT_EQ(err.code(), StatusCode::kIOError) << err.ToString();
  EXPECT_NE(err.message().find("background write-back of chunk"), std::string::npos)
      << err.ToString();
  EXPECT_TRUE(r.engine->Dirty(ids[3]));
  EXPECT_EQ(r.engine->Resident(ids[3]), TierKind::kDevice);
  // Nothing was lost: the cached copy still holds iteration 2's values, and a flush now
  // writes them home.
  ASSERT_TRUE(r.engine->Flush().ok());
  EXPECT_FALSE(r.engine->Dirty(ids[3]));
  for (size_t i = 0; i < ids.size(); ++i) {
    auto p = r.engine->Acquire(ids[i], TierKind::kHost);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    EXPECT_TRUE(Rig::Holds(*p, kChunk, static_cast<uint8_t>(50 + i))) << "chunk " << i;
    ASSERT_TRUE(r.engine->Release(ids[i], false).ok());
  }
}

// Planned mode: a planned eviction of a dirty chunk writes it home in the background and frees
// its room when that ends; a planned prefetch that finds the room still held by it waits
// (deferred, not a stall) and starts at a later call; an acquire of a chunk whose planned
// eviction is in flight keeps the copy.
TEST(Engine, PlannedEvictionWritesBackInTheBackgroundAndAPrefetchTakesTheRoom) {
  EngineConfig cfg;
  cfg.prefetch_depth = 0;
  Rig r(2 * kChunk, 16 * kChunk, 0, cfg, nullptr, /*h2d_bw=*/0);
  std::vector<ChunkId> ids;
  for (int i = 0; i < 3; ++i) {
    ids.push_back(Add(r));
    r.Fill(ids.back(), static_cast<uint8_t>(10 * i));
  }
  r.engine->SetPlanned(true);
  r.engine->BeginIteration();
  for (int i = 0; i < 2; ++i) {
    auto p = r.engine->Acquire(ids[i], TierKind::kDevice);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    std::memset(*p, 0, kChunk);
    auto* b = static_cast<uint8_t*>(*p);
    for (Bytes k = 0; k < kChunk; ++k) b[k] = static_cast<uint8_t>(100 + i + k * 7);
    ASSERT_TRUE(r.engine->Release(ids[i], true).ok());
  }
  ASSERT_TRUE(r.engine->Dirty(ids[0]));
  // Evicting a pinned chunk or one not cached there does nothing.
  ASSERT_TRUE(r.engine->Acquire(ids[1], TierKind::kDevice).ok());
  EXPECT_FALSE(*r.engine->PlanEvict(ids[1], TierKind::kDevice));
  EXPECT_FALSE(*r.engine->PlanEvict(ids[2], TierKind::kDevice));
  ASSERT_TRUE(r.engine->Release(ids[1], false).ok());
  ASSERT_TRUE(*r.engine->PlanEvict(ids[0], TierKind::kDevice));
  // Chunk 2 goes where chunk 0 was: started now if the write-back already ended, else
  // deferred until it has.
  const bool started = *r.engine->PlanPrefetch(ids[2], TierKind::kDevice);
  ASSERT_TRUE(r.engine->Synchronize().ok());  // chunk 0's write-back ends, its room is freed
  EXPECT_EQ(r.engine->Resident(ids[0]), TierKind::kHost);
  if (!started) {
    EXPECT_EQ(r.engine->Stats().plan_deferred, 1u);
    EXPECT_EQ(r.engine->Resident(ids[2]), TierKind::kHost);
    r.engine->Moment("next");  // retries it
  }
  EXPECT_EQ(r.engine->Resident(ids[2]), TierKind::kDevice);
  auto p2 = r.engine->Acquire(ids[2], TierKind::kDevice);
  ASSERT_TRUE(p2.ok());
  ASSERT_TRUE(r.engine->Synchronize().ok());
  EXPECT_TRUE(Rig::Holds(*p2, kChunk, 20));
  ASSERT_TRUE(r.engine->Release(ids[2], false).ok());
  // An acquire cancels a planned eviction still in flight: the copy stays (clean once written).
  ASSERT_TRUE(*r.engine->PlanEvict(ids[1], TierKind::kDevice));
  auto p1 = r.engine->Acquire(ids[1], TierKind::kDevice);
  ASSERT_TRUE(p1.ok());
  EXPECT_TRUE(Rig::Holds(*p1, kChunk, 101));
  ASSERT_TRUE(r.engine->Release(ids[1], false).ok());
  EXPECT_EQ(r.engine->Resident(ids[1]), TierKind::kDevice);
  EXPECT_FALSE(r.engine->Dirty(ids[1]));
  // Chunk 0's new values reached its home.
  auto p0 = r.engine->Acquire(ids[0], TierKind::kHost);
  ASSERT_TRUE(p0.ok());
  EXPECT_TRUE(Rig::Holds(*p0, kChunk, 100));
  ASSERT_TRUE(r.engine->Release(ids[0], false).ok());
  const EngineStats st = r.engine->Stats();
  EXPECT_EQ(st.plan_evictions, 2u);
  EXPECT_EQ(st.plan_prefetches, 1u);
  EXPECT_EQ(st.plan_skipped, 2u);
  const prof::Report rep = r.Report();
  EXPECT_LE(rep.tiers[static_cast<int>(TierKind::kDevice)].peak.bytes, 2 * kChunk);
}

// Whatever a plan says — evictions of chunks about to be used, prefetches that cannot fit, on
// every tier — the values are the same and no budget is exceeded: the plan only moves copies.
TEST(Engine, ArbitraryPlannedActionsNeverChangeAValueNorExceedABudget) {
  for (bool nvme : {false, true}) {
    SCOPED_TRACE(nvme ? "NVMe homes" : "host homes");
    EngineConfig cfg;
    cfg.prefetch_depth = 2;
    cfg.host_reserve_bytes = nvme ? 3 * kChunk : 0;
    Rig r(4 * kChunk, nvme ? 8 * kChunk : 64 * kChunk, nvme ? 64 * kChunk : 0, cfg);
    std::vector<ChunkId> ids;
    for (int i = 0; i < 10; ++i) {
      ids.push_back(Add(r));
      r.Fill(ids.back(), static_cast<uint8_t>(i * 13));
    }
    std::vector<uint8_t> seed(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) seed[i] = static_cast<uint8_t>(i * 13);
    std::mt19937 rng(7);
    r.engine->SetPlanned(true);
    for (int it = 0; it < 4; ++it) {
      r.engine->BeginIteration();
      for (int k = 0; k < 60; ++k) {
        // A few random planned actions before each access.
        for (int a = static_cast<int>(rng() % 4); a > 0; --a) {
          const ChunkId c = ids[rng() % ids.size()];
          const TierKind t = (rng() % 3 == 0) ? TierKind::kHost : TierKind::kDevice;
          auto res = (rng() % 2) ? r.engine->PlanEvict(c, t) : r.engine->PlanPrefetch(c, t);
          ASSERT_TRUE(res.ok()) << res.status().ToString();
        }
        const int i = static_cast<int>(rng() % ids.size());
        const TierKind where = (rng() % 4 == 0) ? TierKind::kHost : TierKind::kDevice;
        auto p = r.engine->Acquire(ids[i], where);
        ASSERT_TRUE(p.ok()) << p.status().ToString();
        ASSERT_TRUE(Rig::Holds(*p, kChunk, seed[i])) << "iteration " << it << " access " << k;
        const bool write = rng() % 2 == 0;
        if (write) {
          seed[i] = static_cast<uint8_t>(seed[i] + 1);
          auto* b = static_cast<uint8_t*>(*p);
          for (Bytes x = 0; x < kChunk; ++x) b[x] = static_cast<uint8_t>(seed[i] + x * 7);
        }
        ASSERT_TRUE(r.engine->Release(ids[i], write).ok());
        if (k % 17 == 0) r.engine->Moment("m");
      }
    }
    ASSERT_TRUE(r.engine->Flush().ok());
    for (size_t i = 0; i < ids.size(); ++i) {
      auto p = r.engine->Acquire(ids[i], TierKind::kHost);
      ASSERT_TRUE(p.ok());
      EXPECT_TRUE(Rig::Holds(*p, kChunk, seed[i])) << "chunk " << i;
      ASSERT_TRUE(r.engine->Release(ids[i], false).ok());
    }
    const EngineStats st = r.engine->Stats();
    EXPECT_GT(st.plan_evictions, 10u);
    EXPECT_GT(st.plan_prefetches, 10u);
    const prof::Report rep = r.Report();
    EXPECT_LE(rep.tiers[static_cast<int>(TierKind::kDevice)].peak.bytes, 4 * kChunk);
    EXPECT_LE(rep.tiers[static_cast<int>(TierKind::kHost)].peak.bytes,
              nvme ? 8 * kChunk : 64 * kChunk);
  }
}

TEST(Engine, ChunksThatDoNotFitInHostLiveOnNvme) {
  EngineConfig cfg;
  cfg.host_reserve_bytes = 2 * kChunk;
  Rig r(2 * kChunk, 5 * kChunk, 16 * kChunk, cfg);
  std::vector<ChunkId> ids;
  for (int i = 0; i < 8; ++i) {
    ids.push_back(Add(r));
  }
  int on_nvme = 0;
  for (ChunkId id : ids) on_nvme += r.engine->Home(id) == TierKind::kNvme;
  EXPECT_EQ(on_nvme, 5);  // 3 homes fit in host beside the 2-chunk reserve
  for (size_t i = 0; i < ids.size(); ++i) r.Fill(ids[i], static_cast<uint8_t>(i * 3));
  for (int round = 0; round < 2; ++round) {
    for (size_t i = 0; i < ids.size(); ++i) {
      auto p = r.engine->Acquire(ids[i], TierKind::kDevice);
      ASSERT_TRUE(p.ok()) << p.status().ToString();
      EXPECT_TRUE(Rig::Holds(*p, kChunk, static_cast<uint8_t>(i * 3))) << i;
      ASSERT_TRUE(r.engine->Release(ids[i], false).ok());
    }
  }
  const EngineStats s = r.engine->Stats();
  EXPECT_GT(s.bytes_moved[2][0] + s.bytes_moved[2][1], 0u);  // read from NVMe
  EXPECT_GT(s.bytes_moved[1][2], 0u);                         // written back from the host cache
  {
    const prof::Report rep = r.Report();
    for (TierKind k : {TierKind::kDevice, TierKind::kHost}) {
      const prof::TierStats& t = rep.tiers[static_cast<int>(k)];
      EXPECT_GT(t.peak.bytes, 0u);
      EXPECT_LE(t.peak.bytes, t.budget_bytes) << TierKindName(k);
    }
  }
}

TEST(Engine, ZeroIsLazyAndReadsZeros) {
  Rig r(2 * kChunk, 8 * kChunk);
  ChunkId a = Add(r, Category::kGrad);
  r.Fill(a, 9);
  ASSERT_TRUE(r.engine->Acquire(a, TierKind::kDevice).ok());
  ASSERT_TRUE(r.engine->Release(a, true).ok());
  const Bytes moved = r.engine->Stats().bytes_moved[0][1];
  ASSERT_TRUE(r.engine->Zero(a).ok());
  EXPECT_EQ(r.engine->Resident(a), TierKind::kHost);
  EXPECT_EQ(r.engine->Stats().bytes_moved[0][1], moved);  // dropped, not written back
  auto p = r.engine->Acquire(a, TierKind::kDevice);
  ASSERT_TRUE(p.ok());
  for (Bytes i = 0; i < kChunk; ++i) ASSERT_EQ(static_cast<uint8_t*>(*p)[i], 0) << i;
  ASSERT_TRUE(r.engine->Release(a, false).ok());
  auto h = r.engine->Acquire(a, TierKind::kHost);
  ASSERT_TRUE(h.ok());
  for (Bytes i = 0; i < kChunk; ++i) ASSERT_EQ(static_cast<uint8_t*>(*h)[i], 0) << i;
}

TEST(Engine, AnAdoptedHostCopyBecomesTheContentWithoutACopy) {
  constexpr int kHost = static_cast<int>(TierKind::kHost);
  constexpr int kNvme = static_cast<int>(TierKind::kNvme);
  Rig r(2 * kChunk, 16 * kChunk, 16 * kChunk);
  ChunkId a = Add(r);  // homed on the host, with a clean device copy
  r.Fill(a, 1);
  ASSERT_TRUE(r.engine->Acquire(a, TierKind::kDevice).ok());
  ASSERT_TRUE(r.engine->Release(a, false).ok());
  auto nv = r.engine->AddChunk(kChunk, Category::kOptimState, TierKind::kNvme);
  ASSERT_TRUE(nv.ok());
  const ChunkId n = *nv;
  r.Fill(n, 2);  // a dirty host copy of an NVMe-homed chunk
  auto fill = [&](uint8_t seed) {
    auto s = r.engine->AllocateScratch(TierKind::kHost, kChunk, Category::kParam);
    EXPECT_TRUE(s.ok()) << s.status().ToString();
    auto* b = static_cast<uint8_t*>(s->addr);
    for (Bytes i = 0; i < kChunk; ++i) b[i] = static_cast<uint8_t>(seed + i * 7);
    return *s;
  };
  // Pinned: refused, nothing changes.
  ASSERT_TRUE(r.engine->Acquire(a, TierKind::kDevice).ok());
  Region sa = fill(9);
  EXPECT_EQ(r.engine->AdoptHostCopy(a, sa).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(r.engine->Release(a, false).ok());
  std::vector<uint8_t> out(kChunk);
  ASSERT_TRUE(r.engine->ReadAt(a, 0, out.data(), kChunk).ok());
  EXPECT_TRUE(Rig::Holds(out.data(), kChunk, 1));
  EXPECT_EQ(r.engine->Stats().scratch[kHost], kChunk);

  const chunks::EngineStats before = r.engine->Stats();
  ASSERT_TRUE(r.engine->AdoptHostCopy(a, sa).ok());
  EXPECT_EQ(r.engine->Resident(a), TierKind::kHost);  // the device copy is gone (stale)
  EXPECT_EQ(r.engine->Home(a), TierKind::kHost);
  ASSERT_TRUE(r.engine->ReadAt(a, 0, out.data(), kChunk).ok());
  EXPECT_TRUE(Rig::Holds(out.data(), kChunk, 9));
  Region sn = fill(8);
  ASSERT_TRUE(r.engine->AdoptHostCopy(n, sn).ok());
  EXPECT_TRUE(r.engine->Dirty(n));
  EXPECT_EQ(r.engine->Resident(n), TierKind::kHost);
  ASSERT_TRUE(r.engine->ReadAt(n, 0, out.data(), kChunk).ok());
  EXPECT_TRUE(Rig::Holds(out.data(), kChunk, 8));
  chunks::EngineStats after = r.engine->Stats();
  EXPECT_EQ(after.scratch[kHost], 0u);
  // a's home and n's host copy only: the scratch regions became them, the old ones are gone.
  EXPECT_EQ(after.tiers[kHost].used, 2 * kChunk);
  for (int s = 0; s < 3; ++s) {
    for (int d = 0; d < 3; ++d) EXPECT_EQ(after.bytes_moved[s][d], before.bytes_moved[s][d]);
  }
  // The NVMe home gets the adopted bytes like any dirty copy's.
  ASSERT_TRUE(r.engine->Flush().ok());
  EXPECT_FALSE(r.engine->Dirty(n));
  EXPECT_EQ(r.engine->Stats().bytes_moved[kHost][kNvme], after.bytes_moved[kHost][kNvme] + kChunk);
  auto d = r.engine->Acquire(a, TierKind::kDevice);
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(Rig::Holds(*d, kChunk, 9));
  ASSERT_TRUE(r.engine->Release(a, false).ok());
  EXPECT_EQ(r.engine->Stats().tiers[static_cast<int>(TierKind::kDevice)].used, kChunk);
}

TEST(Engine, AcquireForWriteLeavesTheZeroFillToTheCaller) {
  Rig r(2 * kChunk, 8 * kChunk);
  ChunkId a = Add(r, Category::kGrad);
  ChunkId b = Add(r, Category::kGrad);
  r.Fill(a, 9);
  r.Fill(b, 5);
  ASSERT_TRUE(r.engine->Acquire(a, TierKind::kDevice).ok());
  ASSERT_TRUE(r.engine->Release(a, true).ok());
  ASSERT_TRUE(r.engine->Zero(a).ok());
  const Bytes h2d = r.engine->Stats().bytes_moved[1][0];
  bool must_zero = false;
  auto p = r.engine->AcquireForWrite(a, TierKind::kDevice, &must_zero);
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_TRUE(must_zero);
  EXPECT_EQ(r.engine->Stats().bytes_moved[1][0], h2d);  // nothing copied in
  // The caller's duty: zeros over the whole chunk, then its own writes.
  auto* d = static_cast<uint8_t*>(*p);
  std::memset(d, 0, kChunk);
  d[10] = 42;
  ASSERT_TRUE(r.engine->Release(a, true).ok());
  EXPECT_TRUE(r.engine->Dirty(a));
  auto h = r.engine->Acquire(a, TierKind::kHost);  // written back from the device
  ASSERT_TRUE(h.ok());
  for (Bytes i = 0; i < kChunk; ++i) {
    ASSERT_EQ(static_cast<uint8_t*>(*h)[i], i == 10 ? 42 : 0) << i;
  }
  ASSERT_TRUE(r.engine->Release(a, false).ok());
  // A chunk with content: filled as by Acquire, nothing owed.
  auto q = r.engine->AcquireForWrite(b, TierKind::kDevice, &must_zero);
  ASSERT_TRUE(q.ok());
  EXPECT_FALSE(must_zero);
  EXPECT_TRUE(Rig::Holds(*q, kChunk, 5));
  ASSERT_TRUE(r.engine->Release(b, false).ok());
  // A zero chunk acquired on host is handed over unfilled too (no memset the caller's own
  // writes would repeat): it owes every byte, and what it wrote is what the chunk holds.
  ASSERT_TRUE(r.engine->Zero(b).ok());
  auto z = r.engine->AcquireForWrite(b, TierKind::kHost, &must_zero);
  ASSERT_TRUE(z.ok());
  EXPECT_TRUE(must_zero);
  std::memset(*z, 7, kChunk);  // the caller's values, over all of it
  ASSERT_TRUE(r.engine->Release(b, true).ok());
  auto zr = r.engine->Acquire(b, TierKind::kDevice);
  ASSERT_TRUE(zr.ok());
  for (Bytes i = 0; i < kChunk; ++i) ASSERT_EQ(static_cast<uint8_t*>(*zr)[i], 7) << i;
  ASSERT_TRUE(r.engine->Release(b, false).ok());
  EXPECT_EQ(r.engine->AcquireForWrite(b, TierKind::kDevice, nullptr).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(r.engine->Pins(b), 0);
  for (const prof::StallStats& st : r.Report().stalls) EXPECT_NE(st.cause, "zero fill");
}

TEST(Engine, BadRequestsGetSpecificErrorsAndChangeNothing) {
  Rig r(kChunk, 3 * kChunk);
  ChunkId a = Add(r), b = Add(r);
  EXPECT_EQ(r.engine->Acquire(99, TierKind::kDevice).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(r.engine->Acquire(a, TierKind::kNvme).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(r.engine->Release(a, false).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(r.engine->Acquire(a, TierKind::kDevice).ok());
  EXPECT_EQ(r.engine->Acquire(a, TierKind::kHost).status().code(),
            StatusCode::kFailedPrecondition);
  auto full = r.engine->Acquire(b, TierKind::kDevice);
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(full.status().message().find("need 4096 bytes"), std::string::npos)
      << full.status().message();
  EXPECT_EQ(r.engine->Resident(b), TierKind::kHost);
  EXPECT_EQ(r.engine->Zero(a).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(r.engine->Pins(a), 1);
  ASSERT_TRUE(r.engine->Release(a, false).ok());
  auto big = r.engine->AddChunk(2 * kChunk, Category::kParam);
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(r.engine->num_chunks(), 2u);
  // Each refusal is an OOM event in the timeline, on the tier that refused.
  const prof::Report rep = r.Report();
  const auto& dev = rep.tiers[static_cast<int>(TierKind::kDevice)];
  const auto& host = rep.tiers[static_cast<int>(TierKind::kHost)];
  EXPECT_EQ(dev.ooms, 1u);
  EXPECT_EQ(dev.largest_oom_bytes, kChunk);
  EXPECT_EQ(host.ooms, 1u);
  EXPECT_EQ(host.largest_oom_bytes, 2 * kChunk);
}

// A zero fill that fails leaves the chunk as it was: lazily zero, nothing cached or dirty —
// never its home's stale bytes (a chunk Zero()ed after it held values keeps them in its home
// region until it is filled again).
TEST(Engine, AFailedZeroFillLeavesTheChunkLazilyZero) {
  Rig r(2 * kChunk, 8 * kChunk, 0, {}, nullptr, 0, /*faulty_device=*/true);
  ChunkId a = Add(r);
  r.Fill(a, 9);
  ASSERT_TRUE(r.engine->Zero(a).ok());
  // An acquire's zero fill (one copy of zeros to the device) fails: the acquire fails.
  r.faults->FailNextWrite(EIO);
  auto p = r.engine->Acquire(a, TierKind::kDevice);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), StatusCode::kIOError);
  EXPECT_EQ(r.engine->Resident(a), TierKind::kHost);
  EXPECT_FALSE(r.engine->Dirty(a));
  EXPECT_TRUE(r.engine->ZeroContent(a));
  // A prefetch's zero fill fails in the background: what waits for it gets the error.
  r.faults->FailNextWrite(EIO);
  auto hinted = r.engine->PrefetchHint(a, TierKind::kDevice);
  ASSERT_TRUE(hinted.ok() && *hinted);
  std::vector<uint8_t> got(kChunk, 0xaa);
  Status s = r.engine->ReadAt(a, 0, got.data(), kChunk);
  EXPECT_EQ(s.code(), StatusCode::kIOError) << s.ToString();
  EXPECT_NE(s.message().find("prefetch of chunk"), std::string::npos) << s.ToString();
  EXPECT_EQ(r.faults->faults_fired(), 2u);
  EXPECT_EQ(r.engine->Resident(a), TierKind::kHost);
  EXPECT_FALSE(r.engine->Dirty(a));
  // Still zeros, wherever it is read.
  ASSERT_TRUE(r.engine->ReadAt(a, 0, got.data(), kChunk).ok());
  for (Bytes i = 0; i < kChunk; ++i) ASSERT_EQ(got[i], 0) << i;
  auto d = r.engine->Acquire(a, TierKind::kDevice);
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  for (Bytes i = 0; i < kChunk; ++i) ASSERT_EQ(static_cast<uint8_t*>(*d)[i], 0) << i;
  ASSERT_TRUE(r.engine->Release(a, false).ok());
  auto h = r.engine->Acquire(a, TierKind::kHost);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  for (Bytes i = 0; i < kChunk; ++i) ASSERT_EQ(static_cast<uint8_t*>(*h)[i], 0) << i;
  ASSERT_TRUE(r.engine->Release(a, false).ok());
}

Bytes RssAnonBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("RssAnon:", 0) == 0) return std::stoull(line.substr(8)) * 1024;
  }
  return 0;
}

// Zero fills cost no resident memory, whatever the chunk size: their source is a read-only
// mapping of the kernel's zero page (it was a zeroed buffer of the largest chunk, kept for the
// engine's life: 64 MiB here). The home written from it holds zeros.
TEST(Engine, ZeroFillsOfLargeChunksTakeNoResidentMemory) {
  constexpr Bytes kBig = 64 * kMiB;
  NvmeTierConfig nc;
  nc.dir = ::testing::TempDir();
  nc.capacity = kBig;
  auto nvme = NewNvmeTier(nc);
  ASSERT_TRUE(nvme.ok()) << nvme.status().ToString();
  std::unique_ptr<Tier> host = HostTierOf(16 * kChunk);
  std::unique_ptr<Mover> mover = NewMover(MoverConfig{}, nullptr, nullptr);
  auto e = Engine::Create(EngineConfig{}, EngineTiers{nullptr, host.get(), nvme->get()},
                          mover.get(), nullptr);
  ASSERT_TRUE(e.ok()) << e.status().ToString();
  Engine& engine = **e;
  auto c = engine.AddChunk(kBig, Category::kParam, TierKind::kNvme);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  const char value[4] = {1, 2, 3, 4};
  const Bytes before = RssAnonBytes();
  ASSERT_TRUE(engine.WriteAt(*c, 0, value, 4).ok());  // fills the NVMe home with zeros first
  const Bytes grew = RssAnonBytes() - std::min(before, RssAnonBytes());
#if !defined(TIERMEM_TSAN)  // TSan's shadow of every byte the checksums read is resident
  EXPECT_LT(grew, kBig / 8) << "resident memory grew by " << grew << " bytes";
#endif
  std::vector<char> back(1 * kMiB, 7);
  ASSERT_TRUE(engine.ReadAt(*c, 0, back.data(), back.size()).ok());
  EXPECT_EQ(std::memcmp(back.data(), value, 4), 0);
  for (Bytes i = 4; i < back.size(); ++i) ASSERT_EQ(back[i], 0) << i;
  ASSERT_TRUE(engine.ReadAt(*c, kBig - back.size(), back.data(), back.size()).ok());
  for (Bytes i = 0; i < back.size(); ++i) ASSERT_EQ(back[i], 0) << i;
}

}  // namespace
}  // namespace tiermem::chunks

namespace tiermem::chunks {
namespace {

// A read-only home (serving a checkpoint in place): its bytes are read into the cached copy on
// the device and on the host, every write is refused before a byte reaches the home, a refused
// release drops what the caller wrote, and eviction never writes home.
TEST(Engine, ReadOnlyHomesAreReadAndNeverWritten) {
  Rig r(2 * kChunk, 2 * kChunk, 16 * kChunk);
  const ChunkId a = *r.engine->AddChunk(kChunk, Category::kParam, TierKind::kNvme);
  // The home: a region of the NVMe tier holding known bytes (a file home in a session).
  auto home = r.nvme_tier->Allocate(kChunk);
  ASSERT_TRUE(home.ok());
  std::vector<uint8_t> want(kChunk);
  for (Bytes i = 0; i < kChunk; ++i) want[i] = static_cast<uint8_t>(3 + i * 7);
  ASSERT_TRUE(r.nvme_tier->Copy({*home, 0, want.data(), kChunk, CopyDir::kToTier})->Wait().ok());
  ASSERT_TRUE(r.engine->SetReadOnlyHome(a, *home).ok());
  EXPECT_TRUE(r.engine->ReadOnlyHome(a));
  EXPECT_FALSE(r.engine->ZeroContent(a));
  for (TierKind where : {TierKind::kDevice, TierKind::kHost}) {
    auto p = r.engine->Acquire(a, where);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    EXPECT_TRUE(Rig::Holds(*p, kChunk, 3));
    std::memset(*p, 0, kChunk);  // the caller writes the cached copy anyway
    Status s = r.engine->Release(a, /*modified=*/true);
    EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
    EXPECT_NE(s.message().find("read in place"), std::string::npos) << s.ToString();
    EXPECT_EQ(r.engine->Pins(a), 0);
    EXPECT_FALSE(r.engine->Dirty(a));
    p = r.engine->Acquire(a, where);  // the home's bytes again, not what was written
    ASSERT_TRUE(p.ok());
    EXPECT_TRUE(Rig::Holds(*p, kChunk, 3));
    ASSERT_TRUE(r.engine->Release(a, false).ok());
  }
  uint8_t byte = 1;
  EXPECT_EQ(r.engine->WriteAt(a, 0, &byte, 1).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(r.engine->Zero(a).code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(r.engine->PrepareAdopt(a).code(), StatusCode::kFailedPrecondition);
  ASSERT_TRUE(r.engine->Flush().ok());
  std::vector<uint8_t> now(kChunk);
  ASSERT_TRUE(r.nvme_tier->Copy({*home, 0, now.data(), kChunk, CopyDir::kFromTier})->Wait().ok());
  EXPECT_EQ(now, want);
  const prof::Report rep = r.Report();
  EXPECT_EQ(Rig::Moved(rep, TierKind::kDevice, TierKind::kNvme), 0u);
  EXPECT_EQ(Rig::Moved(rep, TierKind::kHost, TierKind::kNvme), 0u);
  // Only an NVMe-homed, unpinned chunk takes one.
  const ChunkId h = *r.engine->AddChunk(kChunk, Category::kParam, TierKind::kHost);
  EXPECT_EQ(r.engine->SetReadOnlyHome(h, *home).code(), StatusCode::kFailedPrecondition);
}


// A chunk added with a home region the caller allocated (a served chunk's placeholder home)
// and moved to a home of the tier's own (RehomeOnNvme): lazily zero throughout, nothing
// written; refused for a chunk with values, a cached copy or a host home; a full tier is
// kResourceExhausted with the chunk's home unchanged.
TEST(Engine, AChunkAddedAtAGivenHomeIsRehomedOnNvme) {
  Rig r(2 * kChunk, 2 * kChunk, 3 * kChunk);
  auto given = r.nvme_tier->Allocate(kChunk);
  ASSERT_TRUE(given.ok());
  const Bytes used_before = r.nvme_tier->Stats().used;
  const ChunkId a = *r.engine->AddChunk(kChunk, Category::kParam, TierKind::kNvme, *given);
  EXPECT_EQ(r.engine->Home(a), TierKind::kNvme);
  EXPECT_EQ(r.nvme_tier->Stats().used, used_before);  // no second allocation
  ASSERT_TRUE(r.engine->RehomeOnNvme(a).ok());
  EXPECT_EQ(r.nvme_tier->Stats().used, used_before);  // the given home freed, a new one taken
  EXPECT_TRUE(r.engine->ZeroContent(a));
  auto p = r.engine->Acquire(a, TierKind::kHost);
  ASSERT_TRUE(p.ok());
  const auto* bytes = static_cast<const uint8_t*>(*p);
  EXPECT_TRUE(std::all_of(bytes, bytes + kChunk, [](uint8_t v) { return v == 0; }));
  // In use, cached, or holding values: refused.
  EXPECT_EQ(r.engine->RehomeOnNvme(a).code(), StatusCode::kFailedPrecondition);
  std::memset(*p, 5, kChunk);
  ASSERT_TRUE(r.engine->Release(a, true).ok());
  EXPECT_EQ(r.engine->RehomeOnNvme(a).code(), StatusCode::kFailedPrecondition);
  const ChunkId h = *r.engine->AddChunk(kChunk, Category::kParam, TierKind::kHost);
  EXPECT_EQ(r.engine->RehomeOnNvme(h).code(), StatusCode::kFailedPrecondition);
  // A full tier: the error names the chunk, and its home stays.
  const ChunkId b = *r.engine->AddChunk(kChunk, Category::kParam, TierKind::kNvme);
  const ChunkId c = *r.engine->AddChunk(kChunk, Category::kParam, TierKind::kNvme);
  (void)c;
  Status full = r.engine->RehomeOnNvme(b);
  EXPECT_EQ(full.code(), StatusCode::kResourceExhausted) << full.ToString();
  EXPECT_NE(full.message().find("chunk " + std::to_string(b)), std::string::npos);
  EXPECT_EQ(r.engine->Home(b), TierKind::kNvme);
  EXPECT_TRUE(r.engine->ZeroContent(b));
  EXPECT_EQ(r.engine->AddChunk(kChunk, Category::kParam, TierKind::kNvme, Region{}).status().code(),
            StatusCode::kInvalidArgument);  // a region smaller than the chunk
}

}  // namespace
}  // namespace tiermem::chunks
