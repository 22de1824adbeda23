// SimDevice implementation. Regions are separate aligned heap blocks (so ASan catches an
// overrun of one region into the next); the budget is charged with the size rounded up to
// the alignment. Each lane is a FIFO served by worker threads that memcpy and then, under a
// bandwidth model, sleep out the rest of the copy's modelled duration.
// Freed blocks are kept for reuse by a later allocation of the same rounded size (at most
// `capacity` bytes of them; off under ASan so it still catches use after free): fresh heap
// blocks of chunk size are mmap'd and page-faulted again on every allocation, which cost the
// engine 10-50 ms a step on a 13 MiB chunk (first touch is 0.6-2.7 GB/s on the dev VM), a
// cost a real device's allocator does not have. The budget is charged as before.
//
// Ordering invariants (all under mu_):
//  * live_[id].compute is the Completion of the region's last ComputeUsed on a SimStream
//    (null after kHostStream uses: that work is done); copies_in are the copies into it not
//    yet known to be done; fences are compute uses of regions that held its memory before.
//  * A freed block keeps every pending compute Completion of its last region (its own use
//    and its inherited fences): reused from free_, the new region inherits them; not reused,
//    it waits in retired_ and goes back to the heap only once they all fired.
//  * A copy snapshots the waits of its region when it is issued and, on its lane thread,
//    waits for them before any byte moves — a device-side wait: the issuer never blocks.
#include "tiers/fake/sim_device.h"

#include <chrono>
#include <cstring>
#include <map>
#include <new>
#include <random>
#include <thread>
#include <unordered_map>
#include <vector>

#include "base/clock.h"
#include "base/mutex.h"
#include "base/sanitizers.h"
#include "tiers/fake/sim_stream.h"
#include "tiers/worker_pool.h"

namespace tiermem {
namespace {

constexpr bool kReuseBlocks = !kAsanBuild;

using Fences = std::vector<std::shared_ptr<Completion>>;

// Drops the completions that already fired.
void Prune(Fences* f) {
  std::erase_if(*f, [](const std::shared_ptr<Completion>& c) { return c->Poll(); });
}

// One copy engine. With one thread a FIFO; in asynchronous mode several threads and a random
// delay per copy. With a bandwidth model a copy of n bytes takes at least latency + n /
// bandwidth of wall time (the memcpy, then sleep for the rest).
class Lane {
 public:
  Lane(const SimDeviceConfig& c, double bytes_per_s, uint64_t seed)
      : bytes_per_s_(bytes_per_s),
        latency_ns_(c.copy_latency_ns),
        min_delay_ns_(c.async ? std::min(c.async_min_delay_ns, c.async_max_delay_ns) : 0),
        max_delay_ns_(c.async ? c.async_max_delay_ns : 0),
        rng_(seed),
        pool_(c.async ? std::max(1, c.async_lane_threads) : 1) {}

  // `waits` fire before the bytes move (compute fences of the region).
  void Push(std::function<void()> copy, Bytes bytes, Fences waits,
            std::shared_ptr<Completion> done) {
    uint64_t delay = 0;
    if (max_delay_ns_ > 0) {
      MutexLock lock(mu_);
      delay = std::uniform_int_distribution<uint64_t>(min_delay_ns_, max_delay_ns_)(rng_);
    }
    pool_.Push([this, copy = std::move(copy), bytes, waits = std::move(waits), delay,
                done = std::move(done)] {
      for (const auto& w : waits) w->Wait().IgnoreError();  // compute ran (or failed: moot)
      if (delay > 0) std::this_thread::sleep_for(std::chrono::nanoseconds(delay));
      const uint64_t start = Clock::Real()->NowNs();
      copy();
      uint64_t modelled = latency_ns_;
      if (bytes_per_s_ > 0) modelled += static_cast<uint64_t>(bytes / bytes_per_s_ * 1e9);
      const uint64_t spent = Clock::Real()->NowNs() - start;
      if (modelled > spent) std::this_thread::sleep_for(std::chrono::nanoseconds(modelled - spent));
      done->Complete(OkStatus());
    });
  }

