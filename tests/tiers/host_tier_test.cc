// Host tier specifics beyond the conformance suite: size classes and dedicated mappings,
// slab reuse, the pinner hook, prefaulting and range exposure, mlock, NUMA lookup, config
// validation.
#include "tiers/host/host_tier.h"

#include <gtest/gtest.h>
#include <numa.h>
#include <sched.h>

#include <fstream>
#include <map>
#include <set>

#include "base/sanitizers.h"

namespace tiermem {
namespace {

class RecordingPinner final : public HostPinner {
 public:
  Status Register(void* addr, Bytes bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (fail_next_) {
      fail_next_ = false;
      return UnavailableError("pinner refused");
    }
    EXPECT_EQ(pinned_.count(addr), 0u) << "registered twice";
    pinned_[addr] = bytes;
    ++registers_;
    return OkStatus();
  }
  void Unregister(void* addr) override {
    std::lock_guard<std::mutex> lock(mu_);
    EXPECT_EQ(pinned_.erase(addr), 1u) << "unregister of memory never registered";
  }
  std::map<void*, Bytes> pinned() {
    std::lock_guard<std::mutex> lock(mu_);
    return pinned_;
  }
  int registers() {
    std::lock_guard<std::mutex> lock(mu_);
    return registers_;
  }
  void FailNext() {
    std::lock_guard<std::mutex> lock(mu_);
    fail_next_ = true;
  }

 private:
  std::mutex mu_;
  std::map<void*, Bytes> pinned_;
  int registers_ = 0;
  bool fail_next_ = false;
};

HostTierConfig SmallConfig() {
  HostTierConfig c;
  c.capacity = 64 * kMiB;
  c.slot_bytes = 1 * kMiB;
  c.min_class_bytes = 64 * kKiB;
  c.slab_bytes = 16 * kMiB;
  return c;
}

HostTier* Host(const std::unique_ptr<Tier>& t) { return AsHostTier(t.get()); }

bool Inside(const Region& r, const std::vector<HostRange>& ranges) {
  for (const auto& g : ranges) {
    auto* b = static_cast<char*>(g.addr);
    auto* p = static_cast<char*>(r.addr);
    if (p >= b && p + r.bytes <= b + g.bytes) return true;
  }
  return false;
}

TEST(HostTier, SizeClassesAndDedicatedMappings) {
  auto t = NewHostTier(SmallConfig());
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  Tier* tier = t->get();
  EXPECT_EQ(tier->kind(), TierKind::kHost);
  EXPECT_EQ(Host(*t)->mapped_bytes(), 0u);  // nothing prefaulted
  struct Case { Bytes ask, got; bool dedicated; };
  const Case cases[] = {
      {1, 64 * kKiB, false},           {64 * kKiB, 64 * kKiB, false},
      {64 * kKiB + 1, 128 * kKiB, false}, {300 * kKiB, 512 * kKiB, false},
      {1 * kMiB, 1 * kMiB, false},     {1 * kMiB + 1, 2 * kMiB, true},
      {5 * kMiB + 3, 6 * kMiB, true},
  };
  std::vector<Region> regions;
  Bytes used = 0;
  for (const auto& c : cases) {
    auto r = tier->Allocate(c.ask);
    ASSERT_TRUE(r.ok()) << c.ask;
    EXPECT_EQ(r->bytes, c.got) << c.ask;
    used += c.got;
    regions.push_back(*r);
  }
  EXPECT_EQ(tier->Stats().used, used);
  const auto ranges = Host(*t)->Ranges();
  int slabs = 0, dedicated = 0;
  for (const auto& g : ranges) (g.dedicated ? dedicated : slabs)++;
  EXPECT_EQ(slabs, 4);  // one slab per class used: 64K, 128K, 512K, 1M
  EXPECT_EQ(dedicated, 2);
  EXPECT_EQ(Host(*t)->mapped_bytes(), 4 * 16 * kMiB + 2 * kMiB + 6 * kMiB);
  // Every region lies in a range; no two regions overlap.
  std::map<char*, Bytes> spans;
  for (const auto& r : regions) {
    EXPECT_TRUE(Inside(r, ranges));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(r.addr) % 4096, 0u);
    spans[static_cast<char*>(r.addr)] = r.bytes;
  }
  char* end = nullptr;
  for (auto& [p, n] : spans) {
    EXPECT_GE(p, end);
    end = p + n;
  }
  // Slabs are 2 MiB aligned for huge pages.
  for (const auto& g : ranges) EXPECT_EQ(reinterpret_cast<uintptr_t>(g.addr) % (2 * kMiB), 0u);
  // Freeing a dedicated region unmaps it.
  ASSERT_TRUE(tier->Free(regions.back()).ok());
  EXPECT_EQ(Host(*t)->Ranges().size(), ranges.size() - 1);
  regions.pop_back();
  for (const auto& r : regions) ASSERT_TRUE(tier->Free(r).ok());
  EXPECT_EQ(tier->Stats().used, 0u);
  // Empty slabs stay mapped (faulted once) and are reused by any class.
  EXPECT_EQ(Host(*t)->mapped_bytes(), 4 * 16 * kMiB);
  auto again = tier->Allocate(256 * kKiB);
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(Inside(*again, Host(*t)->Ranges()));
  EXPECT_EQ(Host(*t)->mapped_bytes(), 4 * 16 * kMiB);
}

TEST(HostTier, FreedSlotIsReusedWithoutNewMemory) {
  auto t = NewHostTier(SmallConfig());
  ASSERT_TRUE(t.ok());
  auto a = (*t)->Allocate(1 * kMiB);
  ASSERT_TRUE(a.ok());
  const Bytes mapped = Host(*t)->mapped_bytes();
  ASSERT_TRUE((*t)->Free(*a).ok());
  auto b = (*t)->Allocate(1 * kMiB);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->addr, a->addr);
  EXPECT_NE(b->id, a->id);
  EXPECT_EQ(Host(*t)->mapped_bytes(), mapped);
}

