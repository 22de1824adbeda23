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

// One run: the pieces a session has (the NVMe tier, its registered staging tier, SimDevice),
// a Mover per bounce configuration, the chunks the lone moves carry and the streaming
// baseline's buffers. Members are declared in the order Setup builds them and torn down in
// reverse (the movers before the staging tier they bounce through, the tier last).
// Thread-safety: owned by the calling thread (the movers and the tier run their own).
class BounceBench {
 public:
  explicit BounceBench(const BounceOptions& o) : o_(o) {}
  ~BounceBench() {
    for (int b = 0; b < registered_; ++b) pinner_->Unregister(bufs_[b].get());
  }

  // Builds everything; kInvalidArgument for bad options or --configs.
  Status Setup() {
    TIERMEM_ASSIGN_OR_RETURN(const Bytes chunk, ParseBytes(o_.chunk));
    chunk_ = AlignUp(chunk, kPage);
    if (chunk_ < 4 * kMiB || o_.moves < 1 || o_.rounds < 1 || o_.busy_threads < 0) {
      return InvalidArgumentError(
          "--chunk >= 4MiB, --moves and --rounds >= 1, --busy-threads >= 0");
    }
    total_ = chunk_ * static_cast<Bytes>(o_.moves);
    TIERMEM_RETURN_IF_ERROR(OpenTiers());
    TIERMEM_RETURN_IF_ERROR(AddConfigs());
    TIERMEM_RETURN_IF_ERROR(FillChunks());
    return AllocateStreamBuffers();
  }

  // rounds[c][r]: configuration c in round r; each round runs the streaming write, every
  // configuration's lone writes and reads (rotating which goes first, so drift in the disk
  // hits each alike) and the streaming read, with the busy threads spinning.
  Status Measure(std::vector<std::vector<Rates>>* rounds) {
    rounds->assign(configs_.size(), {});
    Busy busy(o_.busy_threads);
    for (int round = 0; round < o_.rounds; ++round) {
      TIERMEM_ASSIGN_OR_RETURN(const double sw, Stream(CopyDir::kToTier));
      for (size_t c = 0; c < configs_.size(); ++c) {
        const size_t k = (c + round) % configs_.size();
        TIERMEM_ASSIGN_OR_RETURN(const double lw, Lone(configs_[k].mover.get(), true));
        TIERMEM_ASSIGN_OR_RETURN(const double lr, Lone(configs_[k].mover.get(), false));
        (*rounds)[k].push_back({lw, lr, sw, 0});
      }
      TIERMEM_ASSIGN_OR_RETURN(const double sr, Stream(CopyDir::kFromTier));
      for (auto& per : *rounds) per.back().stream_read = sr;
      if (!o_.json) {
        std::printf("round %d: streaming write %.2f read %.2f GB/s |", round + 1, sw / 1e9,
                    sr / 1e9);
        for (size_t c = 0; c < configs_.size(); ++c) {
          std::printf(" %s lone write %.2f read %.2f", configs_[c].name.c_str(),
                      (*rounds)[c].back().lone_write / 1e9, (*rounds)[c].back().lone_read / 1e9);
        }
        std::printf("\n");
        std::fflush(stdout);
      }
    }
    return OkStatus();
  }

  // The data made the round trip intact (the tier verified every block on the way back too).
  Status CheckRoundTrip() const {
    for (int i = 0; i < o_.moves; ++i) {
      auto* p = static_cast<const uint64_t*>(dev_[i].addr);
      for (Bytes j = 0; j < chunk_ / 8; ++j) {
        if (p[j] != Pattern(i, j)) {
          return DataLossError("chunk " + std::to_string(i) + " changed on its round trips");
        }
      }
    }
    return OkStatus();
  }

