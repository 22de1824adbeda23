#include "runtime/engine/stand_in_tiers.h"

#include <mutex>
#include <string>
#include <unordered_map>

#include "tiers/fake/sim_device.h"

namespace tiermem::engine {
namespace {

class StandInTier final : public Tier {
 public:
  StandInTier(TierKind kind, Bytes capacity) : kind_(kind) {
    SimDeviceConfig c;
    c.capacity = capacity;
    c.alignment = 64;
    inner_ = NewSimDevice(c);
  }
  TierKind kind() const override { return kind_; }
  std::string name() const override {
    return std::string(TierKindName(kind_)) + " (stand-in)";
  }
  StatusOr<Region> Allocate(Bytes bytes) override {
    auto r = inner_->Allocate(bytes);
    if (!r.ok()) {
      return Status(r.status().code(), std::string(TierKindName(kind_)) + " tier: " +
                                           r.status().message());
    }
    Region out = *r;
    if (kind_ != TierKind::kHost) {
      std::lock_guard<std::mutex> lock(mu_);
      addr_[out.id] = out.addr;
      out.addr = nullptr;
    }
    return out;
  }
  Status Free(const Region& region) override {
    Region r = Restore(region);
    Status s = inner_->Free(r);
    if (s.ok() && kind_ != TierKind::kHost) {
      std::lock_guard<std::mutex> lock(mu_);
      addr_.erase(region.id);
    }
    return s;
  }
  std::shared_ptr<Completion> Copy(const CopyRequest& request) override {
    CopyRequest r = request;
    r.region = Restore(request.region);
    return inner_->Copy(r);
  }
  TierStats Stats() const override { return inner_->Stats(); }

 private:
  Region Restore(const Region& region) const {
    if (kind_ == TierKind::kHost) return region;
    std::lock_guard<std::mutex> lock(mu_);
    Region r = region;
    auto it = addr_.find(region.id);
    if (it != addr_.end()) r.addr = it->second;
    return r;
  }

  const TierKind kind_;
  std::unique_ptr<Tier> inner_;
  mutable std::mutex mu_;
  std::unordered_map<uint64_t, void*> addr_;  // GUARDED_BY(mu_); hidden addresses (NVMe)
};

}  // namespace

std::unique_ptr<Tier> NewStandInTier(TierKind kind, Bytes capacity) {
  return std::make_unique<StandInTier>(kind, capacity);
}

}  // namespace tiermem::engine
