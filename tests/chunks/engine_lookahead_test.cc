// The engine's lookahead prefetch in host mode (no device tier; NVMe-homed chunks computed on
// in host room), on the access pattern of training with deferred optimizer updates: each
// group's update reads its grad, m and v (and writes param, m, v) at the next forward's first
// use of the group; the backward rewrites the grads in reverse group order. The acquire-wait
// counters (EngineStats::waits) say how many acquires found their bytes not started
// ("misses"): Lookahead::kRoom must start the update's reads before they are needed where
// Lookahead::kDepth cannot, with every value the same.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "chunks/engine.h"
#include "chunks/mover.h"
#include "tests/support/host_tier.h"
#include "tiers/fake/mem_nvme.h"

namespace tiermem::chunks {
namespace {

constexpr Bytes kChunk = 4096;
constexpr int kGroups = 6;
enum Kind { kP = 0, kG = 1, kM = 2, kV = 3, kKinds = 4 };

// A host-mode stack: the host tier (room for `host_chunks` chunks), the in-memory NVMe fake
// and the Mover; every chunk is homed on NVMe.
struct HostRig {
  HostRig(EngineConfig cfg, Bytes host_chunks) {
    host = testing::TestHostTier(host_chunks * kChunk, kChunk);
    staging = testing::TestHostTier(4 * kChunk, kChunk);
    nvme = NewMemNvme(MemNvmeConfig{64 * kChunk * kGroups});
    MoverConfig mc;
    mc.staging_slot_bytes = kChunk;
    mc.staging_slots = 1;
    mover = NewMover(mc, staging.get(), nullptr);
    auto e = Engine::Create(cfg, EngineTiers{nullptr, host.get(), nvme.get()}, mover.get(),
                            nullptr);
    EXPECT_TRUE(e.ok()) << e.status().ToString();
    engine = std::move(e).value();
    for (int g = 0; g < kGroups; ++g) {
      for (int k = 0; k < kKinds; ++k) {
        auto id = engine->AddChunk(kChunk, Category::kParam, TierKind::kNvme);
        EXPECT_TRUE(id.ok()) << id.status().ToString();
        ids[g][k] = *id;
      }
    }
  }
  ~HostRig() { engine.reset(); }

  // Acquires on the host after every move in flight has landed, so that what the counters
  // see depends on the recorded order and the room only, not on the disk's timing: a chunk
  // whose prefetch was started is there, one whose prefetch was not is a miss.
  uint32_t* Acquire(int g, int k) {
    EXPECT_TRUE(engine->Synchronize().ok());
    auto p = engine->Acquire(ids[g][k], TierKind::kHost);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    return p.ok() ? static_cast<uint32_t*>(*p) : nullptr;
  }
  void Release(int g, int k, bool modified) {
    EXPECT_TRUE(engine->Release(ids[g][k], modified).ok());
  }

  // The deferred update of group g: p += m, m = 3m + grad, v += grad^2 (integers: exact).
  void Update(int g) {
    engine->Phase("optimizer");
    uint32_t* p = Acquire(g, kP);
    const uint32_t* gr = Acquire(g, kG);
    uint32_t* m = Acquire(g, kM);
    uint32_t* v = Acquire(g, kV);
    for (Bytes i = 0; i < kChunk / 4; ++i) {
      m[i] = 3 * m[i] + gr[i];
      v[i] += gr[i] * gr[i];
      p[i] += m[i];
    }
    Release(g, kV, true);
    Release(g, kM, true);
    Release(g, kG, false);
    Release(g, kP, true);
    engine->Phase("forward");
  }

  // One training iteration: the forward (each group's pending update first, then its param
  // read), the backward (grads of every group, in reverse, from the params).
  void Iteration(int it) {
    engine->BeginIteration();
    engine->Phase("forward");
    for (int g = 0; g < kGroups; ++g) {
      if (it > 0) Update(g);
      Acquire(g, kP);
      Release(g, kP, false);
    }
    engine->Phase("backward");
    for (int g = kGroups; g-- > 0;) {
      const uint32_t* p = Acquire(g, kP);
      uint32_t* gr = Acquire(g, kG);
      for (Bytes i = 0; i < kChunk / 4; ++i) gr[i] = p[i] * 2654435761u + static_cast<uint32_t>(it);
      Release(g, kG, true);
      Release(g, kP, false);
    }
  }

  // Every chunk's content, read where it is.
  std::vector<uint32_t> Contents() {
    std::vector<uint32_t> out(kGroups * kKinds * kChunk / 4);
    for (int g = 0; g < kGroups; ++g) {
      for (int k = 0; k < kKinds; ++k) {
        EXPECT_TRUE(engine
                        ->ReadAt(ids[g][k], 0, out.data() + (g * kKinds + k) * kChunk / 4, kChunk)
                        .ok());
      }
    }
    return out;
  }