  // Per configuration: the medians of each rate and of the per-round lone/streaming ratios,
  // as a table or (--json) one JSON object.
  void Report(const std::vector<std::vector<Rates>>& rounds) const {
    nlohmann::json results = nlohmann::json::array();
    if (!o_.json) {
      std::printf(
          "bounce bench: %s, chunk %s, %d lone moves per direction, %d busy threads, "
          "%d rounds (median; ratios paired per round)\n",
          std::string(nvme_->io_backend_name()).c_str(), FormatBytes(chunk_).c_str(), o_.moves,
          o_.busy_threads, o_.rounds);
      std::printf("  %-16s %12s %12s %14s %14s %12s %12s\n", "config", "lone write", "lone read",
                  "stream write", "stream read", "write ratio", "read ratio");
    }
    for (size_t c = 0; c < configs_.size(); ++c) {
      std::vector<double> lw, lr, sw, sr, pw, pr;
      for (const Rates& r : rounds[c]) {
        lw.push_back(r.lone_write);
        lr.push_back(r.lone_read);
        sw.push_back(r.stream_write);
        sr.push_back(r.stream_read);
        pw.push_back(r.lone_write / r.stream_write);
        pr.push_back(r.lone_read / r.stream_read);
      }
      results.push_back({{"config", configs_[c].name},
                         {"lone_write_bytes_per_s", lw},
                         {"lone_read_bytes_per_s", lr},
                         {"stream_write_bytes_per_s", sw},
                         {"stream_read_bytes_per_s", sr},
                         {"paired_ratio", {{"write", Median(pw)}, {"read", Median(pr)}}}});
      if (!o_.json) {
        std::printf("  %-16s %12.2f %12.2f %14.2f %14.2f %12.3f %12.3f\n", configs_[c].name.c_str(),
                    Median(lw) / 1e9, Median(lr) / 1e9, Median(sw) / 1e9, Median(sr) / 1e9,
                    Median(pw), Median(pr));
      }
    }
    if (o_.json) {
      nlohmann::json j = {
          {"bench", "bounce"},     {"engine", std::string(nvme_->io_backend_name())},
          {"chunk_bytes", chunk_}, {"moves", o_.moves},
          {"rounds", o_.rounds},   {"busy_threads", o_.busy_threads},
          {"configs", results}};
      std::cout << j.dump() << "\n";
    }
  }

