// DirectMover: a stand-in for the Mover (runtime/mover.h) until its implementation lands.
// It issues each move as direct Tier::Copy calls: device/NVMe <-> host uses the non-host
// tier's Copy with the host region's address; host <-> host is a memcpy; device <-> NVMe
// bounces through a heap buffer (two chained copies). It records copy begin/end events when
// a recorder is attached, like the Mover.
//
// Threading: thread-safe. Tiers and the recorder must outlive it and its completions.
#pragma once

#include <memory>

#include "runtime/mover.h"

namespace tiermem::engine {

std::unique_ptr<Mover> NewDirectMover(TimelineRecorder* recorder);

}  // namespace tiermem::engine
