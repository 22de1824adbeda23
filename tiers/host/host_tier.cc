// Host tier implementation.
//
// Invariants (all under mu_):
//  - Every byte handed out lies in exactly one live mapping: a slab in slabs_ or a dedicated
//    mapping in dedicated_. Mappings are registered with the pinner before their first region
//    is handed out and unregistered (then unmapped) only when no region lies in them: a
//    dedicated mapping at its region's Free, slabs at destruction.
//  - A slab is either empty (live == 0, in empty_slabs_, class undetermined) or belongs to one
//    size class; its free_slots holds exactly the slots without a live region. A slab of class
//    c with a free slot is in partial_[c]; a full one is in no list.
//  - The budget (budget_) is checked before memory is taken and charged with Region.bytes
//    once it was found, both under mu_; it is released after the memory is back in its slab
//    or unmapped. So Stats().used never counts a region twice, never exceeds the capacity,
//    and a failed allocation (no memory, pinner refused) leaves every stat unchanged.
//  - mapped_ (slab bytes) never exceeds max_slab_bytes_, the capacity rounded up to the
//    mapping alignment (a huge page, else a page): slabs are slab_bytes_ long but the last,
//    which takes what is left (its slots: as many of a class as fit; an empty slab too small
//    for a class is not used for it). When fragmentation across classes would need more, the
//    region gets a dedicated mapping. What is mapped beyond the budget (dedicated mappings
//    beside slabs, and each mapping's rounding up to its alignment) is Stats().host_overhead.
// Copies: a Copy looks the region up under mu_, validates it, and queues a memcpy on the
// worker pool; the caller guarantees (Tier contract) that the region is not freed meanwhile.
#include "tiers/host/host_tier.h"

#include <hwloc.h>
#include <numa.h>
#include <numaif.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cassert>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <vector>

#include "base/logging.h"
#include "base/mutex.h"
#include "tiers/worker_pool.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace tiermem {
namespace {

constexpr Bytes kPage = 4 * kKiB;
constexpr Bytes kHugePage = 2 * kMiB;

// Faults in [p, p + len) with MADV_POPULATE_WRITE; 0 or the errno of the first piece that
// failed. First-touch faults are kernel work (zeroing, and in a VM the host backing the page)
// that proceeds in parallel across cores, so a large range is cut into huge-page-aligned
// pieces of at least kPopulatePieceBytes populated on up to kPopulateThreads threads at once
// (the caller's among them): slab creation is the host tier's one up-front cost.
constexpr Bytes kPopulatePieceBytes = 8 * kMiB;
constexpr unsigned kPopulateThreads = 4;
int Populate(char* p, Bytes len) {
  const unsigned cpus = std::max(1u, std::thread::hardware_concurrency());
  const Bytes most = std::min<Bytes>(std::min(cpus, kPopulateThreads), len / kPopulatePieceBytes);
  const Bytes pieces = std::max<Bytes>(most, 1);
  const Bytes piece = (len / pieces + kHugePage - 1) / kHugePage * kHugePage;
  std::vector<int> err(pieces, 0);
  auto run = [&](Bytes i) {
    const Bytes at = i * piece;
    if (at >= len) return;
    if (madvise(p + at, std::min(piece, len - at), MADV_POPULATE_WRITE) != 0) err[i] = errno;
  };
  std::vector<std::thread> helpers;
  for (Bytes i = 1; i < pieces; ++i) {
    try {
      helpers.emplace_back(run, i);
    } catch (const std::system_error&) {  // no thread to be had: this one does the piece
      run(i);
    }
  }
  run(0);
  for (std::thread& t : helpers) t.join();
  for (int e : err) {
    if (e != 0) return e;
  }
  return 0;
}

Status ValidateConfig(const HostTierConfig& c) {
  auto bad = [](const std::string& what) {
    return InvalidArgumentError("host tier config: " + what);
  };
  if (c.capacity == 0) return bad("capacity must be > 0");
  if (c.slot_bytes == 0 || c.slot_bytes % kPage != 0) {
    return bad("slot_bytes (" + std::to_string(c.slot_bytes) +
               ") must be a positive multiple of 4096");
  }
  if (c.min_class_bytes == 0 || c.min_class_bytes % kPage != 0 ||
      c.min_class_bytes > c.slot_bytes) {
    return bad("min_class_bytes (" + std::to_string(c.min_class_bytes) +
               ") must be a positive multiple of 4096 and <= slot_bytes");
  }
  if (c.slab_bytes == 0) return bad("slab_bytes must be > 0");
  if (c.prefault_bytes > c.capacity) {
    return bad("prefault_bytes (" + std::to_string(c.prefault_bytes) + ") exceeds capacity (" +
               std::to_string(c.capacity) + ")");
  }
  if (c.copy_threads < 1) return bad("copy_threads must be >= 1");
  if (c.numa_node >= 0 && numa_available() >= 0 && c.numa_node > numa_max_node()) {
    return bad("numa_node " + std::to_string(c.numa_node) + " does not exist (max " +
               std::to_string(numa_max_node()) + ")");
  }
  return OkStatus();
}

class HostTierImpl final : public HostTier {
 public:
  HostTierImpl(const HostTierConfig& c, int node)
      : config_(c),
        node_(node),
        budget_(c.capacity),
        slab_bytes_(AlignUp(std::max(c.slab_bytes, c.slot_bytes), c.slot_bytes)),
        max_slab_bytes_(AlignUp(c.capacity, c.huge_pages ? kHugePage : kPage)),
        lock_memory_(c.lock_memory) {
    for (Bytes s = c.slot_bytes; s >= c.min_class_bytes; s /= 2) {
      classes_.push_back(AlignUp(s, kPage));
      if (s / 2 < c.min_class_bytes || s / 2 < kPage) break;
    }
    partial_.resize(classes_.size());
    workers_ = std::make_unique<WorkerPool>(c.copy_threads);
  }