TEST(HostTier, FragmentedSlabMemoryFallsBackToDedicatedMappings) {
  HostTierConfig c = SmallConfig();
  c.capacity = 16 * kMiB;  // room for exactly one slab
  auto t = NewHostTier(c);
  ASSERT_TRUE(t.ok());
  auto small = (*t)->Allocate(64 * kKiB);  // takes the only slab for the 64 KiB class
  auto big = (*t)->Allocate(1 * kMiB);     // no slab left for the 1 MiB class
  ASSERT_TRUE(small.ok() && big.ok());
  EXPECT_EQ(big->bytes, 1 * kMiB);
  int dedicated = 0;
  for (const auto& g : Host(*t)->Ranges()) dedicated += g.dedicated;
  EXPECT_EQ(dedicated, 1);
  EXPECT_EQ((*t)->Stats().used, 64 * kKiB + 1 * kMiB);
  // The dedicated mapping (2 MiB, huge-page aligned) is memory beyond the budget.
  EXPECT_EQ((*t)->Stats().host_overhead, 2 * kMiB);
}

// Slab memory never exceeds the budget: with the whole budget mapped at creation and a budget
// that is not a whole number of slabs, the last slab is only the rest (it used to be a whole
// slab: 48 MiB mapped for a 40 MiB budget). Its slots serve the classes that fit in it; a
// class that does not fit never gets it.
TEST(HostTier, SlabMemoryNeverExceedsTheBudget) {
  HostTierConfig c = SmallConfig();
  c.capacity = 40 * kMiB;  // 2.5 slabs of 16 MiB
  c.slot_bytes = 16 * kMiB;
  c.prefault_bytes = c.capacity;
  auto t = NewHostTier(c);
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(Host(*t)->mapped_bytes(), 40 * kMiB);
  EXPECT_EQ(Host(*t)->Ranges().size(), 3u);
  EXPECT_EQ((*t)->Stats().host_overhead, 0u);
  // Two 16 MiB slots take the two whole slabs (not the short one); the rest of the budget is
  // 8 MiB, which a third does not fit.
  auto a = (*t)->Allocate(16 * kMiB), b = (*t)->Allocate(16 * kMiB);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ((*t)->Allocate(16 * kMiB).status().code(), StatusCode::kResourceExhausted);
  // The short slab serves the smaller classes: 8 MiB of 1 MiB slots, no new memory.
  std::vector<Region> small;
  for (int i = 0; i < 8; ++i) {
    auto r = (*t)->Allocate(1 * kMiB);
    ASSERT_TRUE(r.ok()) << i << ": " << r.status().ToString();
    small.push_back(*r);
  }
  EXPECT_EQ((*t)->Stats().used, 40 * kMiB);
  EXPECT_EQ(Host(*t)->mapped_bytes(), 40 * kMiB);
  EXPECT_EQ(Host(*t)->Ranges().size(), 3u);
  for (const Region& r : small) EXPECT_TRUE(Inside(r, Host(*t)->Ranges()));
  // Freed, the short slab is not handed to the 16 MiB class: a freed whole slab is.
  for (const Region& r : small) ASSERT_TRUE((*t)->Free(r).ok());
  ASSERT_TRUE((*t)->Free(*a).ok());
  auto again = (*t)->Allocate(16 * kMiB);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->addr, a->addr);
  EXPECT_EQ(Host(*t)->mapped_bytes(), 40 * kMiB);
  EXPECT_EQ((*t)->Stats().host_overhead, 0u);
}

