// `tiermem bench nvme`: the NVMe tier's sequential write-then-read throughput against fio's
// (io_uring, O_DIRECT) with the same directory, size, block size and queue depth, measured
// alternately in one run (ours, fio, ours, fio, ...). Prints the median of each, the ratio of
// the medians ours/fio, and the median of the per-round ratios ("paired"); --json prints one
// JSON object instead.
//
// Ours: a fresh tier per round (capacity = size, piece = block, depth = depth) and one region
// of `size`; the host side is two registered, huge-page 64 MiB buffers, used alternately
// by copies of 64 MiB with two in flight, so the engine always has work queued. The tier
// checksums every 4 KiB block (CRC32C) on write and verifies on read; fio does not.
// fio: `fio --ioengine=io_uring --direct=1 --rw=write|read --bs --iodepth --size` on --file,
// which is deleted after each round (a fresh file each round, like our fresh tier), with the
// same buffer advantages as ours: registered buffers and files (`--fixedbufs
// --registerfiles`) and, with `--fio-iomem auto` (the default), huge-page buffers
// (`--iomem=mmaphuge`) whenever the kernel has enough free hugetlb pages for its depth x block
// of buffers (HugePages_Free in /proc/meminfo; our buffers get transparent huge pages, which
// fio cannot ask for). The report says which fio got.
//
// `--lone CHUNK`: a lone chunk's read, as a host-mode session fetches an NVMe-homed chunk into
// host chunk memory. Ours: after the same write (and streaming read) of `size`, CHUNK-sized
// copies read one at a time, each waited for, into one registered huge-page host buffer of
// CHUNK. fio: the same file written as above, then read with `--bs=CHUNK --iodepth=1` (one
// request at a time). The round's first runner alternates (ours first in odd rounds, fio in
// even ones); each round's ratio is ours/fio, and the median of those is the result.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "base/clock.h"
#include "base/units.h"
#include "tiers/nvme/nvme_tier.h"
#include "tools/commands.h"

