// Structural validation of the Perfetto / Chrome Trace Event export: required fields per
// phase, numeric counters, async begin/end pairs, balanced B/E per thread, timestamps in us
// and non-decreasing per track, names for every process and thread; plus exact counter values
// on the golden timeline.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <vector>

#include "tests/prof/golden_timeline.h"
#include "prof/perfetto.h"
#include "prof/synthetic.h"

namespace tiermem::prof {
namespace {

std::string TempPath(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() / "tiermem_perfetto_test";
  std::filesystem::create_directories(dir);
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return (dir / (std::string(info->name()) + "_" + name)).string();
}

// Validates `trace` against the Trace Event format; returns the number of events checked.
size_t Validate(const nlohmann::json& trace) {
  EXPECT_TRUE(trace.is_object());
  const auto& events = trace.at("traceEvents");
  EXPECT_TRUE(events.is_array());
  std::map<std::pair<int, int>, double> last_ts;                 // per (pid, tid)
  std::map<std::pair<int, int>, std::vector<std::string>> stack;  // B/E per (pid, tid)
  std::map<std::tuple<std::string, std::string, std::string>, int> open;  // async (cat,id,name)
  std::set<int> named_pids, used_pids;
  std::set<std::pair<int, int>> named_threads, used_threads;
  for (const auto& e : events) {
    const std::string ph = e.at("ph");
    EXPECT_TRUE(e.at("pid").is_number_integer());
    EXPECT_TRUE(e.at("tid").is_number_integer());
    EXPECT_TRUE(e.at("name").is_string());
    const int pid = e["pid"], tid = e["tid"];
    if (ph == "M") {
      EXPECT_TRUE(e.at("args").at("name").is_string());
      if (e["name"] == "process_name") named_pids.insert(pid);
      if (e["name"] == "thread_name") named_threads.insert({pid, tid});
      continue;
    }
    used_pids.insert(pid);
    EXPECT_TRUE(e.at("ts").is_number()) << e;
    double ts = e["ts"];
    if (ph == "X") {
      // A complete slice is written when it ends (it may have begun before the events just
      // written): its end time is what keeps the track's order.
      EXPECT_TRUE(e.at("dur").is_number()) << e;
      EXPECT_GE(e["dur"].get<double>(), 0.0);
      ts += e["dur"].get<double>();
      used_threads.insert({pid, tid});
    }
    EXPECT_GE(ts, 0.0);
    auto [it, inserted] = last_ts.try_emplace({pid, tid}, ts);
    EXPECT_GE(ts, it->second) << "timestamps go backwards on pid " << pid << " tid " << tid;
    it->second = ts;
    if (ph == "C") {
      EXPECT_TRUE(e.at("args").is_object());
      EXPECT_FALSE(e["args"].empty());
      for (const auto& [k, v] : e["args"].items()) EXPECT_TRUE(v.is_number()) << k;
    } else if (ph == "b" || ph == "e") {
      EXPECT_TRUE(e.at("cat").is_string());
      EXPECT_TRUE(e.at("id").is_string());
      auto key = std::make_tuple(e["cat"].get<std::string>(), e["id"].get<std::string>(),
                                 e["name"].get<std::string>());
      if (ph == "b") {
        EXPECT_EQ(open[key]++, 0) << "async slice begun twice: " << e;
      } else {
        EXPECT_EQ(open[key]--, 1) << "async end without begin: " << e;
      }
    } else if (ph == "B") {
      stack[{pid, tid}].push_back(e["name"]);
      used_threads.insert({pid, tid});
    } else if (ph == "E") {
      auto& s = stack[{pid, tid}];
      EXPECT_FALSE(s.empty()) << "E without B: " << e;
      if (!s.empty()) {
        EXPECT_EQ(s.back(), e["name"].get<std::string>());
        s.pop_back();
      }
    } else if (ph == "X") {
      EXPECT_TRUE(e.at("args").is_object());
    } else if (ph == "i") {
      const std::string scope = e.at("s");
      EXPECT_TRUE(scope == "g" || scope == "p" || scope == "t") << e;
      used_threads.insert({pid, tid});
    } else {
      ADD_FAILURE() << "unexpected phase " << ph;
    }
  }
  for (const auto& [key, n] : open) EXPECT_EQ(n, 0) << std::get<0>(key) << " " << std::get<1>(key);
  for (const auto& [key, s] : stack) EXPECT_TRUE(s.empty());
  for (int pid : used_pids) EXPECT_TRUE(named_pids.count(pid)) << "unnamed process " << pid;
  for (const auto& t : used_threads) EXPECT_TRUE(named_threads.count(t)) << "unnamed thread " << t.second;
  return events.size();
}

nlohmann::json Export(const std::string& tmt) {
  const std::string out = tmt + ".json";
  Status s = ExportPerfetto(tmt, out);
  EXPECT_TRUE(s.ok()) << s.ToString();
  std::ifstream in(out);
  return nlohmann::json::parse(in);
}

TEST(PerfettoExportTest, GoldenTimelineIsValidAndExact) {
  const std::string path = TempPath("golden.tmt");
  testing::WriteGoldenTimeline(path);
  const nlohmann::json trace = Export(path);
  EXPECT_GT(Validate(trace), 20u);
  // The device "memory" counter reaches exactly the 20 MiB peak at t = 3 us; one OOM instant;
  // 3 copies and 2 stalls as async slices; the 2 phases and 2 iterations as slices.
  double peak = 0, peak_ts = -1;
  int ooms = 0, copies = 0, stalls = 0, phases = 0, iterations = 0, allocs = 0;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] == "C" && e["pid"] == 1 && e["name"] == "memory") {
      double sum = 0;
      for (const auto& [k, v] : e["args"].items()) sum += v.get<double>();
      if (sum > peak) {
        peak = sum;
        peak_ts = e["ts"];
      }
    }
    if (e["ph"] == "i" && e["name"] == "OOM on device") ++ooms;
    if (e["ph"] == "b" && e["cat"] == "copy") ++copies;
    if (e["ph"] == "b" && e["cat"] == "stall") ++stalls;
    if (e["ph"] == "b" && e["cat"] == "alloc:device") ++allocs;
    if (e["ph"] == "B" && e["tid"] == 1) ++phases;
    if (e["ph"] == "B" && e["tid"] == 2) ++iterations;
  }
  EXPECT_EQ(peak, 20.0 * (1 << 20));
  EXPECT_DOUBLE_EQ(peak_ts, 3.0);
  EXPECT_EQ(ooms, 1);
  EXPECT_EQ(copies, 3);
  EXPECT_EQ(stalls, 2);
  EXPECT_EQ(allocs, 3);
  EXPECT_EQ(phases, 3);
  EXPECT_EQ(iterations, 2);
}