 private:
  const double bytes_per_s_;
  const uint64_t latency_ns_;
  const uint64_t min_delay_ns_;
  const uint64_t max_delay_ns_;
  Mutex mu_;
  std::mt19937_64 rng_ TIERMEM_GUARDED_BY(mu_);
  WorkerPool pool_;  // last: drained and joined first
};

class SimDevice final : public Tier, public ComputeOrdering {
 public:
  explicit SimDevice(const SimDeviceConfig& c)
      : config_(c),
        budget_(c.capacity),
        h2d_(std::make_unique<Lane>(c, c.h2d_bytes_per_s, c.async_seed)),
        d2h_(std::make_unique<Lane>(c, c.d2h_bytes_per_s, c.async_seed * 7919 + 1)) {}

  ~SimDevice() override {
    h2d_.reset();  // drain queued copies while their regions still exist
    d2h_.reset();
    // Compute still queued on a SimStream may touch the memory: wait for it before freeing.
    for (auto& [id, r] : live_) {
      for (auto* fs : {&r.fences, &r.copies_in}) WaitAll(*fs).IgnoreError();
      if (r.compute) r.compute->Wait().IgnoreError();
      ::operator delete(r.region.addr, std::align_val_t(kAddrAlign));
    }
    for (auto* blocks : {&retired_}) {
      for (Block& b : *blocks) {
        WaitAll(b.fences).IgnoreError();
        ::operator delete(b.addr, std::align_val_t(kAddrAlign));
      }
    }
    for (auto& [bytes, b] : free_) {
      WaitAll(b.fences).IgnoreError();
      ::operator delete(b.addr, std::align_val_t(kAddrAlign));
    }
  }

  TierKind kind() const override { return TierKind::kDevice; }
  std::string name() const override { return config_.async ? "sim-device-async" : "sim-device"; }
  ComputeOrdering* ordering() override { return this; }

  StatusOr<Region> Allocate(Bytes bytes) override {
    if (bytes == 0) return InvalidArgumentError("sim-device: allocation of 0 bytes");
    const Bytes rounded = AlignUp(bytes, config_.alignment);
    TIERMEM_RETURN_IF_ERROR(budget_.Reserve(rounded, "device (sim)"));
    Block block;
    {
      MutexLock lock(mu_);
      ReapRetiredLocked();
      auto it = free_.find(rounded);
      if (it != free_.end()) {
        block = std::move(it->second);
        free_.erase(it);
        free_bytes_ -= rounded;
      }
    }
    if (block.addr == nullptr) {
      block.addr = ::operator new(rounded, std::align_val_t(kAddrAlign), std::nothrow);
    }
    if (block.addr == nullptr) {
      budget_.Release(rounded);
      return ResourceExhaustedError("sim-device: host allocation of " + std::to_string(rounded) +
                                    " bytes failed");
    }
    MutexLock lock(mu_);
    Region r{next_id_++, rounded, block.addr};
    Live& l = live_[r.id];
    l.region = r;
    l.fences = std::move(block.fences);
    Prune(&l.fences);
    return r;
  }

  Status Free(const Region& region) override {
    Block dead;
    {
      MutexLock lock(mu_);
      auto it = live_.find(region.id);
      if (it == live_.end()) {
        return InvalidArgumentError("sim-device: free of unknown region " +
                                    std::to_string(region.id));
      }
      Live& l = it->second;
      const Bytes bytes = l.region.bytes;
      Block b{l.region.addr, std::move(l.fences)};
      if (l.compute) b.fences.push_back(std::move(l.compute));
      Prune(&b.fences);
      live_.erase(it);
      if (kReuseBlocks && free_bytes_ + bytes <= config_.capacity) {
        free_.emplace(bytes, std::move(b));
        free_bytes_ += bytes;
      } else if (!b.fences.empty()) {
        retired_.push_back(std::move(b));  // compute may still touch it
      } else {
        dead = std::move(b);
      }
      budget_.Release(bytes);
    }
    if (dead.addr != nullptr) ::operator delete(dead.addr, std::align_val_t(kAddrAlign));
    return OkStatus();
  }

