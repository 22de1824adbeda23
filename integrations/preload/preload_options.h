// The preload shim's configuration, read once from the environment (set by `tiermem run`, or
// by hand next to LD_PRELOAD). A bad value is kInvalidArgument naming the variable.
//
//   TIERMEM_PRELOAD_TIMELINE       path   record the timeline here ("" = do not record);
//                                         "%p" in it is replaced by the process id
//   TIERMEM_PRELOAD_EXCLUSIVE      0 | 1  the first process takes the timeline path, every
//                                         other one "<stem>.<pid><ext>" (set by tiermem run)
//   TIERMEM_PRELOAD_OFFLOAD        0 | 1  serve device allocations past the budget from
//                                         managed memory
//   TIERMEM_PRELOAD_DEVICE_BUDGET  size   the device budget (required with offload)
//   TIERMEM_PRELOAD_PREFETCH       profile | off   offload: profile-driven prefetch, or plain
//                                         unified memory
//   TIERMEM_PRELOAD_AHEAD          1..16  offload: launches of lookahead the profile learns
//   TIERMEM_PRELOAD_PREFETCH_MAX   size   offload: largest single prefetch (default 256MiB)
//   TIERMEM_PRELOAD_FLUSH_MS       0..    write the recorded events to the file this often
//                                         (default 1000; 0 = only when buffers fill and at
//                                         exit); also the longest kernel-launch interval
//   TIERMEM_PRELOAD_MAX_ALLOCS     n      live allocations tracked (default 1048576)
//   TIERMEM_PRELOAD_QUIET          0 | 1  no start and exit lines on stderr
#pragma once

#include <string>

#include "base/env.h"
#include "base/status.h"
#include "base/units.h"

namespace tiermem::preload {

struct PreloadOptions {
  std::string timeline_path;
  bool exclusive = false;
  bool offload = false;
  Bytes device_budget = 0;
  bool prefetch = true;
  int ahead = 4;
  Bytes prefetch_max = 256 * kMiB;
  int flush_ms = 1000;
  size_t max_allocs = size_t{1} << 20;
  bool quiet = false;
};

StatusOr<PreloadOptions> ParsePreloadOptions(const EnvGetter& env);

// "run-%p.tmt" with pid 42 -> "run-42.tmt".
std::string ExpandPid(const std::string& path, long pid);

}  // namespace tiermem::preload
