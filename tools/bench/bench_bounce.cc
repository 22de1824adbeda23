// `tiermem bench bounce`: lone device <-> NVMe moves — one chunk at a time, each waited for
// before the next starts, as the engine's write-backs of gradients in the backward and its
// fetches of single chunks are — through the same pieces as a session's: SimDevice, a host
// staging tier registered with the NVMe tier, the Mover's bounce through the session's staging
// slots (BounceMoverConfig), the NVMe tier with checksums. `--configs` compares other staging
// shapes in the same rounds (rotating which goes first). Optionally with `--busy-threads` threads
// spinning on arithmetic meanwhile (as torch's compute occupies the cores during a training step),
// which is what makes the thread hand-offs of a move (device copy -> checksum -> io_uring
// submission -> completion -> next piece) wait for time slices.
//
// The baseline, measured alternately in the same run: the same tier streaming host <-> NVMe
// (registered huge-page buffers, two 64 MiB copies in flight) with the same busy threads.
// Reports each configuration's GB/s per direction and lone/streaming (the median of the
// per-round ratios). The session's staging tier (prefetch_depth 4 + 2 chunk slots) is shared
// by the configurations; the data's round trip is checked at the end.
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "base/clock.h"
#include "base/units.h"
#include "chunks/mover.h"
#include "tiers/fake/sim_device.h"
#include "tiers/host/host_tier.h"
#include "tiers/nvme/nvme_tier.h"
#include "tools/commands.h"

namespace tiermem::tools {
namespace {

constexpr Bytes kPage = 4096;

struct BounceOptions {
  std::string dir = ".";
  std::string chunk = "9MiB";
  int moves = 64;  // lone moves per direction per round
  int rounds = 3;
  int busy_threads = 0;
  // Bounce configurations compared in turn each round: "SLOTSxBYTES" with an optional
  // "/pool" (CopyRequest::inline_work off: the NVMe tier checksums the pieces where it does for
  // any copy — its I/O thread, or its worker pool when it has one — not the bounce's threads).
  std::string configs = "session";
  bool json = false;
};

// Registers the staging tier's slabs with the NVMe tier, as the session's pinner does.
class NvmePinner final : public HostPinner {
 public:
  explicit NvmePinner(NvmeTier* nvme) : nvme_(nvme) {}
  Status Register(void* addr, Bytes bytes) override {
    Status s = nvme_->RegisterHostMemory(addr, bytes);
    return s.code() == StatusCode::kUnavailable ? OkStatus() : s;
  }
  void Unregister(void* addr) override { nvme_->UnregisterHostMemory(addr).IgnoreError(); }

