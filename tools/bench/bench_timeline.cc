// `tiermem bench timeline [--events N] [--threads T] [--json] [--dir D]`: events/s of the
// timeline recorder against a baseline measured in the same run: the same 40-byte events,
// stamped by the same clock, written with a plain buffered fwrite loop (one FILE per thread).
// Both write real files under --dir (default $TMPDIR or /tmp) and delete them afterwards.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "base/clock.h"
#include "base/timeline.h"
#include "tools/commands.h"

namespace tiermem::tools {
namespace {

struct TimelineBenchArgs {
  uint64_t events = 5'000'000;
  int threads = 1;
  bool json = false;
  std::string dir;
};

Event MakeEvent(uint64_t i, int thread, uint32_t label) {
  Event e;
  e.type = (i & 1) ? EventType::kFree : EventType::kAlloc;
  e.id = i;
  e.bytes = 4096 + (i & 1023);
  e.label = label;
  e.chunk = static_cast<ChunkId>(i & 255);
  e.lane = static_cast<uint16_t>(thread);
  e.tier = TierKind::kDevice;
  e.category = Category::kParam;
  return e;
}

double Seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Runs fn(thread_index, events_for_that_thread) on `threads` threads; returns seconds.
template <typename Fn>
double RunThreads(int threads, uint64_t events, Fn fn) {
  std::vector<std::thread> pool;
  const auto start = std::chrono::steady_clock::now();
  for (int t = 0; t < threads; ++t) {
    const uint64_t n = events / threads + (static_cast<uint64_t>(t) < events % threads ? 1 : 0);
    pool.emplace_back([&fn, t, n] { fn(t, n); });
  }
  for (auto& th : pool) th.join();
  return Seconds(start, std::chrono::steady_clock::now());
}

int RunTimelineBench(const TimelineBenchArgs& args) {
  namespace fs = std::filesystem;
  std::string dir = args.dir;
  if (dir.empty()) dir = std::getenv("TMPDIR") != nullptr ? std::getenv("TMPDIR") : "/tmp";
  const std::string stem = dir + "/tiermem_bench_timeline_" + std::to_string(::getpid());
  const Clock* clock = Clock::Real();

  // Baseline: fwrite of the same records, one buffered FILE per thread.
  double fwrite_s = RunThreads(args.threads, args.events, [&](int t, uint64_t n) {
    const std::string path = stem + ".fwrite" + std::to_string(t);
    std::FILE* f = std::fopen(path.c_str(), "wb");
    if (f == nullptr) return;
    for (uint64_t i = 0; i < n; ++i) {
      Event e = MakeEvent(i, t, 1);
      e.ts_ns = clock->NowNs();
      std::fwrite(&e, sizeof(e), 1, f);
    }
    std::fclose(f);
  });
  for (int t = 0; t < args.threads; ++t) fs::remove(stem + ".fwrite" + std::to_string(t));

  // tiermem: one recorder, `threads` recording threads, timed until Close returns.
  const std::string path = stem + ".tmt";
  auto rec = TimelineRecorder::Open(path, clock);
  if (!rec.ok()) {
    std::cerr << "bench timeline: " << rec.status().ToString() << "\n";
    return 1;
  }
  const uint32_t label = (*rec)->InternLabel("bench");
  const auto start = std::chrono::steady_clock::now();
  RunThreads(args.threads, args.events, [&](int t, uint64_t n) {
    for (uint64_t i = 0; i < n; ++i) (*rec)->Record(MakeEvent(i, t, label));
  });
  Status closed = (*rec)->Close();
  const double rec_s = Seconds(start, std::chrono::steady_clock::now());
  const uint64_t file_bytes = fs::file_size(path);
  fs::remove(path);
  if (!closed.ok()) {
    std::cerr << "bench timeline: " << closed.ToString() << "\n";
    return 1;
  }

  const double rec_rate = args.events / rec_s;
  const double fwrite_rate = args.events / fwrite_s;
  if (args.json) {
    nlohmann::json j = {{"benchmark", "timeline"},
                        {"events", args.events},
                        {"threads", args.threads},
                        {"recorder_events_per_s", rec_rate},
                        {"fwrite_events_per_s", fwrite_rate},
                        {"ratio_vs_fwrite", rec_rate / fwrite_rate},
                        {"recorder_file_bytes", file_bytes},
                        {"recorder_s", rec_s},
                        {"fwrite_s", fwrite_s}};
    std::cout << j.dump(2) << "\n";
  } else {
    std::printf("timeline recorder: %llu events, %d thread(s)\n",
                static_cast<unsigned long long>(args.events), args.threads);
    std::printf("  tiermem recorder  %8.2f M events/s  (%.3f s, %.1f MB file)\n", rec_rate / 1e6,
                rec_s, file_bytes / 1e6);
    std::printf("  fwrite baseline   %8.2f M events/s  (%.3f s)\n", fwrite_rate / 1e6, fwrite_s);
    std::printf("  ratio             %8.2fx of fwrite\n", rec_rate / fwrite_rate);
  }
  return 0;
}

}  // namespace

void RegisterBenchTimeline(CLI::App& bench) {
  auto args = std::make_shared<TimelineBenchArgs>();
  CLI::App* cmd =
      bench.add_subcommand("timeline", "timeline recorder events/s vs a plain fwrite loop");
  cmd->add_option("--events", args->events, "events in total")->check(CLI::PositiveNumber);
  cmd->add_option("--threads", args->threads, "recording threads")->check(CLI::Range(1, 256));
  cmd->add_flag("--json", args->json, "print JSON");
  cmd->add_option("--dir", args->dir, "directory for the scratch files (default $TMPDIR or /tmp)");
  cmd->callback([args] {
    int rc = RunTimelineBench(*args);
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace tiermem::tools