  std::shared_ptr<Completion> Copy(const CopyRequest& req) override {
    Region live;
    Fences waits;
    auto done = Completion::Make();
    {
      MutexLock lock(mu_);
      auto it = live_.find(req.region.id);
      if (it != live_.end()) {
        Live& l = it->second;
        live = l.region;
        if (ValidateCopy(req, live).ok()) {
          if (!(config_.drop_waits_for_test & kDropCopyAfterCompute)) {
            Prune(&l.fences);
            waits = l.fences;
            if (l.compute && !l.compute->Poll()) waits.push_back(l.compute);
          }
          if (req.dir == CopyDir::kToTier) {
            Prune(&l.copies_in);
            l.copies_in.push_back(done);
          }
        }
      }
    }
    Status valid = ValidateCopy(req, live);
    if (!valid.ok()) return Completion::Done(valid.WithContext("sim-device"));
    char* dev = static_cast<char*>(live.addr) + req.offset;
    char* host = static_cast<char*>(req.host);
    const Bytes n = req.bytes;
    if (req.dir == CopyDir::kToTier) {
      h2d_->Push([=] { std::memcpy(dev, host, n); }, n, std::move(waits), done);
    } else {
      d2h_->Push([=] { std::memcpy(host, dev, n); }, n, std::move(waits), done);
    }
    return done;
  }

  TierStats Stats() const override { return budget_.Snapshot(); }

  // ---- ComputeOrdering ----
  Status ComputeUsed(const Region& region, ComputeStream stream) override {
    SimStream* s = nullptr;
    if (stream != kHostStream) {
      s = SimStream::FromHandle(stream);
      if (s == nullptr) return InvalidArgumentError("sim-device: not a live SimStream handle");
    }
    MutexLock lock(mu_);
    auto it = live_.find(region.id);
    if (it == live_.end()) {
      return InvalidArgumentError("sim-device: compute use of unknown region " +
                                  std::to_string(region.id));
    }
    // kHostStream: the caller's thread did the work already; nothing to wait for later.
    if (s != nullptr) it->second.compute = s->Record();
    return OkStatus();
  }

  Status ComputeWaits(const Region& region, ComputeStream stream) override {
    SimStream* s = nullptr;
    if (stream != kHostStream) {
      s = SimStream::FromHandle(stream);
      if (s == nullptr) return InvalidArgumentError("sim-device: not a live SimStream handle");
    }
    Fences waits;
    {
      MutexLock lock(mu_);
      auto it = live_.find(region.id);
      if (it == live_.end()) {
        return InvalidArgumentError("sim-device: compute wait on unknown region " +
                                    std::to_string(region.id));
      }
      if (config_.drop_waits_for_test & kDropComputeAfterCopy) return OkStatus();
      Prune(&it->second.copies_in);
      Prune(&it->second.fences);
      waits = it->second.copies_in;
      waits.insert(waits.end(), it->second.fences.begin(), it->second.fences.end());
    }
    if (s == nullptr) return WaitAll(waits).WithContext("sim-device: copy into the region");
    for (auto& w : waits) s->WaitFor(std::move(w));
    return OkStatus();
  }

 private:
  static constexpr size_t kAddrAlign = 256;
  struct Live {
    Region region;
    std::shared_ptr<Completion> compute;  // last ComputeUsed on a SimStream
    Fences copies_in;                     // copies into it, maybe not done
    Fences fences;                        // compute uses of earlier regions of its memory
  };
  struct Block {
    void* addr = nullptr;
    Fences fences;  // pending compute that may still touch it
  };

  void ReapRetiredLocked() TIERMEM_REQUIRES(mu_) {
    std::erase_if(retired_, [](Block& b) {
      Prune(&b.fences);
      if (!b.fences.empty()) return false;
      ::operator delete(b.addr, std::align_val_t(kAddrAlign));
      return true;
    });
  }

  const SimDeviceConfig config_;
  BudgetAccount budget_;
  Mutex mu_;
  std::unordered_map<uint64_t, Live> live_ TIERMEM_GUARDED_BY(mu_);
  uint64_t next_id_ TIERMEM_GUARDED_BY(mu_) = 1;
  std::multimap<Bytes, Block> free_ TIERMEM_GUARDED_BY(mu_);  // size -> freed block
  Bytes free_bytes_ TIERMEM_GUARDED_BY(mu_) = 0;
  std::vector<Block> retired_ TIERMEM_GUARDED_BY(mu_);  // freed, compute pending
  std::unique_ptr<Lane> h2d_;
  std::unique_ptr<Lane> d2h_;
};

}  // namespace

std::unique_ptr<Tier> NewSimDevice(const SimDeviceConfig& config) {
  return std::make_unique<SimDevice>(config);
}

}  // namespace tiermem
