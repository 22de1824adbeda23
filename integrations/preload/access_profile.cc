// Invariants: ranges_ is sorted by base and its ranges do not overlap (they are live
// allocations); history_[launches_ % ahead_] is the slot the next launch's key goes to, and
// the other slots hold the keys of the previous ahead_ - 1 launches (0 before there were any).
// A key's successor list holds distinct (base, offset) pairs, oldest first, at most
// kMaxSuccessors (later ones are dropped: the first ones seen are the earliest uses).
#include "integrations/preload/access_profile.h"

#include <algorithm>

namespace tiermem::preload {
namespace {

constexpr size_t kTableSize = 4096;  // power of two

uint64_t Mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
  return h;
}

}  // namespace

AccessProfile::AccessProfile(int ahead, uint64_t max_bytes, size_t max_ranges)
    : ahead_(std::clamp(ahead, 1, kMaxAhead)),
      max_bytes_(max_bytes),
      max_ranges_(max_ranges),
      table_(kTableSize) {
  ranges_.reserve(max_ranges);
}

bool AccessProfile::AddRange(uint64_t base, uint64_t bytes) {
  MutexLock l(mu_);
  if (ranges_.size() >= max_ranges_) return false;
  auto it = std::lower_bound(ranges_.begin(), ranges_.end(), base,
                             [](const Range& r, uint64_t b) { return r.base < b; });
  ranges_.insert(it, Range{base, base + bytes, 0});  // within the reserved capacity
  return true;
}

void AccessProfile::RemoveRange(uint64_t base) {
  MutexLock l(mu_);
  auto it = std::lower_bound(ranges_.begin(), ranges_.end(), base,
                             [](const Range& r, uint64_t b) { return r.base < b; });
  if (it != ranges_.end() && it->base == base) ranges_.erase(it);
}

size_t AccessProfile::ranges() const {
  MutexLock l(mu_);
  return ranges_.size();
}

AccessProfile::Range* AccessProfile::FindLocked(uint64_t addr) {
  auto it = std::upper_bound(ranges_.begin(), ranges_.end(), addr,
                             [](uint64_t a, const Range& r) { return a < r.base; });
  if (it == ranges_.begin()) return nullptr;
  --it;
  return addr < it->end ? &*it : nullptr;
}

int AccessProfile::OnLaunch(uint64_t kernel, const uint64_t* args, int nargs,
                            PrefetchRequest* out) {
  MutexLock l(mu_);
  if (ranges_.empty()) return 0;
  const uint64_t now = ++launches_;
  Touch touched[kMaxTouched];
  int nt = 0;
  uint64_t key = Mix(0, kernel);
  for (int i = 0; i < nargs && nt < kMaxTouched; ++i) {
    const Range* r = FindLocked(args[i]);
    if (r == nullptr) continue;
    touched[nt++] = Touch{r->base, args[i] - r->base};
    key = Mix(key, args[i]);
  }
  if (key == 0) key = 1;  // 0 marks an empty history slot / table entry

  // Learn: the touched ranges follow each of the previous launches.
  if (nt > 0) {
    for (int h = 0; h < ahead_; ++h) {
      const uint64_t prev = history_[h];
      if (prev == 0) continue;
      Entry& e = table_[prev & (kTableSize - 1)];
      if (e.key != prev) continue;
      for (int t = 0; t < nt && e.n < kMaxSuccessors; ++t) {
        const bool known = std::any_of(e.succ, e.succ + e.n, [&](const Touch& s) {
          return s.base == touched[t].base && s.offset == touched[t].offset;
        });
        if (!known) e.succ[e.n++] = touched[t];
      }
    }
  }

  // Predict: what followed this key before is prefetched now.
  int n = 0;
  Entry& self = table_[key & (kTableSize - 1)];
  if (self.key == key) {
    for (int s = 0; s < self.n; ++s) {
      Range* r = FindLocked(self.succ[s].base);
      if (r == nullptr || r->base != self.succ[s].base) continue;  // freed since
      if (r->last_prefetch != 0 && now - r->last_prefetch < static_cast<uint64_t>(2 * ahead_)) {
        continue;
      }
      const uint64_t start = r->base + self.succ[s].offset;
      if (start >= r->end) continue;
      r->last_prefetch = now;
      out[n++] = PrefetchRequest{r->base, start, std::min(r->end - start, max_bytes_)};
    }
  } else {
    self = Entry{};
    self.key = key;
  }
  history_[now % ahead_] = key;
  return n;
}

}  // namespace tiermem::preload
