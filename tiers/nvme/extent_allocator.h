// First-fit extent allocator over one file's byte range, with coalescing on free.
//
// Invariants: free extents are disjoint, non-adjacent (adjacent ones are merged on Free), and
// each is a multiple of the granularity; `free_bytes()` is their sum. Allocations are rounded up
// to the granularity and placed at the lowest offset that fits (first fit). Freeing a range
// that is not exactly a live allocation is a bug the caller (the tier's region table) prevents.
//
// Thread-safety: externally synchronized (the NVMe tier holds its mutex around every call).
#pragma once

#include <cstdint>
#include <map>
#include <optional>

namespace tiermem::nvme {

class ExtentAllocator {
 public:
  // Manages [0, size); `size` and `granularity` are multiples of `granularity` (> 0).
  ExtentAllocator(uint64_t size, uint64_t granularity);

  // Offset of a free extent of AlignUp(bytes) bytes, or nullopt when none is large enough.
  std::optional<uint64_t> Allocate(uint64_t bytes);
  // Returns [offset, offset + AlignUp(bytes)) to the free list, merging with neighbours.
  void Free(uint64_t offset, uint64_t bytes);

  uint64_t free_bytes() const { return free_bytes_; }
  uint64_t largest_free_extent() const;
  size_t free_extent_count() const { return free_.size(); }

 private:
  uint64_t Round(uint64_t bytes) const {
    return (bytes + granularity_ - 1) / granularity_ * granularity_;
  }

  const uint64_t granularity_;
  std::map<uint64_t, uint64_t> free_;  // offset -> length, bytes
  uint64_t free_bytes_ = 0;
};

}  // namespace tiermem::nvme