  std::unique_ptr<Tier> host, staging, nvme;
  std::unique_ptr<Mover> mover;
  std::unique_ptr<Engine> engine;
  ChunkId ids[kGroups][kKinds] = {};
};

struct Result {
  AcquireWaits waits;      // over the iterations after the warm-up
  AcquireWaits optimizer;  // the same, in the optimizer phase only
  std::vector<uint32_t> contents;
  EngineStats stats;
};

Result Train(Lookahead lookahead, Bytes host_chunks) {
  EngineConfig cfg;
  cfg.prefetch_depth = 2;
  cfg.lookahead = lookahead;
  HostRig r(cfg, host_chunks);
  // Iteration 0 records the order without updates, 1 the order with them; from 2 on the
  // order is followed.
  for (int it = 0; it < 3; ++it) r.Iteration(it);
  const EngineStats before = r.engine->Stats();
  for (int it = 3; it < 7; ++it) r.Iteration(it);
  Result out;
  out.stats = r.engine->Stats();
  out.waits.misses = out.stats.waits.misses - before.waits.misses;
  out.waits.miss_bytes = out.stats.waits.miss_bytes - before.waits.miss_bytes;
  auto phase = [](const EngineStats& s, const std::string& name) {
    for (const auto& [label, w] : s.waits_by_phase) {
      if (label == name) return w;
    }
    return AcquireWaits{};
  };
  out.optimizer.misses =
      phase(out.stats, "optimizer").misses - phase(before, "optimizer").misses;
  out.contents = r.Contents();
  EXPECT_EQ(out.stats.diverged, before.diverged);  // followed after the warm-up
  return out;
}

// The room lookahead starts the deferred update's reads ahead — across the iteration
// boundary, writing dirty grads needed later home to make room — so fewer acquires miss, the
// update's above all; every value is the same. Deterministic: every acquire comes after the
// moves in flight landed (HostRig::Acquire).
TEST(EngineLookahead, RoomStartsTheDeferredUpdatesReadsThatDepthMisses) {
  for (Bytes host_chunks : {Bytes{5}, Bytes{8}}) {
    SCOPED_TRACE("host room: " + std::to_string(host_chunks) + " chunks");
    const Result depth = Train(Lookahead::kDepth, host_chunks);
    const Result room = Train(Lookahead::kRoom, host_chunks);
    std::printf("host %llu chunks: misses depth %llu (optimizer %llu), room %llu (optimizer %llu)\n",
                static_cast<unsigned long long>(host_chunks),
                static_cast<unsigned long long>(depth.waits.misses),
                static_cast<unsigned long long>(depth.optimizer.misses),
                static_cast<unsigned long long>(room.waits.misses),
                static_cast<unsigned long long>(room.optimizer.misses));
    EXPECT_GT(depth.optimizer.misses, 0u);
    EXPECT_LT(room.waits.misses, depth.waits.misses);
    EXPECT_LT(room.optimizer.misses, depth.optimizer.misses);
    EXPECT_EQ(room.waits.miss_bytes, room.waits.misses * kChunk);
    ASSERT_EQ(room.contents.size(), depth.contents.size());
    EXPECT_EQ(0, std::memcmp(room.contents.data(), depth.contents.data(),
                             room.contents.size() * sizeof(uint32_t)));
    EXPECT_GT(room.stats.write_behinds, 0u);
  }
}

// A miss is an acquire that reads its chunk synchronously; a late one waited for a prefetch
// it had started; a lazily zero chunk read for the first time is neither (no bytes come from
// below); an acquire of a resident chunk is neither. Counted per phase too.
TEST(EngineLookahead, MissesCountSynchronousReadsPerPhase) {
  EngineConfig cfg;
  cfg.prefetch_depth = 0;
  HostRig r(cfg, 4);
  r.engine->Phase("a");
  r.Acquire(0, kP);  // lazily zero: a fill, not a read
  r.Release(0, kP, true);
  EXPECT_EQ(r.engine->Stats().waits.misses, 0u);
  ASSERT_TRUE(r.engine->Flush().ok());
  for (int k = 1; k < kKinds; ++k) {  // fill the room: chunk 0's copy is evicted
    r.Acquire(0, k);
    r.Release(0, k, true);
  }
  r.Acquire(1, kP);
  r.Release(1, kP, true);
  r.engine->Phase("b");
  r.Acquire(0, kP);  // evicted before, read back now: a miss
  r.Release(0, kP, false);
  r.Acquire(0, kP);  // resident: nothing
  r.Release(0, kP, false);
  const EngineStats st = r.engine->Stats();
  EXPECT_EQ(st.waits.misses, 1u);
  EXPECT_EQ(st.waits.miss_bytes, kChunk);
  EXPECT_EQ(st.waits.late, 0u);
  ASSERT_EQ(st.waits_by_phase.size(), 3u);  // "" (before any phase), "a", "b"
  EXPECT_EQ(st.waits_by_phase[1].first, "a");
  EXPECT_EQ(st.waits_by_phase[1].second.misses, 0u);
  EXPECT_EQ(st.waits_by_phase[2].first, "b");
  EXPECT_EQ(st.waits_by_phase[2].second.misses, 1u);
}

}  // namespace
}  // namespace tiermem::chunks
