// Mover tests: every lane (host<->host, host<->device, host<->NVMe, device<->NVMe and the
// same-tier bounces) moves random bytes intact, many moves run at once from several threads,
// failures of the inner copies propagate with their code, staging slots are all returned, and
// the timeline gets one begin/end pair per move with the right tiers, bytes and chunk.
#include "chunks/mover.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <unordered_map>

#include "base/mutex.h"
#include "tiers/fake/fault_injecting.h"
#include "tiers/fake/sim_device.h"
#include "tiers/host/host_tier.h"
#include "tiers/worker_pool.h"

namespace tiermem {
namespace {

// A non-addressable tier posing as NVMe: regions are heap vectors reached only through Copy,
// which runs on one worker thread. Stands in for the in-memory NVMe fake.
class LocalNvme final : public Tier {
 public:
  explicit LocalNvme(Bytes capacity) : budget_(capacity) {}
  ~LocalNvme() override { worker_.reset(); }
  TierKind kind() const override { return TierKind::kNvme; }
  std::string name() const override { return "local-nvme"; }
  StatusOr<Region> Allocate(Bytes bytes) override {
    if (bytes == 0) return InvalidArgumentError("local-nvme: 0 bytes");
    const Bytes rounded = AlignUp(bytes, 4096);
    TIERMEM_RETURN_IF_ERROR(budget_.Reserve(rounded, "nvme (local)"));
    MutexLock lock(mu_);
    Region r{next_id_++, rounded, nullptr};
    store_[r.id] = std::make_shared<std::vector<char>>(rounded);
    regions_[r.id] = r;
    return r;
  }
  Status Free(const Region& region) override {
    MutexLock lock(mu_);
    auto it = regions_.find(region.id);
    if (it == regions_.end()) return InvalidArgumentError("local-nvme: unknown region");
    budget_.Release(it->second.bytes);
    regions_.erase(it);
    store_.erase(region.id);
    return OkStatus();
  }
  std::shared_ptr<Completion> Copy(const CopyRequest& req) override {
    (req.inline_work ? inline_copies : pooled_copies).fetch_add(1);
    Region live;
    std::shared_ptr<std::vector<char>> data;
    {
      MutexLock lock(mu_);
      auto it = regions_.find(req.region.id);
      if (it != regions_.end()) {
        live = it->second;
        data = store_[req.region.id];
      }
    }
    Status valid = ValidateCopy(req, live);
    if (!valid.ok()) return Completion::Done(valid);
    auto done = Completion::Make();
    worker_->Push([=] {
      if (req.dir == CopyDir::kToTier) {
        std::memcpy(data->data() + req.offset, req.host, req.bytes);
      } else {
        std::memcpy(req.host, data->data() + req.offset, req.bytes);
      }
      done->Complete(OkStatus());
    });
    return done;
  }
  TierStats Stats() const override { return budget_.Snapshot(); }

  std::atomic<int> inline_copies{0}, pooled_copies{0};  // by CopyRequest::inline_work

 private:
  BudgetAccount budget_;
  Mutex mu_;
  std::unordered_map<uint64_t, Region> regions_ TIERMEM_GUARDED_BY(mu_);
  std::unordered_map<uint64_t, std::shared_ptr<std::vector<char>>> store_ TIERMEM_GUARDED_BY(mu_);
  uint64_t next_id_ TIERMEM_GUARDED_BY(mu_) = 1;
  std::unique_ptr<WorkerPool> worker_ = std::make_unique<WorkerPool>(1);
};

// Stores every event; labels interned in a map. Thread-safe.
class VectorRecorder final : public TimelineRecorder {
 public:
  uint32_t InternLabel(std::string_view text) override {
    MutexLock lock(mu_);
    auto [it, fresh] = labels_.emplace(std::string(text), labels_.size() + 1);
    return it->second;
  }
  void Record(Event e) override {
    if (e.ts_ns == 0) e.ts_ns = Clock::Real()->NowNs();
    MutexLock lock(mu_);
    events_.push_back(e);
  }
  Status Flush() override { return OkStatus(); }
  Status Close() override { return OkStatus(); }
  const Clock* clock() const override { return Clock::Real(); }
  std::vector<Event> events() {
    MutexLock lock(mu_);
    return events_;
  }
  uint32_t label(const std::string& s) {
    MutexLock lock(mu_);
    auto it = labels_.find(s);
    return it == labels_.end() ? 0 : it->second;
  }