namespace tiermem::tools {
namespace {

struct BenchNvmeOptions {
  std::string file;
  std::string size = "4GiB";
  std::string block = "1MiB";
  int depth = 8;
  int rounds = 3;
  std::string engine = "auto";
  std::string fio_iomem = "auto";
  std::string lone;          // a chunk size: the lone-read mode (empty: streaming only)
  std::string read_request;  // the tier's read_request_bytes (empty: its default)
  bool json = false;
};

struct Throughput {
  double write_bps = 0;  // bytes per second
  double read_bps = 0;
  double lone_read_bps = 0;  // --lone: CHUNK-sized reads one at a time
};

// `lone` > 0: also time reads of `lone` bytes, one at a time, into a registered buffer.
StatusOr<Throughput> RunOurs(const std::string& dir, Bytes size, Bytes block, int depth,
                             NvmeIoBackend engine, Bytes lone, std::optional<Bytes> read_request,
                             std::string* engine_name) {
  NvmeTierConfig config;
  if (read_request) config.read_request_bytes = *read_request;
  config.dir = dir;
  config.capacity = size;
  config.io_backend = engine;
  config.queue_depth = depth;
  config.piece_bytes = block;
  config.bounce_buffers = 2;  // the bench's copies are aligned: bounce buffers stay idle
  TIERMEM_ASSIGN_OR_RETURN(std::unique_ptr<NvmeTier> tier, OpenNvmeTier(config));
  *engine_name = tier->name();
  TIERMEM_ASSIGN_OR_RETURN(Region region, tier->Allocate(size));

  const Bytes chunk = std::min<Bytes>(size, 64 * kMiB);
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  std::array<std::unique_ptr<char, Free>, 2> bufs;
  for (int i = 0; i < 2; ++i) {
    // Like the host tier's slabs: 2 MiB aligned and backed by huge pages where the kernel
    // allows, so a 1 MiB piece is a few physically contiguous DMA segments; with 4 KiB pages
    // it is 256 segments and virtio-blk (max_segments 254) splits every request in two.
    bufs[i].reset(static_cast<char*>(std::aligned_alloc(2 * kMiB, AlignUp(chunk, 2 * kMiB))));
    if (!bufs[i]) return ResourceExhaustedError("bench: cannot allocate host buffers");
    (void)::madvise(bufs[i].get(), AlignUp(chunk, 2 * kMiB), MADV_HUGEPAGE);
    for (Bytes j = 0; j < chunk; j += 8) {
      const uint64_t v = (j + 1) * 0x9E3779B97F4A7C15ull ^ i;
      std::memcpy(bufs[i].get() + j, &v, std::min<Bytes>(8, chunk - j));
    }
    Status reg = tier->RegisterHostMemory(bufs[i].get(), chunk);
    if (!reg.ok() && reg.code() != StatusCode::kUnavailable) return reg;
  }

  auto pass = [&](CopyDir dir) -> StatusOr<double> {
    const uint64_t t0 = Clock::Real()->NowNs();
    std::shared_ptr<Completion> inflight[2];
    int k = 0;
    for (Bytes off = 0; off < size; off += chunk, ++k) {
      if (inflight[k % 2]) TIERMEM_RETURN_IF_ERROR(inflight[k % 2]->Wait());
      inflight[k % 2] =
          tier->Copy({region, off, bufs[k % 2].get(), std::min(chunk, size - off), dir});
    }
    for (auto& c : inflight) {
      if (c) TIERMEM_RETURN_IF_ERROR(c->Wait());
    }
    const double s = (Clock::Real()->NowNs() - t0) / 1e9;
    return static_cast<double>(size) / s;
  };
  Throughput t;
  TIERMEM_ASSIGN_OR_RETURN(t.write_bps, pass(CopyDir::kToTier));
  TIERMEM_ASSIGN_OR_RETURN(t.read_bps, pass(CopyDir::kFromTier));
  for (auto& b : bufs) (void)tier->UnregisterHostMemory(b.get());
  if (lone > 0) {
    // Host chunk memory as a session's: huge-page backed, faulted in, registered.
    const Bytes mapped = AlignUp(lone, 2 * kMiB);
    std::unique_ptr<char, Free> buf(static_cast<char*>(std::aligned_alloc(2 * kMiB, mapped)));
    if (!buf) return ResourceExhaustedError("bench: cannot allocate the lone-read buffer");
    (void)::madvise(buf.get(), mapped, MADV_HUGEPAGE);
    std::memset(buf.get(), 0, mapped);
    Status reg = tier->RegisterHostMemory(buf.get(), lone);
    if (!reg.ok() && reg.code() != StatusCode::kUnavailable) return reg;
    const uint64_t t0 = Clock::Real()->NowNs();
    for (Bytes off = 0; off < size; off += lone) {
      TIERMEM_RETURN_IF_ERROR(
          tier->Copy({region, off, buf.get(), lone, CopyDir::kFromTier})->Wait());
    }
    t.lone_read_bps = static_cast<double>(size) / ((Clock::Real()->NowNs() - t0) / 1e9);
    if (reg.ok()) (void)tier->UnregisterHostMemory(buf.get());
  }
  return t;
}

// Free hugetlb bytes (HugePages_Free x Hugepagesize), 0 when none or unknown.
Bytes FreeHugetlbBytes() {
  FILE* f = std::fopen("/proc/meminfo", "r");
  if (f == nullptr) return 0;
  char line[256];
  unsigned long long free_pages = 0, page_kib = 0;
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    std::sscanf(line, "HugePages_Free: %llu", &free_pages);
    std::sscanf(line, "Hugepagesize: %llu kB", &page_kib);
  }
  std::fclose(f);
  return static_cast<Bytes>(free_pages) * page_kib * 1024;
}

// The --iomem fio gets: "mmaphuge" when `mode` is auto and the hugetlb pool holds its
// `buffer_bytes` of buffers (block x depth).
std::string FioIomem(const std::string& mode, Bytes buffer_bytes) {
  if (mode != "auto") return mode;
  return FreeHugetlbBytes() >= buffer_bytes + 4 * kMiB ? "mmaphuge" : "malloc";
}

StatusOr<double> RunFio(const std::string& file, const char* rw, Bytes size, Bytes block, int depth,
                        const std::string& iomem) {
  const std::string cmd = "fio --name=tiermem-bench --filename='" + file +
                          "' --ioengine=io_uring --direct=1 --fixedbufs --registerfiles"
                          " --iomem=" +
                          iomem + " --rw=" + rw + " --bs=" + std::to_string(block) +
                          " --iodepth=" + std::to_string(depth) +
                          " --size=" + std::to_string(size) + " --output-format=json 2>&1";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) return ErrnoToStatus(errno, "bench: running fio");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), pipe)) > 0) out.append(buf, n);
  const int rc = ::pclose(pipe);
  if (rc != 0) return UnavailableError("bench: fio failed (" + cmd + "):\n" + out);
  const size_t brace = out.find('{');  // fio may print notes before the JSON
  auto doc = nlohmann::json::parse(brace == std::string::npos ? out : out.substr(brace), nullptr,
                                   /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.contains("jobs") || doc["jobs"].empty()) {
    return InternalError("bench: cannot parse fio's JSON output:\n" + out);
  }
  const auto& job = doc["jobs"][0][std::string(rw) == "write" ? "write" : "read"];
  return job.value("bw_bytes", 0.0);
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// --lone: ours lone reads against fio `--bs=lone --iodepth=1`, alternating who goes first.
int RunLone(const BenchNvmeOptions& o, const std::string& dir, Bytes size, Bytes block, Bytes lone,
            NvmeIoBackend engine, std::optional<Bytes> read_request) {
  auto fail = [](const Status& s) {
    std::cerr << "tiermem bench nvme: " << s.ToString() << "\n";
    return 1;
  };
  const std::string iomem =
      FioIomem(o.fio_iomem, std::max<Bytes>(block * static_cast<Bytes>(o.depth), lone));
  std::vector<double> ours, stream, fio, ratio;
  std::string engine_name;
  for (int round = 0; round < o.rounds; ++round) {
    const bool fio_first = round % 2 == 1;
    StatusOr<double> f = 0.0;
    auto run_fio = [&] {
      // Lay the file out as the streaming mode does, then read it a chunk at a time.
      f = RunFio(o.file, "write", size, block, o.depth, iomem);
      if (f.ok()) f = RunFio(o.file, "read", size, lone, 1, iomem);
      ::unlink(o.file.c_str());
    };
    if (fio_first) run_fio();
    auto t = RunOurs(dir, size, block, o.depth, engine, lone, read_request, &engine_name);
    if (!fio_first) run_fio();
    if (!t.ok()) return fail(t.status());
    if (!f.ok()) return fail(f.status());
    ours.push_back(t->lone_read_bps);
    stream.push_back(t->read_bps);
    fio.push_back(*f);
    ratio.push_back(*f > 0 ? t->lone_read_bps / *f : 0.0);
    if (!o.json) {
      std::printf(
          "round %d (%s first): ours lone read %.2f GB/s (streaming %.2f) | fio "
          "--bs=%s --iodepth=1 read %.2f GB/s | ours/fio %.3f\n",
          round + 1, fio_first ? "fio" : "ours", ours.back() / 1e9, stream.back() / 1e9,
          FormatBytes(lone).c_str(), fio.back() / 1e9, ratio.back());
      std::fflush(stdout);
    }
  }
  const double r = Median(ratio);
  if (o.json) {
    nlohmann::json j = {
        {"bench", "nvme-lone"},
        {"engine", engine_name},
        {"dir", dir},
        {"size_bytes", size},
        {"lone_bytes", lone},
        {"block_bytes", block},
        {"read_request_bytes",
         std::max(block, read_request.value_or(NvmeTierConfig{}.read_request_bytes))},
        {"depth", o.depth},
        {"rounds", o.rounds},
        {"fio_flags", "--rw=read --iodepth=1 --fixedbufs --registerfiles --iomem=" + iomem},
        {"ours_lone_read_bytes_per_s", ours},
        {"ours_stream_read_bytes_per_s", stream},
        {"fio_lone_read_bytes_per_s", fio},
        {"paired_ratio", ratio},
        {"median_paired_ratio", r},
    };
    std::cout << j.dump() << "\n";
  } else {
    const Bytes request =
        std::max(block, read_request.value_or(NvmeTierConfig{}.read_request_bytes));
    std::printf(
        "nvme lone-read bench: %s, %s read as %s copies one at a time (tier: piece %s, "
        "read requests %s, depth %d), %d rounds; fio --bs=%s --iodepth=1 --fixedbufs "
        "--registerfiles --iomem=%s%s\n",
        engine_name.c_str(), FormatBytes(size).c_str(), FormatBytes(lone).c_str(),
        FormatBytes(block).c_str(), FormatBytes(request).c_str(), o.depth, o.rounds,
        FormatBytes(lone).c_str(), iomem.c_str(),
        iomem == "malloc" ? " (no free hugetlb pages: set vm.nr_hugepages to give fio "
                            "huge-page buffers)"
                          : "");
    std::printf("  ours lone %.2f GB/s, fio %.2f GB/s (medians); ours/fio per round:",
                Median(ours) / 1e9, Median(fio) / 1e9);
    for (double x : ratio) std::printf(" %.3f", x);
    std::printf("; median %.3f\n", r);
  }
  return 0;
}