 private:
  struct Config {
    std::string name;
    std::unique_ptr<Mover> mover;
  };
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };

  // The 8 bytes at word j of lone-move chunk i.
  static uint64_t Pattern(int i, Bytes j) { return (j + 1) * 0x9E3779B97F4A7C15ull ^ i; }

  // The NVMe tier (room for the lone moves' regions and the stream's), the session's staging
  // tier (prefetch_depth (4) + 2 chunk slots, prefaulted and registered) and SimDevice.
  Status OpenTiers() {
    nc_.dir = o_.dir;
    nc_.capacity = 2 * AlignUp(total_, nc_.block_bytes);
    TIERMEM_ASSIGN_OR_RETURN(nvme_, OpenNvmeTier(nc_));
    pinner_ = std::make_unique<NvmePinner>(nvme_.get());
    HostTierConfig sc;
    sc.capacity = 6 * chunk_;
    sc.slot_bytes = chunk_;
    sc.min_class_bytes = kPage;
    sc.slab_bytes = 6 * chunk_;
    sc.prefault_bytes = sc.capacity;
    sc.pinner = pinner_.get();
    TIERMEM_ASSIGN_OR_RETURN(staging_, NewHostTier(sc));
    device_ = NewSimDevice({.capacity = AlignUp(total_, 256)});
    return OkStatus();
  }

  // The bounce configurations of --configs, each its own Mover over the same staging tier.
  Status AddConfigs() {
    for (size_t b = 0; b <= o_.configs.size();) {
      size_t e = o_.configs.find(',', b);
      if (e == std::string::npos) e = o_.configs.size();
      std::string name = o_.configs.substr(b, e - b);
      b = e + 1;
      if (name.empty()) continue;
      MoverConfig mc = BounceMoverConfig(chunk_, nc_.piece_bytes, nc_.queue_depth);
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
          return InvalidArgumentError("--configs: '" + name +
                                      "' is not session or SLOTSxBYTES, with or without /pool");
        }
        mc.staging_slot_bytes = *bytes;
      }
      configs_.push_back({name, NewMover(mc, staging_.get(), nullptr)});
    }
    if (configs_.empty()) return InvalidArgumentError("--configs names no configuration");
    return OkStatus();
  }

  // The lone moves' chunks: one on the device (filled with Pattern) and one on NVMe each.
  Status FillChunks() {
    dev_.resize(o_.moves);
    disk_.resize(o_.moves);
    for (int i = 0; i < o_.moves; ++i) {
      auto d = device_->Allocate(chunk_);
      auto n = nvme_->Allocate(chunk_);
      if (!d.ok()) return d.status();
      if (!n.ok()) return n.status();
      dev_[i] = *d;
      disk_[i] = *n;
      auto* p = static_cast<uint64_t*>(d->addr);
      for (Bytes j = 0; j < chunk_ / 8; ++j) p[j] = Pattern(i, j);
    }
    return OkStatus();
  }

  // Streaming baseline buffers: two registered huge-page 64 MiB buffers , and
  // the NVMe region they stream to (its failure is the streams' error).
  Status AllocateStreamBuffers() {
    sbuf_ = std::min<Bytes>(total_, 64 * kMiB);
    for (auto& b : bufs_) {
      b.reset(static_cast<char*>(std::aligned_alloc(2 * kMiB, AlignUp(sbuf_, 2 * kMiB))));
      if (!b) return ResourceExhaustedError("cannot allocate the streaming buffers");
      (void)::madvise(b.get(), AlignUp(sbuf_, 2 * kMiB), MADV_HUGEPAGE);
      std::memset(b.get(), 0x5a, sbuf_);
      TIERMEM_RETURN_IF_ERROR(pinner_->Register(b.get(), sbuf_));
      ++registered_;
    }
    StatusOr<Region> region = nvme_->Allocate(AlignUp(total_, nc_.block_bytes));
    stream_status_ = region.status();
    if (region.ok()) stream_region_ = *region;
    return OkStatus();
  }

  // Moves every chunk alone, each waited for before the next; bytes/s.
  StatusOr<double> Lone(Mover* mover, bool to_nvme) {
    const uint64_t t0 = Clock::Real()->NowNs();
    for (int i = 0; i < o_.moves; ++i) {
      MoveRequest r;
      r.src = to_nvme ? Endpoint{device_.get(), dev_[i], 0} : Endpoint{nvme_.get(), disk_[i], 0};
      r.dst = to_nvme ? Endpoint{nvme_.get(), disk_[i], 0} : Endpoint{device_.get(), dev_[i], 0};
      r.bytes = chunk_;
      TIERMEM_RETURN_IF_ERROR(mover->Move(r)->Wait());
    }
    return static_cast<double>(total_) / ((Clock::Real()->NowNs() - t0) / 1e9);
  }

  // Streams the same bytes between the host buffers and NVMe, two copies in flight; bytes/s.
  StatusOr<double> Stream(CopyDir dir) {
    TIERMEM_RETURN_IF_ERROR(stream_status_);
    const uint64_t t0 = Clock::Real()->NowNs();
    std::shared_ptr<Completion> inflight[2];
    int k = 0;
    for (Bytes off = 0; off < total_; off += sbuf_, ++k) {
      if (inflight[k % 2]) TIERMEM_RETURN_IF_ERROR(inflight[k % 2]->Wait());
      inflight[k % 2] = nvme_->Copy(
          {stream_region_, off, bufs_[k % 2].get(), std::min(sbuf_, total_ - off), dir});
    }
    for (auto& c : inflight) {
      if (c) TIERMEM_RETURN_IF_ERROR(c->Wait());
    }
    return static_cast<double>(total_) / ((Clock::Real()->NowNs() - t0) / 1e9);
  }

  const BounceOptions& o_;
  Bytes chunk_ = 0;  // bytes per lone move (page-aligned)
  Bytes total_ = 0;  // bytes per direction per round: chunk_ * moves
  NvmeTierConfig nc_;
  std::unique_ptr<NvmeTier> nvme_;
  std::unique_ptr<NvmePinner> pinner_;
  std::unique_ptr<Tier> staging_;
  std::unique_ptr<Tier> device_;
  std::vector<Config> configs_;
  std::vector<Region> dev_, disk_;  // per lone move: its device and NVMe regions
  Bytes sbuf_ = 0;                  // bytes per streaming copy
  std::unique_ptr<char, Free> bufs_[2];
  int registered_ = 0;  // bufs_ registered with the NVMe tier
  Status stream_status_;
  Region stream_region_;
};

int Run(const BounceOptions& o) {
  BounceBench bench(o);
  std::vector<std::vector<Rates>> rounds;
  Status s = bench.Setup();
  if (s.ok()) s = bench.Measure(&rounds);
  if (s.ok()) s = bench.CheckRoundTrip();
  if (!s.ok()) {
    std::cerr << "tiermem bench bounce: " << s.ToString() << "\n";
    return 1;
  }
  bench.Report(rounds);
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
