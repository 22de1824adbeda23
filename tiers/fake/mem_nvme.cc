// MemNvme implementation. Each region is its own heap block (ASan catches overruns); the
// worker (a one-thread WorkerPool) drains a FIFO of memcpy jobs. The region table is checked at
// Copy() time; a region must not be freed while copies on it are in flight (tiers/tier.h), so the
// worker may use the block pointer captured then.
#include "tiers/fake/mem_nvme.h"

#include <cstring>
#include <unordered_map>

#include "base/mutex.h"
#include "tiers/worker_pool.h"

namespace tiermem {
namespace {

class MemNvme final : public Tier {
 public:
  explicit MemNvme(const MemNvmeConfig& c)
      : block_(c.block_bytes == 0 ? 1 : c.block_bytes), budget_(c.capacity) {}

  TierKind kind() const override { return TierKind::kNvme; }
  std::string name() const override { return "mem-nvme"; }
  TierStats Stats() const override { return budget_.Snapshot(); }

  StatusOr<Region> Allocate(Bytes bytes) override {
    if (bytes == 0) return InvalidArgumentError("mem-nvme: allocation of 0 bytes");
    const Bytes rounded = AlignUp(bytes, block_);
    if (rounded < bytes) return budget_.Reserve(bytes, "nvme (mem)");  // overflow: over budget
    TIERMEM_RETURN_IF_ERROR(budget_.Reserve(rounded, "nvme (mem)"));
    std::unique_ptr<char[]> data(new (std::nothrow) char[rounded]());
    if (data == nullptr) {
      budget_.Release(rounded);
      return ResourceExhaustedError("mem-nvme: host allocation of " + std::to_string(rounded) +
                                    " bytes failed");
    }
    MutexLock lock(mu_);
    Region r{next_id_++, rounded, nullptr};
    regions_.emplace(r.id, Block{r, std::move(data)});
    return r;
  }

  Status Free(const Region& region) override {
    std::unique_ptr<char[]> data;
    Bytes bytes;
    {
      MutexLock lock(mu_);
      auto it = regions_.find(region.id);
      if (it == regions_.end()) {
        return InvalidArgumentError("mem-nvme: free of unknown region " +
                                    std::to_string(region.id));
      }
      data = std::move(it->second.data);
      bytes = it->second.region.bytes;
      regions_.erase(it);
    }
    budget_.Release(bytes);
    return OkStatus();
  }

  std::shared_ptr<Completion> Copy(const CopyRequest& req) override {
    Region live;
    char* data = nullptr;
    MutexLock lock(mu_);
    auto it = regions_.find(req.region.id);
    if (it != regions_.end()) {
      live = it->second.region;
      data = it->second.data.get();
    }
    Status valid = ValidateCopy(req, live);
    if (!valid.ok()) return Completion::Done(valid.WithContext("mem-nvme"));
    auto done = Completion::Make();
    char* stored = data + req.offset;
    char* host = static_cast<char*>(req.host);
    const Bytes n = req.bytes;
    const CopyDir dir = req.dir;
    worker_.Push([=] {
      if (n > 0) {
        if (dir == CopyDir::kToTier) {
          std::memcpy(stored, host, n);
        } else {
          std::memcpy(host, stored, n);
        }
      }
      done->Complete(OkStatus());
    });
    return done;
  }

 private:
  struct Block {
    Region region;
    std::unique_ptr<char[]> data;
  };
  const Bytes block_;
  BudgetAccount budget_;
  Mutex mu_;
  std::unordered_map<uint64_t, Block> regions_ TIERMEM_GUARDED_BY(mu_);
  uint64_t next_id_ TIERMEM_GUARDED_BY(mu_) = 1;
  // Last: destroyed first, running queued copies while the regions still exist.
  WorkerPool worker_{1};
};

}  // namespace

std::unique_ptr<Tier> NewMemNvme(const MemNvmeConfig& config) {
  return std::make_unique<MemNvme>(config);
}

}  // namespace tiermem