int Run(const BenchNvmeOptions& o) {
  auto fail = [](const Status& s) {
    std::cerr << "tiermem bench nvme: " << s.ToString() << "\n";
    return 1;
  };
  auto size = ParseBytes(o.size);
  if (!size.ok()) return fail(size.status());
  auto block = ParseBytes(o.block);
  if (!block.ok()) return fail(block.status());
  auto engine = ParseNvmeIoBackend(o.engine);
  if (!engine.ok()) return fail(engine.status());
  if (*block == 0 || *block % 4096 != 0 || *size % *block != 0) {
    return fail(InvalidArgumentError("--block must be a multiple of 4 KiB dividing --size"));
  }
  if (o.depth < 1 || o.rounds < 1) return fail(InvalidArgumentError("--depth and --rounds >= 1"));
  std::filesystem::path file(o.file);
  const std::string dir = file.has_parent_path() ? file.parent_path().string() : ".";
  std::optional<Bytes> read_request;
  if (!o.read_request.empty()) {
    auto rr = ParseBytes(o.read_request);
    if (!rr.ok()) return fail(rr.status());
    read_request = *rr;
  }
  if (!o.lone.empty()) {
    auto lone = ParseBytes(o.lone);
    if (!lone.ok()) return fail(lone.status());
    if (*lone == 0 || *lone % 4096 != 0 || *size % *lone != 0 || *lone > 256 * kMiB) {
      return fail(
          InvalidArgumentError("--lone must be a multiple of 4 KiB dividing --size, at "
                               "most 256 MiB"));
    }
    return RunLone(o, dir, *size, *block, *lone, *engine, read_request);
  }

  const std::string iomem = FioIomem(o.fio_iomem, *block * static_cast<Bytes>(o.depth));
  std::vector<double> ours_w, ours_r, fio_w, fio_r;
  std::string engine_name;
  for (int round = 0; round < o.rounds; ++round) {
    auto ours =
        RunOurs(dir, *size, *block, o.depth, *engine, /*lone=*/0, read_request, &engine_name);
    if (!ours.ok()) return fail(ours.status());
    ours_w.push_back(ours->write_bps);
    ours_r.push_back(ours->read_bps);
    auto fw = RunFio(o.file, "write", *size, *block, o.depth, iomem);
    auto fr = fw.ok() ? RunFio(o.file, "read", *size, *block, o.depth, iomem) : fw;
    ::unlink(o.file.c_str());
    if (!fw.ok()) return fail(fw.status());
    if (!fr.ok()) return fail(fr.status());
    fio_w.push_back(*fw);
    fio_r.push_back(*fr);
    if (!o.json) {
      std::printf("round %d: ours write %.2f read %.2f GB/s | fio write %.2f read %.2f GB/s\n",
                  round + 1, ours_w.back() / 1e9, ours_r.back() / 1e9, fio_w.back() / 1e9,
                  fio_r.back() / 1e9);
      std::fflush(stdout);
    }
  }
  const double mw = Median(ours_w), mr = Median(ours_r), fw = Median(fio_w), fr = Median(fio_r);
  // Paired: each round's ours/fio, then the median (robust to the disk's drift between rounds).
  std::vector<double> pair_w, pair_r;
  for (size_t i = 0; i < ours_w.size(); ++i) {
    pair_w.push_back(fio_w[i] > 0 ? ours_w[i] / fio_w[i] : 0.0);
    pair_r.push_back(fio_r[i] > 0 ? ours_r[i] / fio_r[i] : 0.0);
  }
  const double pw = Median(pair_w), pr = Median(pair_r);
  if (o.json) {
    nlohmann::json j = {
        {"bench", "nvme"},
        {"engine", engine_name},
        {"dir", dir},
        {"size_bytes", *size},
        {"block_bytes", *block},
        {"depth", o.depth},
        {"rounds", o.rounds},
        {"fio_flags", "--fixedbufs --registerfiles --iomem=" + iomem},
        {"ours", {{"write_bytes_per_s", ours_w}, {"read_bytes_per_s", ours_r}}},
        {"fio", {{"write_bytes_per_s", fio_w}, {"read_bytes_per_s", fio_r}}},
        {"median", {{"ours_write", mw}, {"ours_read", mr}, {"fio_write", fw}, {"fio_read", fr}}},
        {"ratio", {{"write", fw > 0 ? mw / fw : 0.0}, {"read", fr > 0 ? mr / fr : 0.0}}},
        {"paired_ratio", {{"write", pw}, {"read", pr}}},
    };
    std::cout << j.dump() << "\n";
  } else {
    const Bytes request =
        std::max(*block, read_request.value_or(NvmeTierConfig{}.read_request_bytes));
    std::printf(
        "nvme bench: %s, %s, block %s (ours: reads in %s requests), depth %d, %d rounds "
        "(median); fio with --fixedbufs --registerfiles --iomem=%s%s\n",
        engine_name.c_str(), FormatBytes(*size).c_str(), FormatBytes(*block).c_str(),
        FormatBytes(request).c_str(), o.depth, o.rounds, iomem.c_str(),
        iomem == "malloc" ? " (no free hugetlb pages: set vm.nr_hugepages to give fio "
                            "huge-page buffers)"
                          : "");
    std::printf("  %-6s %10s %10s %8s %14s\n", "", "ours GB/s", "fio GB/s", "ours/fio",
                "paired ratio");
    std::printf("  %-6s %10.2f %10.2f %8.3f %14.3f\n", "write", mw / 1e9, fw / 1e9,
                fw > 0 ? mw / fw : 0.0, pw);
    std::printf("  %-6s %10.2f %10.2f %8.3f %14.3f\n", "read", mr / 1e9, fr / 1e9,
                fr > 0 ? mr / fr : 0.0, pr);
  }
  return 0;
}

}  // namespace

