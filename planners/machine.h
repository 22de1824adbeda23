// The machine model the planner and the simulator plan against: a budget per tier, the copy
// rate and latency of every directed tier pair, the optimizer kernel rates on the CPU and on
// the device, and the CPU core count. Filled from a trace's measured rates (and the budgets
// it was recorded under), then overridden by what the user gives explicitly.
//
// A copy of b bytes from src to dst takes latency_ns + b / bytes_per_s seconds on the
// (src, dst) copy lane; lanes of different pairs run concurrently with each other and with
// compute (a GPU's copy engines, an io_uring ring). Device<->NVMe goes through pinned bounce
// buffers: when not measured it is modelled as the slower of the two legs, latencies added.
//
// Thread-safety: a value.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/status.h"
#include "base/units.h"
#include "planners/trace.h"

namespace tiermem::planners {

struct MachineModel {
  std::array<Bytes, kNumTierKinds> budget{};  // by TierKind index; nvme 0 = no NVMe tier
  std::array<std::array<LinkRate, kNumTierKinds>, kNumTierKinds> link{};  // [src][dst]
  double cpu_optim_elems_per_s = 0;     // 0 = unknown: optimizer steps keep their tier
  double device_optim_elems_per_s = 0;  // 0 = unknown
  uint32_t cpu_cores = 0;               // informational (the CPU rate is for all cores)

  // The trace's measured rates and recorded budgets, device<->NVMe derived when missing.
  static MachineModel FromTrace(const Trace& trace);

  Bytes Budget(TierKind t) const { return budget[static_cast<int>(t)]; }
  const LinkRate& Link(TierKind src, TierKind dst) const {
    return link[static_cast<int>(src)][static_cast<int>(dst)];
  }
  // Nanoseconds one copy of `bytes` occupies the (src, dst) lane. Requires a rate > 0.
  uint64_t CopyNs(TierKind src, TierKind dst, Bytes bytes) const;
  // The lane a (src, dst) copy occupies, as [src][dst] indices: every copy to or from NVMe
  // shares one lane, the disk's (reads and writes time-share it: mixed reads and writes
  // together reach about one direction's rate, docs/benchmarks.md "NVMe inside a training
  // step"); device<->host pairs have a lane per direction (copy engines).
  static std::pair<int, int> LaneOf(TierKind src, TierKind dst);

  // Fills device<->NVMe links that have no rate from the host legs.
  void DeriveNvmeLinks();
  // Fills the device<->host and host<->NVMe links that have no rate (a trace records only
  // the directions that moved bytes while it was recorded) with the reverse direction's
  // rate, else a conservative default (4 GB/s device<->host, 1 GB/s NVMe; 10 us), then
  // DeriveNvmeLinks. Returns the links filled, as "h2n: assumed a default rate" etc.
  std::vector<std::string> FillMissingLinks();
  // kInvalidArgument naming what is missing: device and host budgets, a device<->host rate
  // both ways, host<->NVMe and device<->NVMe rates when there is an NVMe budget.
  Status Validate() const;
  std::string ToString() const;  // one line per item, for --verbose output and docs
};

// Applies "PAIR=RATE[@LATENCY]" items separated by commas, e.g. "h2d=24GB,d2h=20GB@10us".
// PAIR is one of h2d d2h h2n n2h d2n n2d, or hd / hn / dn for both directions; RATE is bytes
// per second in ParseBytes syntax (an optional "/s" suffix is allowed); LATENCY is a number
// with ns, us or ms. kInvalidArgument naming the bad item.
Status ApplyLinkSpec(std::string_view spec, MachineModel* m);

}  // namespace tiermem::planners
