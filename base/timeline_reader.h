// TimelineReader: the streaming reader of a timeline file (format: timeline_format.h,
// docs/timeline-format.md). It holds one block in memory at a time plus the label table, so
// files of any size read in bounded memory.
//
// Order: events come in file order. Within a block they are in the recording order of one
// recorder thread (timestamps non-decreasing for clock-stamped events); blocks come in the
// order they were flushed, so blocks of different threads overlap in time. Consumers that
// need global time order merge (tools/prof does, with a bounded reorder window).
//
// Errors: a file that does not start with the magic is kInvalidArgument "not a tiermem
// timeline"; a checksum mismatch or an impossible value is kDataLoss naming the byte offset
// and block; a file that simply stops (killed recorder) is not an error: Next() returns false,
// truncated() is true and end_note() says where it ends and how many events were read.
// Thread-safety: externally synchronized (one thread at a time).
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "base/status.h"
#include "base/timeline_event.h"

namespace tiermem {

struct TimelineFileInfo {
  uint32_t version = 0;
  uint64_t clock_start_ns = 0;  // the recorder clock when the file was opened
  uint64_t wall_start_ns = 0;   // CLOCK_REALTIME (ns since the Unix epoch) at the same moment
};

struct TimelineEntry {
  Event event;
  std::string_view label;  // text of event.label ("" for 0); valid while the reader lives
  uint32_t thread = 0;     // recorder thread index of the block that held the event
  uint64_t block = 0;      // 0-based index of that block among all blocks of the file
};

class TimelineReader {
 public:
  // Opens `path` and checks its header. Caller owns the reader.
  static StatusOr<std::unique_ptr<TimelineReader>> Open(const std::string& path);
  // Reads a timeline held in memory (tests, the fuzzer).
  static StatusOr<std::unique_ptr<TimelineReader>> FromBytes(std::string bytes);
  ~TimelineReader();
  TimelineReader(const TimelineReader&) = delete;
  TimelineReader& operator=(const TimelineReader&) = delete;

  // Sets *out to the next event and returns true; returns false at the end of the readable
  // data (see complete()/truncated()); returns an error on corruption. After false or an
  // error, further calls return the same.
  StatusOr<bool> Next(TimelineEntry* out);

  const TimelineFileInfo& info() const { return info_; }
  // The label text for `id`, or "" if it was not (yet) defined.
  std::string_view Label(uint32_t id) const;

  // After Next() returned false: true if the file ended with the recorder's end record.
  bool complete() const { return complete_; }
  // After Next() returned false: true if the file stops without an end record.
  bool truncated() const { return done_ && !complete_; }
  // "" when complete; otherwise e.g. "file ends at byte 5000 inside block 3 (header says 8200
  // payload bytes, 4944 present); 4096 events read".
  const std::string& end_note() const { return end_note_; }
  uint64_t events_read() const { return events_read_; }
  uint64_t blocks_read() const { return blocks_read_; }
  uint64_t bytes_read() const { return offset_; }

 private:
  TimelineReader() = default;
  Status ReadHeader();
  // Reads up to n bytes; returns the count (short only at end of data).
  StatusOr<size_t> ReadSome(void* dst, size_t n);
  // Loads the next block; sets done_ at the end. Events blocks leave their events in payload_.
  Status LoadBlock();
  Status Fail(Status s);

  std::FILE* file_ = nullptr;  // owned; null when reading from memory
  std::string memory_;         // the bytes when reading from memory
  size_t memory_pos_ = 0;

  TimelineFileInfo info_;
  std::unordered_map<uint32_t, std::string> labels_;
  std::vector<unsigned char> payload_;  // the current events block's payload
  size_t next_event_ = 0;               // index into the current block's events
  size_t block_events_ = 0;
  uint32_t block_thread_ = 0;
  uint64_t block_index_ = 0;  // index of the current block

  uint64_t offset_ = 0;  // bytes consumed so far
  uint64_t events_read_ = 0;
  uint64_t blocks_read_ = 0;
  bool done_ = false;
  bool complete_ = false;
  Status error_;
  std::string end_note_;
};

}  // namespace tiermem
