// `tiermem bench copy`: host tier <-> SimDevice copy throughput, through Tier::Copy directly
// and through the Mover, against a plain memcpy of the same bytes between the same buffers,
// measured alternately in the same run (round r runs memcpy, tier, mover for each direction
// before round r+1 starts), so machine noise hits every method alike. Also host -> host
// through the Mover (oneTBB parallel memcpy) against a single memcpy. Reports the median of
// the rounds in GB/s (1e9 bytes/s) and each method's ratio to memcpy.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/clock.h"
#include "chunks/mover.h"
#include "tiers/fake/sim_device.h"
#include "tiers/host/host_tier.h"
#include "tools/commands.h"

namespace tiermem::tools {
namespace {

struct CopyBenchArgs {
  std::string size = "256MiB";
  int rounds = 5;
  bool json = false;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Runs `fn` once and returns seconds; a failed copy aborts the benchmark.
template <typename Fn>
StatusOr<double> Timed(Fn&& fn) {
  const uint64_t t0 = Clock::Real()->NowNs();
  Status s = fn();
  if (!s.ok()) return s;
  return (Clock::Real()->NowNs() - t0) / 1e9;
}

Status RunCopyBench(const CopyBenchArgs& args) {
  TIERMEM_ASSIGN_OR_RETURN(const Bytes size, ParseBytes(args.size));
  if (size == 0 || args.rounds < 1)
    return InvalidArgumentError("bench copy: --size and --rounds must be > 0");
  HostTierConfig hc;
  hc.capacity = 2 * AlignUp(size, 2 * kMiB);
  TIERMEM_ASSIGN_OR_RETURN(std::unique_ptr<Tier> host, NewHostTier(hc));
  std::unique_ptr<Tier> sim = NewSimDevice({.capacity = AlignUp(size, 256)});
  TIERMEM_ASSIGN_OR_RETURN(Region h, host->Allocate(size));
  TIERMEM_ASSIGN_OR_RETURN(Region h2, host->Allocate(size));
  TIERMEM_ASSIGN_OR_RETURN(Region d, sim->Allocate(size));
  std::unique_ptr<Mover> mover = NewMover({}, nullptr, nullptr);
  char* hp = static_cast<char*>(h.addr);
  char* h2p = static_cast<char*>(h2.addr);
  char* dp = static_cast<char*>(d.addr);
  for (Bytes i = 0; i < size; ++i) hp[i] = static_cast<char>(i * 131 + 7);
  // Fault in the SimDevice and second host buffers (untimed).
  std::memcpy(dp, hp, size);
  std::memcpy(h2p, hp, size);

  using Method = std::function<Status()>;
  struct Dir {
    const char* name;
    std::vector<std::pair<const char*, Method>> methods;  // first = the memcpy baseline
  };
  std::vector<Dir> dirs = {
      {"host->device",
       {{"memcpy",
         [&] {
           std::memcpy(dp, hp, size);
           return OkStatus();
         }},
        {"tier_copy",
         [&] {
           return sim->Copy({d, 0, hp, size, CopyDir::kToTier})->Wait();
         }},
        {"mover",
         [&] {
           return mover->Move({{host.get(), h}, {sim.get(), d}, size})->Wait();
         }}}},
      {"device->host",
       {{"memcpy",
         [&] {
           std::memcpy(hp, dp, size);
           return OkStatus();
         }},
        {"tier_copy",
         [&] {
           return sim->Copy({d, 0, hp, size, CopyDir::kFromTier})->Wait();
         }},
        {"mover",
         [&] {
           return mover->Move({{sim.get(), d}, {host.get(), h}, size})->Wait();
         }}}},
      {"host->host",
       {{"memcpy",
         [&] {
           std::memcpy(h2p, hp, size);
           return OkStatus();
         }},
        {"tier_copy",
         [&] {
           return host->Copy({h2, 0, hp, size, CopyDir::kToTier})->Wait();
         }},
        {"mover",
         [&] {
           return mover->Move({{host.get(), h}, {host.get(), h2}, size})->Wait();
         }}}},
  };
  std::map<std::string, std::map<std::string, std::vector<double>>> secs;
  for (int r = 0; r < args.rounds; ++r) {
    for (auto& dir : dirs) {
      for (auto& [name, fn] : dir.methods) {
        TIERMEM_ASSIGN_OR_RETURN(double s, Timed(fn));
        secs[dir.name][name].push_back(s);
      }
    }
  }
  // Each host->device/device->host round trip must have kept the bytes intact.
  for (Bytes i = 0; i < size; i += 4093) {
    if (hp[i] != static_cast<char>(i * 131 + 7) || h2p[i] != hp[i]) {
      return DataLossError("bench copy: data corrupted at byte " + std::to_string(i));
    }
  }

  nlohmann::json out;
  out["size_bytes"] = size;
  out["rounds"] = args.rounds;
  out["numa_node"] = AsHostTier(host.get())->numa_node();
  out["host_memory_locked"] = AsHostTier(host.get())->memory_locked();
  if (!args.json) {
    std::printf("bench copy: %s, %d rounds (median), host tier NUMA node %d, locked %s\n",
                FormatBytes(size).c_str(), args.rounds, AsHostTier(host.get())->numa_node(),
                AsHostTier(host.get())->memory_locked() ? "yes" : "no");
    std::printf("%-14s %-10s %10s %12s\n", "direction", "method", "GB/s", "vs memcpy");
  }
  for (auto& dir : dirs) {
    const double base = size / Median(secs[dir.name]["memcpy"]) / 1e9;
    for (auto& [name, fn] : dir.methods) {
      const double gbs = size / Median(secs[dir.name][name]) / 1e9;
      out["results"][dir.name][name] = {{"gb_per_s", gbs}, {"ratio_vs_memcpy", gbs / base}};
      if (!args.json) std::printf("%-14s %-10s %10.2f %11.2fx\n", dir.name, name, gbs, gbs / base);
    }
  }
  if (args.json) std::printf("%s\n", out.dump(2).c_str());
  TIERMEM_RETURN_IF_ERROR(host->Free(h));
  TIERMEM_RETURN_IF_ERROR(host->Free(h2));
  return sim->Free(d);
}

}  // namespace

void RegisterBenchCopy(CLI::App& bench) {
  auto args = std::make_shared<CopyBenchArgs>();
  CLI::App* cmd = bench.add_subcommand(
      "copy", "host tier <-> SimDevice (and host -> host) copy GB/s vs memcpy, alternated");
  cmd->add_option("--size", args->size, "bytes per copy (e.g. 256MiB)");
  cmd->add_option("--rounds", args->rounds, "rounds; the median is reported");
  cmd->add_flag("--json", args->json, "print JSON instead of a table");
  cmd->callback([args] {
    Status s = RunCopyBench(*args);
    if (!s.ok()) {
      std::fprintf(stderr, "tiermem bench copy: %s\n", s.ToString().c_str());
      throw CLI::RuntimeError(1);
    }
  });
}

}  // namespace tiermem::tools
