// Invariants: every key lives in shard (hash >> 58) at the first empty-or-equal slot of the
// probe sequence that starts at (hash & mask); between that home slot and the key's slot no
// slot is empty (linear probing). Remove restores this by backward-shift: later entries of the
// run move back into the hole when their home slot does not lie cyclically in (hole, slot].
// A shard's `used` counts its occupied slots; inserts stop at 7/8 full so probes stay short.
#include "integrations/preload/alloc_table.h"

#include <sys/mman.h>

#include <cerrno>

#include "base/mutex.h"

namespace tiermem::preload {

struct AllocTable::Shard {
  mutable Mutex mu;
  // slots_per_shard_ entries; the pointer is set once by the constructor, the slots need mu.
  Slot* slots TIERMEM_PT_GUARDED_BY(mu) = nullptr;
  size_t used TIERMEM_GUARDED_BY(mu) = 0;
};

namespace {

uint64_t Hash(uint64_t key) {
  // Fibonacci hashing; addresses are 256-byte aligned, so mix the low bits away first.
  key ^= key >> 29;
  return key * 0x9E3779B97F4A7C15ull;
}

}  // namespace

StatusOr<std::unique_ptr<AllocTable>> AllocTable::Create(size_t capacity) {
  size_t cap = kShards * 16;
  while (cap < capacity) cap *= 2;
  const size_t bytes = cap * sizeof(Slot);
  void* mem = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mem == MAP_FAILED) return ErrnoToStatus(errno, "preload: allocation table mmap");
  return std::unique_ptr<AllocTable>(new AllocTable(mem, bytes, cap));
}

AllocTable::AllocTable(void* mem, size_t map_bytes, size_t capacity)
    : mem_(mem),
      map_bytes_(map_bytes),
      capacity_(capacity),
      slots_per_shard_(capacity / kShards),
      shards_(new Shard[kShards]) {
  for (size_t i = 0; i < kShards; ++i) {
    shards_[i].slots = static_cast<Slot*>(mem) + i * slots_per_shard_;
  }
}

AllocTable::~AllocTable() { munmap(mem_, map_bytes_); }

AllocTable::Shard& AllocTable::ShardOf(uint64_t hash) const { return shards_[hash >> 58]; }

bool AllocTable::Insert(uint64_t key, const AllocInfo& info) {
  const uint64_t h = Hash(key);
  Shard& s = ShardOf(h);
  const size_t mask = slots_per_shard_ - 1;
  MutexLock l(s.mu);
  for (size_t i = h & mask;; i = (i + 1) & mask) {
    Slot& slot = s.slots[i];
    if (slot.key == key) {
      slot.info = info;
      return true;
    }
    if (slot.key == 0) {
      if (s.used + 1 > slots_per_shard_ - slots_per_shard_ / 8) return false;
      slot.key = key;
      slot.info = info;
      ++s.used;
      return true;
    }
  }
}

bool AllocTable::Find(uint64_t key, AllocInfo* out) const {
  const uint64_t h = Hash(key);
  Shard& s = ShardOf(h);
  const size_t mask = slots_per_shard_ - 1;
  MutexLock l(s.mu);
  for (size_t i = h & mask;; i = (i + 1) & mask) {
    const Slot& slot = s.slots[i];
    if (slot.key == 0) return false;
    if (slot.key == key) {
      *out = slot.info;
      return true;
    }
  }
}

bool AllocTable::Remove(uint64_t key, AllocInfo* out) {
  const uint64_t h = Hash(key);
  Shard& s = ShardOf(h);
  const size_t mask = slots_per_shard_ - 1;
  MutexLock l(s.mu);
  size_t hole = h & mask;
  while (true) {
    if (s.slots[hole].key == 0) return false;
    if (s.slots[hole].key == key) break;
    hole = (hole + 1) & mask;
  }
  *out = s.slots[hole].info;
  // Backward-shift the rest of the run into the hole.
  for (size_t j = (hole + 1) & mask; s.slots[j].key != 0; j = (j + 1) & mask) {
    const size_t home = Hash(s.slots[j].key) & mask;
    // The entry at j may move to `hole` unless its home lies cyclically in (hole, j].
    const bool home_in_range = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
    if (home_in_range) continue;
    s.slots[hole] = s.slots[j];
    hole = j;
  }
  s.slots[hole].key = 0;
  --s.used;
  return true;
}

}  // namespace tiermem::preload
