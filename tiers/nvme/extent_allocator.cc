#include "tiers/nvme/extent_allocator.h"

#include <cassert>
#include <iterator>

namespace tiermem::nvme {

ExtentAllocator::ExtentAllocator(uint64_t size, uint64_t granularity) : granularity_(granularity) {
  assert(granularity > 0 && size % granularity == 0);
  if (size > 0) free_.emplace(0, size);
  free_bytes_ = size;
}

std::optional<uint64_t> ExtentAllocator::Allocate(uint64_t bytes) {
  const uint64_t need = Round(bytes);
  if (need == 0) return std::nullopt;
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < need) continue;
    const uint64_t offset = it->first;
    const uint64_t rest = it->second - need;
    free_.erase(it);
    if (rest > 0) free_.emplace(offset + need, rest);
    free_bytes_ -= need;
    return offset;
  }
  return std::nullopt;
}

void ExtentAllocator::Free(uint64_t offset, uint64_t bytes) {
  uint64_t len = Round(bytes);
  free_bytes_ += len;
  auto next = free_.lower_bound(offset);
  assert(next == free_.end() || next->first >= offset + len);
  if (next != free_.end() && next->first == offset + len) {
    len += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    assert(prev->first + prev->second <= offset);
    if (prev->first + prev->second == offset) {
      prev->second += len;
      return;
    }
  }
  free_.emplace_hint(next, offset, len);
}

uint64_t ExtentAllocator::largest_free_extent() const {
  uint64_t best = 0;
  for (const auto& [off, len] : free_) best = len > best ? len : best;
  return best;
}

}  // namespace tiermem::nvme