// A kCollective event becomes a complete slice on the "collectives" track, ending at the
// event's time and lasting its `id` ns.
TEST(PerfettoExportTest, CollectivesAreSlices) {
  const std::string path = TempPath("collectives.tmt");
  {
    auto rec = std::move(TimelineRecorder::Open(path).value());
    Event a;
    a.ts_ns = 1'000'000;
    a.type = EventType::kMoment;
    rec->Record(a);
    Event e;
    e.ts_ns = 5'000'000;
    e.type = EventType::kCollective;
    e.id = 2'000'000;
    e.bytes = 4096;
    e.label = rec->InternLabel("all_gather");
    rec->Record(e);
    ASSERT_TRUE(rec->Close().ok());
  }
  const nlohmann::json trace = Export(path);
  Validate(trace);
  int slices = 0;
  for (const auto& e : trace["traceEvents"]) {
    if (e["ph"] == "X" && e["name"] == "all_gather") {
      ++slices;
      EXPECT_DOUBLE_EQ(e["ts"].get<double>(), 2000.0);   // us since the first event
      EXPECT_DOUBLE_EQ(e["dur"].get<double>(), 2000.0);
      EXPECT_EQ(e["args"]["bytes"], 4096);
    }
  }
  EXPECT_EQ(slices, 1);
}

TEST(PerfettoExportTest, SyntheticRunIsValid) {
  const std::string path = TempPath("synth.tmt");
  ASSERT_TRUE(WriteSyntheticTimeline(path, {.min_events = 15000}).ok());
  EXPECT_GT(Validate(Export(path)), 15000u);
}

TEST(PerfettoExportTest, BadInputIsAnError) {
  const std::string path = TempPath("foreign.tmt");
  std::ofstream(path) << "hello";
  EXPECT_EQ(ExportPerfetto(path, path + ".json").code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace tiermem::prof
