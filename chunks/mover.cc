// Mover implementation.
//
// A move picks its path from the two endpoints. An endpoint is *host-side* when its tier is a
// host tier (kind kHost) and its region has an address:
//   host -> host       a memcpy on the pair's lane thread, split over a oneTBB arena of
//                      memcpy_threads above parallel_memcpy_min_bytes;
//   host -> X, X -> host   one Copy on X with the host region's address as the host side;
//   X -> Y (neither host)  a bounce through staging slots taken from the staging tier: each
//                      slot loops "read a piece of src into the slot, then write it to dst"
//                      until the move is done, so up to `staging_slots` pieces are in flight
//                      and reads of one piece overlap writes of another.
// Invariants of a bounce: pieces cover [0, bytes) exactly once and in increasing offset order
// of issue; a slot holds at most one piece at a time; after the first failure no new piece is
// issued; the move completes (with the first failure, or OK) exactly once, after the last
// in-flight piece finished and after every staging slot was freed back to the staging tier.
// Each move gets a copy id; with a recorder, kCopyBegin is recorded before any byte moves
// and kCopyEnd (kFlagFailed on failure) before the move's completion fires.
// Lanes: one per ordered (source tier, destination tier) pair, created on first use; a lane
// has a timeline lane id and label, and host->host lanes own the thread that runs memcpys (in
// submission order). Other lanes issue onto the tiers' own copy engines.
// Callbacks never capture the Mover: a move in flight when the Mover is destroyed still
// completes (host->host lanes are drained by the destructor).
#include "chunks/mover.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <atomic>
#include <cstring>
#include <map>
#include <utility>

#include "base/clock.h"
#include "base/mutex.h"
#include "base/sanitizers.h"
#include "tiers/worker_pool.h"

namespace tiermem {
namespace {

bool HostSide(const Endpoint& e) {
  return e.tier->kind() == TierKind::kHost && e.region.addr != nullptr;
}

char* HostAddr(const Endpoint& e) { return static_cast<char*>(e.region.addr) + e.offset; }

Status CheckBounds(const Endpoint& e, Bytes bytes, const char* side) {
  if (e.offset > e.region.bytes || bytes > e.region.bytes - e.offset) {
    return OutOfRangeError(std::string("mover: ") + side + " range [" + std::to_string(e.offset) +
                           ", +" + std::to_string(bytes) + ") outside region of " +
                           std::to_string(e.region.bytes) + " bytes");
  }
  return OkStatus();
}

struct Lane {
  uint16_t id = 0;
  uint32_t label = 0;                  // interned "src->dst" tier names; 0 without a recorder
  std::unique_ptr<WorkerPool> worker;  // host->host lanes only
};

// Timeline bookkeeping of one move. Value type, captured by the completion callbacks.
struct MoveRecord {
  TimelineRecorder* recorder = nullptr;
  Event begin;

  void Begin() const {
    if (recorder != nullptr) recorder->Record(begin);
  }
  void End(const Status& s) const {
    if (recorder == nullptr) return;
    Event e = begin;
    e.ts_ns = 0;
    e.type = EventType::kCopyEnd;
    e.flags = s.ok() ? kFlagNone : kFlagFailed;
    recorder->Record(e);
  }
};

class Bounce;

// The staging tier's slots, shared by every bounce: a bounce that finds none free while others
// hold some waits for them (they come back when those finish) instead of failing.
struct StagingPool {
  explicit StagingPool(Tier* t) : tier(t) {}
  Tier* const tier;  // null: the mover has no staging tier (bounces fail at once)
  Mutex mu;
  int holders TIERMEM_GUARDED_BY(mu) = 0;                               // bounces holding slots
  std::vector<std::shared_ptr<Bounce>> waiting TIERMEM_GUARDED_BY(mu);  // started again at a Finish
};

// One device<->NVMe style move through staging slots. Shared by the callbacks of its pieces.
class Bounce : public std::enable_shared_from_this<Bounce> {
 public:
  Bounce(const MoveRequest& req, std::shared_ptr<StagingPool> pool,
         std::shared_ptr<Completion> done, Bytes slot_bytes, int slots, bool inline_work)
      : req_(req),
        pool_(std::move(pool)),
        done_(std::move(done)),
        slot_bytes_(std::min(slot_bytes, req.bytes)),
        max_slots_(slots),
        inline_work_(inline_work) {}

