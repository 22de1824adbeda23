// The warm-up trace: what one (or more) profiled iterations did, as the planner's input.
//
// A trace has a chunk table (id = the engine's ChunkId, dense from 0), a list of iterations,
// each a list of *moments* (a unit's pre-forward, its pre-backward, an optimizer sub-step, or
// another labelled point), and per moment the chunk accesses in order, the non-chunk device
// bytes live during it and its compute time. It also carries the copy and optimizer rates
// measured on the machine and the budgets it was recorded under. docs/trace-format.md is the
// prose version of this header and of the file format in trace.cc; change both together.
//
// Semantics the planner relies on (the runtime records them so):
//   - Every access of a moment happens before or during its compute: all of a moment's chunks
//     must be resident on their tier for the whole moment.
//   - AccessMode::kWrite means the chunk's previous content is not needed (it is lazily zero
//     or fully overwritten): no copy has to bring it in. kRead / kReadWrite need the content;
//     kWrite / kReadWrite modify it.
//   - A unit's saved activations (Moment::saved_bytes, on its pre-forward moment) stay live on
//     the device from that moment through the unit's pre-backward moment (same `unit`) unless
//     a plan offloads or recomputes them. Moment::activation_bytes is everything non-chunk
//     live on the device during the moment as recorded (saved activations of every unit in
//     flight plus temporaries); the temporaries are what is left after subtracting the saved
//     bytes live under the recorded policy (keep everything).
//   - An optimizer sub-step updates `work_elems` parameters of one chunk group; its accesses
//     name the group's chunks on the tier the update ran on.
//   - A chunk with an `expert_set` is a member of that set's *class*: one expert (or part of
//     one) of a mixture-of-experts layer, which the routing picks at run time. Its recorded
//     accesses are a sample of the routing, not the future: the planner plans the class, not
//     the members (planner.h, "Expert classes"). Chunks without one are dense.
//
// Thread-safety: Trace is a value. TraceBuilder is externally synchronized (the thread that
// drives the engine owns it). Ownership: ReadTrace returns a value the caller owns.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "base/units.h"

namespace tiermem::planners {

// The newest trace file format version this build reads and writes. Version 2 added the
// expert-set section; a trace without expert sets is still written as version 1 (the same
// bytes as before), so builds that read only version 1 keep reading dense traces.
inline constexpr uint32_t kTraceVersion = 2;
inline constexpr uint32_t kNoExpertSet = 0xffffffffu;  // TraceChunk::expert_set of a dense chunk

inline constexpr uint32_t kNoUnit = 0xffffffffu;
inline constexpr uint32_t kMaxUnits = 1u << 24;  // unit ids are below this (or kNoUnit)

// Append-only: the numeric values are part of the file format.
enum class MomentKind : uint8_t {
  kPreForward = 0,
  kPreBackward = 1,
  kOptimizerStep = 2,
  kOther = 3,
};
inline constexpr int kNumMomentKinds = 4;
std::string_view MomentKindName(MomentKind k);  // "pre-forward", "pre-backward", ...

enum class AccessMode : uint8_t {
  kRead = 0,
  kWrite = 1,  // previous content not needed
  kReadWrite = 2,
};
inline constexpr int kNumAccessModes = 3;
std::string_view AccessModeName(AccessMode m);  // "read", "write", "read-write"
inline bool Reads(AccessMode m) { return m != AccessMode::kWrite; }
inline bool Writes(AccessMode m) { return m != AccessMode::kRead; }

struct TraceChunk {
  Bytes bytes = 0;
  Category category = Category::kOther;
  uint32_t group = 0;  // chunk group index (< number of chunks; a group's chunks share offsets)
  uint16_t kind = 0;   // index into Trace::kind_names ("param", "grad", "exp_avg", ...)
  TierKind home = TierKind::kHost;  // where the recording run homed it (host or nvme)
  // The expert set (mixture-of-experts layer) this chunk is a member of, or kNoExpertSet.
  // Sets are numbered as the runtime numbers them (its acquire class); any value but
  // kNoExpertSet.
  uint32_t expert_set = kNoExpertSet;
};

// 8 bytes: the builder appends one per Access() call.
struct TraceAccess {
  ChunkId chunk = kNoChunk;
  AccessMode mode = AccessMode::kRead;
  TierKind tier = TierKind::kDevice;  // device or host
  uint16_t reserved = 0;
};
static_assert(sizeof(TraceAccess) == 8);

struct Moment {
  std::string label;  // e.g. "fwd:blocks.3", "opt:g12"
  MomentKind kind = MomentKind::kOther;
  uint32_t unit = kNoUnit;     // the unit (module subtree) of a pre-forward/pre-backward
  uint64_t compute_ns = 0;     // wall time of the moment's compute
  Bytes activation_bytes = 0;  // non-chunk device bytes live during the moment (peak)
  Bytes saved_bytes = 0;       // pre-forward only: bytes the unit saves for its backward
  uint64_t work_elems = 0;     // optimizer sub-step only: parameters updated
  uint32_t first_access = 0;   // into TraceIteration::accesses
  uint32_t num_accesses = 0;
};

struct TraceIteration {
  std::vector<Moment> moments;
  std::vector<TraceAccess> accesses;  // all moments' accesses, in order
};

// Copy rate and fixed latency of one directed tier pair. bytes_per_s == 0: not measured.
struct LinkRate {
  double bytes_per_s = 0;
  uint64_t latency_ns = 0;
};

struct MeasuredRates {
  // link[src][dst] by TierKind index (device 0, host 1, nvme 2); the diagonal is unused.
  std::array<std::array<LinkRate, kNumTierKinds>, kNumTierKinds> link{};
  double cpu_optim_elems_per_s = 0;     // CPU optimizer kernel, all cores
  double device_optim_elems_per_s = 0;  // device optimizer kernel (CUDA or SimDevice twin)
  uint32_t cpu_cores = 0;
};

struct TraceBudgets {
  Bytes device = 0, host = 0, nvme = 0;  // 0 = not configured (nvme) / unknown
};

struct Trace {
  uint32_t version = kTraceVersion;
  std::string source;                   // free text: what recorded or generated it
  std::vector<std::string> kind_names;  // chunk kinds; TraceChunk::kind indexes this
  std::vector<TraceChunk> chunks;       // index = ChunkId
  std::vector<TraceIteration> iterations;
  MeasuredRates rates;
  TraceBudgets budgets;