void RegisterBenchNvme(CLI::App& bench) {
  auto opts = std::make_shared<BenchNvmeOptions>();
  CLI::App* cmd = bench.add_subcommand("nvme", "NVMe tier sequential write/read vs fio");
  cmd->add_option("--file", opts->file, "file for fio; the tier uses its directory")->required();
  cmd->add_option("--size", opts->size, "bytes written then read per round")->capture_default_str();
  cmd->add_option("--block", opts->block, "I/O size (the tier's piece size)")
      ->capture_default_str();
  cmd->add_option("--depth", opts->depth, "queue depth")->capture_default_str();
  cmd->add_option("--rounds", opts->rounds, "alternating rounds; medians are reported")
      ->capture_default_str();
  cmd->add_option("--engine", opts->engine, "auto, io_uring or posix")->capture_default_str();
  cmd->add_option("--fio-iomem", opts->fio_iomem,
                  "fio's buffers: auto (mmaphuge when hugetlb pages are free, else malloc), "
                  "malloc, mmaphuge, shmhuge")
      ->capture_default_str();
  cmd->add_option("--read-request", opts->read_request,
                  "the tier's read request size (read_request_bytes; default: the tier's, off; "
                  "reads use max(this, --block)), e.g. 4MiB");
  cmd->add_option("--lone", opts->lone,
                  "lone-read mode: read --size in copies of this many bytes, one at a time, "
                  "against fio --bs=LONE --iodepth=1 (e.g. 16MiB)");
  cmd->add_flag("--json", opts->json, "print one JSON object");
  cmd->callback([opts] {
    const int rc = Run(*opts);
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace tiermem::tools