 private:
  NvmeTier* nvme_;
};

// Threads that keep the cores busy with arithmetic until stopped.
class Busy {
 public:
  explicit Busy(int n) {
    for (int i = 0; i < n; ++i) {
      threads_.emplace_back([this, i] {
        volatile double sink = 0;
        double x = 1.0 + i;
        while (!stop_.load(std::memory_order_relaxed)) {
          for (int k = 0; k < 100000; ++k) x = x * 1.0000001 + 1e-9;
          sink = x;
        }
        (void)sink;
      });
    }
  }
  ~Busy() {
    stop_ = true;
    for (auto& t : threads_) t.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0 : n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

struct Rates {
  double lone_write = 0, lone_read = 0, stream_write = 0, stream_read = 0;  // bytes/s
};

int Run(const BounceOptions& o) {
  auto fail = [](const Status& s) {
    std::cerr << "tiermem bench bounce: " << s.ToString() << "\n";
    return 1;
  };
  auto chunk_or = ParseBytes(o.chunk);
  if (!chunk_or.ok()) return fail(chunk_or.status());
  const Bytes chunk = AlignUp(*chunk_or, kPage);
  if (chunk < 4 * kMiB || o.moves < 1 || o.rounds < 1 || o.busy_threads < 0) {
    return fail(
        InvalidArgumentError("--chunk >= 4MiB, --moves and --rounds >= 1, --busy-threads >= 0"));
  }
  const Bytes total = chunk * static_cast<Bytes>(o.moves);

  NvmeTierConfig nc;
  nc.dir = o.dir;
  nc.capacity = 2 * AlignUp(total, nc.block_bytes);  // the lone moves' regions + the stream's
  auto nvme_or = OpenNvmeTier(nc);
  if (!nvme_or.ok()) return fail(nvme_or.status());
  std::unique_ptr<NvmeTier> nvme = std::move(nvme_or).value();
  NvmePinner pinner(nvme.get());
  // The session's staging tier: prefetch_depth (4) + 2 chunk slots, prefaulted and registered.
  HostTierConfig sc;
  sc.capacity = 6 * chunk;
  sc.slot_bytes = chunk;
  sc.min_class_bytes = kPage;
  sc.slab_bytes = 6 * chunk;
  sc.prefault_bytes = sc.capacity;
  sc.pinner = &pinner;
  auto staging_or = NewHostTier(sc);
  if (!staging_or.ok()) return fail(staging_or.status());
  std::unique_ptr<Tier> staging = std::move(staging_or).value();
  std::unique_ptr<Tier> device = NewSimDevice({.capacity = AlignUp(total, 256)});
  // The bounce configurations, each its own Mover over the same staging tier.
  struct Config {
    std::string name;
    std::unique_ptr<Mover> mover;
  };
  std::vector<Config> configs;
  for (size_t b = 0; b <= o.configs.size();) {
    size_t e = o.configs.find(',', b);
    if (e == std::string::npos) e = o.configs.size();
    std::string name = o.configs.substr(b, e - b);
    b = e + 1;
    if (name.empty()) continue;
    MoverConfig mc = BounceMoverConfig(chunk, nc.piece_bytes, nc.queue_depth);
    std::string spec = name;
    if (spec.size() > 5 && spec.substr(spec.size() - 5) == "/pool") {
      mc.inline_work = false;
      spec.resize(spec.size() - 5);
    }
    if (spec != "session") {
      const size_t x = spec.find('x');
      auto bytes = x == std::string::npos ? StatusOr<Bytes>(InvalidArgumentError("no 'x'"))
                                          : ParseBytes(spec.substr(x + 1));
      if (!bytes.ok() || x == 0 || (mc.staging_slots = std::atoi(spec.c_str())) < 1) {
        return fail(InvalidArgumentError("--configs: '" + name +
                                         "' is not session or SLOTSxBYTES, with or without /pool"));
      }
      mc.staging_slot_bytes = *bytes;
    }
    configs.push_back({name, NewMover(mc, staging.get(), nullptr)});
  }
  if (configs.empty()) return fail(InvalidArgumentError("--configs names no configuration"));

  std::vector<Region> dev(o.moves), disk(o.moves);
  for (int i = 0; i < o.moves; ++i) {
    auto d = device->Allocate(chunk);
    auto n = nvme->Allocate(chunk);
    if (!d.ok()) return fail(d.status());
    if (!n.ok()) return fail(n.status());
    dev[i] = *d;
    disk[i] = *n;
    auto* p = static_cast<uint64_t*>(d->addr);
    for (Bytes j = 0; j < chunk / 8; ++j) p[j] = (j + 1) * 0x9E3779B97F4A7C15ull ^ i;
  }
  // Streaming baseline buffers: two registered huge-page 64 MiB buffers.
  const Bytes sbuf = std::min<Bytes>(total, 64 * kMiB);
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  std::unique_ptr<char, Free> bufs[2];
  for (auto& b : bufs) {
    b.reset(static_cast<char*>(std::aligned_alloc(2 * kMiB, AlignUp(sbuf, 2 * kMiB))));
    if (!b) return fail(ResourceExhaustedError("cannot allocate the streaming buffers"));
    (void)::madvise(b.get(), AlignUp(sbuf, 2 * kMiB), MADV_HUGEPAGE);
    std::memset(b.get(), 0x5a, sbuf);
    Status s = pinner.Register(b.get(), sbuf);
    if (!s.ok()) return fail(s);
  }
  auto region_or = nvme->Allocate(AlignUp(total, nc.block_bytes));
  const bool have_stream_region = region_or.ok();

  auto lone = [&](Mover* mover, bool to_nvme) -> StatusOr<double> {
    const uint64_t t0 = Clock::Real()->NowNs();
    for (int i = 0; i < o.moves; ++i) {
      MoveRequest r;
      r.src = to_nvme ? Endpoint{device.get(), dev[i], 0} : Endpoint{nvme.get(), disk[i], 0};
      r.dst = to_nvme ? Endpoint{nvme.get(), disk[i], 0} : Endpoint{device.get(), dev[i], 0};
      r.bytes = chunk;
      TIERMEM_RETURN_IF_ERROR(mover->Move(r)->Wait());
    }
    return static_cast<double>(total) / ((Clock::Real()->NowNs() - t0) / 1e9);
  };
  auto stream = [&](CopyDir dir) -> StatusOr<double> {
    if (!have_stream_region) return region_or.status();
    const uint64_t t0 = Clock::Real()->NowNs();
    std::shared_ptr<Completion> inflight[2];
    int k = 0;
    for (Bytes off = 0; off < total; off += sbuf, ++k) {
      if (inflight[k % 2]) TIERMEM_RETURN_IF_ERROR(inflight[k % 2]->Wait());
      inflight[k % 2] =
          nvme->Copy({*region_or, off, bufs[k % 2].get(), std::min(sbuf, total - off), dir});
    }
    for (auto& c : inflight) {
      if (c) TIERMEM_RETURN_IF_ERROR(c->Wait());
    }
    return static_cast<double>(total) / ((Clock::Real()->NowNs() - t0) / 1e9);
  };

  // rounds[c][r]: configuration c in round r; each round runs streaming write, every
  // configuration's lone writes and reads, streaming read.
  std::vector<std::vector<Rates>> rounds(configs.size());
  {
    Busy busy(o.busy_threads);
    for (int round = 0; round < o.rounds; ++round) {
      auto sw = stream(CopyDir::kToTier);
      if (!sw.ok()) return fail(sw.status());
      for (size_t c = 0; c < configs.size(); ++c) {
        // Rotate which configuration goes first, so drift in the disk hits each alike.
        const size_t k = (c + round) % configs.size();
        auto lw = lone(configs[k].mover.get(), true);
        if (!lw.ok()) return fail(lw.status());
        auto lr = lone(configs[k].mover.get(), false);
        if (!lr.ok()) return fail(lr.status());
        rounds[k].push_back({*lw, *lr, *sw, 0});
      }
      auto sr = stream(CopyDir::kFromTier);
      if (!sr.ok()) return fail(sr.status());
      for (auto& per : rounds) per.back().stream_read = *sr;
      if (!o.json) {
        std::printf("round %d: streaming write %.2f read %.2f GB/s |", round + 1, *sw / 1e9,
                    *sr / 1e9);
        for (size_t c = 0; c < configs.size(); ++c) {
          std::printf(" %s lone write %.2f read %.2f", configs[c].name.c_str(),
                      rounds[c].back().lone_write / 1e9, rounds[c].back().lone_read / 1e9);
        }
        std::printf("\n");
        std::fflush(stdout);
      }
    }
  }
  // The data made the round trip intact (the tier verified every block on the way back too).
  for (int i = 0; i < o.moves; ++i) {
    auto* p = static_cast<const uint64_t*>(dev[i].addr);
    for (Bytes j = 0; j < chunk / 8; ++j) {
      if (p[j] != ((j + 1) * 0x9E3779B97F4A7C15ull ^ i)) {
        return fail(DataLossError("chunk " + std::to_string(i) + " changed on its round trips"));
      }
    }
  }
  nlohmann::json results = nlohmann::json::array();
  if (!o.json) {
    std::printf(
        "bounce bench: %s, chunk %s, %d lone moves per direction, %d busy threads, "
        "%d rounds (median; ratios paired per round)\n",
        std::string(nvme->io_backend_name()).c_str(), FormatBytes(chunk).c_str(), o.moves,
        o.busy_threads, o.rounds);
    std::printf("  %-16s %12s %12s %14s %14s %12s %12s\n", "config", "lone write", "lone read",
                "stream write", "stream read", "write ratio", "read ratio");
  }
  for (size_t c = 0; c < configs.size(); ++c) {
    std::vector<double> lw, lr, sw, sr, pw, pr;
    for (const Rates& r : rounds[c]) {
      lw.push_back(r.lone_write);
      lr.push_back(r.lone_read);
      sw.push_back(r.stream_write);
      sr.push_back(r.stream_read);
      pw.push_back(r.lone_write / r.stream_write);
      pr.push_back(r.lone_read / r.stream_read);
    }
    results.push_back({{"config", configs[c].name},
                       {"lone_write_bytes_per_s", lw},
                       {"lone_read_bytes_per_s", lr},
                       {"stream_write_bytes_per_s", sw},
                       {"stream_read_bytes_per_s", sr},
                       {"paired_ratio", {{"write", Median(pw)}, {"read", Median(pr)}}}});
    if (!o.json) {
      std::printf("  %-16s %12.2f %12.2f %14.2f %14.2f %12.3f %12.3f\n", configs[c].name.c_str(),
                  Median(lw) / 1e9, Median(lr) / 1e9, Median(sw) / 1e9, Median(sr) / 1e9,
                  Median(pw), Median(pr));
    }
  }
  if (o.json) {
    nlohmann::json j = {{"bench", "bounce"},    {"engine", std::string(nvme->io_backend_name())},
                        {"chunk_bytes", chunk}, {"moves", o.moves},
                        {"rounds", o.rounds},   {"busy_threads", o.busy_threads},
                        {"configs", results}};
    std::cout << j.dump() << "\n";
  }
  for (auto& b : bufs) pinner.Unregister(b.get());
  return 0;
}

}  // namespace

void RegisterBenchBounce(CLI::App& bench) {
  auto opts = std::make_shared<BounceOptions>();
  CLI::App* cmd = bench.add_subcommand(
      "bounce", "lone device<->NVMe moves through the staging bounce vs streaming host<->NVMe");
  cmd->add_option("--dir", opts->dir, "directory for the NVMe tier's file")->capture_default_str();
  cmd->add_option("--chunk", opts->chunk, "bytes per move (a chunk)")->capture_default_str();
  cmd->add_option("--moves", opts->moves, "lone moves per direction per round")
      ->capture_default_str();
  cmd->add_option("--rounds", opts->rounds, "alternating rounds; medians are reported")
      ->capture_default_str();
  cmd->add_option("--busy-threads", opts->busy_threads,
                  "threads spinning on arithmetic meanwhile (torch's compute)")
      ->capture_default_str();
  cmd->add_option("--configs", opts->configs,
                  "bounce configurations compared in turn: session (what a session uses) or "
                  "SLOTSxBYTES (e.g. 4x2MiB), either with /pool to leave the checksums to the "
                  "NVMe tier (its I/O thread) instead of the bounce's threads; comma-separated")
      ->capture_default_str();
  cmd->add_flag("--json", opts->json, "print one JSON object");
  cmd->callback([opts] {
    const int rc = Run(*opts);
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace tiermem::tools