  Bytes TotalChunkBytes() const;
  Bytes MaxChunkBytes() const;
  std::string_view KindName(ChunkId c) const;
  uint32_t NumGroups() const;  // 1 + the largest group index (0 without chunks)
  bool HasExpertSets() const;  // some chunk is a member of an expert set
  bool IsExpert(ChunkId c) const { return chunks[c].expert_set != kNoExpertSet; }
};

// Checks every invariant the planner relies on; kInvalidArgument naming the first violation
// (e.g. "iteration 0 moment 7 (fwd:blocks.2) access 1: unknown chunk 99 (the chunk table has
// 40 chunks)").
Status ValidateTrace(const Trace& trace);

// Serialized file format (trace.cc, docs/trace-format.md). Encode never fails on a valid
// trace; Decode checks framing (kInvalidArgument: not a trace / newer version; kDataLoss:
// torn, checksum mismatch, inconsistent framing) and then ValidateTrace.
std::string EncodeTrace(const Trace& trace);
StatusOr<Trace> DecodeTrace(std::string_view bytes);
// Writes atomically (temp file + rename) so a reader never sees a torn file it wrote.
Status WriteTraceFile(const Trace& trace, const std::string& path);
StatusOr<Trace> ReadTraceFile(const std::string& path);

// Records a trace from the runtime's hot path. Access() is an 8-byte append to a vector whose
// capacity persists across iterations; checks are deferred to Finish() (a misuse such as an
// access outside a moment is remembered and reported there), so recording costs a few ns per
// access. Externally synchronized.
class TraceBuilder {
 public:
  TraceBuilder() = default;
  // Declares chunk `id` (ids must end up dense from 0; any order). A repeated id is reported
  // by Finish.
  void DeclareChunk(ChunkId id, const TraceChunk& chunk);
  // Returns the index of `name` in the kind table, adding it if new.
  uint16_t KindIndex(std::string_view name);
  void SetSource(std::string_view source);
  void SetRates(const MeasuredRates& rates) { trace_.rates = rates; }
  void SetBudgets(const TraceBudgets& budgets) { trace_.budgets = budgets; }

  void BeginIteration();
  void BeginMoment(std::string_view label, MomentKind kind, uint32_t unit = kNoUnit);
  void Access(ChunkId chunk, AccessMode mode, TierKind tier) {
    cur_->accesses.push_back(TraceAccess{chunk, mode, tier, 0});
  }
  // The latest access of `chunk` in the current iteration, if it is a read, becomes
  // read-write (the runtime learns that a chunk acquired for reading was modified only when
  // it is released). Scans back from the newest access; no-op when there is none.
  void MarkWritten(ChunkId chunk);
  // `chunk` is a member of expert set `set` (the runtime marks it at every acquire as a class
  // member: O(1); any time before Finish). The latest mark wins.
  void MarkExpertSet(ChunkId chunk, uint32_t set);
  void SetActivationBytes(Bytes live_bytes);  // non-chunk device bytes live (peak)
  void SetSavedBytes(Bytes saved_bytes);      // pre-forward: bytes saved for backward
  void SetWorkElems(uint64_t elems);          // optimizer sub-step: parameters updated
  void EndMoment(uint64_t compute_ns);

  // Moves the trace out and validates it. The builder is empty afterwards.
  StatusOr<Trace> Finish();

 private:
  void Misuse(std::string what);
  Trace trace_;
  std::vector<bool> declared_;
  std::vector<uint32_t> expert_marks_;  // per chunk (kNoExpertSet: none), applied at Finish
  TraceIteration scratch_;  // target of Access() outside an iteration (reported by Finish)
  TraceIteration* cur_ = &scratch_;
  bool in_moment_ = false;
  std::string misuse_;  // first misuse, reported by Finish
};

}  // namespace tiermem::planners
