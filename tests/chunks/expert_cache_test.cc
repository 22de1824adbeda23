// ClassScores and the chunk engine with class members (mixture-of-experts experts): pick
// frequencies with decay, expected next uses, the order followed through routed acquires, and
// prefetch hints.
#include "chunks/expert_cache.h"

#include <gtest/gtest.h>

#include <random>

#include "base/timeline.h"
#include "chunks/engine.h"
#include "chunks/mover.h"
#include "tiers/fake/sim_device.h"
#include "tests/support/host_tier.h"

namespace tiermem::chunks {
namespace {

TEST(ClassScores, FrequentMembersAreExpectedSoonerAndColdOnesDecay) {
  ClassScores s;
  // Class 0 visited at order positions 10 (each iteration has 100 positions): expert 1 is
  // picked every visit, expert 2 every fourth, expert 3 only in the first.
  for (int it = 0; it < 20; ++it) {
    s.Observe(0, 1, 10);
    if (it % 4 == 0) s.Observe(0, 2, 10);
    if (it == 0) s.Observe(0, 3, 10);
    s.Observe(0, 1, 10);  // again in the same visit: counted once
    s.EndVisit();
    s.BeginIteration();
  }
  EXPECT_EQ(s.visits(0), 20u);
  EXPECT_EQ(s.ClassOf(1), 0u);
  EXPECT_EQ(s.ClassOf(9), kNoClass);
  const double p1 = s.PickProbability(1), p2 = s.PickProbability(2), p3 = s.PickProbability(3);
  EXPECT_GT(p1, 0.8);
  EXPECT_GT(p2, p3);
  EXPECT_LT(p3, 0.1);  // decayed: 19 visits without it
  // Expected next uses, from position 50 of a cyclic order of 100: the next visit is at 110.
  const uint64_t e1 = s.ExpectedNextUse(1, 50, 100, true);
  const uint64_t e2 = s.ExpectedNextUse(2, 50, 100, true);
  const uint64_t e3 = s.ExpectedNextUse(3, 50, 100, true);
  EXPECT_GE(e1, 110u);
  EXPECT_LT(e1, 140u);
  EXPECT_LT(e1, e2);
  EXPECT_LT(e2, e3);
  EXPECT_EQ(s.ExpectedNextUse(1, 5, 100, true), s.ExpectedNextUse(1, 10, 100, true));
  EXPECT_EQ(s.ExpectedNextUse(9, 5, 100, true), kNeverUsed);
  EXPECT_EQ(s.ExpectedNextUse(1, 50, 100, false), kNeverUsed);  // no visit left this iteration
}

constexpr Bytes kChunk = 4096;

std::unique_ptr<Tier> Host(Bytes capacity) { return testing::TestHostTier(capacity, kChunk); }

struct MoeRig {
  explicit MoeRig(Bytes device) {
    SimDeviceConfig dc;
    dc.capacity = device;
    dev = NewSimDevice(dc);
    host = Host(256 * kChunk);
    staging = Host(4 * kChunk);
    MoverConfig mc;
    mc.staging_slot_bytes = kChunk;
    mc.staging_slots = 1;
    mover = NewMover(mc, staging.get(), nullptr);
    auto e = Engine::Create(EngineConfig{}, EngineTiers{dev.get(), host.get(), nullptr},
                            mover.get(), nullptr);
    EXPECT_TRUE(e.ok());
    engine = std::move(e).value();
  }
  // A chunk with content (written through its host home, as weights are): device copies of
  // it are clean.
  ChunkId Add() {
    auto id = engine->AddChunk(kChunk, Category::kParam);
    EXPECT_TRUE(id.ok());
    auto p = engine->Acquire(*id, TierKind::kHost);
    EXPECT_TRUE(p.ok());
    static_cast<char*>(*p)[0] = 1;
    EXPECT_TRUE(engine->Release(*id, true).ok());
    return *id;
  }
  Bytes ToDevice() const {
    return engine->Stats().bytes_moved[static_cast<int>(TierKind::kHost)]
                                      [static_cast<int>(TierKind::kDevice)];
  }
  std::unique_ptr<Tier> dev, host, staging;
  std::unique_ptr<Mover> mover;
  std::unique_ptr<Engine> engine;
};

// A served MoE: 4 layers, each a dense chunk then 2 of its 8 experts, the routing skewed (two
// hot experts per layer take most tokens). Run as class members the order stays followed and
// the hot experts stay cached; run as ordered acquires the order diverges at every token and
// LRU cycles the cache: more bytes.
Bytes Serve(bool as_class, uint64_t* diverged) {
  MoeRig r(12 * kChunk);  // dense 4 + room for 8 of the 32 experts
  r.engine->SetCyclic(true);
  std::vector<ChunkId> dense;
  std::vector<std::vector<ChunkId>> experts(4);
  for (int l = 0; l < 4; ++l) {
    dense.push_back(r.Add());
    for (int e = 0; e < 8; ++e) experts[l].push_back(r.Add());
  }
  std::mt19937 gen(7);
  std::uniform_real_distribution<double> u(0, 1);
  for (int token = 0; token < 60; ++token) {
    r.engine->BeginIteration();
    for (int l = 0; l < 4; ++l) {
      EXPECT_TRUE(r.engine->Acquire(dense[l], TierKind::kDevice).ok());
      EXPECT_TRUE(r.engine->Release(dense[l], false).ok());
      int a = u(gen) < 0.85 ? 0 : 2 + static_cast<int>(u(gen) * 6);
      int b = u(gen) < 0.85 ? 1 : 2 + static_cast<int>(u(gen) * 6);
      for (int e : {a, b}) {
        const ChunkId c = experts[l][static_cast<size_t>(e)];
        EXPECT_TRUE(r.engine->Acquire(c, TierKind::kDevice, as_class ? l : kNoClass).ok());
        EXPECT_TRUE(r.engine->Release(c, false).ok());
      }
    }
  }
  *diverged = r.engine->Stats().diverged;
  return r.ToDevice();
}

TEST(EngineClasses, RoutedAcquiresKeepTheOrderFollowedAndHotExpertsCached) {
  uint64_t div_class = 0, div_plain = 0;
  const Bytes with = Serve(true, &div_class);
  const Bytes without = Serve(false, &div_plain);
  EXPECT_LE(div_class, 1u);  // (the first iteration has no order to follow yet)
  EXPECT_GT(div_plain, 30u);
  EXPECT_LT(with, without) << "class-aware " << with << " bytes, ordered " << without;
}

TEST(EngineClasses, APrefetchHintBringsTheChunkAndKeepsItUntilAcquired) {
  MoeRig r(3 * kChunk);
  const ChunkId a = r.Add(), b = r.Add(), c = r.Add(), d = r.Add();
  for (ChunkId x : {a, b, c}) {
    ASSERT_TRUE(r.engine->Acquire(x, TierKind::kDevice).ok());
    ASSERT_TRUE(r.engine->Release(x, false).ok());
  }
  ASSERT_TRUE(r.engine->Synchronize().ok());
  const Bytes before = r.ToDevice();
  auto h = r.engine->PrefetchHint(d, TierKind::kDevice);
  ASSERT_TRUE(h.ok());
  EXPECT_TRUE(*h);
  EXPECT_EQ(r.engine->Resident(d), TierKind::kDevice);
  EXPECT_EQ(r.engine->Stats().hint_prefetches, 1u);
  auto again = r.engine->PrefetchHint(d, TierKind::kDevice);
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(*again);  // there already
  // Hints for the two chunks it displaced may not evict it (kept till acquired).
  for (ChunkId x : {a, b, c}) {
    if (r.engine->Resident(x) == TierKind::kDevice) continue;
    ASSERT_TRUE(r.engine->PrefetchHint(x, TierKind::kDevice).ok());
    EXPECT_EQ(r.engine->Resident(d), TierKind::kDevice);
  }
  ASSERT_TRUE(r.engine->Synchronize().ok());
  const Bytes hinted = r.ToDevice();
  EXPECT_EQ(hinted, before + 3 * kChunk);  // d, then a and b (c finds every copy hinted)
  ASSERT_TRUE(r.engine->Acquire(d, TierKind::kDevice).ok());
  ASSERT_TRUE(r.engine->Release(d, false).ok());
  ASSERT_TRUE(r.engine->Synchronize().ok());
  EXPECT_EQ(r.ToDevice(), hinted);  // the acquire moved nothing more
  EXPECT_EQ(r.engine->PrefetchHint(d, TierKind::kNvme).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(r.engine->PrefetchHint(99, TierKind::kDevice).status().code(),
            StatusCode::kOutOfRange);
}

}  // namespace
}  // namespace tiermem::chunks