  ~HostTierImpl() override {
    workers_.reset();  // drain queued copies while the memory is still mapped
    for (auto& [addr, m] : dedicated_) Unmap(addr, m.map_bytes);
    for (auto& s : slabs_) Unmap(s.base, s.map_bytes);
  }

  // Creates the prefaulted slabs. Called once, before the tier is shared.
  Status Prefault() {
    MutexLock lock(mu_);
    while (mapped_ < config_.prefault_bytes) {
      TIERMEM_ASSIGN_OR_RETURN(size_t idx, NewSlabLocked());
      empty_slabs_.push_back(idx);
    }
    return OkStatus();
  }

  TierKind kind() const override { return TierKind::kHost; }
  std::string name() const override { return "host"; }

  StatusOr<Region> Allocate(Bytes bytes) override {
    if (bytes == 0) return InvalidArgumentError("host tier: allocation of 0 bytes");
    int cls = -1;
    Bytes size = 0;
    if (bytes <= config_.slot_bytes) {
      cls = static_cast<int>(classes_.size()) - 1;
      while (classes_[cls] < bytes) --cls;  // classes_ is descending; classes_[0] >= bytes
      size = classes_[cls];
    } else {
      size = AlignUp(bytes, config_.huge_pages ? kHugePage : kPage);
    }
    // Budget charges happen only under mu_ and frees only add room, so room seen here is
    // still there after the memory is found; a failure to find memory then changes nothing
    // (not even peak or total_allocations).
    MutexLock lock(mu_);
    const TierStats now = budget_.Snapshot();
    if (size > now.capacity - now.used) return budget_.Reserve(size, "host");  // the error
    StatusOr<Region> r = cls >= 0 ? AllocateSlotLocked(cls) : AllocateDedicatedLocked(size);
    if (r.ok()) {
      Status charged = budget_.Reserve(size, "host");
      assert(charged.ok());
      charged.IgnoreError();
    }
    return r;
  }

