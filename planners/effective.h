// The effective sequence: one trace iteration with a placement applied — the order of moments
// a schedule actually runs, the tier each access is served on, the compute each moment costs
// and the non-chunk bytes (temporaries, saved activations) each occupies. The planner plans
// over it and the simulator executes it; both build it here so they cannot disagree.
//
// What a placement changes:
//   - optimizer sub-steps of a group run on `update_on` (accesses move to that tier; compute
//     is work_elems / the modelled rate, or on the recorded tier the measured time, scaled by
//     the trace's rate over the model's when they differ); a host step
//     with `overlap` runs on the CPU lane, concurrently with the device stream, placed right
//     after the last moment that touches any of its chunks (its grads are complete there);
//   - a unit's saved activations are kept on the device, offloaded to the host after its
//     forward and fetched back `prefetch_lead` moments before its backward, or dropped after
//     the forward and recomputed in the backward (the forward's compute is added to it).
//
// Program-order footprint of a saved-activation span (forward f, backward b, prefetch p):
// keep: device during f..b; offload: device during f and p..b, host during f..p (the host
// copy is allocated at the end of f and freed once its fetch back is issued at p); recompute:
// device during f and during b. Temporaries (a moment's recorded non-chunk bytes minus the saved
// bytes live under keep) occupy the device during their moment only. A span pairs a pre-forward
// that saves bytes with the first later pre-backward of the same unit; saves without a later
// backward are temporaries of their forward.
//
// Thread-safety: values. An EffIteration points into the Trace it was built from (labels):
// the trace must outlive it.
#pragma once

#include <cstdint>
#include <map>
#include <string_view>
#include <vector>

#include "planners/machine.h"
#include "planners/trace.h"

namespace tiermem::planners {

inline constexpr uint32_t kNoGroup = 0xffffffffu;

// Append-only: the numeric values are part of the plan encoding.
enum class ActivationPolicy : uint8_t { kKeep = 0, kOffload = 1, kRecompute = 2 };
std::string_view ActivationPolicyName(ActivationPolicy p);  // "keep", "offload", "recompute"

struct GroupChoice {
  TierKind update_on = TierKind::kNone;  // kNone: where the trace ran it
  bool overlap = false;                  // host step overlapped with the backward
};

struct UnitChoice {
  ActivationPolicy policy = ActivationPolicy::kKeep;
  uint32_t prefetch_lead = 1;  // offload: fetch back this many moments before the backward
                               // (0: at the backward moment itself)
  friend bool operator==(const UnitChoice&, const UnitChoice&) = default;
};

struct Placement {
  std::vector<TierKind> home;            // per chunk: host or nvme (required)
  std::vector<GroupChoice> groups;       // per group; missing entries = as recorded
  std::map<uint32_t, UnitChoice> units;  // per unit; missing = keep
};

struct EffAccess {
  ChunkId chunk = kNoChunk;
  TierKind tier = TierKind::kDevice;
  bool needs_content = true;  // the moment's first access of it reads
  bool modifies = false;      // some access of it in the moment writes
};

struct ActSpan {
  uint32_t unit = kNoUnit;
  uint32_t fwd = 0, bwd = 0;  // effective moment indices
  uint32_t prefetch_at = 0;   // offload: effective moment whose start fetches it back
  Bytes bytes = 0;
  ActivationPolicy policy = ActivationPolicy::kKeep;
};

struct EffMoment {
  uint32_t trace_moment = 0;
  MomentKind kind = MomentKind::kOther;
  uint32_t unit = kNoUnit;
  uint32_t group = kNoGroup;  // optimizer sub-step of one group
  std::string_view label;
  uint64_t compute_ns = 0;  // recompute included
  uint64_t recompute_ns = 0;
  bool async = false;             // runs on the CPU lane, overlapped with the device stream
  uint32_t first = 0, count = 0;  // into EffIteration::accesses
  Bytes temp_bytes = 0;
};

struct EffIteration {
  std::vector<EffMoment> moments;
  std::vector<EffAccess> accesses;  // merged per chunk within a moment, first-access order
  std::vector<ActSpan> spans;
  std::vector<Bytes> dev_extra;   // per moment: program-order non-chunk device bytes
  std::vector<Bytes> host_extra;  // per moment: offloaded activations on the host
  size_t size() const { return moments.size(); }
  const EffAccess* begin(size_t m) const { return accesses.data() + moments[m].first; }
  const EffAccess* end(size_t m) const { return begin(m) + moments[m].count; }
};

// Builds the effective sequence of `iter` (an iteration of `trace`) under `placement`.
// kInvalidArgument if the placement's home table does not cover the chunks.
StatusOr<EffIteration> BuildEffective(const Trace& trace, const TraceIteration& iter,
                                      const Placement& placement, const MachineModel& machine);

// The group of an optimizer sub-step if all its accesses are of one group, else kNoGroup.
uint32_t StepGroup(const Trace& trace, const TraceIteration& iter, const Moment& m);

// True when two effective moments are "the same moment" for divergence purposes: label,
// kind, and the same accesses (chunk, needs_content, modifies, and the tier except for
// optimizer sub-steps, whose tier is a placement decision).
bool SameMoment(const EffIteration& a, size_t i, const EffIteration& b, size_t j);

}  // namespace tiermem::planners
