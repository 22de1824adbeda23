// CudaTier: a budget-exact arena on one GPU with two copy lanes.
//
// Invariants (all under mu_):
//  * free_ maps offset -> size of every free block of the arena; blocks never overlap or
//    touch (adjacent free blocks are merged on Free), and together with live_ they tile the
//    arena exactly: sum(free sizes) + sum(live sizes) == arena_bytes_.
//  * live_ maps region id -> {offset, size}; size is the requested size rounded up to the
//    alignment and is what the BudgetAccount was charged, so Stats().used is exact.
//  * arena_bytes_ == config.capacity rounded down to the alignment; the budget is that value.
// A Copy validates its request against live_ at submission; the caller must not free a region
// with copies in flight (Tier contract), so a copy never outlives its region.
//
// Each Lane owns a stream and a FIFO of (event, completion). Copy() enqueues the memcpy and an
// event record on the stream, then pushes the pair; the lane's thread waits on the events in
// FIFO order (cudaEventSynchronize, blocking-sync events, no spinning), completes, and drops
// its reference to the event. The lane thread is the only one that completes its copies.
//
// Ordering against compute (tiers/tier.h; all under mu_):
//  * Events are reference-counted (EventPool hands out shared_ptrs whose deleter returns the
//    event to the pool), so an event a region still waits on is never re-recorded.
//  * live_[id].compute is the event recorded on the compute stream at the region's last
//    ComputeUsed; copies_in the events after copies into it; fences the compute events of
//    regions that held its bytes before (inherited from retired_ at Allocate).
//  * Free moves a region's pending compute events (its own and inherited) to retired_ with its
//    byte range; Allocate gives a new region every retired event whose range overlaps its
//    own, and drops retired entries whose events completed. Nothing blocks: the memory is
//    reusable at once, and the first copy into it waits on the device.
//  * Copy() makes its lane stream wait (cudaStreamWaitEvent) for the region's compute event and
//    fences before the memcpy; ComputeWaits makes the caller's stream wait for copies_in and
//    fences. So a write-back never reads a chunk before torch's kernels wrote it, a prefetch
//    never overwrites memory queued kernels still read, and a kernel never reads a chunk
//    before its prefetch landed.
#include "tiers/cuda/cuda_tier.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <deque>
#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "base/mutex.h"
#include "tiers/cuda/cuda_status.h"

namespace tiermem {
namespace {

// Reference-counted CUDA events (cudaEventDisableTiming | cudaEventBlockingSync). The pool
// is shared with every event it handed out, so an event may outlive the tier's other parts.
class EventPool : public std::enable_shared_from_this<EventPool> {
 public:
  explicit EventPool(int device) : device_(device) {}
  ~EventPool() {
    for (cudaEvent_t e : idle_) cudaEventDestroy(e);
  }
  // An unrecorded-or-finished event, or the CUDA error.
  StatusOr<std::shared_ptr<CUevent_st>> Get() {
    cudaEvent_t ev = nullptr;
    {
      MutexLock lock(mu_);
      if (!idle_.empty()) {
        ev = idle_.back();
        idle_.pop_back();
      }
    }
    if (ev == nullptr) {
      cudaSetDevice(device_);
      TIERMEM_CUDA_RETURN_IF_ERROR(
          cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventBlockingSync),
          "cuda tier: cudaEventCreate");
    }
    std::weak_ptr<EventPool> pool = weak_from_this();
    return std::shared_ptr<CUevent_st>(ev, [pool](cudaEvent_t e) {
      if (auto p = pool.lock()) {
        MutexLock lock(p->mu_);
        p->idle_.push_back(e);
      } else {
        cudaEventDestroy(e);
      }
    });
  }