  // Allocates up to max_slots_ slots (fewer if the staging tier is short) and starts one piece
  // per slot. With none free: waits for a holder's Finish if there is one, else fails.
  void Start() {
    const Bytes pieces = (req_.bytes + slot_bytes_ - 1) / slot_bytes_;
    const int want = static_cast<int>(std::min<Bytes>(static_cast<Bytes>(max_slots_), pieces));
    Status alloc_error;
    {
      MutexLock lock(pool_->mu);
      for (int i = 0; i < want; ++i) {
        StatusOr<Region> r = pool_->tier->Allocate(slot_bytes_);
        if (!r.ok()) {
          alloc_error = r.status();
          break;
        }
        slots_.push_back(*r);
      }
      if (slots_.empty() && pool_->holders > 0) {
        pool_->waiting.push_back(shared_from_this());
        return;
      }
      if (!slots_.empty()) ++pool_->holders;
    }
    if (slots_.empty()) {
      done_->Complete(alloc_error.WithContext("mover: no staging slot for a bounced move"));
      return;
    }
    auto self = shared_from_this();
    for (size_t i = 0; i < slots_.size(); ++i) self->Pump(i);
  }

 private:
  // Issues the next piece on `slot`, or finishes the move if nothing is left in flight.
  void Pump(size_t slot) {
    Bytes off = 0, n = 0;
    {
      MutexLock lock(mu_);
      if (!error_.ok() || next_ >= req_.bytes) {
        if (in_flight_ > 0 || finished_) return;
        finished_ = true;
      } else {
        off = next_;
        n = std::min(slot_bytes_, req_.bytes - off);
        next_ += n;
        ++in_flight_;
      }
    }
    if (n == 0) {
      Finish();
      return;
    }
    auto self = shared_from_this();
    void* buf = slots_[slot].addr;
    // inline_work: this pipeline's threads (the caller's, then each copy's completing one)
    // do the pieces' checksums themselves instead of handing each to another pool.
    auto read = req_.src.tier->Copy(
        {req_.src.region, req_.src.offset + off, buf, n, CopyDir::kFromTier, inline_work_});
    read->OnDone([self, slot, off, n, buf](const Status& s) {
      if (!s.ok()) {
        self->PieceDone(slot, s);
        return;
      }
      auto write = self->req_.dst.tier->Copy({self->req_.dst.region, self->req_.dst.offset + off,
                                              buf, n, CopyDir::kToTier, self->inline_work_});
      write->OnDone([self, slot](const Status& s2) { self->PieceDone(slot, s2); });
    });
  }

  void PieceDone(size_t slot, const Status& s) {
    {
      MutexLock lock(mu_);
      --in_flight_;
      if (!s.ok() && error_.ok()) error_ = s;
    }
    Pump(slot);
  }

  // Runs once (finished_ was set by the caller): no piece is in flight and none will be
  // issued, so the slots are idle and error_ is final.
  void Finish() {
    std::vector<std::shared_ptr<Bounce>> waiting;
    {
      MutexLock lock(pool_->mu);
      for (const Region& r : slots_) pool_->tier->Free(r).IgnoreError();
      --pool_->holders;
      waiting.swap(pool_->waiting);
    }
    Status s;
    {
      MutexLock lock(mu_);
      s = error_;
    }
    done_->Complete(std::move(s));
    for (const std::shared_ptr<Bounce>& b : waiting) b->Start();  // each waits again if short
  }

  const MoveRequest req_;
  const std::shared_ptr<StagingPool> pool_;
  const std::shared_ptr<Completion> done_;
  const Bytes slot_bytes_;
  const int max_slots_;
  const bool inline_work_;
  std::vector<Region> slots_;  // written by Start only, before any piece is issued

  Mutex mu_;
  Bytes next_ TIERMEM_GUARDED_BY(mu_) = 0;  // offset of the next piece to issue
  int in_flight_ TIERMEM_GUARDED_BY(mu_) = 0;
  bool finished_ TIERMEM_GUARDED_BY(mu_) = false;
  Status error_ TIERMEM_GUARDED_BY(mu_);  // first failure
};

class MoverImpl final : public Mover {
 public:
  MoverImpl(const MoverConfig& config, Tier* staging, TimelineRecorder* recorder)
      : config_(config),
        pool_(std::make_shared<StagingPool>(staging)),
        recorder_(recorder),
        arena_(config.memcpy_threads > 0 ? config.memcpy_threads : tbb::task_arena::automatic) {}

