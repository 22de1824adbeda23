// Export of a timeline to Chrome Trace Event JSON, which ui.perfetto.dev and chrome://tracing
// open. Track layout:
//   pid 1/2/3 "device/host/nvme tier": counters "memory" (one series per category) and
//     "budget"; allocation lifetimes as async slices (cat "alloc:<tier>", name = category).
//   pid 10 "tiermem": tid 1 "phases" (B/E slices), tid 2 "iterations" (B/E slices),
//     tid 3 "moments" (instants), tid 4 "stalls & OOMs" (instants, plus stalls as async
//     slices, cat "stall"), tid 100+lane "copy lane N" (copies as async slices, cat "copy").
// Timestamps are microseconds (3 decimals) from the first event, non-decreasing in file order.
// Slices still open at the end of the timeline are closed at its last timestamp with
// args.unfinished = true, so every begin has its end.
#pragma once

#include <string>

#include "base/status.h"

namespace tiermem::prof {

Status ExportPerfetto(const std::string& timeline_path, const std::string& out_path);

}  // namespace tiermem::prof