  Status Free(const Region& region) override {
    Bytes size = 0;
    {
      MutexLock lock(mu_);
      auto it = regions_.find(region.id);
      if (it == regions_.end()) {
        return InvalidArgumentError("host tier: free of unknown region " +
                                    std::to_string(region.id));
      }
      const Live live = it->second;
      regions_.erase(it);
      size = live.region.bytes;
      if (live.slab < 0) {
        auto d = dedicated_.find(live.region.addr);
        Unmap(d->first, d->second.map_bytes);
        map_total_ -= d->second.map_bytes;
        dedicated_.erase(d);
      } else {
        Slab& s = slabs_[live.slab];
        const bool was_full = s.free_slots.empty();
        s.free_slots.push_back(live.slot);
        if (--s.live == 0) {
          RemoveFromPartial(s.cls, live.slab);
          s.cls = -1;
          s.free_slots.clear();
          empty_slabs_.push_back(live.slab);
        } else if (was_full) {
          partial_[s.cls].push_back(live.slab);
        }
      }
    }
    budget_.Release(size);
    return OkStatus();
  }

  std::shared_ptr<Completion> Copy(const CopyRequest& req) override {
    Region live;
    {
      MutexLock lock(mu_);
      auto it = regions_.find(req.region.id);
      if (it != regions_.end()) live = it->second.region;
    }
    Status valid = ValidateCopy(req, live);
    if (!valid.ok()) return Completion::Done(valid.WithContext("host tier"));
    auto done = Completion::Make();
    char* mem = static_cast<char*>(live.addr) + req.offset;
    char* host = static_cast<char*>(req.host);
    const Bytes n = req.bytes;
    const bool to_tier = req.dir == CopyDir::kToTier;
    workers_->Push([=] {
      if (to_tier) {
        std::memmove(mem, host, n);  // memmove: the host side may be another host region
      } else {
        std::memmove(host, mem, n);
      }
      done->Complete(OkStatus());
    });
    return done;
  }

  TierStats Stats() const override {
    TierStats st = budget_.Snapshot();
    Bytes mapped;
    {
      MutexLock lock(mu_);
      mapped = map_total_;
    }
    st.host_overhead = mapped > st.capacity ? mapped - st.capacity : 0;
    return st;
  }

  std::vector<HostRange> Ranges() const override {
    MutexLock lock(mu_);
    std::vector<HostRange> out;
    for (const auto& s : slabs_) out.push_back({s.base, s.bytes, false});
    for (const auto& [addr, m] : dedicated_) out.push_back({addr, m.bytes, true});
    return out;
  }
  int numa_node() const override { return node_; }
  bool memory_locked() const override {
    MutexLock lock(mu_);
    return lock_memory_;
  }
  Bytes mapped_bytes() const override {
    MutexLock lock(mu_);
    Bytes total = mapped_;
    for (const auto& [addr, m] : dedicated_) total += m.bytes;
    return total;
  }

 private:
  struct Slab {
    char* base = nullptr;
    Bytes bytes = 0;  // slab_bytes_, or less for the last one (the rest of the budget)
    Bytes map_bytes = 0;
    int cls = -1;                      // size class, -1 while empty
    uint32_t live = 0;                 // live regions in this slab
    std::vector<uint32_t> free_slots;  // slot indices without a live region
  };
  struct Mapping {
    Bytes bytes = 0;      // the region's size
    Bytes map_bytes = 0;  // what was mmap'd (>= bytes)
  };
  struct Live {
    Region region;
    int slab = -1;  // -1: dedicated mapping
    uint32_t slot = 0;
  };

