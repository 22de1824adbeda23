// MemNvme implementation. Each region is its own heap block (ASan catches overruns); the
// worker thread drains a FIFO of memcpy jobs. The region table is checked at Copy() time; a
// region must not be freed while copies on it are in flight (tiers/tier.h), so the worker
// may use the block pointer captured then.
#include "tiers/fake/mem_nvme.h"

#include <cstring>
#include <deque>
#include <thread>
#include <unordered_map>

namespace tiermem {
namespace {

class MemNvme final : public Tier {
 public:
  explicit MemNvme(const MemNvmeConfig& c)
      : block_(c.block_bytes == 0 ? 1 : c.block_bytes), budget_(c.capacity),
        worker_([this] { Run(); }) {}

  ~MemNvme() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();  // drains queued copies first
  }

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
    std::lock_guard<std::mutex> lock(mu_);
    Region r{next_id_++, rounded, nullptr};
    regions_.emplace(r.id, Block{r, std::move(data)});
    return r;
  }

  Status Free(const Region& region) override {
    std::unique_ptr<char[]> data;
    Bytes bytes;
    {
      std::lock_guard<std::mutex> lock(mu_);
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
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(req.region.id);
    if (it != regions_.end()) {
      live = it->second.region;
      data = it->second.data.get();
    }
    Status valid = ValidateCopy(req, live);
    if (!valid.ok()) return Completion::Done(valid.WithContext("mem-nvme"));
    auto done = Completion::Make();
    queue_.push_back(Job{data + req.offset, static_cast<char*>(req.host), req.bytes, req.dir, done});
    cv_.notify_one();
    return done;
  }

 private:
  struct Block {
    Region region;
    std::unique_ptr<char[]> data;
  };
  struct Job {
    char* stored;
    char* host;
    Bytes bytes;
    CopyDir dir;
    std::shared_ptr<Completion> done;
  };

  void Run() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping and drained
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      if (job.bytes > 0) {
        if (job.dir == CopyDir::kToTier) {
          std::memcpy(job.stored, job.host, job.bytes);
        } else {
          std::memcpy(job.host, job.stored, job.bytes);
        }
      }
      job.done->Complete(OkStatus());
    }
  }

  const Bytes block_;
  BudgetAccount budget_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<uint64_t, Block> regions_;  // GUARDED_BY(mu_)
  uint64_t next_id_ = 1;                         // GUARDED_BY(mu_)
  std::deque<Job> queue_;                        // GUARDED_BY(mu_)
  bool stop_ = false;                            // GUARDED_BY(mu_)
  std::thread worker_;                           // last: starts after the fields above exist
};

}  // namespace

std::unique_ptr<Tier> NewMemNvme(const MemNvmeConfig& config) {
  return std::make_unique<MemNvme>(config);
}

}  // namespace tiermem