 private:
  const int device_;
  Mutex mu_;
  std::vector<cudaEvent_t> idle_ TIERMEM_GUARDED_BY(mu_);  // owned
};

using Event = std::shared_ptr<CUevent_st>;  // a cudaEvent_t from the EventPool
using Events = std::vector<Event>;

// Drops the events that have completed (cudaEventQuery; an error counts as completed: the
// stream that waits on it reports it).
void Prune(Events* events) {
  std::erase_if(*events,
                [](const Event& e) { return cudaEventQuery(e.get()) != cudaErrorNotReady; });
}

class Lane {
 public:
  Lane(int device, cudaStream_t stream, std::shared_ptr<EventPool> pool)
      : device_(device), stream_(stream), pool_(std::move(pool)), thread_([this] { Run(); }) {}
  ~Lane() {
    {
      MutexLock lock(mu_);
      stop_ = true;
    }
    cv_.NotifyAll();
    thread_.join();  // drains the queue first
    cudaStreamDestroy(stream_);
  }

  cudaStream_t stream() const { return stream_; }

  // Records an event after the work already enqueued on the stream and completes `done` when
  // it has passed; returns the event (null after a failure, when `done` has completed with the
  // error already).
  Event Track(std::shared_ptr<Completion> done) {
    StatusOr<Event> ev = pool_->Get();
    if (!ev.ok()) {
      // Fall back to a synchronous wait so the copy still completes correctly.
      const cudaError_t sync = cudaStreamSynchronize(stream_);
      done->Complete(CudaErrorToStatus(sync, "cuda tier: copy"));
      return nullptr;
    }
    const cudaError_t err = cudaEventRecord(ev->get(), stream_);
    if (err != cudaSuccess) {
      done->Complete(CudaErrorToStatus(err, "cuda tier: event record"));
      return nullptr;
    }
    {
      MutexLock lock(mu_);
      queue_.push_back({*ev, std::move(done)});
    }
    cv_.NotifyOne();
    return *ev;
  }

 private:
  struct Item {
    Event event;
    std::shared_ptr<Completion> done;
  };

  void Run() {
    cudaSetDevice(device_);
    for (;;) {
      Item item;
      {
        MutexLock lock(mu_);
        while (!stop_ && queue_.empty()) cv_.Wait(lock);
        if (queue_.empty()) return;  // stop_ and drained
        item = std::move(queue_.front());
        queue_.pop_front();
      }
      const cudaError_t err = cudaEventSynchronize(item.event.get());
      item.event.reset();
      item.done->Complete(CudaErrorToStatus(err, "cuda tier: copy"));
    }
  }

  const int device_;
  const cudaStream_t stream_;  // owned
  const std::shared_ptr<EventPool> pool_;
  Mutex mu_;
  CondVar cv_;
  bool stop_ TIERMEM_GUARDED_BY(mu_) = false;
  std::deque<Item> queue_ TIERMEM_GUARDED_BY(mu_);
  std::thread thread_;  // last: starts after the members above exist
};

class CudaTier final : public Tier, public ComputeOrdering {
 public:
  CudaTier(const CudaTierConfig& config, void* arena, Bytes arena_bytes, cudaStream_t h2d,
           cudaStream_t d2h)
      : config_(config),
        arena_(static_cast<unsigned char*>(arena)),
        arena_bytes_(arena_bytes),
        budget_(arena_bytes),
        events_(std::make_shared<EventPool>(config.device)),
        h2d_(config.device, h2d, events_),
        d2h_(config.device, d2h, events_) {
    free_[0] = arena_bytes;
  }

  ~CudaTier() override {
    // Lanes are destroyed (drained) after this body; the arena must outlive their copies, and
    // compute queued on other streams that touches it (its recorded events).
    cudaSetDevice(config_.device);
    cudaStreamSynchronize(h2d_.stream());
    cudaStreamSynchronize(d2h_.stream());
    for (auto& [id, b] : live_) {
      if (b.compute) cudaEventSynchronize(b.compute.get());
    }
    for (const Retired& r : retired_) {
      for (const Event& e : r.events) cudaEventSynchronize(e.get());
    }
    cudaFree(arena_);
  }

  ComputeOrdering* ordering() override { return this; }

  TierKind kind() const override { return TierKind::kDevice; }
  std::string name() const override { return "cuda:" + std::to_string(config_.device); }

