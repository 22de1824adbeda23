// AllocTable: the shim's map from a live allocation's address (or VMM handle) to what it is
// (size, kind, stream label), so that a free can be recorded with its size and tier and the
// offload budget can be given back. It sits on the hot path of every interposed allocation,
// so it never allocates after Create(): a fixed number of slots, split into shards of
// open-addressed linear-probing tables (backward-shift deletion, no tombstones), one mutex
// per shard.
//
// Capacity: Create(capacity) reserves `capacity` slots in one anonymous mapping (pages are
// touched only when used). A shard that is full refuses the insert (Insert returns false);
// the shim then says so once and the allocation goes untracked (its free shows up as an
// unmatched free in the report) — never a wrong size.
// Thread-safety: thread-safe (a mutex per shard). Ownership: caller owns the table.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "base/status.h"

namespace tiermem::preload {

// What a live allocation is. The values are internal to the shim (not a file format).
enum class AllocKind : uint8_t {
  kDevice = 1,          // cudaMalloc / cudaMallocAsync / cudaMallocFromPoolAsync (counts
                        // against the offload budget)
  kDeviceManaged = 2,   // the application's own cudaMallocManaged
  kOffloadManaged = 3,  // offload mode: a device allocation served from managed memory
  kHostPinned = 4,      // cudaHostAlloc / cudaMallocHost
  kHostRegistered = 5,  // cudaHostRegister
  kVmmHandle = 6,       // cuMemCreate (key = the handle)
};

struct AllocInfo {
  uint64_t bytes = 0;
  uint32_t label = 0;  // timeline label of the stream ("stream 0x..."), 0 = none
  AllocKind kind = AllocKind::kDevice;
};

class AllocTable {
 public:
  // `capacity` is rounded up to a power of two >= kShards * 16.
  static StatusOr<std::unique_ptr<AllocTable>> Create(size_t capacity);
  ~AllocTable();
  AllocTable(const AllocTable&) = delete;
  AllocTable& operator=(const AllocTable&) = delete;

  // Inserts or replaces `key` (nonzero). False if the key's shard is full.
  bool Insert(uint64_t key, const AllocInfo& info);
  // Removes `key`; returns false if it was not there. *out receives its info when found.
  bool Remove(uint64_t key, AllocInfo* out);
  bool Find(uint64_t key, AllocInfo* out) const;
  size_t capacity() const { return capacity_; }

  static constexpr size_t kShards = 64;

 private:
  struct Slot {
    uint64_t key;  // 0 = empty
    AllocInfo info;
  };
  struct Shard;
  AllocTable(void* mem, size_t map_bytes, size_t capacity);
  Shard& ShardOf(uint64_t hash) const;

  void* mem_;
  size_t map_bytes_;
  size_t capacity_;
  size_t slots_per_shard_;  // power of two
  std::unique_ptr<Shard[]> shards_;
};

}  // namespace tiermem::preload
