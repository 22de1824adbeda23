// Stand-ins for the host and NVMe tiers while their implementations (tiers/host, tiers/nvme,
// the in-memory NVMe fake) are being written on other branches: a SimDevice-backed tier that
// reports itself as `kind`. As kHost its regions are host-addressable; as kNvme the region
// address is hidden (nullptr), so the engine reaches its bytes only through Copy, as with a
// real NVMe tier. Replace with the real tiers when they land (one call site in the engine's
// factory and one in the torch integration).
//
// Threading: thread-safe (forwards to a thread-safe tier).
#pragma once

#include <memory>

#include "tiers/tier.h"

namespace tiermem::engine {

// Caller owns the result.
std::unique_ptr<Tier> NewStandInTier(TierKind kind, Bytes capacity);

}  // namespace tiermem::engine
