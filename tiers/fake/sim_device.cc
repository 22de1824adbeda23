// SimDevice implementation. Regions are separate aligned heap blocks (so ASan catches an
// overrun of one region into the next); the budget is charged with the size rounded up to
// the alignment. Each lane is a FIFO served by one thread that memcpy's and then, under a
// bandwidth model, sleeps out the rest of the copy's modelled duration.
// Freed blocks are kept for reuse by a later allocation of the same rounded size (at most
// `capacity` bytes of them; off under ASan so it still catches use after free): fresh heap
// blocks of chunk size are mmap'd and page-faulted again on every allocation, which cost the
// engine 10-50 ms a step on a 13 MiB chunk (first touch is 0.6-2.7 GB/s on the dev VM), a
// cost a real device's allocator does not have. The budget is charged as before.
#include "tiers/fake/sim_device.h"

#include <chrono>
#include <cstring>
#include <map>
#include <new>
#include <thread>
#include <unordered_map>

#include "runtime/base/clock.h"
#include "tiers/worker_pool.h"

namespace tiermem {
namespace {

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kReuseBlocks = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kReuseBlocks = false;
#else
constexpr bool kReuseBlocks = true;
#endif
#else
constexpr bool kReuseBlocks = true;
#endif

// One copy engine: a one-thread FIFO. With a bandwidth model a copy of n bytes takes at least
// latency + n / bandwidth of wall time (the memcpy, then sleep for the rest).
class Lane {
 public:
  Lane(double bytes_per_s, uint64_t latency_ns) : bytes_per_s_(bytes_per_s), latency_ns_(latency_ns) {}
  void Push(std::function<void()> copy, Bytes bytes, std::shared_ptr<Completion> done) {
    pool_.Push([this, copy = std::move(copy), bytes, done = std::move(done)] {
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
  WorkerPool pool_{1};  // last: drained and joined first
};

class SimDevice final : public Tier {
 public:
  explicit SimDevice(const SimDeviceConfig& c)
      : config_(c),
        budget_(c.capacity),
        h2d_(std::make_unique<Lane>(c.h2d_bytes_per_s, c.copy_latency_ns)),
        d2h_(std::make_unique<Lane>(c.d2h_bytes_per_s, c.copy_latency_ns)) {}

  ~SimDevice() override {
    h2d_.reset();  // drain queued copies while their regions still exist
    d2h_.reset();
    for (auto& [id, r] : regions_) ::operator delete(r.addr, std::align_val_t(kAddrAlign));
    for (auto& [bytes, p] : free_) ::operator delete(p, std::align_val_t(kAddrAlign));
  }

  TierKind kind() const override { return TierKind::kDevice; }
  std::string name() const override { return "sim-device"; }

  StatusOr<Region> Allocate(Bytes bytes) override {
    if (bytes == 0) return InvalidArgumentError("sim-device: allocation of 0 bytes");
    const Bytes rounded = AlignUp(bytes, config_.alignment);
    TIERMEM_RETURN_IF_ERROR(budget_.Reserve(rounded, "device (sim)"));
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = free_.find(rounded);
      if (it != free_.end()) {
        p = it->second;
        free_.erase(it);
        free_bytes_ -= rounded;
      }
    }
    if (p == nullptr) p = ::operator new(rounded, std::align_val_t(kAddrAlign), std::nothrow);
    if (p == nullptr) {
      budget_.Release(rounded);
      return ResourceExhaustedError("sim-device: host allocation of " + std::to_string(rounded) +
                                    " bytes failed");
    }
    std::lock_guard<std::mutex> lock(mu_);
    Region r{next_id_++, rounded, p};
    regions_.emplace(r.id, r);
    return r;
  }

  Status Free(const Region& region) override {
    Region r;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = regions_.find(region.id);
      if (it == regions_.end()) {
        return InvalidArgumentError("sim-device: free of unknown region " +
                                    std::to_string(region.id));
      }
      r = it->second;
      regions_.erase(it);
      if (kReuseBlocks && free_bytes_ + r.bytes <= config_.capacity) {
        free_.emplace(r.bytes, r.addr);
        free_bytes_ += r.bytes;
        r.addr = nullptr;
      }
    }
    if (r.addr != nullptr) ::operator delete(r.addr, std::align_val_t(kAddrAlign));
    budget_.Release(r.bytes);
    return OkStatus();
  }

  std::shared_ptr<Completion> Copy(const CopyRequest& req) override {
    Region live;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = regions_.find(req.region.id);
      if (it != regions_.end()) live = it->second;
    }
    Status valid = ValidateCopy(req, live);
    if (!valid.ok()) return Completion::Done(valid.WithContext("sim-device"));
    auto done = Completion::Make();
    char* dev = static_cast<char*>(live.addr) + req.offset;
    char* host = static_cast<char*>(req.host);
    const Bytes n = req.bytes;
    if (req.dir == CopyDir::kToTier) {
      h2d_->Push([=] { std::memcpy(dev, host, n); }, n, done);
    } else {
      d2h_->Push([=] { std::memcpy(host, dev, n); }, n, done);
    }
    return done;
  }

  TierStats Stats() const override { return budget_.Snapshot(); }

 private:
  static constexpr size_t kAddrAlign = 256;
  const SimDeviceConfig config_;
  BudgetAccount budget_;
  std::mutex mu_;
  std::unordered_map<uint64_t, Region> regions_;  // GUARDED_BY(mu_)
  uint64_t next_id_ = 1;                          // GUARDED_BY(mu_)
  std::multimap<Bytes, void*> free_;              // GUARDED_BY(mu_) size -> freed block
  Bytes free_bytes_ = 0;                          // GUARDED_BY(mu_)
  std::unique_ptr<Lane> h2d_;
  std::unique_ptr<Lane> d2h_;
};

}  // namespace

std::unique_ptr<Tier> NewSimDevice(const SimDeviceConfig& config) {
  return std::make_unique<SimDevice>(config);
}

}  // namespace tiermem
