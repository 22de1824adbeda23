#include "chunks/eviction_policy.h"

#include <tuple>

namespace tiermem::chunks {
namespace {

class DefaultPolicy final : public EvictionPolicy {
 public:
  size_t ChooseVictim(std::span<const EvictionCandidate> c) override {
    size_t best = 0;
    for (size_t i = 1; i < c.size(); ++i) {
      if (Key(c[i]) < Key(c[best])) best = i;
    }
    return best;
  }

 private:
  // Smaller key = better victim.
  static std::tuple<int, int, uint64_t> Key(const EvictionCandidate& e) {
    if (e.order_known) {
      const bool never = e.next_use == kNeverUsed;
      return {never ? 0 : 1, e.dirty ? 1 : 0, never ? 0 : UINT64_MAX - e.next_use};
    }
    return {0, e.dirty ? 1 : 0, e.last_use};
  }
};

}  // namespace

std::unique_ptr<EvictionPolicy> NewDefaultEvictionPolicy() {
  return std::make_unique<DefaultPolicy>();
}

}  // namespace tiermem::chunks