TEST(HostTier, PinnerSeesEveryMappingOnceAndFailureChangesNothing) {
  RecordingPinner pinner;
  {
    HostTierConfig c = SmallConfig();
    c.pinner = &pinner;
    c.prefault_bytes = 32 * kMiB;
    auto t = NewHostTier(c);
    ASSERT_TRUE(t.ok());
    // Prefaulted slabs are registered before any allocation, and match Ranges().
    EXPECT_EQ(pinner.registers(), 2);
    auto ranges = Host(*t)->Ranges();
    ASSERT_EQ(ranges.size(), 2u);
    for (const auto& g : ranges) {
      EXPECT_EQ(pinner.pinned().count(g.addr), 1u);
      EXPECT_EQ(pinner.pinned()[g.addr], 16 * kMiB);
    }
    auto slot = (*t)->Allocate(1000);  // from a prefaulted slab: no new registration
    ASSERT_TRUE(slot.ok());
    EXPECT_EQ(pinner.registers(), 2);
    auto big = (*t)->Allocate(3 * kMiB);
    ASSERT_TRUE(big.ok());
    EXPECT_EQ(pinner.registers(), 3);
    EXPECT_EQ(pinner.pinned()[big->addr], 4 * kMiB);
    ASSERT_TRUE((*t)->Free(*big).ok());
    EXPECT_EQ(pinner.pinned().count(big->addr), 0u);
    // A refused registration fails the allocation with the pinner's code; nothing changes.
    const TierStats before = (*t)->Stats();
    pinner.FailNext();
    auto refused = (*t)->Allocate(3 * kMiB);
    ASSERT_FALSE(refused.ok());
    EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable);
    EXPECT_EQ((*t)->Stats().used, before.used);
    EXPECT_EQ((*t)->Stats().total_allocations, before.total_allocations);
    EXPECT_EQ((*t)->Stats().peak, before.peak);
    EXPECT_EQ((*t)->Stats().live_regions, before.live_regions);
    EXPECT_EQ(Host(*t)->Ranges().size(), 2u);
  }
  EXPECT_TRUE(pinner.pinned().empty()) << "the tier left memory registered";
}