  StatusOr<Region> Allocate(Bytes bytes) override {
    if (bytes == 0) return InvalidArgumentError("cuda tier: cannot allocate 0 bytes");
    if (bytes > arena_bytes_) {  // also keeps AlignUp below from overflowing
      const TierStats st = budget_.Snapshot();
      return ResourceExhaustedError(name() + " tier: need " + std::to_string(bytes) + " bytes, " +
                                    std::to_string(st.capacity - st.used) + " available of a " +
                                    std::to_string(st.capacity) + "-byte budget");
    }
    const Bytes size = AlignUp(bytes, config_.alignment);
    TIERMEM_RETURN_IF_ERROR(budget_.Reserve(size, name()));
    MutexLock lock(mu_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < size) continue;
      const Bytes offset = it->first;
      const Bytes rest = it->second - size;
      free_.erase(it);
      if (rest > 0) free_[offset + size] = rest;
      const uint64_t id = next_id_++;
      Block& b = live_[id];
      b.offset = offset;
      b.size = size;
      InheritFencesLocked(&b);
      return Region{id, size, arena_ + offset};
    }
    budget_.Release(size);
    return ResourceExhaustedError(name() + " tier: need " + std::to_string(size) +
                                  " contiguous bytes; the budget has room but the arena is "
                                  "fragmented (largest free block " +
                                  std::to_string(LargestFreeLocked()) + " bytes)");
  }

