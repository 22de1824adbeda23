// The engine under the ordering contract (tiers/tier.h, engine.h "Ordering against compute"):
// device work is queued on a SimStream that runs late, copies on an asynchronous SimDevice land
// late and out of order, and the budget forces evictions, write-backs, write-behinds and
// reuse of freed device memory. A "training" loop reads chunks into an accumulator outside the
// chunks (forward: released unmodified, so their evictions are clean and their memory is
// reused at once) and updates them in place (backward: dirty, written back); the result must
// equal the same arithmetic done synchronously, exactly. Dropping one kind of wait in the
// SimDevice (drop_waits_for_test) makes the same loop compute wrong numbers, so these tests
// can fail.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "base/sanitizers.h"
#include "base/timeline.h"
#include "chunks/engine.h"
#include "chunks/mover.h"
#include "tiers/fake/mem_nvme.h"
#include "tiers/fake/sim_device.h"
#include "tiers/fake/sim_stream.h"
#include "tiers/host/host_tier.h"

namespace tiermem::chunks {
namespace {


constexpr size_t kElems = 4096;  // floats per chunk
constexpr Bytes kChunk = kElems * sizeof(float);
constexpr int kChunks = 8;

std::unique_ptr<Tier> HostTierOf(Bytes capacity) {
  HostTierConfig hc;
  hc.capacity = capacity;
  hc.slot_bytes = kChunk;
  hc.min_class_bytes = 4096;
  hc.slab_bytes = 16 * kChunk;
  hc.huge_pages = false;
  auto t = NewHostTier(hc);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return std::move(t).value();
}

struct Setup {
  bool nvme_homes = false;    // host budget too small for the homes: they go to NVMe
  uint32_t drop_waits = 0;    // SimDropWait bits
  int prefetch_depth = 2;
  bool write_behind = true;
  uint64_t stream_delay_ns = 150'000;
};

struct Result {
  std::vector<float> values;  // every chunk's floats, chunk after chunk
  std::vector<float> acc;     // the forward's accumulator
  std::vector<float> probes;  // chunk it % kChunks read after iteration it, for every it
  EngineStats stats;
};

// The arithmetic of one iteration, on plain host arrays or on the stream.
void ForwardOp(const float* p, float* acc) {
  for (size_t k = 0; k < kElems; ++k) acc[k] = acc[k] * 0.5f + p[k];
}
void BackwardOp(float* p, int chunk, int iter) {
  for (size_t k = 0; k < kElems; ++k) p[k] = p[k] * 0.999f + static_cast<float>(chunk + iter + k % 7);
}
float InitValue(int chunk, size_t k) { return static_cast<float>(chunk * 1000 + k % 97); }

constexpr int kIters = 6;

Result Expected() {
  Result r;
  r.values.resize(kChunks * kElems);
  r.acc.assign(kElems, 0.0f);
  for (int c = 0; c < kChunks; ++c) {
    for (size_t k = 0; k < kElems; ++k) r.values[c * kElems + k] = InitValue(c, k);
  }
  for (int it = 0; it < kIters; ++it) {
    for (int c = 0; c < kChunks; ++c) ForwardOp(&r.values[c * kElems], r.acc.data());
    for (int c = kChunks - 1; c >= 0; --c) BackwardOp(&r.values[c * kElems], c, it);
    const float* p = &r.values[(it % kChunks) * kElems];
    r.probes.insert(r.probes.end(), p, p + kElems);
  }
  return r;
}

StatusOr<Result> Train(const Setup& s) {
  SimDeviceConfig dc;
  dc.capacity = 3 * kChunk;
  dc.async = true;
  dc.async_max_delay_ns = 400'000;
  dc.drop_waits_for_test = s.drop_waits;
  auto dev = NewSimDevice(dc);
  auto host = HostTierOf(s.nvme_homes ? 4 * kChunk : 32 * kChunk);
  auto staging = HostTierOf(4 * kChunk);
  std::unique_ptr<Tier> nvme = s.nvme_homes ? NewMemNvme({.capacity = 64 * kChunk}) : nullptr;
  MoverConfig mc;
  mc.staging_slot_bytes = kChunk;
  mc.staging_slots = 1;
  auto mover = NewMover(mc, staging.get(), nullptr);
  EngineConfig ec;
  ec.prefetch_depth = s.prefetch_depth;
  ec.write_behind = s.write_behind;
  ec.host_reserve_bytes = s.nvme_homes ? 2 * kChunk : 0;
  TIERMEM_ASSIGN_OR_RETURN(auto engine, Engine::Create(ec, EngineTiers{dev.get(), host.get(), nvme.get()},
                                                       mover.get(), nullptr));
  SimStream stream(s.stream_delay_ns);
  Result out;
  out.acc.assign(kElems, 0.0f);
  {
    std::vector<ChunkId> ids;
    for (int c = 0; c < kChunks; ++c) {
      TIERMEM_ASSIGN_OR_RETURN(ChunkId id, engine->AddChunk(kChunk, Category::kParam));
      std::vector<float> init(kElems);
      for (size_t k = 0; k < kElems; ++k) init[k] = InitValue(c, k);
      TIERMEM_RETURN_IF_ERROR(engine->WriteAt(id, 0, init.data(), kChunk));
      ids.push_back(id);
    }
    engine->SetComputeStream(stream.handle());
    float* acc = out.acc.data();
    for (int it = 0; it < kIters; ++it) {
      engine->BeginIteration();
      for (int c = 0; c < kChunks; ++c) {  // forward: read-only
        TIERMEM_ASSIGN_OR_RETURN(void* p, engine->Acquire(ids[c], TierKind::kDevice));
        auto* f = static_cast<const float*>(p);
        stream.Enqueue([f, acc] { ForwardOp(f, acc); });
        TIERMEM_RETURN_IF_ERROR(engine->Release(ids[c], false));
      }
      for (int c = kChunks - 1; c >= 0; --c) {  // backward: in place
        TIERMEM_ASSIGN_OR_RETURN(void* p, engine->Acquire(ids[c], TierKind::kDevice));
        auto* f = static_cast<float*>(p);
        stream.Enqueue([f, c, it] { BackwardOp(f, c, it); });
        TIERMEM_RETURN_IF_ERROR(engine->Release(ids[c], true));
      }
      // A value read mid-training (logging) sees the queued work on that chunk.
      std::vector<float> probe(kElems);
      TIERMEM_RETURN_IF_ERROR(engine->ReadAt(ids[it % kChunks], 0, probe.data(), kChunk));
      out.probes.insert(out.probes.end(), probe.begin(), probe.end());
    }
    // The host reads nothing before the stream is done with it.
    TIERMEM_RETURN_IF_ERROR(stream.Synchronize());
    out.values.resize(kChunks * kElems);
    for (int c = 0; c < kChunks; ++c) {
      TIERMEM_RETURN_IF_ERROR(engine->ReadAt(ids[c], 0, &out.values[c * kElems], kChunk));
    }
    out.stats = engine->Stats();
  }
  engine.reset();
  return out;
}

size_t Mismatches(const Result& got, const Result& want) {
  size_t bad = 0;
  for (size_t i = 0; i < want.values.size(); ++i) bad += got.values[i] != want.values[i];
  for (size_t i = 0; i < want.acc.size(); ++i) bad += got.acc[i] != want.acc[i];
  for (size_t i = 0; i < want.probes.size(); ++i) bad += got.probes[i] != want.probes[i];
  return bad;
}

TEST(EngineOrdering, LaggingComputeStreamTrainsExactlyWithHostHomes) {
  const Result want = Expected();
  for (int round = 0; round < 2; ++round) {
    auto got = Train({});
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    EXPECT_EQ(Mismatches(*got, want), 0u) << "round " << round;
    EXPECT_GT(got->stats.evictions, 0u);
    EXPECT_GT(got->stats.prefetches, 0u);
    EXPECT_GT(got->stats.device_waits, 0u) << "no acquire ordered the stream after a prefetch";
  }
}

TEST(EngineOrdering, LaggingComputeStreamTrainsExactlyWithNvmeHomes) {
  auto got = Train({.nvme_homes = true});
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(Mismatches(*got, Expected()), 0u);
  EXPECT_GT(got->stats.bytes_moved[static_cast<int>(TierKind::kDevice)]
                                  [static_cast<int>(TierKind::kNvme)], 0u);
}

TEST(EngineOrdering, WithoutPrefetchOrWriteBehindStillExact) {
  auto got = Train({.prefetch_depth = 0, .write_behind = false});
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(Mismatches(*got, Expected()), 0u);
  EXPECT_EQ(got->stats.device_waits, 0u);
}

// ReadAt/WriteAt on a chunk pinned on the device, with work on it still queued: the read sees
// that work's result, the write lands after the queued work read the old values.
TEST(EngineOrdering, ReadAtAndWriteAtOfAPinnedChunkAreOrderedWithQueuedWork) {
  auto dev = NewSimDevice({.capacity = 4 * kChunk, .async = true});
  auto host = HostTierOf(8 * kChunk);
  auto mover = NewMover({}, nullptr, nullptr);
  auto engine = Engine::Create({}, EngineTiers{dev.get(), host.get(), nullptr}, mover.get(),
                               nullptr);
  ASSERT_TRUE(engine.ok());
  Engine& e = **engine;
  SimStream stream(20'000'000);  // the work runs 20 ms after it is queued
  e.SetComputeStream(stream.handle());
  auto id = e.AddChunk(kChunk, Category::kParam);
  ASSERT_TRUE(id.ok());
  std::vector<float> ones(kElems, 1.0f), seen(kElems, 0.0f), read(kElems, 0.0f);
  ASSERT_TRUE(e.WriteAt(*id, 0, ones.data(), kChunk).ok());
  auto p = e.Acquire(*id, TierKind::kDevice);
  ASSERT_TRUE(p.ok());
  auto* f = static_cast<float*>(*p);
  stream.Enqueue([f] { for (size_t k = 0; k < kElems; ++k) f[k] += 1.0f; });  // -> 2
  ASSERT_TRUE(e.ReadAt(*id, 0, read.data(), kChunk).ok());
  EXPECT_EQ(std::count(read.begin(), read.end(), 2.0f), static_cast<long>(kElems));
  float* s = seen.data();
  stream.Enqueue([f, s] { std::memcpy(s, f, kChunk); });  // must see 2, not 7
  std::vector<float> sevens(kElems, 7.0f);
  ASSERT_TRUE(e.WriteAt(*id, 0, sevens.data(), kChunk).ok());
  ASSERT_TRUE(e.Release(*id, true).ok());
  ASSERT_TRUE(stream.Synchronize().ok());
  EXPECT_EQ(std::count(seen.begin(), seen.end(), 2.0f), static_cast<long>(kElems));
  ASSERT_TRUE(e.ReadAt(*id, 0, read.data(), kChunk).ok());
  EXPECT_EQ(std::count(read.begin(), read.end(), 7.0f), static_cast<long>(kElems));
}

// The same loop with a wait dropped computes wrong numbers: the tests above can fail.
TEST(EngineOrdering, DroppingTheCopyAfterComputeWaitBreaksTraining) {
  if (kTsanBuild) GTEST_SKIP() << "a deliberate data race (the wait is dropped)";
  auto got = Train({.drop_waits = kDropCopyAfterCompute});
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_GT(Mismatches(*got, Expected()), 0u);
}

TEST(EngineOrdering, DroppingTheComputeAfterCopyWaitBreaksTraining) {
  if (kTsanBuild) GTEST_SKIP() << "a deliberate data race (the wait is dropped)";
  auto got = Train({.drop_waits = kDropComputeAfterCopy, .stream_delay_ns = 0});
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_GT(Mismatches(*got, Expected()), 0u);
}

}  // namespace
}  // namespace tiermem::chunks