  StatusOr<Region> AllocateSlotLocked(int cls) TIERMEM_REQUIRES(mu_) {
    size_t idx;
    if (!partial_[cls].empty()) {
      idx = partial_[cls].back();
    } else {
      // The last empty slab that holds a slot of this class (the short last one may not).
      size_t fits = empty_slabs_.size();
      for (size_t i = empty_slabs_.size(); i-- > 0;) {
        if (slabs_[empty_slabs_[i]].bytes >= classes_[cls]) {
          fits = i;
          break;
        }
      }
      if (fits < empty_slabs_.size()) {
        idx = empty_slabs_[fits];
        empty_slabs_.erase(empty_slabs_.begin() + static_cast<std::ptrdiff_t>(fits));
      } else if (mapped_ < max_slab_bytes_ &&
                 std::min(slab_bytes_, max_slab_bytes_ - mapped_) >= classes_[cls]) {
        TIERMEM_ASSIGN_OR_RETURN(idx, NewSlabLocked());
      } else {
        // Slab memory is fragmented across classes: serve this one from its own mapping.
        return AllocateDedicatedLocked(classes_[cls]);
      }
      Slab& s = slabs_[idx];
      s.cls = cls;
      const uint32_t n = static_cast<uint32_t>(s.bytes / classes_[cls]);
      s.free_slots.clear();
      for (uint32_t i = n; i-- > 0;) s.free_slots.push_back(i);  // hand out low addresses first
      partial_[cls].push_back(idx);
    }
    Slab& s = slabs_[idx];
    const uint32_t slot = s.free_slots.back();
    s.free_slots.pop_back();
    ++s.live;
    if (s.free_slots.empty()) RemoveFromPartial(cls, idx);
    Region r{next_id_++, classes_[cls], s.base + static_cast<Bytes>(slot) * classes_[cls]};
    regions_.emplace(r.id, Live{r, static_cast<int>(idx), slot});
    return r;
  }

  StatusOr<Region> AllocateDedicatedLocked(Bytes size) TIERMEM_REQUIRES(mu_) {
    Bytes map_bytes = 0;
    TIERMEM_ASSIGN_OR_RETURN(char* p, MapLocked(size, &map_bytes));
    dedicated_.emplace(p, Mapping{size, map_bytes});
    Region r{next_id_++, size, p};
    regions_.emplace(r.id, Live{r, -1, 0});
    return r;
  }

  // A slab of slab_bytes_, or of the rest of max_slab_bytes_ when that is less. Requires
  // mapped_ < max_slab_bytes_.
  StatusOr<size_t> NewSlabLocked() TIERMEM_REQUIRES(mu_) {
    const Bytes bytes = std::min(slab_bytes_, max_slab_bytes_ - mapped_);
    Bytes map_bytes = 0;
    TIERMEM_ASSIGN_OR_RETURN(char* p, MapLocked(bytes, &map_bytes));
    slabs_.push_back(Slab{p, bytes, map_bytes, -1, 0, {}});
    mapped_ += bytes;
    return slabs_.size() - 1;
  }

  void RemoveFromPartial(int cls, size_t idx) TIERMEM_REQUIRES(mu_) {
    if (cls < 0) return;
    auto& v = partial_[cls];
    for (size_t i = 0; i < v.size(); ++i) {
      if (v[i] == idx) {
        v[i] = v.back();
        v.pop_back();
        return;
      }
    }
  }

