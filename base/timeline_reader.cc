// The timeline reader. It walks the file block by block: a block is accepted only when its
// 16-byte header checksum and its payload checksum both match, so every event handed out
// comes from a complete, verified block. Running out of bytes (inside the header of a block
// or inside its payload) ends the read as "truncated" with a note; bytes that are present but
// wrong are kDataLoss. An events block is parsed lazily: Next() copies one 40-byte record at
// a time out of payload_ and validates its enums, so no malformed value reaches a consumer.
#include "base/timeline_reader.h"

#include <cerrno>
#include <cstring>

#include "base/crc32c.h"
#include "base/timeline_format.h"

namespace tiermem {
namespace {

namespace fmt = timeline_format;

uint32_t GetU32(const unsigned char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t GetU64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// Fuzzing builds (FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION, the libFuzzer convention) accept
// any checksum so the fuzzer reaches the parsing behind it; everything else is still checked.
bool ChecksumMismatch(uint32_t stored, uint32_t computed) {
#ifdef FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION
  (void)stored;
  (void)computed;
  return false;
#else
  return stored != computed;
#endif
}

bool ValidTier(TierKind t) { return static_cast<int>(t) < kNumTierKinds || t == TierKind::kNone; }

// Returns "" if `e` is well-formed, else what is wrong with it.
std::string CheckEvent(const Event& e) {
  const int type = static_cast<int>(e.type);
  if (type < static_cast<int>(EventType::kAlloc) ||
      type > static_cast<int>(EventType::kCollective)) {
    return "unknown event type " + std::to_string(type);
  }
  if (!ValidTier(e.tier) || !ValidTier(e.tier2)) {
    return "invalid tier " + std::to_string(static_cast<int>(e.tier)) + "/" +
           std::to_string(static_cast<int>(e.tier2));
  }
  if (static_cast<int>(e.category) >= kNumCategories) {
    return "invalid category " + std::to_string(static_cast<int>(e.category));
  }
  return "";
}

}  // namespace

TimelineReader::~TimelineReader() {
  if (file_ != nullptr) std::fclose(file_);
}

StatusOr<std::unique_ptr<TimelineReader>> TimelineReader::Open(const std::string& path) {
  std::unique_ptr<TimelineReader> r(new TimelineReader());
  r->file_ = std::fopen(path.c_str(), "rb");
  if (r->file_ == nullptr) return ErrnoToStatus(errno, "timeline: open " + path);
  std::setvbuf(r->file_, nullptr, _IOFBF, 1 << 20);
  Status s = r->ReadHeader();
  if (!s.ok()) return s.WithContext(path);
  return r;
}

StatusOr<std::unique_ptr<TimelineReader>> TimelineReader::FromBytes(std::string bytes) {
  std::unique_ptr<TimelineReader> r(new TimelineReader());
  r->memory_ = std::move(bytes);
  TIERMEM_RETURN_IF_ERROR(r->ReadHeader());
  return r;
}

std::string_view TimelineReader::Label(uint32_t id) const {
  auto it = labels_.find(id);
  return it == labels_.end() ? std::string_view() : std::string_view(it->second);
}

StatusOr<size_t> TimelineReader::ReadSome(void* dst, size_t n) {
  size_t got;
  if (file_ != nullptr) {
    got = std::fread(dst, 1, n, file_);
    if (got < n && std::ferror(file_)) return ErrnoToStatus(errno, "timeline: read");
  } else {
    got = std::min(n, memory_.size() - memory_pos_);
    if (got > 0) std::memcpy(dst, memory_.data() + memory_pos_, got);
    memory_pos_ += got;
  }
  offset_ += got;
  return got;
}

Status TimelineReader::Fail(Status s) {
  error_ = s;
  done_ = true;
  return s;
}

Status TimelineReader::ReadHeader() {
  unsigned char h[fmt::kHeaderBytes];
  TIERMEM_ASSIGN_OR_RETURN(size_t got, ReadSome(h, sizeof(h)));
  const size_t magic_got = std::min<size_t>(got, 8);
  if (got == 0) return InvalidArgumentError("not a tiermem timeline (empty file)");
  if (std::memcmp(h, fmt::kMagic, magic_got) != 0) {
    return InvalidArgumentError("not a tiermem timeline (bad magic)");
  }
  if (got < sizeof(h)) {
    // A prefix of a real header: the recorder was killed before writing it. Nothing to read.
    done_ = true;
    end_note_ =
        "file ends at byte " + std::to_string(got) + " inside the file header; 0 events read";
    return OkStatus();
  }
  if (ChecksumMismatch(GetU32(h + 36), Crc32c(h, 36))) {
    return DataLossError("timeline header checksum mismatch (bytes 0..39)");
  }
  info_.version = GetU32(h + 8);
  if (info_.version != fmt::kVersion) {
    return InvalidArgumentError("timeline version " + std::to_string(info_.version) +
                                " is not supported (this reader reads version " +
                                std::to_string(fmt::kVersion) + ")");
  }
  if (GetU32(h + 12) != fmt::kHeaderBytes) {
    return DataLossError("timeline header size " + std::to_string(GetU32(h + 12)) + " != 40");
  }
  info_.clock_start_ns = GetU64(h + 16);
  info_.wall_start_ns = GetU64(h + 24);
  return OkStatus();
}

Status TimelineReader::LoadBlock() {
  const uint64_t block_start = offset_;
  const uint64_t index = blocks_read_;
  auto truncated_note = [&](const std::string& where) {
    done_ = true;
    end_note_ = "file ends at byte " + std::to_string(offset_) + " " + where + "; " +
                std::to_string(events_read_) + " events read";
  };
  unsigned char h[fmt::kBlockHeaderBytes];
  TIERMEM_ASSIGN_OR_RETURN(size_t got, ReadSome(h, sizeof(h)));
  if (got == 0) {
    truncated_note(index == 0 ? std::string("right after the file header with no end record "
                                            "(the recorder did not close: killed?)")
                              : "after block " + std::to_string(index - 1) +
                                    " with no end record (the recorder did not close: killed?)");
    return OkStatus();
  }
  if (got < sizeof(h)) {
    truncated_note("inside the header of block " + std::to_string(index) +
                   " (which starts at byte " + std::to_string(block_start) + ")");
    return OkStatus();
  }
  const std::string where =
      "block " + std::to_string(index) + " at byte " + std::to_string(block_start);
  if (ChecksumMismatch(GetU32(h + 12), Crc32c(h, 12))) {
    return DataLossError("timeline: header checksum mismatch in " + where);
  }
  const uint32_t kind = GetU32(h);
  const uint32_t payload_bytes = GetU32(h + 4);
  if (payload_bytes > fmt::kMaxPayloadBytes) {
    return DataLossError("timeline: " + where + " claims " + std::to_string(payload_bytes) +
                         " payload bytes (limit " + std::to_string(fmt::kMaxPayloadBytes) + ")");
  }
  payload_.resize(payload_bytes);
  TIERMEM_ASSIGN_OR_RETURN(got, ReadSome(payload_.data(), payload_bytes));
  if (got < payload_bytes) {
    truncated_note("inside block " + std::to_string(index) + " (which starts at byte " +
                   std::to_string(block_start) + "; its header says " +
                   std::to_string(payload_bytes) + " payload bytes, " + std::to_string(got) +
                   " present)");
    return OkStatus();
  }
  if (ChecksumMismatch(GetU32(h + 8), Crc32c(payload_.data(), payload_bytes))) {
    return DataLossError("timeline: payload checksum mismatch in " + where);
  }
  ++blocks_read_;
  block_index_ = index;
  next_event_ = block_events_ = 0;
  switch (kind) {
    case fmt::kBlockLabel: {
      if (payload_bytes < 4) return DataLossError("timeline: short label record in " + where);
      const uint32_t id = GetU32(payload_.data());
      if (id == 0) return DataLossError("timeline: label id 0 defined in " + where);
      std::string text(reinterpret_cast<const char*>(payload_.data()) + 4, payload_bytes - 4);
      auto [it, inserted] = labels_.try_emplace(id, std::move(text));
      if (!inserted &&
          it->second != std::string_view(reinterpret_cast<const char*>(payload_.data()) + 4,
                                         payload_bytes - 4)) {
        return DataLossError("timeline: label " + std::to_string(id) + " redefined in " + where);
      }
      return OkStatus();
    }
    case fmt::kBlockEvents: {
      if (payload_bytes < fmt::kEventsPrefixBytes) {
        return DataLossError("timeline: short events block " + where);
      }
      const uint32_t count = GetU32(payload_.data() + 4);
      if (uint64_t{count} * sizeof(Event) + fmt::kEventsPrefixBytes != payload_bytes) {
        return DataLossError("timeline: " + where + " holds " + std::to_string(payload_bytes) +
                             " payload bytes, not the " + std::to_string(count) +
                             " events it announces");
      }
      block_thread_ = GetU32(payload_.data());
      block_events_ = count;
      return OkStatus();
    }
    case fmt::kBlockEnd: {
      if (payload_bytes != 16) return DataLossError("timeline: bad end record in " + where);
      const uint64_t total_events = GetU64(payload_.data());
      const uint64_t total_blocks = GetU64(payload_.data() + 8);
      if (total_events != events_read_ || total_blocks != blocks_read_) {
        return DataLossError("timeline: end record in " + where + " counts " +
                             std::to_string(total_events) + " events in " +
                             std::to_string(total_blocks) + " blocks, but the file holds " +
                             std::to_string(events_read_) + " events in " +
                             std::to_string(blocks_read_) + " blocks");
      }
      unsigned char extra;
      TIERMEM_ASSIGN_OR_RETURN(got, ReadSome(&extra, 1));
      if (got != 0) {
        return DataLossError("timeline: bytes after the end record at byte " +
                             std::to_string(offset_ - 1));
      }
      done_ = true;
      complete_ = true;
      return OkStatus();
    }
    default:
      return OkStatus();  // a block kind from a newer writer: skipped
  }
}

StatusOr<bool> TimelineReader::Next(TimelineEntry* out) {
  while (true) {
    if (!error_.ok()) return error_;
    if (next_event_ < block_events_) {
      Event e;
      std::memcpy(&e, payload_.data() + fmt::kEventsPrefixBytes + next_event_ * sizeof(Event),
                  sizeof(Event));
      std::string bad = CheckEvent(e);
      if (bad.empty() && e.label != 0 && labels_.find(e.label) == labels_.end()) {
        bad = "undefined label " + std::to_string(e.label);
      }
      if (!bad.empty()) {
        return Fail(DataLossError("timeline: event " + std::to_string(next_event_) + " of block " +
                                  std::to_string(block_index_) + ": " + bad));
      }
      ++next_event_;
      ++events_read_;
      out->event = e;
      out->label = Label(e.label);
      out->thread = block_thread_;
      out->block = block_index_;
      return true;
    }
    if (done_) return false;
    Status s = LoadBlock();
    if (!s.ok()) return Fail(std::move(s));
  }
}

}  // namespace tiermem