Bytes VmLockedBytes() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmLck:", 0) == 0) return std::stoull(line.substr(6)) * kKiB;
  }
  return 0;
}

TEST(HostTier, LocksItsMemoryWhenAllowed) {
  if (kAsanBuild || kTsanBuild) GTEST_SKIP() << "the sanitizers turn mlock into a no-op";
  HostTierConfig c = SmallConfig();
  c.prefault_bytes = 16 * kMiB;
  const Bytes before = VmLockedBytes();
  auto t = NewHostTier(c);
  ASSERT_TRUE(t.ok());
  const Bytes locked = VmLockedBytes() - before;
  // Either the whole slab is locked, or the tier says it fell back to pageable memory.
  EXPECT_EQ(locked, Host(*t)->memory_locked() ? 16 * kMiB : 0u);
  c.lock_memory = false;
  auto plain = NewHostTier(c);
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE(Host(*plain)->memory_locked());
  EXPECT_EQ(VmLockedBytes() - before, locked);
}

TEST(HostTier, NumaNodeIsTheCallersWithoutAGpu) {
  auto node = NearestNumaNode("");
  ASSERT_TRUE(node.ok());
  if (numa_available() >= 0) {
    EXPECT_EQ(*node, numa_node_of_cpu(sched_getcpu()));
  }
  auto t = NewHostTier(SmallConfig());
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(Host(*t)->numa_node(), *node);
  HostTierConfig c = SmallConfig();
  c.numa_node = 0;
  auto forced = NewHostTier(c);
  ASSERT_TRUE(forced.ok());
  EXPECT_EQ(Host(*forced)->numa_node(), 0);
}

TEST(HostTier, PciBusIdIsParsedAndAnUnknownOneFallsBack) {
  EXPECT_EQ(NearestNumaNode("not-a-bus-id").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(NearestNumaNode("0000:65:00.0junk").status().code(), StatusCode::kInvalidArgument);
  auto caller = NearestNumaNode("");
  auto unknown = NearestNumaNode("0000:fe:1f.7");  // no such device here
  ASSERT_TRUE(unknown.ok());
  EXPECT_EQ(*unknown, *caller);
  EXPECT_TRUE(NearestNumaNode("fe:1f.7").ok());  // domain optional
}

TEST(HostTier, BadConfigIsInvalidArgumentNamingTheField) {
  struct Case { const char* field; void (*mutate)(HostTierConfig&); };
  const Case cases[] = {
      {"capacity", [](HostTierConfig& c) { c.capacity = 0; }},
      {"slot_bytes", [](HostTierConfig& c) { c.slot_bytes = 1000; }},
      {"min_class_bytes", [](HostTierConfig& c) { c.min_class_bytes = 2 * kMiB; }},
      {"slab_bytes", [](HostTierConfig& c) { c.slab_bytes = 0; }},
      {"prefault_bytes", [](HostTierConfig& c) { c.prefault_bytes = c.capacity + 1; }},
      {"copy_threads", [](HostTierConfig& c) { c.copy_threads = 0; }},
      {"numa_node", [](HostTierConfig& c) { c.numa_node = 4000; }},
      {"PCI bus id", [](HostTierConfig& c) { c.gpu_pci_bus_id = "gpu0"; }},
  };
  for (const auto& k : cases) {
    HostTierConfig c = SmallConfig();
    k.mutate(c);
    auto t = NewHostTier(c);
    ASSERT_FALSE(t.ok()) << k.field;
    EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument) << k.field;
    EXPECT_NE(t.status().message().find(k.field), std::string::npos) << t.status().message();
  }
}

TEST(HostTier, AsHostTierOnlyMatchesTheHostTier) {
  auto t = NewHostTier(SmallConfig());
  ASSERT_TRUE(t.ok());
  EXPECT_NE(AsHostTier(t->get()), nullptr);
}

}  // namespace
}  // namespace tiermem