  // Maps `bytes` of memory: NUMA-bound, huge-page advised, faulted once, locked when allowed,
  // registered with the pinner. Sets *map_bytes to the length to munmap.
  StatusOr<char*> MapLocked(Bytes bytes, Bytes* map_bytes) TIERMEM_REQUIRES(mu_) {
    const Bytes align = config_.huge_pages ? kHugePage : kPage;
    const Bytes len = AlignUp(bytes, align);
    const Bytes over = len + (align > kPage ? align : 0);
    void* raw = mmap(nullptr, over, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) {
      return ErrnoToStatus(errno, "host tier: mmap of " + std::to_string(over) + " bytes");
    }
    // Trim to a 2 MiB-aligned range so the kernel can back it with huge pages.
    char* base = static_cast<char*>(raw);
    char* p = reinterpret_cast<char*>(AlignUp(reinterpret_cast<uintptr_t>(base), align));
    if (p > base) munmap(base, p - base);
    if (base + over > p + len) munmap(p + len, base + over - (p + len));

    if (node_ >= 0 && numa_available() >= 0 && numa_max_node() > 0) {
      unsigned long mask[16] = {};
      mask[node_ / (8 * sizeof(unsigned long))] |= 1ul << (node_ % (8 * sizeof(unsigned long)));
      // PREFERRED, not BIND: a full node spills over rather than failing the fault.
      if (mbind(p, len, MPOL_PREFERRED, mask, sizeof(mask) * 8, 0) != 0) {
        LogOnce(LogLevel::kWarn, "host tier mbind",
                "host tier: mbind to NUMA node " + std::to_string(node_) + " failed (" +
                    std::strerror(errno) + "); memory is not NUMA-bound");
      }
    }
    if (config_.huge_pages && madvise(p, len, MADV_HUGEPAGE) != 0) {
      LogOnce(LogLevel::kInfo, "host tier hugepage",
              std::string("host tier: MADV_HUGEPAGE refused (") + std::strerror(errno) +
                  "); using base pages");
    }
    if (const int err = Populate(p, len); err != 0) {
      if (err == ENOMEM || err == EFAULT) {
        munmap(p, len);
        return ResourceExhaustedError("host tier: cannot fault in " + std::to_string(len) +
                                      " bytes of host memory");
      }
      // Older kernel: fault by touching each page.
      for (Bytes off = 0; off < len; off += kPage) p[off] = 0;
    }
    if (lock_memory_ && mlock(p, len) != 0) {
      const int err = errno;
      rlimit lim{};
      getrlimit(RLIMIT_MEMLOCK, &lim);
      LogOnce(LogLevel::kWarn, "host tier mlock",
              "host tier: mlock of " + std::to_string(len) + " bytes refused (" +
                  std::strerror(err) + ", RLIMIT_MEMLOCK = " +
                  (lim.rlim_cur == RLIM_INFINITY ? std::string("unlimited")
                                                 : std::to_string(lim.rlim_cur) + " bytes") +
                  "); host memory stays pageable (raise the limit or grant CAP_IPC_LOCK)");
      lock_memory_ = false;
    }
    if (config_.pinner != nullptr) {
      Status s = config_.pinner->Register(p, len);
      if (!s.ok()) {
        munmap(p, len);
        return s.WithContext("host tier: pinning " + std::to_string(len) + " bytes");
      }
    }
    *map_bytes = len;
    map_total_ += len;
    return p;
  }

  void Unmap(void* p, Bytes map_bytes) {
    if (config_.pinner != nullptr) config_.pinner->Unregister(p);
    munmap(p, map_bytes);
  }

  const HostTierConfig config_;
  const int node_;
  BudgetAccount budget_;
  const Bytes slab_bytes_;
  const Bytes max_slab_bytes_;  // slab memory at most: the capacity, aligned as mappings are
  std::vector<Bytes> classes_;  // size classes, descending; immutable after construction

