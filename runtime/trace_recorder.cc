#include "runtime/trace_recorder.h"

#include <algorithm>
#include <thread>
#include <utility>

#include "base/clock.h"

namespace tiermem::session {

using planners::MomentKind;

Status TraceRecorder::Arm(std::string path, int iterations) {
  if (path.empty()) return InvalidArgumentError("record_trace: the trace path is empty");
  if (iterations < 1) {
    return InvalidArgumentError("record_trace: iterations must be >= 1 (got " +
                                std::to_string(iterations) + ")");
  }
  if (state_ != State::kIdle) {
    return FailedPreconditionError("record_trace: a trace is already being recorded to " + path_);
  }
  path_ = std::move(path);
  remaining_ = iterations;
  state_ = State::kArmed;
  return OkStatus();
}

Status TraceRecorder::ArmInMemory(int iterations) {
  TIERMEM_RETURN_IF_ERROR(Arm("-", iterations));
  path_.clear();
  return OkStatus();
}

StatusOr<bool> TraceRecorder::BeginIteration(const Probes& p,
                                             const planners::TraceBudgets& budgets) {
  if (state_ == State::kIdle) return false;
  if (state_ == State::kRecording) EndMoment(p);
  if (remaining_ == 0) return Write(p, budgets);
  if (!started_) {
    links_at_start_ = p.links;
    started_ = true;
  }
  state_ = State::kRecording;
  --remaining_;
  builder_.BeginIteration();
  in_flight_.clear();
  in_flight_bytes_ = 0;
  // Everything up to the first labelled moment (e.g. an embedding outside every unit).
  Moment("iteration-start", MomentKind::kOther, planners::kNoUnit, p);
  return false;
}

void TraceRecorder::Moment(std::string_view label, MomentKind kind, uint32_t unit,
                           const Probes& p) {
  if (state_ != State::kRecording || paused_) return;
  EndMoment(p);
  if (kind == MomentKind::kPreBackward && unit != planners::kNoUnit) {
    // The unit's saved activations are consumed from here on: no longer in flight after it.
    for (auto it = in_flight_.begin(); it != in_flight_.end(); ++it) {
      if (it->first == unit) {
        in_flight_bytes_ -= it->second;
        in_flight_.erase(it);
        break;
      }
    }
  }
  Begin(label, kind, unit, p.stall_ns);
}

void TraceRecorder::Begin(std::string_view label, MomentKind kind, uint32_t unit,
                          uint64_t stall_ns) {
  builder_.BeginMoment(label, kind, unit);
  in_moment_ = true;
  label_ = std::string(label);
  kind_ = kind;
  unit_ = unit;
  begin_ns_ = Clock::Real()->NowNs();
  begin_stall_ns_ = stall_ns;
  cur_saved_ = 0;
  explicit_activation_ = ~Bytes{0};
  work_elems_ = 0;
  moment_serial_ = (moment_serial_ + 1) % 0x3fffffffu;  // never kUnseen >> 2
}

void TraceRecorder::Split() {
  // No fresh probes here (the hot path has none): the stall counter as of the moment's
  // start, so the split-off part's stall time is counted as the new moment's compute.
  // (EndMoment reads only the stall counter.)
  Probes p;
  p.stall_ns = begin_stall_ns_;
  EndMoment(p);
  Begin(label_ + "+", MomentKind::kOther, planners::kNoUnit, begin_stall_ns_);
}

void TraceRecorder::SetPaused(bool paused, const Probes& p) {
  if (paused && !paused_ && state_ == State::kRecording) EndMoment(p);
  paused_ = paused;
}

void TraceRecorder::SetWorkElems(uint64_t elems, bool on_device) {
  work_elems_ = elems;
  work_on_device_ = on_device;
}

void TraceRecorder::EndMoment(const Probes& p) {
  if (!in_moment_) return;
  in_moment_ = false;
  const uint64_t wall = Clock::Real()->NowNs() - begin_ns_;
  const uint64_t stall = p.stall_ns - begin_stall_ns_;
  const uint64_t compute = wall > stall ? wall - stall : 0;
  // saved_bytes belongs on a unit's pre-forward only (the format's rule); bytes saved
  // elsewhere (outside every unit) are live but not attributable, so they count as
  // temporaries of the moment.
  const bool pre_forward = kind_ == MomentKind::kPreForward && unit_ != planners::kNoUnit;
  const Bytes live =
      explicit_activation_ != ~Bytes{0} ? explicit_activation_ : in_flight_bytes_ + cur_saved_;
  builder_.SetActivationBytes(std::max(live, pre_forward ? cur_saved_ : Bytes{0}));
  if (pre_forward) {
    builder_.SetSavedBytes(cur_saved_);
    if (cur_saved_ > 0) {
      in_flight_.emplace_back(unit_, cur_saved_);
      in_flight_bytes_ += cur_saved_;
    }
  }
  if (kind_ == MomentKind::kOptimizerStep) {
    builder_.SetWorkElems(work_elems_);
    opt_elems_[work_on_device_ ? 1 : 0] += work_elems_;
    opt_ns_[work_on_device_ ? 1 : 0] += compute;
  }
  builder_.EndMoment(compute);
}

StatusOr<bool> TraceRecorder::Finish(const Probes& p, const planners::TraceBudgets& budgets) {
  if (state_ != State::kRecording) {
    state_ = State::kIdle;
    return false;
  }
  EndMoment(p);
  return Write(p, budgets);
}

StatusOr<bool> TraceRecorder::Write(const Probes& p, const planners::TraceBudgets& budgets) {
  state_ = State::kIdle;
  declared_ = false;  // the builder is empty after Finish: a later recording starts afresh
  started_ = false;
  planners::MeasuredRates r;
  for (int a = 0; a < kNumTierKinds; ++a) {
    for (int b = 0; b < kNumTierKinds; ++b) {
      const Bytes bytes = p.links[a][b].bytes - links_at_start_[a][b].bytes;
      const uint64_t ns = p.links[a][b].busy_ns - links_at_start_[a][b].busy_ns;
      if (a != b && bytes > 0 && ns > 0) r.link[a][b].bytes_per_s = bytes * 1e9 / ns;
    }
  }
  if (opt_ns_[0] > 0) r.cpu_optim_elems_per_s = opt_elems_[0] * 1e9 / opt_ns_[0];
  if (opt_ns_[1] > 0) r.device_optim_elems_per_s = opt_elems_[1] * 1e9 / opt_ns_[1];
  r.cpu_cores = std::max(1u, std::thread::hardware_concurrency());
  opt_elems_[0] = opt_elems_[1] = opt_ns_[0] = opt_ns_[1] = 0;
  builder_.SetRates(r);
  builder_.SetBudgets(budgets);
  StatusOr<planners::Trace> t = builder_.Finish();
  if (!t.ok()) {
    return InternalError("record_trace: the recorded trace is not valid (" + t.status().message() +
                         "); nothing was written to " + path_);
  }
  if (!path_.empty()) TIERMEM_RETURN_IF_ERROR(planners::WriteTraceFile(*t, path_));
  last_ = std::move(*t);
  return true;
}

}  // namespace tiermem::session
