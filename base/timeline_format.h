// On-disk framing of the timeline file, shared by the recorder (timeline.cc) and the reader
// (timeline_reader.cc). docs/timeline-format.md is the prose version of this header; change
// both together and bump kTimelineVersion on any incompatible change. All integers are
// little-endian.
//
//   file    := header block*
//   header  := magic[8] "TIERMEM\x1a" | u32 version | u32 header_bytes (=40)
//              | u64 clock_start_ns | u64 wall_start_ns | u32 flags (=0) | u32 crc32c(bytes 0..35)
//   block   := u32 kind | u32 payload_bytes | u32 crc32c(payload) | u32 crc32c(bytes 0..11)
//              | payload
//   kind 1 (label):  u32 id | UTF-8 text (payload_bytes - 4 bytes, no terminator)
//   kind 2 (events): u32 thread | u32 count | count x 40-byte Event (timeline_event.h)
//   kind 3 (end):    u64 total_events | u64 total_blocks   (written by Close)
//   other kinds: skipped by readers (forward compatibility).
#pragma once

#include <cstddef>
#include <cstdint>

namespace tiermem::timeline_format {

inline constexpr char kMagic[8] = {'T', 'I', 'E', 'R', 'M', 'E', 'M', '\x1a'};
inline constexpr uint32_t kVersion = 1;
inline constexpr size_t kHeaderBytes = 40;
inline constexpr size_t kBlockHeaderBytes = 16;
inline constexpr uint32_t kMaxPayloadBytes = 64u << 20;  // readers reject larger blocks
inline constexpr size_t kEventsPrefixBytes = 8;          // thread + count

enum BlockKind : uint32_t {
  kBlockLabel = 1,
  kBlockEvents = 2,
  kBlockEnd = 3,
};

}  // namespace tiermem::timeline_format