  mutable Mutex mu_;
  bool lock_memory_ TIERMEM_GUARDED_BY(mu_);
  std::vector<Slab> slabs_ TIERMEM_GUARDED_BY(mu_);
  std::vector<std::vector<size_t>> partial_ TIERMEM_GUARDED_BY(mu_);  // per class
  std::vector<size_t> empty_slabs_ TIERMEM_GUARDED_BY(mu_);
  std::unordered_map<void*, Mapping> dedicated_ TIERMEM_GUARDED_BY(mu_);
  std::unordered_map<uint64_t, Live> regions_ TIERMEM_GUARDED_BY(mu_);
  Bytes mapped_ TIERMEM_GUARDED_BY(mu_) = 0;     // slab bytes (sum of Slab::bytes)
  Bytes map_total_ TIERMEM_GUARDED_BY(mu_) = 0;  // every live mapping's mmap'd length
  uint64_t next_id_ TIERMEM_GUARDED_BY(mu_) = 1;
  std::unique_ptr<WorkerPool> workers_;
};

// "dddd:bb:dd.f" or "bb:dd.f" (hex), as cudaDeviceGetPCIBusId writes it.
bool ParseBusId(const std::string& s, unsigned* domain, unsigned* bus, unsigned* dev,
                unsigned* func) {
  char tail = 0;
  if (std::sscanf(s.c_str(), "%x:%x:%x.%x%c", domain, bus, dev, func, &tail) == 4) return true;
  *domain = 0;
  return std::sscanf(s.c_str(), "%x:%x.%x%c", bus, dev, func, &tail) == 3;
}

}  // namespace

StatusOr<int> NearestNumaNode(const std::string& gpu_pci_bus_id) {
  unsigned domain = 0, bus = 0, dev = 0, func = 0;
  if (!gpu_pci_bus_id.empty() && !ParseBusId(gpu_pci_bus_id, &domain, &bus, &dev, &func)) {
    return InvalidArgumentError("host tier: malformed PCI bus id '" + gpu_pci_bus_id +
                                "' (want dddd:bb:dd.f)");
  }
  hwloc_topology_t topo;
  if (hwloc_topology_init(&topo) != 0) return -1;
  // PCI discovery only when there is a GPU to place memory near: it costs start-up time, and
  // hwloc's pci plugin (libpciaccess) leaks its scan state, which LeakSanitizer reports.
  hwloc_topology_set_io_types_filter(topo, gpu_pci_bus_id.empty()
                                               ? HWLOC_TYPE_FILTER_KEEP_NONE
                                               : HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
  if (hwloc_topology_load(topo) != 0) {
    hwloc_topology_destroy(topo);
    return -1;
  }
  int node = -1;
  if (!gpu_pci_bus_id.empty()) {
    hwloc_obj_t pci = hwloc_get_pcidev_by_busid(topo, domain, bus, dev, func);
    hwloc_obj_t anc = pci != nullptr ? hwloc_get_non_io_ancestor_obj(topo, pci) : nullptr;
    if (anc != nullptr && anc->nodeset != nullptr) node = hwloc_bitmap_first(anc->nodeset);
    if (node < 0) {
      LogOnce(LogLevel::kWarn, "host tier pci",
              "host tier: PCI device " + gpu_pci_bus_id +
                  " not found by hwloc; using the NUMA node of the calling CPU");
    }
  }
  if (node < 0) {
    const int cpu = sched_getcpu();
    hwloc_obj_t pu =
        cpu >= 0 ? hwloc_get_pu_obj_by_os_index(topo, static_cast<unsigned>(cpu)) : nullptr;
    if (pu != nullptr && pu->nodeset != nullptr) node = hwloc_bitmap_first(pu->nodeset);
  }
  hwloc_topology_destroy(topo);
  return node;
}

StatusOr<std::unique_ptr<Tier>> NewHostTier(const HostTierConfig& config) {
  TIERMEM_RETURN_IF_ERROR(ValidateConfig(config));
  int node = config.numa_node;
  if (node < 0) {
    TIERMEM_ASSIGN_OR_RETURN(node, NearestNumaNode(config.gpu_pci_bus_id));
  }
  auto tier = std::make_unique<HostTierImpl>(config, node);
  TIERMEM_RETURN_IF_ERROR(tier->Prefault());
  return std::unique_ptr<Tier>(std::move(tier));
}

HostTier* AsHostTier(Tier* tier) { return dynamic_cast<HostTier*>(tier); }

}  // namespace tiermem
