#include "chunks/eviction_policy.h"

namespace tiermem::chunks {
namespace {

class DefaultPolicy final : public EvictionPolicy {
 public:
  size_t ChooseVictim(std::span<const EvictionCandidate> c) override {
    size_t best = 0;
    EvictionRank best_rank = RankForEviction(c[0]);
    for (size_t i = 1; i < c.size(); ++i) {
      const EvictionRank r = RankForEviction(c[i]);
      if (r < best_rank) {
        best = i;
        best_rank = r;
      }
    }
    return best;
  }
};

}  // namespace

std::unique_ptr<EvictionPolicy> NewDefaultEvictionPolicy() {
  return std::make_unique<DefaultPolicy>();
}

}  // namespace tiermem::chunks