  Status Free(const Region& region) override {
    MutexLock lock(mu_);
    auto it = live_.find(region.id);
    if (it == live_.end() || arena_ + it->second.offset != region.addr) {
      return InvalidArgumentError(name() + " tier: Free of an unknown region (id " +
                                  std::to_string(region.id) + ")");
    }
    Bytes offset = it->second.offset;
    Bytes size = it->second.size;
    {
      Retired r{offset, size, std::move(it->second.fences)};
      if (it->second.compute) r.events.push_back(std::move(it->second.compute));
      Prune(&r.events);
      if (!r.events.empty()) retired_.push_back(std::move(r));
    }
    live_.erase(it);
    budget_.Release(size);
    // Merge with the free neighbours.
    auto next = free_.lower_bound(offset);
    if (next != free_.end() && next->first == offset + size) {
      size += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == offset) {
        offset = prev->first;
        size += prev->second;
        free_.erase(prev);
      }
    }
    free_[offset] = size;
    return OkStatus();
  }

  std::shared_ptr<Completion> Copy(const CopyRequest& request) override {
    // Held across the enqueue: a ComputeUsed/ComputeWaits on this region is ordered entirely
    // before or after this copy, and copies_in gets the copy's event before anyone looks.
    MutexLock lock(mu_);
    auto it = live_.find(request.region.id);
    if (it == live_.end() || arena_ + it->second.offset != request.region.addr) {
      return Completion::Done(InvalidArgumentError(name() +
                                                   " tier: copy on an unknown region (id " +
                                                   std::to_string(request.region.id) + ")"));
    }
    Block& b = it->second;
    const Region live{request.region.id, b.size, arena_ + b.offset};
    if (Status s = ValidateCopy(request, live); !s.ok()) return Completion::Done(s);
    if (request.bytes == 0) return Completion::Done(OkStatus());
    if (request.host == nullptr) {
      return Completion::Done(
          InvalidArgumentError(name() + " tier: copy with a null host pointer"));
    }
    unsigned char* dev = static_cast<unsigned char*>(live.addr) + request.offset;
    const bool to_tier = request.dir == CopyDir::kToTier;
    Lane& lane = to_tier ? h2d_ : d2h_;
    cudaError_t err = cudaSetDevice(config_.device);
    // The compute that used the region (and its memory's earlier regions) comes first.
    Prune(&b.fences);
    for (const Event& e : b.fences) {
      if (err == cudaSuccess) err = cudaStreamWaitEvent(lane.stream(), e.get(), 0);
    }
    if (b.compute && err == cudaSuccess)
      err = cudaStreamWaitEvent(lane.stream(), b.compute.get(), 0);
    if (err == cudaSuccess) {
      err = to_tier ? cudaMemcpyAsync(dev, request.host, request.bytes, cudaMemcpyHostToDevice,
                                      lane.stream())
                    : cudaMemcpyAsync(request.host, dev, request.bytes, cudaMemcpyDeviceToHost,
                                      lane.stream());
    }
    if (err != cudaSuccess) return Completion::Done(CudaErrorToStatus(err, name() + " tier: copy"));
    auto done = Completion::Make();
    Event ev = lane.Track(done);
    if (to_tier && ev) {
      Prune(&b.copies_in);
      b.copies_in.push_back(std::move(ev));
    }
    return done;
  }

  // ---- ComputeOrdering ----
  Status ComputeUsed(const Region& region, ComputeStream stream) override {
    MutexLock lock(mu_);
    TIERMEM_ASSIGN_OR_RETURN(Block * b, FindLocked(region, "compute use"));
    TIERMEM_ASSIGN_OR_RETURN(Event ev, events_->Get());
    TIERMEM_CUDA_RETURN_IF_ERROR(cudaSetDevice(config_.device), "cuda tier: cudaSetDevice");
    TIERMEM_CUDA_RETURN_IF_ERROR(
        cudaEventRecord(ev.get(), reinterpret_cast<cudaStream_t>(stream.handle)),
        "cuda tier: recording a compute use");
    b->compute = std::move(ev);
    return OkStatus();
  }

  Status ComputeWaits(const Region& region, ComputeStream stream) override {
    MutexLock lock(mu_);
    TIERMEM_ASSIGN_OR_RETURN(Block * b, FindLocked(region, "compute wait"));
    Prune(&b->copies_in);
    Prune(&b->fences);
    auto s = reinterpret_cast<cudaStream_t>(stream.handle);
    for (const Events* evs : {&b->copies_in, &b->fences}) {
      for (const Event& e : *evs) {
        TIERMEM_CUDA_RETURN_IF_ERROR(cudaStreamWaitEvent(s, e.get(), 0),
                                     "cuda tier: compute waiting for a copy");
      }
    }
    return OkStatus();
  }

  TierStats Stats() const override { return budget_.Snapshot(); }

 private:
  struct Block {
    Bytes offset = 0;
    Bytes size = 0;
    Event compute;     // the last ComputeUsed
    Events copies_in;  // copies into it, maybe not done
    Events fences;     // compute uses of earlier regions of its bytes
  };
  // Freed bytes with compute still pending on them.
  struct Retired {
    Bytes offset = 0;
    Bytes size = 0;
    Events events;
  };

  StatusOr<Block*> FindLocked(const Region& region, const char* what) TIERMEM_REQUIRES(mu_) {
    auto it = live_.find(region.id);
    if (it == live_.end() || arena_ + it->second.offset != region.addr) {
      return InvalidArgumentError(name() + " tier: " + what + " of an unknown region (id " +
                                  std::to_string(region.id) + ")");
    }
    return &it->second;
  }

  // A new region over [offset, offset + size) waits for the compute of every retired region
  // it overlaps; retired entries whose compute finished are dropped.
  void InheritFencesLocked(Block* b) TIERMEM_REQUIRES(mu_) {
    std::erase_if(retired_, [&](Retired& r) {
      Prune(&r.events);
      if (r.events.empty()) return true;
      if (r.offset < b->offset + b->size && b->offset < r.offset + r.size) {
        b->fences.insert(b->fences.end(), r.events.begin(), r.events.end());
      }
      return false;
    });
  }

  Bytes LargestFreeLocked() const TIERMEM_REQUIRES(mu_) {
    Bytes best = 0;
    for (const auto& [offset, size] : free_) best = std::max(best, size);
    return best;
  }

  const CudaTierConfig config_;
  unsigned char* const arena_;  // device memory, owned (cudaFree in the destructor)
  const Bytes arena_bytes_;
  BudgetAccount budget_;
  mutable Mutex mu_;
  std::map<Bytes, Bytes> free_ TIERMEM_GUARDED_BY(mu_);  // offset -> size
  std::unordered_map<uint64_t, Block> live_ TIERMEM_GUARDED_BY(mu_);
  std::vector<Retired> retired_ TIERMEM_GUARDED_BY(mu_);
  uint64_t next_id_ TIERMEM_GUARDED_BY(mu_) = 1;
  const std::shared_ptr<EventPool> events_;
  Lane h2d_;
  Lane d2h_;
};

}  // namespace

int CudaRuntimeBuildVersion() { return CUDART_VERSION; }