 private:
  Mutex mu_;
  std::map<std::string, uint32_t> labels_ TIERMEM_GUARDED_BY(mu_);
  std::vector<Event> events_ TIERMEM_GUARDED_BY(mu_);
};

std::vector<char> RandomBytes(Bytes n, uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<char> v(n);
  for (Bytes i = 0; i < n; i += 8) {  // 8 random bytes per draw (cheap under TSan too)
    const uint64_t x = rng();
    std::memcpy(v.data() + i, &x, std::min<Bytes>(8, n - i));
  }
  return v;
}

void Write(Tier* t, const Region& r, Bytes off, const std::vector<char>& data) {
  ASSERT_TRUE(t->Copy({r, off, const_cast<char*>(data.data()), data.size(), CopyDir::kToTier})
                  ->Wait()
                  .ok());
}

std::vector<char> Read(Tier* t, const Region& r, Bytes off, Bytes n) {
  std::vector<char> out(n);
  Status s = t->Copy({r, off, out.data(), n, CopyDir::kFromTier})->Wait();
  EXPECT_TRUE(s.ok()) << s.ToString();
  return out;
}

std::unique_ptr<Tier> MakeHost(Bytes capacity, Bytes slot = 4 * kMiB) {
  HostTierConfig c;
  c.capacity = capacity;
  c.slot_bytes = slot;
  c.slab_bytes = 16 * kMiB;
  auto t = NewHostTier(c);
  EXPECT_TRUE(t.ok()) << t.status().ToString();
  return std::move(t).value();
}

class MoverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    host_ = MakeHost(256 * kMiB);
    staging_ = MakeHost(64 * kMiB, 1 * kMiB);
    sim_ = NewSimDevice({.capacity = 256 * kMiB});
    nvme_ = std::make_unique<LocalNvme>(256 * kMiB);
  }
  std::vector<Tier*> tiers() { return {host_.get(), sim_.get(), nvme_.get()}; }

  std::unique_ptr<Tier> host_, staging_, sim_, nvme_;
};

TEST_F(MoverTest, EveryTierPairMovesRandomBytesIntact) {
  VectorRecorder rec;
  auto mover = NewMover({.staging_slot_bytes = 1 * kMiB, .staging_slots = 3,
                         .parallel_memcpy_min_bytes = 8 * kMiB},
                        staging_.get(), &rec);
  uint32_t seed = 1;
  int moves = 0;
  // Sizes: one piece, several pieces with a ragged tail, and above the parallel-memcpy bar.
  for (Bytes n : {Bytes{1000}, Bytes{3 * kMiB + 123}, Bytes{9 * kMiB + 7}}) {
    for (Tier* src : tiers()) {
      for (Tier* dst : tiers()) {
        SCOPED_TRACE(src->name() + " -> " + dst->name() + ", " + std::to_string(n) + " bytes");
        auto rs = src->Allocate(n + 100);
        auto rd = dst->Allocate(n + 200);
        ASSERT_TRUE(rs.ok() && rd.ok());
        const auto data = RandomBytes(n, seed++);
        Write(src, *rs, 37, data);
        const auto before = RandomBytes(200, seed++);  // around the destination range
        Write(dst, *rd, 0, std::vector<char>(before.begin(), before.begin() + 61));
        Status s = mover->Move({{src, *rs, 37}, {dst, *rd, 61}, n, ChunkId{7}, Category::kParam})
                       ->Wait();
        ASSERT_TRUE(s.ok()) << s.ToString();
        ++moves;
        EXPECT_EQ(Read(dst, *rd, 61, n), data);
        // Bytes before the destination offset are untouched.
        EXPECT_EQ(Read(dst, *rd, 0, 61), std::vector<char>(before.begin(), before.begin() + 61));
        ASSERT_TRUE(src->Free(*rs).ok());
        ASSERT_TRUE(dst->Free(*rd).ok());
      }
    }
  }
  EXPECT_EQ(staging_->Stats().used, 0u);
  EXPECT_EQ(staging_->Stats().live_regions, 0u);
  // Bounces used up to 3 slots of 1 MiB at once, never more.
  EXPECT_EQ(staging_->Stats().peak, 3 * kMiB);
  EXPECT_EQ(rec.events().size(), 2u * moves);
}

