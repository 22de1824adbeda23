#include "base/clock.h"

#include <time.h>

namespace tiermem {
namespace {
class SteadyClock final : public Clock {
 public:
  uint64_t NowNs() const override {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
  }
};
}  // namespace

const Clock* Clock::Real() {
  static const SteadyClock* clock = new SteadyClock();  // never destroyed: usable at exit
  return clock;
}

}  // namespace tiermem
