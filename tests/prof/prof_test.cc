// Golden-number tests of `tiermem prof report --json` (ReportToJson over AnalyzeFile) on a
// hand-made timeline, plus the time-order merge, truncated and corrupt inputs, text width and
// the diff.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "tests/prof/golden_timeline.h"
#include "prof/analysis.h"
#include "prof/render.h"
#include "prof/synthetic.h"

namespace tiermem::prof {
namespace {

constexpr uint64_t M = 1 << 20;

std::string TempPath(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() / "tiermem_prof_test";
  std::filesystem::create_directories(dir);
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return (dir / (std::string(info->name()) + "_" + name)).string();
}

// Overlapping copies count once in a pair's active time and in a tier's read/write time; the
// achieved rate is bytes over that union, not over the summed copy durations.
TEST(ProfReportTest, ActiveTimeIsTheUnionOfOverlappingCopies) {
  const std::string path = TempPath("overlap.tmt");
  {
    ManualClock clock(0);
    auto rec = std::move(TimelineRecorder::Open(path, &clock).value());
    auto copy = [&](uint64_t ts, bool begin, TierKind src, TierKind dst, uint64_t id,
                    uint64_t bytes, uint8_t flags = 0) {
      Event e;
      e.ts_ns = ts;
      e.type = begin ? EventType::kCopyBegin : EventType::kCopyEnd;
      e.tier = src;
      e.tier2 = dst;
      e.id = id;
      e.bytes = bytes;
      e.flags = flags;
      rec->Record(e);
    };
    const auto nvme = TierKind::kNvme, host = TierKind::kHost, dev = TierKind::kDevice;
    // NVMe reads: [1000, 3000) and [2000, 4000) to host overlap (active 3000 ns for 8 MiB),
    // [6000, 7000) to the device (a bounce) — 4000 ns of NVMe read time for 10 MiB in all.
    // NVMe writes: [2500, 5000) and a failed one inside it [3000, 3500): 2500 ns, 6 MiB.
    // (Recorded in time order.)
    copy(1000, true, nvme, host, 1, 4 * M);
    copy(2000, true, nvme, host, 2, 4 * M);
    copy(2500, true, host, nvme, 4, 6 * M);
    copy(3000, false, nvme, host, 1, 0);
    copy(3000, true, host, nvme, 5, 6 * M);
    copy(3500, false, host, nvme, 5, 0, kFlagFailed);
    copy(4000, false, nvme, host, 2, 0);
    copy(5000, false, host, nvme, 4, 0);
    copy(6000, true, nvme, dev, 3, 2 * M);
    copy(7000, false, nvme, dev, 3, 0);
  }
  auto report = AnalyzeFile(path);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  const nlohmann::json j = ReportToJson(*report);
  std::map<std::string, nlohmann::json> moves;
  for (const auto& m : j["moves"]) {
    moves[m["src"].get<std::string>() + ">" + m["dst"].get<std::string>()] = m;
  }
  EXPECT_EQ(moves["nvme>host"]["busy_ns"], 4000);
  EXPECT_EQ(moves["nvme>host"]["active_ns"], 3000);
  EXPECT_EQ(moves["nvme>device"]["active_ns"], 1000);
  EXPECT_EQ(moves["host>nvme"]["active_ns"], 2500);
  EXPECT_EQ(moves["host>nvme"]["busy_ns"], 2500);  // completed copies only
  const auto& io = j["io"]["nvme"];
  EXPECT_EQ(io["read_bytes"], 10 * M);
  EXPECT_EQ(io["read_active_ns"], 4000);
  EXPECT_EQ(io["write_bytes"], 6 * M);
  EXPECT_EQ(io["write_active_ns"], 2500);
  EXPECT_EQ(io["active_ns"], 5000);  // [1000, 5000) and [6000, 7000)
  EXPECT_EQ(j["io"]["host"]["write_bytes"], 8 * M);
  EXPECT_EQ(j["io"]["host"]["write_active_ns"], 3000);
  EXPECT_EQ(j["io"]["device"]["write_active_ns"], 1000);
  const std::string text = RenderReportText(*report, "overlap.tmt");
  EXPECT_NE(text.find("NVMe reads while busy:  10.00 MiB in 4.00 us"), std::string::npos) << text;
}

TEST(ProfReportTest, GoldenNumbers) {
  const std::string path = TempPath("golden.tmt");
  testing::WriteGoldenTimeline(path);
  auto report = AnalyzeFile(path);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  const nlohmann::json j = ReportToJson(*report);

  EXPECT_EQ(j["file"]["events"], testing::kGoldenEvents);
  EXPECT_EQ(j["file"]["complete"], true);
  EXPECT_EQ(j["file"]["out_of_order_events"], 0);
  EXPECT_EQ(j["t0_ns"], 1000);
  EXPECT_EQ(j["duration_ns"], 10000);

  const auto& dev = j["tiers"]["device"];
  EXPECT_EQ(dev["peak"]["bytes"], 20 * M);
  EXPECT_EQ(dev["peak"]["t_ns"], 3000);
  EXPECT_EQ(dev["peak"]["moment"], "layer1.pre-forward");
  EXPECT_EQ(dev["peak"]["phase"], "forward");
  // (10 MiB x 2000 + 16 MiB x 1000 + 20 MiB x 1000 + 10 MiB x 6000) / 10000 ns = 11.6 MiB.
  EXPECT_EQ(dev["avg_bytes"], 12163482);
  EXPECT_EQ(dev["end_bytes"], 10 * M);
  EXPECT_EQ(dev["budget_bytes"], 100 * M);
  EXPECT_EQ(dev["allocs"], 3);
  EXPECT_EQ(dev["frees"], 2);
  EXPECT_EQ(dev["ooms"], 1);
  EXPECT_EQ(dev["largest_oom_bytes"], 200 * M);
  EXPECT_EQ(dev["categories"]["param"]["peak"]["bytes"], 10 * M);
  EXPECT_EQ(dev["categories"]["param"]["peak"]["t_ns"], 0);
  EXPECT_EQ(dev["categories"]["param"]["peak"]["moment"], "layer0.pre-forward");
  EXPECT_EQ(dev["categories"]["param"]["avg_bytes"], 10 * M);
  EXPECT_EQ(dev["categories"]["activation"]["peak"]["bytes"], 10 * M);
  EXPECT_EQ(dev["categories"]["activation"]["peak"]["t_ns"], 3000);
  // (6 MiB x 1000 + 10 MiB x 1000) / 10000 = 1.6 MiB.
  EXPECT_EQ(dev["categories"]["activation"]["avg_bytes"], 1677722);
  EXPECT_EQ(dev["categories"]["grad"]["peak"]["bytes"], 0);

  const auto& host = j["tiers"]["host"];
  EXPECT_EQ(host["peak"]["bytes"], 30 * M);
  EXPECT_EQ(host["peak"]["t_ns"], 8000);
  EXPECT_EQ(host["peak"]["phase"], "forward");
  EXPECT_EQ(host["avg_bytes"], 3 * M);
  EXPECT_EQ(host["categories"]["optim_state"]["peak"]["bytes"], 30 * M);
  EXPECT_TRUE(j["tiers"].contains("nvme"));  // the failed copy's destination
  EXPECT_EQ(j["tiers"]["nvme"]["peak"]["bytes"], 0);

  ASSERT_EQ(j["moves"].size(), 3u);
  EXPECT_EQ(j["moves"][0]["src"], "device");
  EXPECT_EQ(j["moves"][0]["dst"], "host");
  EXPECT_EQ(j["moves"][0]["bytes"], 8 * M);
  EXPECT_EQ(j["moves"][0]["busy_ns"], 2000);
  EXPECT_EQ(j["moves"][0]["active_ns"], 2000);  // one copy: active = busy
  EXPECT_EQ(j["moves"][1]["src"], "host");
  EXPECT_EQ(j["moves"][1]["dst"], "device");
  EXPECT_EQ(j["moves"][1]["bytes"], 4 * M);
  EXPECT_EQ(j["moves"][1]["count"], 1);
  EXPECT_EQ(j["moves"][2]["dst"], "nvme");
  EXPECT_EQ(j["moves"][2]["bytes"], 0);
  EXPECT_EQ(j["moves"][2]["failed"], 1);
  EXPECT_EQ(j["bytes_moved"], 12 * M);

  EXPECT_EQ(j["stalls"]["total_ns"], 1500);
  EXPECT_EQ(j["stalls"]["count"], 2);
  ASSERT_EQ(j["stalls"]["by_cause"].size(), 2u);
  EXPECT_EQ(j["stalls"]["by_cause"][0]["cause"], "evict");
  EXPECT_EQ(j["stalls"]["by_cause"][0]["ns"], 1000);
  EXPECT_EQ(j["stalls"]["by_cause"][1]["cause"], "prefetch late");
  EXPECT_EQ(j["stalls"]["by_cause"][1]["ns"], 500);

  ASSERT_EQ(j["top_chunks"].size(), 1u);
  EXPECT_EQ(j["top_chunks"][0]["chunk"], 5);
  EXPECT_EQ(j["top_chunks"][0]["moves"], 2);
  EXPECT_EQ(j["top_chunks"][0]["bytes"], 12 * M);

  ASSERT_EQ(j["phases"].size(), 2u);
  EXPECT_EQ(j["phases"][0]["phase"], "forward");
  EXPECT_EQ(j["phases"][0]["count"], 2);
  EXPECT_EQ(j["phases"][0]["time_ns"], 6000);
  EXPECT_EQ(j["phases"][0]["stall_ns"], 500);
  EXPECT_EQ(j["phases"][0]["bytes_moved"], 4 * M);
  EXPECT_EQ(j["phases"][0]["device_peak_bytes"], 20 * M);
  EXPECT_EQ(j["phases"][1]["phase"], "backward");
  EXPECT_EQ(j["phases"][1]["time_ns"], 4000);
  EXPECT_EQ(j["phases"][1]["stall_ns"], 1000);
  EXPECT_EQ(j["phases"][1]["bytes_moved"], 8 * M);
  EXPECT_EQ(j["phases"][1]["device_peak_bytes"], 20 * M);

  EXPECT_EQ(j["iterations"]["count"], 2);
  EXPECT_EQ(j["iterations"]["step_mean_ns"], 5000);
  EXPECT_EQ(j["iterations"]["step_min_ns"], 2000);
  EXPECT_EQ(j["iterations"]["step_max_ns"], 8000);
  EXPECT_EQ(j["unmatched"]["frees"], 1);
  EXPECT_EQ(j["unmatched"]["open_copies"], 0);

  // The terminal report fits 80 columns and names the peak's moment.
  const std::string text = RenderReportText(*report, path);
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) EXPECT_LE(line.size(), 80u) << line;
  EXPECT_NE(text.find("20.00 MiB"), std::string::npos) << text;
  EXPECT_NE(text.find("layer1.pre-forward (forward)"), std::string::npos) << text;
}

TEST(ProfReportTest, MergesThreadsByTimestamp) {
  const std::string path = TempPath("threads.tmt");
  constexpr int kPerThread = 20000;
  {
    auto rec = std::move(TimelineRecorder::Open(path).value());
    auto run = [&](uint64_t parity) {
      for (int i = 0; i < kPerThread; ++i) {
        Event e;
        e.type = EventType::kMoment;
        e.ts_ns = 10 + 2 * static_cast<uint64_t>(i) + parity;
        e.id = parity;
        rec->Record(e);
      }
    };
    std::thread a(run, 0), b(run, 1);
    a.join();
    b.join();
    ASSERT_TRUE(rec->Close().ok());
  }
  auto reader = std::move(TimelineReader::Open(path).value());
  OrderedEvents events(reader.get());
  TimelineEntry e;
  uint64_t n = 0;
  while (*events.Next(&e)) {
    ASSERT_EQ(e.event.ts_ns, 10 + n) << n;  // a perfect interleaving of the two threads
    ++n;
  }
  EXPECT_EQ(n, 2u * kPerThread);
  EXPECT_EQ(events.out_of_order(), 0u);
}

TEST(ProfReportTest, TruncatedAndCorruptFiles) {
  const std::string path = TempPath("golden.tmt");
  testing::WriteGoldenTimeline(path);
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  const std::string cut = TempPath("cut.tmt");
  {
    std::ofstream out(cut, std::ios::binary);
    out.write(bytes.data(), bytes.size() - 10);  // inside the end record
  }
  auto r = AnalyzeFile(cut);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_FALSE(r->complete);
  EXPECT_EQ(r->events, testing::kGoldenEvents);
  EXPECT_NE(r->end_note.find("file ends at byte " + std::to_string(bytes.size() - 10)),
            std::string::npos);
  EXPECT_NE(RenderReportText(*r, cut).find("TRUNCATED"), std::string::npos);

  const std::string bad = TempPath("bad.tmt");
  {
    std::string b = bytes;
    b[200] ^= 1;
    std::ofstream out(bad, std::ios::binary);
    out.write(b.data(), b.size());
  }
  EXPECT_EQ(AnalyzeFile(bad).status().code(), StatusCode::kDataLoss);
  const std::string foreign = TempPath("foreign.tmt");
  std::ofstream(foreign) << "{\"traceEvents\": []}";
  auto f = AnalyzeFile(foreign);
  EXPECT_EQ(f.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(f.status().message().find("not a tiermem timeline"), std::string::npos);
}

TEST(ProfReportTest, DiffShowsChangeInPercent) {
  const std::string a = TempPath("a.tmt");
  testing::WriteGoldenTimeline(a);
  auto ra = AnalyzeFile(a);
  ASSERT_TRUE(ra.ok());
  Report rb = *ra;
  rb.tiers[0].peak.bytes = 25 * M;  // +25%
  rb.stall_ns = 750;                // -50%
  const nlohmann::json d = DiffToJson(*ra, rb);
  bool saw_peak = false, saw_stall = false;
  for (const auto& row : d["rows"]) {
    if (row["metric"] == "device peak") {
      saw_peak = true;
      EXPECT_DOUBLE_EQ(row["change_pct"].get<double>(), 25.0);
    }
    if (row["metric"] == "stall time") {
      saw_stall = true;
      EXPECT_DOUBLE_EQ(row["change_pct"].get<double>(), -50.0);
    }
  }
  EXPECT_TRUE(saw_peak && saw_stall);
  const std::string text = RenderDiffText(*ra, rb, a, "b");
  EXPECT_NE(text.find("+25.0%"), std::string::npos) << text;
  EXPECT_NE(text.find("-50.0%"), std::string::npos) << text;
}

TEST(ProfReportTest, SyntheticRunIsConsistent) {
  const std::string path = TempPath("synth.tmt");
  auto n = WriteSyntheticTimeline(path, {.min_events = 20000});
  ASSERT_TRUE(n.ok());
  auto r = AnalyzeFile(path);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->events, *n);
  EXPECT_TRUE(r->complete);
  EXPECT_EQ(r->unmatched_frees + r->unmatched_copy_ends + r->unmatched_stall_ends, 0u);
  EXPECT_EQ(r->open_copies + r->open_stalls, 0u);
  // 10 resident 64 MiB chunks + a 64 MiB gradient + activations (24/12/8 MiB per layer).
  EXPECT_EQ(r->tiers[0].categories[static_cast<int>(Category::kParam)].peak.bytes, 640 * M);
  EXPECT_LE(r->tiers[0].peak.bytes, r->tiers[0].budget_bytes);
}

// The preload shim's additions to the schema: kernel-launch intervals (a peak carries the
// launches before it), issued prefetches (not bytes moved) and managed allocations.
TEST(ProfReportTest, KernelLaunchesPrefetchesAndManagedAllocations) {
  const std::string path = TempPath("preload.tmt");
  {
    auto rec = std::move(TimelineRecorder::Open(path).value());
    auto ev = [&](uint64_t ts, EventType type, TierKind tier, uint64_t id, uint64_t bytes,
                  uint8_t flags = kFlagNone) {
      Event e;
      e.ts_ns = ts;
      e.type = type;
      e.tier = tier;
      e.id = id;
      e.bytes = bytes;
      e.flags = flags;
      if (type == EventType::kPrefetch) e.tier2 = TierKind::kDevice;
      rec->Record(e);
    };
    ev(100, EventType::kAlloc, TierKind::kDevice, 0x1000, 1 * M);
    ev(150, EventType::kKernelLaunches, TierKind::kNone, 1, 5);
    ev(200, EventType::kAlloc, TierKind::kDevice, 0x2000, 2 * M, kFlagManaged);
    ev(300, EventType::kKernelLaunches, TierKind::kNone, 2, 3);
    ev(310, EventType::kPrefetch, TierKind::kHost, 0x2000, M / 2);
    ev(400, EventType::kFree, TierKind::kDevice, 0x2000, 2 * M, kFlagManaged);
    ASSERT_TRUE(rec->Close().ok());
  }
  auto report = AnalyzeFile(path);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  const nlohmann::json j = ReportToJson(*report);
  EXPECT_EQ(j["kernel_launches"]["total"], 8);
  EXPECT_EQ(j["kernel_launches"]["intervals"], 2);
  EXPECT_EQ(j["tiers"]["device"]["peak"]["bytes"], 3 * M);
  EXPECT_EQ(j["tiers"]["device"]["peak"]["kernel_launches"], 5);
  EXPECT_EQ(j["tiers"]["device"]["peak"]["t_ns"], 100);
  EXPECT_EQ(j["tiers"]["device"]["managed_allocs"], 1);
  EXPECT_EQ(j["prefetches"]["count"], 1);
  EXPECT_EQ(j["prefetches"]["bytes"], M / 2);
  EXPECT_EQ(j["bytes_moved"], 0);
  const std::string text = RenderReportText(*report, path);
  EXPECT_NE(text.find("(peak after 5 of 8 kernel launches)"), std::string::npos) << text;
  EXPECT_NE(text.find("Kernel launches: 8 (2 intervals); prefetches issued: 1 (512.00 KiB)"),
            std::string::npos) << text;
}

}  // namespace
// Collectives of a sharded session (kCollective: op label, bytes, duration in id) are summed
// per operation, in the JSON and the text report.
TEST(ProfReportTest, CollectivesAreSummedPerOperation) {
  const std::string path = TempPath("collectives.tmt");
  {
    auto rec = std::move(TimelineRecorder::Open(path).value());
    auto coll = [&](uint64_t ts, const char* op, uint64_t bytes, uint64_t ns) {
      Event e;
      e.ts_ns = ts;
      e.type = EventType::kCollective;
      e.id = ns;
      e.bytes = bytes;
      e.label = rec->InternLabel(op);
      rec->Record(e);
    };
    coll(1000, "all_gather", M, 400);
    coll(2000, "reduce_scatter", 2 * M, 700);
    coll(3000, "all_gather", M, 100);
    ASSERT_TRUE(rec->Close().ok());
  }
  auto report = AnalyzeFile(path);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  const nlohmann::json j = ReportToJson(*report);
  ASSERT_EQ(j["collectives"].size(), 2u);
  EXPECT_EQ(j["collectives"][0]["op"], "all_gather");
  EXPECT_EQ(j["collectives"][0]["count"], 2);
  EXPECT_EQ(j["collectives"][0]["bytes"], 2 * M);
  EXPECT_EQ(j["collectives"][0]["ns"], 500);
  EXPECT_EQ(j["collectives"][1]["op"], "reduce_scatter");
  EXPECT_EQ(j["collectives"][1]["ns"], 700);
  const std::string text = RenderReportText(*report, path);
  EXPECT_NE(text.find("Collectives"), std::string::npos) << text;
  EXPECT_NE(text.find("reduce_scatter"), std::string::npos) << text;
}

}  // namespace tiermem::prof
