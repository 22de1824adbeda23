// TraceRecorder: records the session's warm-up trace (planners/trace.h, docs/trace-format.md)
// from the calls the bindings already make — iterations, moments, chunk acquires and releases,
// optimizer sub-steps — plus the saved-activation bytes the bindings report.
//
// Life cycle: Arm(path, n) → the next n iterations are recorded (from the next
// BeginIteration) → at the BeginIteration after the n-th (or at Finish) the trace is closed,
// validated and written atomically to `path`. One recording per Arm.
//
// What a moment's numbers mean (the session records them so):
//   compute_ns: wall time from the moment's start to the next moment's start, minus the
//     engine's stall time in between (the time acquires waited for copies), i.e. what the
//     moment costs with every chunk already in place;
//   saved_bytes (pre-forward): bytes of non-chunk tensors the unit saved for backward;
//   activation_bytes: the binding's explicit value if it gave one (SetActivationBytes: e.g.
//     from the CUDA allocator), else the saved bytes of every unit in flight (forward seen,
//     backward not yet begun) plus the moment's own — temporaries are not seen on CPU.
// Measured rates at Finish: each tier pair's copy rate from the mover's counters over the
// recorded iterations (bytes / busy time), the CPU and device optimizer rates from the
// optimizer sub-steps (parameters updated / compute time), the machine's core count.
//
// Thread-safety: externally synchronized (the session's thread).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"
#include "chunks/mover.h"
#include "planners/trace.h"

namespace tiermem::session {

class TraceRecorder {
 public:
  // What the recorder reads from its owner at moment and iteration boundaries.
  struct Probes {
    uint64_t stall_ns = 0;  // the engine's cumulative stall time
    LinkTable links{};      // the mover's cumulative counters
  };

  // kInvalidArgument for an empty path or iterations < 1; kFailedPrecondition while a
  // recording is armed or running.
  Status Arm(std::string path, int iterations);
  // The same without a file: the trace is only kept (TakeTrace), e.g. for the session's own
  // planning.
  Status ArmInMemory(int iterations);
  bool armed() const { return state_ != State::kIdle; }
  bool recording() const { return state_ == State::kRecording; }
  const std::string& path() const { return path_; }

  // The chunk table, declared once before the first recorded iteration (ids dense from 0).
  planners::TraceBuilder& builder() { return builder_; }
  bool needs_chunks() const { return !declared_; }
  void ChunksDeclared() { declared_ = true; }

  // Returns true when this call completed the recording (the file is then written; a write
  // error is returned).
  StatusOr<bool> BeginIteration(const Probes& p, const planners::TraceBudgets& budgets);
  void Moment(std::string_view label, planners::MomentKind kind, uint32_t unit, const Probes& p);
  // A chunk accessed on a second tier within one moment (the format forbids it: e.g. a
  // binding reading a value on the host after using it on the device) starts a new moment
  // ("<label>+", kind other) so the trace stays valid.
  void Access(ChunkId chunk, planners::AccessMode mode, TierKind tier) {
    if (!in_moment_ || paused_) return;
    if (chunk >= tier_in_moment_.size()) tier_in_moment_.resize(chunk + 1, kUnseen);
    uint32_t& seen = tier_in_moment_[chunk];
    const uint32_t stamp = (moment_serial_ << 2) | static_cast<uint32_t>(tier);
    if ((seen >> 2) == moment_serial_ && seen != stamp) Split();
    tier_in_moment_[chunk] = (moment_serial_ << 2) | static_cast<uint32_t>(tier);
    builder_.Access(chunk, mode, tier);
  }
  // Paused (the session's SetTracing(false): eval, no_grad inference), nothing is recorded:
  // such passes are not part of the training iteration the plan is for. Pausing ends the
  // current moment (its compute time stops there); recording resumes at the next moment.
  void SetPaused(bool paused, const Probes& p);
  bool paused() const { return paused_; }
  // `chunk` was acquired as a member of expert set `set` (the session's acquire class).
  void MarkExpertSet(ChunkId chunk, uint32_t set) {
    if (recording() && !paused_) builder_.MarkExpertSet(chunk, set);
  }
  // A chunk acquired for reading was released modified: its last access becomes read-write.
  void MarkWritten(ChunkId chunk) {
    if (recording() && !paused_) builder_.MarkWritten(chunk);
  }
  void AddSavedBytes(Bytes b) {
    if (!paused_) cur_saved_ += b;
  }
  void SetActivationBytes(Bytes b) { explicit_activation_ = b; }
  void SetWorkElems(uint64_t elems, bool on_device);
  // Ends the recording now (a partial last iteration is dropped) and writes the file. False
  // when nothing was recorded.
  StatusOr<bool> Finish(const Probes& p, const planners::TraceBudgets& budgets);
  // The last completed recording (file or in-memory), once; nullopt when none is waiting.
  std::optional<planners::Trace> TakeTrace() {
    std::optional<planners::Trace> t = std::move(last_);
    last_.reset();
    return t;
  }
  bool in_memory() const { return path_.empty(); }

 private:
  enum class State { kIdle, kArmed, kRecording };
  void EndMoment(const Probes& p);
  void Split();
  void Begin(std::string_view label, planners::MomentKind kind, uint32_t unit, uint64_t stall_ns);
  static constexpr uint32_t kUnseen = 0xffffffffu;
  std::vector<uint32_t> tier_in_moment_;  // per chunk: moment serial << 2 | tier
  uint32_t moment_serial_ = 0;
  std::string label_;
  StatusOr<bool> Write(const Probes& p, const planners::TraceBudgets& budgets);

  State state_ = State::kIdle;
  std::string path_;
  int remaining_ = 0;  // iterations still to begin
  bool declared_ = false;
  bool paused_ = false;
  planners::TraceBuilder builder_;
  // The current moment.
  bool in_moment_ = false;
  planners::MomentKind kind_ = planners::MomentKind::kOther;
  uint32_t unit_ = planners::kNoUnit;
  uint64_t begin_ns_ = 0, begin_stall_ns_ = 0;
  Bytes cur_saved_ = 0;
  Bytes explicit_activation_ = ~Bytes{0};  // ~0: not given
  uint64_t work_elems_ = 0;
  bool work_on_device_ = false;
  // Saved bytes of units whose forward was recorded and whose backward has not begun.
  std::vector<std::pair<uint32_t, Bytes>> in_flight_;
  Bytes in_flight_bytes_ = 0;
  // Optimizer rates and link counters over the recorded iterations.
  uint64_t opt_elems_[2] = {0, 0}, opt_ns_[2] = {0, 0};  // [host, device]
  LinkTable links_at_start_{};
  bool started_ = false;
  std::optional<planners::Trace> last_;
};

}  // namespace tiermem::session
