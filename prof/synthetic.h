// A synthetic but self-consistent training-run timeline (`tiermem prof synth`): layers whose
// parameter chunks are prefetched host->device and evicted under a device budget, activations
// allocated in forward and freed in backward, gradients offloaded device->host, optimizer state
// on host and NVMe, late prefetches recorded as stalls. Used for demos (docs/img/timeline.png),
// the scale check and tests; deterministic (a ManualClock drives time).
#pragma once

#include <cstdint>
#include <string>

#include "base/status.h"

namespace tiermem::prof {

struct SyntheticOptions {
  uint64_t min_events = 100000;  // iterations are added until at least this many events
  int layers = 24;
};

// Writes the timeline to `path`; returns the number of events written.
StatusOr<uint64_t> WriteSyntheticTimeline(const std::string& path, const SyntheticOptions& options);

}  // namespace tiermem::prof
