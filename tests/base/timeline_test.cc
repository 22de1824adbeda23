// Tests of the timeline recorder and reader: round trips of every event type and of
// labels, multi-threaded recording, a readable prefix after truncation at every block
// boundary and at random points, kDataLoss for every corrupted byte, foreign files.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "base/clock.h"
#include "base/crc32c.h"
#include "base/timeline.h"
#include "base/timeline_reader.h"

namespace tiermem {
namespace {

std::string TempPath(const std::string& name) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  auto dir = std::filesystem::temp_directory_path() / "tiermem_timeline_test";
  std::filesystem::create_directories(dir);
  return (dir / (std::string(info->name()) + "_" + name)).string();
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

bool SameEvent(const Event& a, const Event& b) { return std::memcmp(&a, &b, sizeof(Event)) == 0; }

struct ReadResult {
  std::vector<TimelineEntry> entries;
  std::vector<std::string> labels;  // resolved label text of each entry (owned copy)
  Status status;
  bool complete = false;
  bool truncated = false;
  std::string note;
};

ReadResult ReadBytes(std::string bytes) {
  ReadResult r;
  auto reader = TimelineReader::FromBytes(std::move(bytes));
  if (!reader.ok()) {
    r.status = reader.status();
    return r;
  }
  TimelineEntry e;
  while (true) {
    auto more = (*reader)->Next(&e);
    if (!more.ok()) {
      r.status = more.status();
      return r;
    }
    if (!*more) break;
    r.entries.push_back(e);
    r.labels.emplace_back(e.label);
  }
  r.complete = (*reader)->complete();
  r.truncated = (*reader)->truncated();
  r.note = (*reader)->end_note();
  return r;
}

TEST(TimelineTest, RoundTripsEveryEventTypeAndLabel) {
  const std::string path = TempPath("t.tmt");
  ManualClock clock(1000);
  std::vector<Event> written;
  std::vector<std::string> written_labels;
  {
    auto rec = TimelineRecorder::Open(path, &clock);
    ASSERT_TRUE(rec.ok()) << rec.status().ToString();
    uint32_t fwd = (*rec)->InternLabel("forward");
    uint32_t late = (*rec)->InternLabel("prefetch late");
    uint32_t mod = (*rec)->InternLabel("layer3.pre-forward");
    EXPECT_EQ((*rec)->InternLabel("forward"), fwd);
    EXPECT_NE(fwd, late);
    EXPECT_NE(fwd, 0u);
    for (int t = static_cast<int>(EventType::kAlloc); t <= static_cast<int>(EventType::kPrefetch);
         ++t) {
      Event e;
      e.type = static_cast<EventType>(t);
      e.ts_ns = (t % 2 == 0) ? 0 : 5000 + t;  // 0 = stamped by the clock
      e.id = 100 + t;
      e.bytes = uint64_t{1} << (20 + t);
      e.label = t == 5 ? late : t == 8 ? mod : t == 9 ? fwd : 0;
      e.chunk = t == 1 ? kNoChunk : 7 * t;
      e.lane = static_cast<uint16_t>(t);
      e.tier = static_cast<TierKind>(t % 3);
      e.tier2 = t == 3 ? TierKind::kNvme : TierKind::kNone;
      e.category = static_cast<Category>(t % 5);
      e.flags = t == 4 ? kFlagFailed : t == 2 ? kFlagClean : kFlagNone;
      clock.AdvanceNs(10);
      (*rec)->Record(e);
      if (e.ts_ns == 0) e.ts_ns = clock.NowNs();
      written.push_back(e);
      written_labels.push_back(t == 5 ? "prefetch late" : t == 8 ? "layer3.pre-forward" : t == 9 ? "forward" : "");
    }
    EXPECT_EQ((*rec)->clock(), &clock);
    ASSERT_TRUE((*rec)->Close().ok());
    ASSERT_TRUE((*rec)->Close().ok());  // idempotent
    (*rec)->Record(written[0]);         // dropped after Close
  }
  auto reader = TimelineReader::Open(path);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  EXPECT_EQ((*reader)->info().version, 1u);
  EXPECT_EQ((*reader)->info().clock_start_ns, 1000u);
  EXPECT_GT((*reader)->info().wall_start_ns, 1600000000ull * 1000000000ull);
  ReadResult r = ReadBytes(ReadAll(path));
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  ASSERT_EQ(r.entries.size(), written.size());
  for (size_t i = 0; i < written.size(); ++i) {
    EXPECT_TRUE(SameEvent(r.entries[i].event, written[i])) << "event " << i;
    EXPECT_EQ(r.labels[i], written_labels[i]) << "event " << i;
    EXPECT_EQ(r.entries[i].thread, 0u);
  }
  EXPECT_TRUE(r.complete);
  EXPECT_FALSE(r.truncated);
  EXPECT_EQ(r.note, "");
}

TEST(TimelineTest, MultiThreadRecordingKeepsEveryEventAndPerThreadOrder) {
  const std::string path = TempPath("mt.tmt");
  constexpr int kThreads = 6;
  constexpr uint64_t kPerThread = 30000;
  {
    auto rec = TimelineRecorder::Open(path);
    ASSERT_TRUE(rec.ok());
    TimelineRecorder* r = rec->get();
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([r, t] {
        const uint32_t label = r->InternLabel("thread " + std::to_string(t));
        for (uint64_t i = 0; i < kPerThread; ++i) {
          Event e;
          e.type = EventType::kMoment;
          e.id = i;
          e.lane = static_cast<uint16_t>(t);
          e.label = label;
          r->Record(e);
          if (i == kPerThread / 2 && t == 0) {
            ASSERT_TRUE(r->Flush().ok());
          }
        }
      });
    }
    for (auto& th : threads) th.join();
    ASSERT_TRUE(r->Close().ok());
  }
  ReadResult r = ReadBytes(ReadAll(path));
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  ASSERT_TRUE(r.complete);
  ASSERT_EQ(r.entries.size(), kThreads * kPerThread);
  std::vector<uint64_t> next(kThreads, 0);
  std::vector<uint64_t> last_ts(kThreads, 0);
  std::map<int, uint32_t> thread_of_lane;
  for (size_t i = 0; i < r.entries.size(); ++i) {
    const Event& e = r.entries[i].event;
    ASSERT_LT(e.lane, kThreads);
    EXPECT_EQ(r.labels[i], "thread " + std::to_string(e.lane));
    ASSERT_EQ(e.id, next[e.lane]) << "lane " << e.lane;  // per-thread order kept
    ++next[e.lane];
    ASSERT_GE(e.ts_ns, last_ts[e.lane]);
    last_ts[e.lane] = e.ts_ns;
    auto [it, inserted] = thread_of_lane.try_emplace(e.lane, r.entries[i].thread);
    EXPECT_EQ(it->second, r.entries[i].thread);  // one recorder thread index per thread
  }
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(next[t], kPerThread);
}

// Writes a single-threaded timeline of `n` events with labels interleaved and a Flush every
// `flush_every` events, so the file has many blocks of different sizes.
std::vector<Event> WriteSample(const std::string& path, int n, int flush_every) {
  ManualClock clock(0);
  auto rec = TimelineRecorder::Open(path, &clock);
  EXPECT_TRUE(rec.ok());
  std::vector<Event> events;
  for (int i = 0; i < n; ++i) {
    Event e;
    e.type = i % 7 == 0 ? EventType::kPhase : EventType::kAlloc;
    e.label = i % 7 == 0 ? (*rec)->InternLabel("phase " + std::to_string(i / 7 % 13)) : 0;
    e.id = i;
    e.bytes = 4096 * (i + 1);
    e.tier = TierKind::kHost;
    clock.AdvanceNs(3);
    (*rec)->Record(e);
    e.ts_ns = clock.NowNs();
    events.push_back(e);
    if ((i + 1) % flush_every == 0) {
      EXPECT_TRUE((*rec)->Flush().ok());
    }
  }
  EXPECT_TRUE((*rec)->Close().ok());
  return events;
}

struct BlockSpan {
  size_t begin, end;
  uint32_t events;  // events in the block (0 for non-event blocks)
};

// An independent walk of the framing (docs/timeline-format.md).
std::vector<BlockSpan> WalkBlocks(const std::string& bytes) {
  std::vector<BlockSpan> blocks;
  size_t pos = 40;
  while (pos + 16 <= bytes.size()) {
    uint32_t kind, len, count = 0;
    std::memcpy(&kind, bytes.data() + pos, 4);
    std::memcpy(&len, bytes.data() + pos + 4, 4);
    if (kind == 2) std::memcpy(&count, bytes.data() + pos + 16 + 4, 4);
    blocks.push_back({pos, pos + 16 + len, count});
    pos += 16 + len;
  }
  EXPECT_EQ(pos, bytes.size());
  return blocks;
}

TEST(TimelineTest, TruncatedFileYieldsExactlyTheCompleteBlocks) {
  const std::string path = TempPath("trunc.tmt");
  std::vector<Event> events = WriteSample(path, 7000, 1500);
  const std::string bytes = ReadAll(path);
  std::vector<BlockSpan> blocks = WalkBlocks(bytes);
  ASSERT_GT(blocks.size(), 10u);

  auto check_cut = [&](size_t cut) {
    SCOPED_TRACE("cut at byte " + std::to_string(cut));
    size_t expect_events = 0;
    for (const BlockSpan& b : blocks) {
      if (b.end <= cut) expect_events += b.events;
    }
    ReadResult r = ReadBytes(bytes.substr(0, cut));
    ASSERT_TRUE(r.status.ok()) << r.status.ToString();
    ASSERT_EQ(r.entries.size(), expect_events);
    for (size_t i = 0; i < expect_events; ++i) {
      ASSERT_TRUE(SameEvent(r.entries[i].event, events[i])) << i;
    }
    if (cut == bytes.size()) {
      EXPECT_TRUE(r.complete);
      return;
    }
    EXPECT_TRUE(r.truncated);
    EXPECT_FALSE(r.complete);
    EXPECT_NE(r.note.find("file ends at byte " + std::to_string(cut)), std::string::npos) << r.note;
    EXPECT_NE(r.note.find("; " + std::to_string(expect_events) + " events read"), std::string::npos)
        << r.note;
  };
  for (const BlockSpan& b : blocks) {
    check_cut(b.begin);
    check_cut(b.begin + 1);
    check_cut(b.end - 1);
    check_cut(b.end);
  }
  for (size_t cut = 1; cut <= 40; ++cut) check_cut(cut);
  std::mt19937 rng(42);
  for (int i = 0; i < 300; ++i) check_cut(1 + rng() % bytes.size());
  // The note names the block for a cut inside a payload.
  ReadResult mid = ReadBytes(bytes.substr(0, blocks[3].begin + 20));
  EXPECT_NE(mid.note.find("inside block 3"), std::string::npos) << mid.note;
}

TEST(TimelineTest, EveryCorruptedByteIsDataLossNeverACrash) {
  const std::string path = TempPath("corrupt.tmt");
  WriteSample(path, 300, 100);
  const std::string bytes = ReadAll(path);
  ASSERT_TRUE(ReadBytes(bytes).status.ok());
  for (size_t pos = 0; pos < bytes.size(); ++pos) {
    std::string bad = bytes;
    bad[pos] = static_cast<char>(bad[pos] ^ 0x5a);
    ReadResult r = ReadBytes(bad);
    ASSERT_FALSE(r.status.ok()) << "byte " << pos << " corrupted but the read succeeded";
    const StatusCode want = pos < 8 ? StatusCode::kInvalidArgument : StatusCode::kDataLoss;
    ASSERT_EQ(r.status.code(), want) << "byte " << pos << ": " << r.status.ToString();
  }
  // Trailing garbage after a complete timeline.
  ReadResult r = ReadBytes(bytes + "x");
  EXPECT_EQ(r.status.code(), StatusCode::kDataLoss) << r.status.ToString();
}

TEST(TimelineTest, ForeignFilesAreRejectedClearly) {
  ReadResult r = ReadBytes("#!/bin/sh\necho this is not a timeline at all, sorry\n");
  EXPECT_EQ(r.status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status.message().find("not a tiermem timeline"), std::string::npos);
  EXPECT_EQ(ReadBytes("").status.code(), StatusCode::kInvalidArgument);
  auto missing = TimelineReader::Open(TempPath("does-not-exist.tmt"));
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  auto bad_dir = TimelineRecorder::Open("/nonexistent-dir/x.tmt");
  EXPECT_EQ(bad_dir.status().code(), StatusCode::kNotFound);
}

TEST(TimelineTest, FlushMakesEventsReadableBeforeClose) {
  const std::string path = TempPath("flush.tmt");
  auto rec = TimelineRecorder::Open(path);
  ASSERT_TRUE(rec.ok());
  for (int i = 0; i < 10; ++i) {
    Event e;
    e.type = EventType::kIteration;
    e.id = i;
    (*rec)->Record(e);
  }
  ASSERT_TRUE((*rec)->Flush().ok());
  ReadResult r = ReadBytes(ReadAll(path));  // as if the process were killed now
  ASSERT_TRUE(r.status.ok());
  EXPECT_EQ(r.entries.size(), 10u);
  EXPECT_TRUE(r.truncated);
  EXPECT_NE(r.note.find("no end record"), std::string::npos) << r.note;
  ASSERT_TRUE((*rec)->Close().ok());
  r = ReadBytes(ReadAll(path));
  EXPECT_TRUE(r.complete);
  EXPECT_EQ(r.entries.size(), 10u);
}

}  // namespace
}  // namespace tiermem