  ~MoverImpl() override {
    MutexLock lock(mu_);
    lanes_.clear();  // joins host->host lane threads after their queued memcpys
  }

  std::shared_ptr<Completion> Move(const MoveRequest& req) override {
    if (req.src.tier == nullptr || req.dst.tier == nullptr) {
      return Completion::Done(InvalidArgumentError("mover: move with a null tier"));
    }
    const bool src_host = HostSide(req.src), dst_host = HostSide(req.dst);
    if (src_host) {
      Status s = CheckBounds(req.src, req.bytes, "source");
      if (!s.ok()) return Completion::Done(s);
    }
    if (dst_host) {
      Status s = CheckBounds(req.dst, req.bytes, "destination");
      if (!s.ok()) return Completion::Done(s);
    }
    if (req.bytes == 0) return Completion::Done(OkStatus());
    const bool bounce = !src_host && !dst_host;
    if (bounce && (pool_->tier == nullptr || pool_->tier->kind() != TierKind::kHost)) {
      return Completion::Done(FailedPreconditionError(
          "mover: " + req.src.tier->name() + " -> " + req.dst.tier->name() +
          " needs host staging slots, and the mover has no host staging tier"));
    }

    Lane* lane = LaneFor(req.src.tier, req.dst.tier, src_host && dst_host);
    MoveRecord rec;
    rec.recorder = recorder_;
    rec.begin.type = EventType::kCopyBegin;
    rec.begin.id = next_copy_id_.fetch_add(1, std::memory_order_relaxed);  // only uniqueness
    rec.begin.bytes = req.bytes;
    rec.begin.label = lane->label;
    rec.begin.chunk = req.chunk;
    rec.begin.lane = lane->id;
    rec.begin.tier = req.src.tier->kind();
    rec.begin.tier2 = req.dst.tier->kind();
    rec.begin.category = req.category;
    rec.Begin();

    auto done = Completion::Make();
    std::shared_ptr<Completion> inner;
    if (src_host && dst_host) {
      inner = Completion::Make();
      char* dst = HostAddr(req.dst);
      const char* src = HostAddr(req.src);
      const Bytes n = req.bytes;
      const Bytes min_parallel = config_.parallel_memcpy_min_bytes;
      tbb::task_arena* arena = &arena_;
      lane->worker->Push([=] {
        if (n < min_parallel) {
          std::memmove(dst, src, n);
        } else {
          constexpr Bytes kPiece = 1 * kMiB;
          int hb = 0;        // TSan token: libtbb is uninstrumented (base/sanitizers.h)
          TsanRelease(&hb);  // this thread's view of src/dst -> the pieces
          arena->execute([&] {
            tbb::parallel_for(tbb::blocked_range<Bytes>(0, (n + kPiece - 1) / kPiece),
                              [&](const tbb::blocked_range<Bytes>& r) {
                                TsanAcquire(&hb);
                                const Bytes b = r.begin() * kPiece;
                                const Bytes e = std::min(n, r.end() * kPiece);
                                std::memcpy(dst + b, src + b, e - b);
                                TsanRelease(&hb);  // the piece's writes -> the completion
                              });
          });
          TsanAcquire(&hb);
        }
        inner->Complete(OkStatus());
      });
    } else if (src_host) {
      inner = req.dst.tier->Copy(
          {req.dst.region, req.dst.offset, HostAddr(req.src), req.bytes, CopyDir::kToTier});
    } else if (dst_host) {
      inner = req.src.tier->Copy(
          {req.src.region, req.src.offset, HostAddr(req.dst), req.bytes, CopyDir::kFromTier});
    } else {
      inner = Completion::Make();
      auto b = std::make_shared<Bounce>(req, pool_, inner, config_.staging_slot_bytes,
                                        std::max(1, config_.staging_slots), config_.inline_work);
      b->Start();
    }
    const int si = static_cast<int>(req.src.tier->kind()),
              di = static_cast<int>(req.dst.tier->kind());
    std::shared_ptr<Counters> counters = counters_;
    const Bytes n = req.bytes;
    const uint64_t t0 = Clock::Real()->NowNs();
    inner->OnDone([done, rec, counters, si, di, n, t0](const Status& s) {
      rec.End(s);
      if (s.ok() && si >= 0 && si < kNumTierKinds && di >= 0 && di < kNumTierKinds) {
        Counters::Link& l = counters->link[si][di];
        l.bytes.fetch_add(n, std::memory_order_relaxed);
        l.moves.fetch_add(1, std::memory_order_relaxed);
        l.busy_ns.fetch_add(Clock::Real()->NowNs() - t0, std::memory_order_relaxed);
      }
      done->Complete(s);
    });
    return done;
  }