StatusOr<int> CudaDeviceCount() {
  int count = 0;  // left unwritten by the runtime when there is no driver
  TIERMEM_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  if (count <= 0) return UnavailableError("cudaGetDeviceCount: no CUDA device");
  return count;
}

StatusOr<std::unique_ptr<Tier>> NewCudaTier(const CudaTierConfig& config) {
  if (config.alignment == 0 || (config.alignment & (config.alignment - 1)) != 0) {
    return InvalidArgumentError("cuda tier: alignment must be a power of two (got " +
                                std::to_string(config.alignment) + ")");
  }
  const Bytes arena_bytes = config.capacity / config.alignment * config.alignment;
  if (arena_bytes == 0) {
    return InvalidArgumentError("cuda tier: capacity must be at least the alignment");
  }
  TIERMEM_ASSIGN_OR_RETURN(const int count, CudaDeviceCount());
  if (config.device < 0 || config.device >= count) {
    return InvalidArgumentError("cuda tier: device " + std::to_string(config.device) +
                                " does not exist (" + std::to_string(count) + " devices)");
  }
  TIERMEM_CUDA_RETURN_IF_ERROR(cudaSetDevice(config.device), "cuda tier: cudaSetDevice");
  void* arena = nullptr;
  if (cudaError_t err = cudaMalloc(&arena, arena_bytes); err != cudaSuccess) {
    return CudaErrorToStatus(
        err, "cuda tier: cudaMalloc of a " + std::to_string(arena_bytes) + "-byte arena");
  }
  cudaStream_t h2d = nullptr, d2h = nullptr;
  cudaError_t err = cudaStreamCreateWithFlags(&h2d, cudaStreamNonBlocking);
  if (err == cudaSuccess) err = cudaStreamCreateWithFlags(&d2h, cudaStreamNonBlocking);
  if (err != cudaSuccess) {
    if (h2d != nullptr) cudaStreamDestroy(h2d);
    cudaFree(arena);
    return CudaErrorToStatus(err, "cuda tier: cudaStreamCreate");
  }
  return std::unique_ptr<Tier>(new CudaTier(config, arena, arena_bytes, h2d, d2h));
}

Status CudaHostRegister(void* ptr, Bytes bytes) {
  if (ptr == nullptr || bytes == 0) {
    return InvalidArgumentError("CudaHostRegister: need a non-null pointer and bytes > 0");
  }
  int count = 0;
  TIERMEM_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count), "CudaHostRegister");
  TIERMEM_CUDA_RETURN_IF_ERROR(cudaHostRegister(ptr, bytes, cudaHostRegisterPortable),
                               "CudaHostRegister of " + std::to_string(bytes) + " bytes");
  return OkStatus();
}

Status CudaHostUnregister(void* ptr) {
  if (ptr == nullptr) return InvalidArgumentError("CudaHostUnregister: null pointer");
  TIERMEM_CUDA_RETURN_IF_ERROR(cudaHostUnregister(ptr), "CudaHostUnregister");
  return OkStatus();
}

namespace {
class CudaHostPinner final : public HostPinner {
 public:
  Status Register(void* addr, Bytes bytes) override { return CudaHostRegister(addr, bytes); }
  void Unregister(void* addr) override { CudaHostUnregister(addr).IgnoreError(); }
};
}  // namespace

std::unique_ptr<HostPinner> NewCudaHostPinner() { return std::make_unique<CudaHostPinner>(); }

StatusOr<CudaHostRegistration> CudaHostRegistration::Make(void* ptr, Bytes bytes) {
  TIERMEM_RETURN_IF_ERROR(CudaHostRegister(ptr, bytes));
  return CudaHostRegistration(ptr);
}

CudaHostRegistration& CudaHostRegistration::operator=(CudaHostRegistration&& other) noexcept {
  if (this != &other) {
    if (ptr_ != nullptr) CudaHostUnregister(ptr_).IgnoreError();
    ptr_ = other.ptr_;
    other.ptr_ = nullptr;
  }
  return *this;
}

CudaHostRegistration::~CudaHostRegistration() {
  if (ptr_ != nullptr) CudaHostUnregister(ptr_).IgnoreError();
}

}  // namespace tiermem