TEST_F(MoverTest, TimelineHasBeginEndPairsWithTiersBytesAndChunk) {
  VectorRecorder rec;
  auto mover = NewMover({.staging_slot_bytes = 1 * kMiB}, staging_.get(), &rec);
  auto h = host_->Allocate(1 * kMiB);
  auto d = sim_->Allocate(1 * kMiB);
  auto n = nvme_->Allocate(1 * kMiB);
  ASSERT_TRUE(h.ok() && d.ok() && n.ok());
  ASSERT_TRUE(mover->Move({{host_.get(), *h}, {sim_.get(), *d}, 4096, 11, Category::kGrad})
                  ->Wait().ok());
  ASSERT_TRUE(mover->Move({{sim_.get(), *d}, {nvme_.get(), *n}, 5000, 12, Category::kOptimState})
                  ->Wait().ok());
  auto fi = NewFaultInjectingTier(NewSimDevice({.capacity = 8 * kMiB}));
  auto f = fi->Allocate(1 * kMiB);
  ASSERT_TRUE(f.ok());
  fi->FailNextWrite(EIO);
  EXPECT_EQ(mover->Move({{host_.get(), *h}, {fi.get(), *f}, 100, 13})->Wait().code(),
            StatusCode::kIOError);

  const auto ev = rec.events();
  ASSERT_EQ(ev.size(), 6u);
  struct Want { TierKind src, dst; Bytes bytes; ChunkId chunk; Category cat; bool failed;
                std::string label; };
  const Want want[] = {
      {TierKind::kHost, TierKind::kDevice, 4096, 11, Category::kGrad, false, "host->sim-device"},
      {TierKind::kDevice, TierKind::kNvme, 5000, 12, Category::kOptimState, false,
       "sim-device->local-nvme"},
      {TierKind::kHost, TierKind::kDevice, 100, 13, Category::kOther, true,
       "host->fault-injecting(sim-device)"},
  };
  std::set<uint64_t> ids;
  for (int i = 0; i < 3; ++i) {
    const Event& b = ev[2 * i];
    const Event& e = ev[2 * i + 1];
    SCOPED_TRACE(i);
    EXPECT_EQ(b.type, EventType::kCopyBegin);
    EXPECT_EQ(e.type, EventType::kCopyEnd);
    EXPECT_EQ(b.id, e.id);
    ids.insert(b.id);
    EXPECT_EQ(b.tier, want[i].src);
    EXPECT_EQ(b.tier2, want[i].dst);
    EXPECT_EQ(e.tier, want[i].src);
    EXPECT_EQ(e.tier2, want[i].dst);
    EXPECT_EQ(b.bytes, want[i].bytes);
    EXPECT_EQ(e.bytes, want[i].bytes);
    EXPECT_EQ(b.chunk, want[i].chunk);
    EXPECT_EQ(b.category, want[i].cat);
    EXPECT_EQ(b.flags, kFlagNone);
    EXPECT_EQ(e.flags, want[i].failed ? kFlagFailed : kFlagNone);
    EXPECT_NE(b.label, 0u);
    EXPECT_EQ(b.label, rec.label(want[i].label));
    EXPECT_EQ(b.lane, e.lane);
    EXPECT_LE(b.ts_ns, e.ts_ns);
  }
  EXPECT_EQ(ids.size(), 3u);
  // Different tier pairs are different lanes.
  EXPECT_NE(ev[0].lane, ev[2].lane);
  ASSERT_TRUE(fi->Free(*f).ok());
}

