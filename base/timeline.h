// TimelineRecorder: the cheap, thread-safe, streaming writer of the timeline (see
// timeline_event.h for the schema, docs/timeline-format.md for the file format).
//
// Threading: every method is thread-safe. Events go to a per-thread buffer and are written as
// checksummed blocks, so a killed process leaves a readable prefix. Labels are interned once
// and written before the first block that uses them.
// Ownership: the caller owns the recorder; it must outlive every thread that records into it.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "base/clock.h"
#include "base/status.h"
#include "base/timeline_event.h"

namespace tiermem {

class TimelineRecorder {
 public:
  // Creates/truncates `path`. `clock` must outlive the recorder (default: Clock::Real()).
  static StatusOr<std::unique_ptr<TimelineRecorder>> Open(const std::string& path,
                                                          const Clock* clock = nullptr);
  virtual ~TimelineRecorder() = default;

  // Returns a stable nonzero id for `text`; the same text always gets the same id.
  virtual uint32_t InternLabel(std::string_view text) = 0;
  // Records `e`; stamps e.ts_ns with the clock when it is 0.
  virtual void Record(Event e) = 0;
  // Makes everything recorded so far durable in the file (all threads' buffers).
  virtual Status Flush() = 0;
  // Flushes and closes; later Record calls are dropped. Idempotent.
  virtual Status Close() = 0;
  virtual const Clock* clock() const = 0;
};

}  // namespace tiermem
