// Injectable time source. Everything that reads time (the mover's bandwidth model, the
// timeline recorder, planners) takes a `const Clock*` so tests can drive time by hand.
#pragma once

#include <atomic>
#include <cstdint>

namespace tiermem {

// Thread-safe: implementations must allow concurrent NowNs() calls.
class Clock {
 public:
  virtual ~Clock() = default;
  // Monotonic nanoseconds since an arbitrary epoch.
  virtual uint64_t NowNs() const = 0;
  // Process-wide steady clock (CLOCK_MONOTONIC). Never null, never destroyed.
  static const Clock* Real();
};

// A clock that moves only when told. Thread-safe.
class ManualClock final : public Clock {
 public:
  explicit ManualClock(uint64_t start_ns = 0) : now_ns_(start_ns) {}
  uint64_t NowNs() const override { return now_ns_.load(std::memory_order_acquire); }
  void AdvanceNs(uint64_t ns) { now_ns_.fetch_add(ns, std::memory_order_acq_rel); }
  void SetNs(uint64_t ns) { now_ns_.store(ns, std::memory_order_release); }

 private:
  std::atomic<uint64_t> now_ns_;
};

}  // namespace tiermem