 private:
  Lane* LaneFor(Tier* src, Tier* dst, bool host_to_host) {
    MutexLock lock(mu_);
    auto& lane = lanes_[{src, dst}];
    if (lane == nullptr) {
      lane = std::make_unique<Lane>();
      lane->id = static_cast<uint16_t>(lanes_.size());
      if (recorder_ != nullptr)
        lane->label = recorder_->InternLabel(src->name() + "->" + dst->name());
      if (host_to_host) lane->worker = std::make_unique<WorkerPool>(1);
    }
    return lane.get();
  }

  // Shared with the completion callbacks (which never capture the Mover).
  struct Counters {
    struct Link {
      std::atomic<Bytes> bytes{0};
      std::atomic<uint64_t> moves{0};
      std::atomic<uint64_t> busy_ns{0};
    };
    Link link[kNumTierKinds][kNumTierKinds];
  };

  LinkTable Links() const override {
    LinkTable t{};
    for (int a = 0; a < kNumTierKinds; ++a) {
      for (int b = 0; b < kNumTierKinds; ++b) {
        const Counters::Link& l = counters_->link[a][b];
        t[a][b] = {l.bytes.load(std::memory_order_relaxed), l.moves.load(std::memory_order_relaxed),
                   l.busy_ns.load(std::memory_order_relaxed)};
      }
    }
    return t;
  }

  const MoverConfig config_;
  const std::shared_ptr<Counters> counters_ = std::make_shared<Counters>();
  const std::shared_ptr<StagingPool> pool_;  // the staging tier's slots, shared with the bounces
  TimelineRecorder* const recorder_;
  tbb::task_arena arena_;
  std::atomic<uint64_t> next_copy_id_{1};
  Mutex mu_;
  std::map<std::pair<Tier*, Tier*>, std::unique_ptr<Lane>> lanes_ TIERMEM_GUARDED_BY(mu_);
};

}  // namespace

MoverConfig BounceMoverConfig(Bytes chunk_bytes, Bytes io_piece, int io_depth) {
  MoverConfig mc;
  if (io_piece == 0 || chunk_bytes <= io_piece) {
    mc.staging_slot_bytes = std::max<Bytes>(chunk_bytes, 1);
    mc.staging_slots = 1;
    return mc;
  }
  const Bytes depth = static_cast<Bytes>(std::max(io_depth, 1));
  mc.staging_slot_bytes = std::max(io_piece, chunk_bytes / depth / io_piece * io_piece);
  mc.staging_slots = static_cast<int>(std::min(depth, chunk_bytes / mc.staging_slot_bytes));
  return mc;
}

std::unique_ptr<Mover> NewMover(const MoverConfig& config, Tier* staging,
                                TimelineRecorder* recorder) {
  return std::make_unique<MoverImpl>(config, staging, recorder);
}

}  // namespace tiermem

#if defined(TIERMEM_TSAN)  // base/sanitizers.h: gcc's and clang's TSan
// libtbb is not built with TSan: the hand-off of a parallel_for task from one TBB thread to
// another happens inside the uninstrumented library, so TSan reports the task object's fields
// (written by the spawning thread, read by the stealing one) as races — in the partitioner,
// the small-object pool and parallel_for's own task (its finalize(), seen when the CPU
// kernels split a large tensor across threads). Those reports are about TBB's own objects;
// races in our code (the lambdas' captures, the buffers) still show.
extern "C" const char* __tsan_default_suppressions() {
  return "race:oneapi/tbb/partitioner.h\n"
         "race:oneapi/tbb/parallel_for.h\n"
         "race:oneapi/tbb/detail/_small_object_pool.h\n";
}
#endif