TEST_F(MoverTest, ManyMovesInFlightFromSeveralThreads) {
  // Host->host moves here stay under the parallel-memcpy bar: EveryTierPair covers the TBB
  // path, and TBB's spinning workers make this test crawl under TSan on 2 cores.
  auto mover = NewMover({.staging_slot_bytes = 256 * kKiB, .staging_slots = 2},
                        staging_.get(), nullptr);
  constexpr int kThreads = 4, kMovesPerThread = 12;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(100 + t);
      struct Pending {
        Tier *src, *dst;
        Region rs, rd;
        std::vector<char> data;
        std::shared_ptr<Completion> done;
      };
      std::vector<Pending> pending;
      auto all = tiers();
      for (int i = 0; i < kMovesPerThread; ++i) {
        Pending p;
        p.src = all[rng() % 3];
        p.dst = all[rng() % 3];
        const Bytes n = 1 + rng() % (2 * kMiB);
        auto rs = p.src->Allocate(n);
        auto rd = p.dst->Allocate(n);
        if (!rs.ok() || !rd.ok()) {
          ++failures;
          continue;
        }
        p.rs = *rs;
        p.rd = *rd;
        p.data = RandomBytes(n, 1000 * t + i);
        if (!p.src->Copy({p.rs, 0, p.data.data(), n, CopyDir::kToTier})->Wait().ok()) ++failures;
        p.done = mover->Move({{p.src, p.rs}, {p.dst, p.rd}, n});
        pending.push_back(std::move(p));
      }
      for (auto& p : pending) {  // all this thread's moves are in flight before the first wait
        if (!p.done->Wait().ok()) ++failures;
        std::vector<char> back(p.data.size());
        if (!p.dst->Copy({p.rd, 0, back.data(), back.size(), CopyDir::kFromTier})->Wait().ok() ||
            back != p.data) {
          ++failures;
        }
        if (!p.src->Free(p.rs).ok() || !p.dst->Free(p.rd).ok()) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(staging_->Stats().used, 0u);
  for (Tier* t : tiers()) EXPECT_EQ(t->Stats().used, 0u) << t->name();
}

TEST_F(MoverTest, FailingInnerCopyPropagatesItsStatusAndReturnsSlots) {
  auto fdev = NewFaultInjectingTier(NewSimDevice({.capacity = 64 * kMiB}));
  auto fnvme = NewFaultInjectingTier(std::make_unique<LocalNvme>(64 * kMiB));
  auto mover = NewMover({.staging_slot_bytes = 1 * kMiB, .staging_slots = 2}, staging_.get(),
                        nullptr);
  const Bytes n = 5 * kMiB;
  auto d = fdev->Allocate(n);
  auto v = fnvme->Allocate(n);
  auto h = host_->Allocate(n);
  ASSERT_TRUE(d.ok() && v.ok() && h.ok());

  // Device read fails mid-bounce (EIO): kIOError, and the NVMe side keeps no partial piece
  // from the failed read.
  fdev->FailNextRead(EIO);
  Status s = mover->Move({{fdev.get(), *d}, {fnvme.get(), *v}, n})->Wait();
  EXPECT_EQ(s.code(), StatusCode::kIOError) << s.ToString();
  EXPECT_EQ(staging_->Stats().used, 0u);

  // NVMe full on write (ENOSPC): kResourceExhausted.
  fnvme->FailNextWrite(ENOSPC);
  s = mover->Move({{fdev.get(), *d}, {fnvme.get(), *v}, n})->Wait();
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
  EXPECT_EQ(staging_->Stats().used, 0u);

  // Short write on the direct host->device lane: kIOError naming it.
  fdev->ShortNextWrite(10);
  s = mover->Move({{host_.get(), *h}, {fdev.get(), *d}, 4096})->Wait();
  EXPECT_EQ(s.code(), StatusCode::kIOError);
  EXPECT_NE(s.message().find("short write"), std::string::npos) << s.message();
  EXPECT_EQ(fdev->faults_fired(), 2u);
  EXPECT_EQ(fnvme->faults_fired(), 1u);

  // With the faults consumed the same moves succeed.
  const auto data = RandomBytes(n, 5);
  Write(host_.get(), *h, 0, data);
  ASSERT_TRUE(mover->Move({{host_.get(), *h}, {fdev.get(), *d}, n})->Wait().ok());
  ASSERT_TRUE(mover->Move({{fdev.get(), *d}, {fnvme.get(), *v}, n})->Wait().ok());
  EXPECT_EQ(Read(fnvme.get(), *v, 0, n), data);
  EXPECT_EQ(staging_->Stats().used, 0u);
}

// More bounced moves in flight than the staging tier has slots: the ones that find none wait
// for a holder to finish (before: kResourceExhausted for a move the engine issued in good faith).
TEST_F(MoverTest, BouncesBeyondTheStagingSlotsWaitForThem) {
  auto one_slot = MakeHost(1 * kMiB, 1 * kMiB);
  auto mover = NewMover({.staging_slot_bytes = 1 * kMiB, .staging_slots = 4}, one_slot.get(),
                        nullptr);
  constexpr int kMoves = 12;
  constexpr Bytes kBytes = 3 * kMiB + 123;
  std::vector<Region> src, dst;
  std::vector<std::vector<char>> data;
  std::vector<std::shared_ptr<Completion>> done;
  for (int i = 0; i < kMoves; ++i) {
    const bool up = i % 2 == 0;  // device->NVMe and NVMe->device alternately
    Tier* from = up ? sim_.get() : nvme_.get();
    Tier* to = up ? nvme_.get() : sim_.get();
    auto rs = from->Allocate(kBytes);
    auto rd = to->Allocate(kBytes);
    ASSERT_TRUE(rs.ok() && rd.ok());
    data.push_back(RandomBytes(kBytes, 500 + i));
    ASSERT_TRUE(from->Copy({*rs, 0, data.back().data(), kBytes, CopyDir::kToTier})->Wait().ok());
    src.push_back(*rs);
    dst.push_back(*rd);
  }
  for (int i = 0; i < kMoves; ++i) {  // all in flight before the first wait
    const bool up = i % 2 == 0;
    done.push_back(mover->Move({{up ? sim_.get() : nvme_.get(), src[i]},
                                {up ? nvme_.get() : sim_.get(), dst[i]}, kBytes}));
  }
  for (int i = 0; i < kMoves; ++i) {
    const Status st = done[i]->Wait();
    ASSERT_TRUE(st.ok()) << i << ": " << st.ToString();
    Tier* to = i % 2 == 0 ? nvme_.get() : sim_.get();
    std::vector<char> back(kBytes);
    ASSERT_TRUE(to->Copy({dst[i], 0, back.data(), kBytes, CopyDir::kFromTier})->Wait().ok());
    EXPECT_EQ(back, data[i]) << i;
  }
  EXPECT_EQ(one_slot->Stats().used, 0u);
  EXPECT_EQ(one_slot->Stats().peak, 1 * kMiB);
}

// A bounce asks the NVMe side to checksum on its own threads (inline_work) unless configured
// not to; a direct host <-> NVMe move is the caller's copy and never asks.
TEST_F(MoverTest, BouncePiecesAskForInlineWorkAsConfigured) {
  auto* nvme = static_cast<LocalNvme*>(nvme_.get());
  auto d = sim_->Allocate(3 * kMiB);
  auto n = nvme_->Allocate(3 * kMiB);
  auto h = host_->Allocate(3 * kMiB);
  ASSERT_TRUE(d.ok() && n.ok() && h.ok());
  for (bool inline_work : {true, false}) {
    MoverConfig mc{.staging_slot_bytes = 1 * kMiB, .staging_slots = 2};
    mc.inline_work = inline_work;
    auto mover = NewMover(mc, staging_.get(), nullptr);
    nvme->inline_copies = 0;
    nvme->pooled_copies = 0;
    ASSERT_TRUE(mover->Move({{sim_.get(), *d}, {nvme_.get(), *n}, 3 * kMiB})->Wait().ok());
    ASSERT_TRUE(mover->Move({{nvme_.get(), *n}, {sim_.get(), *d}, 3 * kMiB})->Wait().ok());
    EXPECT_EQ(nvme->inline_copies.load(), inline_work ? 6 : 0);  // 3 pieces each way
    EXPECT_EQ(nvme->pooled_copies.load(), inline_work ? 0 : 6);
    ASSERT_TRUE(mover->Move({{host_.get(), *h}, {nvme_.get(), *n}, 3 * kMiB})->Wait().ok());
    EXPECT_EQ(nvme->pooled_copies.load(), inline_work ? 1 : 7);
  }
}

// The session's bounce staging: whole I/O pieces, the disk's queue depth of them per move (as
// many as the chunk has), the slots no smaller than the chunk needs to fit in that many.
TEST(BounceMoverConfig, SlotsOfWholePiecesUpToTheQueueDepth) {
  struct Case {
    Bytes chunk, piece;
    int depth;
    Bytes slot;
    int slots;
  };
  for (const Case& c : {Case{9 * kMiB, kMiB, 8, kMiB, 8}, Case{64 * kMiB, kMiB, 8, 8 * kMiB, 8},
                        Case{64 * kMiB, kMiB, 32, 2 * kMiB, 32}, Case{4 * kMiB, kMiB, 8, kMiB, 4},
                        Case{5 * kMiB / 2, kMiB, 8, kMiB, 2}, Case{kMiB, kMiB, 8, kMiB, 1},
                        Case{512 * kKiB, kMiB, 8, 512 * kKiB, 1},
                        Case{36 * kMiB, 4 * kMiB, 8, 4 * kMiB, 8}}) {
    const MoverConfig mc = BounceMoverConfig(c.chunk, c.piece, c.depth);
    EXPECT_EQ(mc.staging_slot_bytes, c.slot) << c.chunk << " / " << c.piece << " / " << c.depth;
    EXPECT_EQ(mc.staging_slots, c.slots) << c.chunk << " / " << c.piece << " / " << c.depth;
    EXPECT_LE(mc.staging_slot_bytes * static_cast<Bytes>(mc.staging_slots), c.chunk);
  }
}

TEST_F(MoverTest, BadRequestsGetSpecificCodes) {
  auto mover = NewMover({}, nullptr, nullptr);
  auto h = host_->Allocate(4096);
  auto d = sim_->Allocate(4096);
  auto v = nvme_->Allocate(4096);
  ASSERT_TRUE(h.ok() && d.ok() && v.ok());
  EXPECT_EQ(mover->Move({{nullptr, *h}, {sim_.get(), *d}, 10})->Wait().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(mover->Move({{host_.get(), *h, h->bytes - 50}, {sim_.get(), *d}, 100})->Wait().code(),
            StatusCode::kOutOfRange);
  EXPECT_EQ(mover->Move({{sim_.get(), *d}, {host_.get(), *h}, 5000})->Wait().code(),
            StatusCode::kOutOfRange);
  // Device -> NVMe needs staging, and this mover has none.
  EXPECT_EQ(mover->Move({{sim_.get(), *d}, {nvme_.get(), *v}, 10})->Wait().code(),
            StatusCode::kFailedPrecondition);
  // A staging tier with no room left: kResourceExhausted.
  auto tiny = MakeHost(1 * kMiB, 1 * kMiB);
  auto hog = tiny->Allocate(1 * kMiB);
  ASSERT_TRUE(hog.ok());
  auto mover2 = NewMover({.staging_slot_bytes = 64 * kKiB}, tiny.get(), nullptr);
  Status s = mover2->Move({{sim_.get(), *d}, {nvme_.get(), *v}, 10})->Wait();
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
  // A zero-byte move is a no-op that succeeds.
  EXPECT_TRUE(mover->Move({{sim_.get(), *d}, {nvme_.get(), *v}, 0})->Wait().ok());
}

}  // namespace
}  // namespace tiermem
