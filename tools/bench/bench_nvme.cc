// `tiermem bench nvme`: the NVMe tier's sequential write-then-read throughput and CPU cost
// against fio's (io_uring, O_DIRECT) with the same file system, size, block size, queue depth
// and buffer advantages, alternating in one run (ours first in odd rounds, fio first in even
// ones). Prints each round's rates, ratio ours/fio and CPU seconds per GB moved, then the
// medians; --json prints one JSON object instead.
//
// The fair fio: registered buffers and files (`--fixedbufs --registerfiles`) and huge-page
// buffers (`--iomem=mmaphuge`), like the tier's. With `--fio-iomem auto` (the default) the
// bench leases the huge pages for the run (HugePageLease: it raises vm.nr_hugepages and mounts
// a hugetlbfs as root when the machine lacks them, and undoes that at exit, also on SIGINT or
// SIGTERM); where it cannot, fio runs on malloc buffers and the report says so, and why.
//
// Ours: a fresh tier per round (capacity = size, piece = block, depth = depth) and one region
// of `size`; the host side is `--host-buffers` bytes (default depth x block, fio's buffer
// footprint) of registered huge-page memory (from the lease, else transparent huge pages),
// cut into block-sized slots, each a copy of one block; every slot's copy is in flight and
// each is resubmitted with the next block as soon as it completes (oldest first), so the
// tier's queue stays `depth` deep, as fio resubmits each buffer on its completion. (Copies of
// several pieces each, two at a time, let the queue fall to half its depth between copies:
// reads measured 0.80x of fio that way where the same tier read at 1.01-1.04x with its queue
// kept full, 2026-12-07 on the VM.) The footprint matters on a VM: reads into 2 x 64 MiB ran at
// about 0.6x of reads into 2 x 4 MiB through the same tier in the same minutes (the hypervisor's
// copy into guest memory; docs/benchmarks.md), so the bench gives ours fio's footprint. The tier
// checksums every 4 KiB block (CRC32C) on write and verifies on read; fio does not.
//
// CPU cost: ours is the process's user + system time over each pass (getrusage: the caller,
// the I/O thread and any checksum workers); fio's is the usr_cpu + sys_cpu it reports over its
// job (its own getrusage, not its start-up). Both per GB moved.
//
// `--lone CHUNK`: a lone chunk's read, as a host-mode session fetches an NVMe-homed chunk into
// host chunk memory. Ours: after the same write (and streaming read) of `size`, CHUNK-sized
// copies read one at a time, each waited for, into one registered huge-page host buffer of
// CHUNK. fio: the same file written as above, then read with `--bs=CHUNK --iodepth=1` (one
// request at a time). The round's first runner alternates; each round's ratio is ours/fio,
// and the median of those is the result.
#include <fcntl.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "base/clock.h"
#include "base/units.h"
#include "tiers/nvme/nvme_tier.h"
#include "tools/bench/hugepage_lease.h"
#include "tools/commands.h"

extern char** environ;

namespace tiermem::tools {
namespace {

constexpr Bytes kHugePage = 2 * kMiB;

struct BenchNvmeOptions {
  std::string file;
  std::string size = "4GiB";
  std::string block = "1MiB";
  int depth = 8;
  int rounds = 3;
  std::string engine = "auto";
  std::string fio_iomem = "auto";
  std::string host_buffers;  // ours' host buffer bytes (empty: depth x block, fio's)
  int checksum_threads = 0;  // the tier's checksum_threads (0: on its I/O threads)
  std::string lone;          // a chunk size: the lone-read mode (empty: streaming only)
  std::string read_request;  // the tier's read_request_bytes (empty: its default)
  bool json = false;
};

// The parsed options both modes share.
struct Setup {
  std::string dir;  // the tier's directory: --file's
  Bytes size = 0, block = 0, host_buffers = 0, lone = 0;
  NvmeIoBackend engine = NvmeIoBackend::kAuto;
  std::optional<Bytes> read_request;
};

double ProcessCpuSeconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_utime.tv_usec / 1e6 + u.ru_stime.tv_sec +
         u.ru_stime.tv_usec / 1e6;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0 : n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// Host memory for the tier's copies: hugetlb pages when `hugetlb`, else 2 MiB-aligned with
// MADV_HUGEPAGE (transparent huge pages, as the host tier's slabs). Faulted in and filled.
class HostBuffer {
 public:
  static StatusOr<std::unique_ptr<HostBuffer>> Map(Bytes bytes, bool hugetlb) {
    std::unique_ptr<HostBuffer> b(new HostBuffer);
    b->mapped_ = AlignUp(bytes, kHugePage);
    b->bytes_ = bytes;
    if (hugetlb) {
      void* p = ::mmap(nullptr, b->mapped_, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
      if (p != MAP_FAILED) {
        b->base_ = static_cast<char*>(p);
        b->kind_ = "hugetlb";
      }
    }
    if (b->base_ == nullptr) {
      // Over-map by a huge page and trim to 2 MiB alignment.
      void* p = ::mmap(nullptr, b->mapped_ + kHugePage, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) return ErrnoToStatus(errno, "bench: mapping host buffers");
      char* raw = static_cast<char*>(p);
      char* aligned = reinterpret_cast<char*>(AlignUp(reinterpret_cast<uintptr_t>(raw), kHugePage));
      if (aligned > raw) ::munmap(raw, aligned - raw);
      ::munmap(aligned + b->mapped_, raw + b->mapped_ + kHugePage - (aligned + b->mapped_));
      b->base_ = aligned;
      (void)::madvise(b->base_, b->mapped_, MADV_HUGEPAGE);
    }
    for (Bytes j = 0; j + 8 <= b->mapped_; j += 8) {
      const uint64_t v = (j + 1) * 0x9E3779B97F4A7C15ull;
      std::memcpy(b->base_ + j, &v, 8);
    }
    if (b->kind_.empty()) b->kind_ = DescribeThp(b->base_, b->mapped_);
    return b;
  }
  ~HostBuffer() { ::munmap(base_, mapped_); }
  char* data() const { return base_; }
  Bytes bytes() const { return bytes_; }
  const std::string& kind() const { return kind_; }  // "hugetlb", "THP 100%", ...

 private:
  HostBuffer() = default;
  // How much of the mapping at `addr` transparent huge pages back (from /proc/self/smaps).
  static std::string DescribeThp(const char* addr, Bytes bytes) {
    std::ifstream f("/proc/self/smaps");
    std::string line;
    bool inside = false;
    const auto a = reinterpret_cast<uintptr_t>(addr);
    while (std::getline(f, line)) {
      unsigned long lo, hi;
      if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2) {
        inside = lo <= a && a < hi;
        continue;
      }
      unsigned long kib;
      if (inside && std::sscanf(line.c_str(), "AnonHugePages: %lu kB", &kib) == 1) {
        return "THP " + std::to_string(static_cast<int>(100.0 * kib * kKiB / bytes)) + "%";
      }
    }
    return "THP ?";
  }

  char* base_ = nullptr;
  Bytes mapped_ = 0, bytes_ = 0;
  std::string kind_;
};

struct OursResult {
  double write_bps = 0, read_bps = 0;      // bytes per second
  double write_cpu_s = 0, read_cpu_s = 0;  // process CPU seconds over each pass
  double lone_read_bps = 0;                // --lone: CHUNK-sized reads one at a time
  std::string engine, buffers;             // the tier's name; the host buffers' kind
};

// Ours' host buffers in block-sized slots: host_buffers / block, at least two.
size_t Slots(const Setup& s) {
  return static_cast<size_t>(std::max<Bytes>(2, s.host_buffers / s.block));
}

StatusOr<std::unique_ptr<NvmeTier>> OpenTier(const Setup& s, int depth, int checksum_threads) {
  NvmeTierConfig config;
  if (s.read_request) config.read_request_bytes = *s.read_request;
  config.dir = s.dir;
  config.capacity = s.size;
  config.io_backend = s.engine;
  config.queue_depth = depth;
  config.piece_bytes = s.block;
  config.bounce_buffers = 2;  // the bench's copies are aligned: bounce buffers stay idle
  config.checksum_threads = checksum_threads;
  return OpenNvmeTier(config);
}

// Writes then reads `size` through a fresh tier (and, with s.lone, reads it again a chunk at
// a time). `hugetlb`: the host buffers come from the hugetlb pool.
StatusOr<OursResult> RunOurs(const Setup& s, int depth, int checksum_threads, bool hugetlb) {
  TIERMEM_ASSIGN_OR_RETURN(std::unique_ptr<NvmeTier> tier, OpenTier(s, depth, checksum_threads));
  TIERMEM_ASSIGN_OR_RETURN(Region region, tier->Allocate(s.size));
  OursResult out;
  out.engine = tier->name();
  // Block-sized slots of the host buffers, every one's copy in flight (Slots).
  const Bytes copy = s.block;
  const size_t slots = Slots(s);
  TIERMEM_ASSIGN_OR_RETURN(std::unique_ptr<HostBuffer> buf, HostBuffer::Map(slots * copy, hugetlb));
  out.buffers = buf->kind();
  Status reg = tier->RegisterHostMemory(buf->data(), buf->bytes());
  if (!reg.ok() && reg.code() != StatusCode::kUnavailable) return reg;

  auto pass = [&](CopyDir dir, double* cpu_s) -> StatusOr<double> {
    const double cpu0 = ProcessCpuSeconds();
    const uint64_t t0 = Clock::Real()->NowNs();
    std::vector<std::shared_ptr<Completion>> inflight(slots);
    size_t k = 0;
    for (Bytes off = 0; off < s.size; off += copy, ++k) {
      std::shared_ptr<Completion>& slot = inflight[k % slots];  // the oldest copy's
      if (slot) TIERMEM_RETURN_IF_ERROR(slot->Wait());
      slot = tier->Copy(
          {region, off, buf->data() + (k % slots) * copy, std::min(copy, s.size - off), dir});
    }
    for (auto& c : inflight) {
      if (c) TIERMEM_RETURN_IF_ERROR(c->Wait());
    }
    const double secs = (Clock::Real()->NowNs() - t0) / 1e9;
    *cpu_s = ProcessCpuSeconds() - cpu0;
    return static_cast<double>(s.size) / secs;
  };
  TIERMEM_ASSIGN_OR_RETURN(out.write_bps, pass(CopyDir::kToTier, &out.write_cpu_s));
  TIERMEM_ASSIGN_OR_RETURN(out.read_bps, pass(CopyDir::kFromTier, &out.read_cpu_s));
  if (reg.ok()) (void)tier->UnregisterHostMemory(buf->data());
  if (s.lone > 0) {
    // Host chunk memory as a session's: huge-page backed, faulted in, registered.
    TIERMEM_ASSIGN_OR_RETURN(std::unique_ptr<HostBuffer> chunk, HostBuffer::Map(s.lone, hugetlb));
    Status lreg = tier->RegisterHostMemory(chunk->data(), s.lone);
    if (!lreg.ok() && lreg.code() != StatusCode::kUnavailable) return lreg;
    const uint64_t t0 = Clock::Real()->NowNs();
    for (Bytes off = 0; off < s.size; off += s.lone) {
      TIERMEM_RETURN_IF_ERROR(
          tier->Copy({region, off, chunk->data(), s.lone, CopyDir::kFromTier})->Wait());
    }
    out.lone_read_bps = static_cast<double>(s.size) / ((Clock::Real()->NowNs() - t0) / 1e9);
    if (lreg.ok()) (void)tier->UnregisterHostMemory(chunk->data());
  }
  return out;
}

// Runs `argv` (stdout and stderr captured together) and returns its output; kUnavailable when
// it cannot start or exits non-zero. A lease's signal handler stops it if the bench is ended.
StatusOr<std::string> RunChild(const std::vector<std::string>& argv) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return ErrnoToStatus(errno, "bench: pipe");
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDERR_FILENO);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  const int rc = ::posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(fds[1]);
  if (rc != 0) {
    ::close(fds[0]);
    return UnavailableError("bench: cannot run " + argv[0] + ": " + std::strerror(rc));
  }
  HugePageLease::SetChild(pid);
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fds[0], buf, sizeof(buf));
    if (n > 0) {
      out.append(buf, n);
    } else if (n == 0 || errno != EINTR) {
      break;
    }
  }
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  HugePageLease::SetChild(0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::string cmd;
    for (const std::string& a : argv) cmd += a + " ";
    return UnavailableError("bench: " + argv[0] + " failed (" + cmd + "):\n" + out);
  }
  return out;
}

struct FioResult {
  double bps = 0;    // bytes per second
  double cpu_s = 0;  // usr + sys CPU seconds over the job, as fio reports them
};

// fio's buffers: "malloc", "mmaphuge" (anonymous huge pages) or "mmaphuge:FILE".
StatusOr<FioResult> RunFio(const std::string& file, const char* rw, Bytes size, Bytes block,
                           int depth, const std::string& iomem) {
  std::vector<std::string> argv = {"fio",
                                   "--name=tiermem-bench",
                                   "--filename=" + file,
                                   "--ioengine=io_uring",
                                   "--direct=1",
                                   "--fixedbufs",
                                   "--registerfiles",
                                   "--iomem=" + iomem,
                                   std::string("--rw=") + rw,
                                   "--bs=" + std::to_string(block),
                                   "--iodepth=" + std::to_string(depth),
                                   "--size=" + std::to_string(size),
                                   "--output-format=json"};
  TIERMEM_ASSIGN_OR_RETURN(std::string out, RunChild(argv));
  const size_t brace = out.find('{');  // fio may print notes before the JSON
  auto doc = nlohmann::json::parse(brace == std::string::npos ? out : out.substr(brace), nullptr,
                                   /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.contains("jobs") || doc["jobs"].empty()) {
    return InternalError("bench: cannot parse fio's JSON output:\n" + out);
  }
  const auto& job = doc["jobs"][0];
  FioResult r;
  r.bps = job[std::string(rw) == "write" ? "write" : "read"].value("bw_bytes", 0.0);
  r.cpu_s = (job.value("usr_cpu", 0.0) + job.value("sys_cpu", 0.0)) / 100.0 *
            job.value("job_runtime", 0.0) / 1000.0;
  return r;
}

// fio's --iomem and ours' huge pages for a run: `fio_bytes` of fio buffers, `ours_bytes` of
// ours. `mode` auto leases the pages (setting them up where it may); other modes are fio's own
// and give ours transparent huge pages.
struct Buffers {
  std::unique_ptr<HugePageLease> lease;
  std::string iomem;          // fio's --iomem
  bool ours_hugetlb = false;  // ours' host buffers come from the hugetlb pool
  std::string note;           // what fio got and why
};
Buffers LeaseBuffers(const std::string& mode, Bytes fio_bytes, Bytes ours_bytes) {
  Buffers b;
  if (mode != "auto") {
    b.iomem = mode;
    b.note = "fio --iomem=" + mode + " as asked; ours on transparent huge pages";
    return b;
  }
  // fio rounds its buffers (depth x block + a page) up to whole huge pages.
  b.lease = HugePageLease::Acquire(AlignUp(fio_bytes + 4096, kHugePage) + kHugePage +
                                   AlignUp(ours_bytes, kHugePage));
  if (!b.lease->ok()) {
    b.iomem = "malloc";
    b.note = b.lease->Describe() + "; fio runs on malloc buffers (not the fair baseline)";
    return b;
  }
  b.iomem = b.lease->mount().empty()
                ? "mmaphuge"
                : "mmaphuge:" + b.lease->mount() + "/tiermem-fio-" + std::to_string(::getpid());
  b.ours_hugetlb = true;
  b.note = b.lease->Describe();
  return b;
}

// fio writes `file` then reads it (`read_block` at `read_depth`); the file is deleted after.
StatusOr<std::pair<FioResult, FioResult>> RunFioPair(const std::string& file, const Setup& s,
                                                     int depth, Bytes read_block, int read_depth,
                                                     const std::string& iomem) {
  HugePageLease::SetScratchFile(file);
  auto w = RunFio(file, "write", s.size, s.block, depth, iomem);
  StatusOr<FioResult> r = w.ok() ? RunFio(file, "read", s.size, read_block, read_depth, iomem)
                                 : StatusOr<FioResult>(w.status());
  ::unlink(file.c_str());
  HugePageLease::SetScratchFile("");
  const size_t colon = iomem.find(':');
  if (colon != std::string::npos) ::unlink(iomem.substr(colon + 1).c_str());  // fio's, if left
  if (!w.ok()) return w.status();
  if (!r.ok()) return r.status();
  return std::make_pair(*w, *r);
}

int Fail(const Status& s) {
  std::cerr << "tiermem bench nvme: " << s.ToString() << "\n";
  return 1;
}

// --lone: ours lone reads against fio `--bs=lone --iodepth=1`, alternating who goes first.
int RunLone(const BenchNvmeOptions& o, const Setup& s) {
  Buffers bufs =
      LeaseBuffers(o.fio_iomem, std::max(s.block * o.depth, s.lone), s.lone + Slots(s) * s.block);
  if (!o.json) std::printf("fio: --iomem=%s; %s\n", bufs.iomem.c_str(), bufs.note.c_str());
  std::fflush(stdout);
  std::vector<double> ours, stream, fio, ratio;
  std::string engine_name;
  for (int round = 0; round < o.rounds; ++round) {
    const bool fio_first = round % 2 == 1;
    StatusOr<std::pair<FioResult, FioResult>> f = InternalError("fio did not run");
    auto run_fio = [&] { f = RunFioPair(o.file, s, o.depth, s.lone, 1, bufs.iomem); };
    if (fio_first) run_fio();
    auto t = RunOurs(s, o.depth, o.checksum_threads, bufs.ours_hugetlb);
    if (!fio_first) run_fio();
    if (!t.ok()) return Fail(t.status());
    if (!f.ok()) return Fail(f.status());
    engine_name = t->engine;
    ours.push_back(t->lone_read_bps);
    stream.push_back(t->read_bps);
    fio.push_back(f->second.bps);
    ratio.push_back(fio.back() > 0 ? ours.back() / fio.back() : 0.0);
    if (!o.json) {
      std::printf(
          "round %d (%s first): ours lone read %.2f GB/s (streaming %.2f) | fio "
          "--bs=%s --iodepth=1 read %.2f GB/s | ours/fio %.3f\n",
          round + 1, fio_first ? "fio" : "ours", ours.back() / 1e9, stream.back() / 1e9,
          FormatBytes(s.lone).c_str(), fio.back() / 1e9, ratio.back());
      std::fflush(stdout);
    }
  }
  const Bytes request = std::max(s.block, s.read_request.value_or(0));
  if (o.json) {
    nlohmann::json j = {
        {"bench", "nvme-lone"},
        {"engine", engine_name},
        {"dir", s.dir},
        {"size_bytes", s.size},
        {"lone_bytes", s.lone},
        {"block_bytes", s.block},
        {"read_request_bytes", request},
        {"depth", o.depth},
        {"rounds", o.rounds},
        {"fio_flags", "--rw=read --iodepth=1 --fixedbufs --registerfiles --iomem=" + bufs.iomem},
        {"hugepages", bufs.note},
        {"ours_lone_read_bytes_per_s", ours},
        {"ours_stream_read_bytes_per_s", stream},
        {"fio_lone_read_bytes_per_s", fio},
        {"paired_ratio", ratio},
        {"median_paired_ratio", Median(ratio)}};
    std::cout << j.dump() << "\n";
    return 0;
  }
  std::printf(
      "nvme lone-read bench: %s, %s read as %s copies one at a time (tier: piece %s, read "
      "requests %s, depth %d), %d rounds; fio --bs=%s --iodepth=1 --fixedbufs --registerfiles "
      "--iomem=%s\n",
      engine_name.c_str(), FormatBytes(s.size).c_str(), FormatBytes(s.lone).c_str(),
      FormatBytes(s.block).c_str(), FormatBytes(request).c_str(), o.depth, o.rounds,
      FormatBytes(s.lone).c_str(), bufs.iomem.c_str());
  std::printf("  ours lone %.2f GB/s, fio %.2f GB/s (medians); ours/fio per round:",
              Median(ours) / 1e9, Median(fio) / 1e9);
  for (double x : ratio) std::printf(" %.3f", x);
  std::printf("; median %.3f\n", Median(ratio));
  return 0;
}

// Per-round series of the streaming mode, one per side and direction.
struct Series {
  std::vector<double> bps, cpu_s_per_gb;
  void Add(double bps_value, double cpu_s, Bytes bytes) {
    bps.push_back(bps_value);
    cpu_s_per_gb.push_back(cpu_s / (static_cast<double>(bytes) / 1e9));
  }
  nlohmann::json Json() const { return {{"bytes_per_s", bps}, {"cpu_s_per_gb", cpu_s_per_gb}}; }
};

std::vector<double> Ratios(const Series& ours, const Series& fio) {
  std::vector<double> r;
  for (size_t i = 0; i < ours.bps.size(); ++i) {
    r.push_back(fio.bps[i] > 0 ? ours.bps[i] / fio.bps[i] : 0.0);
  }
  return r;
}

void PrintSummary(const BenchNvmeOptions& o, const Setup& s, const OursResult& last,
                  const Buffers& bufs, const Series (&ours)[2], const Series (&fio)[2]) {
  std::printf(
      "nvme bench: %s, %s, block %s, depth %d, %d rounds alternating (ours first in odd "
      "rounds)\n  ours: %zu copies of %s in flight from %s of registered %s host buffers, "
      "CRC32C per 4 KiB %s\n  fio:  --ioengine=io_uring --direct=1 --fixedbufs "
      "--registerfiles --iomem=%s\n",
      last.engine.c_str(), FormatBytes(s.size).c_str(), FormatBytes(s.block).c_str(), o.depth,
      o.rounds, Slots(s), FormatBytes(s.block).c_str(), FormatBytes(Slots(s) * s.block).c_str(),
      last.buffers.c_str(),
      o.checksum_threads > 0 ? ("on " + std::to_string(o.checksum_threads) + " workers").c_str()
                             : "on the I/O thread",
      bufs.iomem.c_str());
  std::printf("  %-6s %10s %10s %16s %16s\n", "", "ours GB/s", "fio GB/s", "ours/fio median",
              "CPU s/GB ours fio");
  const char* names[2] = {"write", "read"};
  for (int d = 0; d < 2; ++d) {
    std::printf("  %-6s %10.2f %10.2f %16.3f %10.3f %5.3f   (per round:", names[d],
                Median(ours[d].bps) / 1e9, Median(fio[d].bps) / 1e9,
                Median(Ratios(ours[d], fio[d])), Median(ours[d].cpu_s_per_gb),
                Median(fio[d].cpu_s_per_gb));
    for (double r : Ratios(ours[d], fio[d])) std::printf(" %.3f", r);
    std::printf(")\n");
  }
}

int RunStreaming(const BenchNvmeOptions& o, const Setup& s) {
  Buffers bufs = LeaseBuffers(o.fio_iomem, s.block * o.depth, s.host_buffers);
  if (!o.json) std::printf("fio: --iomem=%s; %s\n", bufs.iomem.c_str(), bufs.note.c_str());
  std::fflush(stdout);
  Series ours[2], fio[2];          // [0] write, [1] read
  std::vector<std::string> first;  // who ran first, per round
  OursResult last;
  for (int round = 0; round < o.rounds; ++round) {
    const bool fio_first = round % 2 == 1;
    first.push_back(fio_first ? "fio" : "ours");
    StatusOr<std::pair<FioResult, FioResult>> f = InternalError("fio did not run");
    auto run_fio = [&] { f = RunFioPair(o.file, s, o.depth, s.block, o.depth, bufs.iomem); };
    if (fio_first) run_fio();
    auto t = RunOurs(s, o.depth, o.checksum_threads, bufs.ours_hugetlb);
    if (!fio_first) run_fio();
    if (!t.ok()) return Fail(t.status());
    if (!f.ok()) return Fail(f.status());
    last = *t;
    ours[0].Add(t->write_bps, t->write_cpu_s, s.size);
    ours[1].Add(t->read_bps, t->read_cpu_s, s.size);
    fio[0].Add(f->first.bps, f->first.cpu_s, s.size);
    fio[1].Add(f->second.bps, f->second.cpu_s, s.size);
    if (!o.json) {
      std::printf(
          "round %d (%s first): write ours %.2f fio %.2f GB/s (%.3f), read ours %.2f fio %.2f "
          "GB/s (%.3f); CPU s/GB write ours %.3f fio %.3f, read ours %.3f fio %.3f\n",
          round + 1, fio_first ? "fio" : "ours", t->write_bps / 1e9, f->first.bps / 1e9,
          Ratios(ours[0], fio[0]).back(), t->read_bps / 1e9, f->second.bps / 1e9,
          Ratios(ours[1], fio[1]).back(), ours[0].cpu_s_per_gb.back(), fio[0].cpu_s_per_gb.back(),
          ours[1].cpu_s_per_gb.back(), fio[1].cpu_s_per_gb.back());
      std::fflush(stdout);
    }
  }
  if (!o.json) {
    PrintSummary(o, s, last, bufs, ours, fio);
    return 0;
  }
  nlohmann::json j = {
      {"bench", "nvme"},
      {"engine", last.engine},
      {"dir", s.dir},
      {"size_bytes", s.size},
      {"block_bytes", s.block},
      {"depth", o.depth},
      {"rounds", o.rounds},
      {"first", first},
      {"ours_host_buffers", {{"bytes", s.host_buffers}, {"kind", last.buffers}}},
      {"checksum_threads", o.checksum_threads},
      {"fio_flags", "--fixedbufs --registerfiles --iomem=" + bufs.iomem},
      {"hugepages",
       {{"note", bufs.note},
        {"leased", bufs.lease != nullptr && bufs.lease->ok()},
        {"added_pages", bufs.lease ? bufs.lease->added_pages() : 0},
        {"mounted", bufs.lease != nullptr && bufs.lease->mounted() ? bufs.lease->mount() : ""}}},
      {"ours", {{"write", ours[0].Json()}, {"read", ours[1].Json()}}},
      {"fio", {{"write", fio[0].Json()}, {"read", fio[1].Json()}}},
      {"ratio", {{"write", Ratios(ours[0], fio[0])}, {"read", Ratios(ours[1], fio[1])}}},
      {"median",
       {{"ratio_write", Median(Ratios(ours[0], fio[0]))},
        {"ratio_read", Median(Ratios(ours[1], fio[1]))},
        {"ours_write_cpu_s_per_gb", Median(ours[0].cpu_s_per_gb)},
        {"ours_read_cpu_s_per_gb", Median(ours[1].cpu_s_per_gb)},
        {"fio_write_cpu_s_per_gb", Median(fio[0].cpu_s_per_gb)},
        {"fio_read_cpu_s_per_gb", Median(fio[1].cpu_s_per_gb)}}},
  };
  std::cout << j.dump() << "\n";
  return 0;
}

StatusOr<Setup> ParseSetup(const BenchNvmeOptions& o) {
  Setup s;
  TIERMEM_ASSIGN_OR_RETURN(s.size, ParseBytes(o.size));
  TIERMEM_ASSIGN_OR_RETURN(s.block, ParseBytes(o.block));
  TIERMEM_ASSIGN_OR_RETURN(s.engine, ParseNvmeIoBackend(o.engine));
  if (s.block == 0 || s.block % 4096 != 0 || s.size % s.block != 0) {
    return InvalidArgumentError("--block must be a multiple of 4 KiB dividing --size");
  }
  if (o.depth < 1 || o.rounds < 1 || o.checksum_threads < 0) {
    return InvalidArgumentError("--depth and --rounds >= 1, --checksum-threads >= 0");
  }
  s.host_buffers = s.block * static_cast<Bytes>(o.depth);
  if (!o.host_buffers.empty()) {
    TIERMEM_ASSIGN_OR_RETURN(s.host_buffers, ParseBytes(o.host_buffers));
  }
  if (s.host_buffers < 2 * s.block) {
    return InvalidArgumentError("--host-buffers must hold two blocks at least");
  }
  const std::filesystem::path file(o.file);
  s.dir = file.has_parent_path() ? file.parent_path().string() : ".";
  if (!o.read_request.empty()) {
    TIERMEM_ASSIGN_OR_RETURN(Bytes rr, ParseBytes(o.read_request));
    s.read_request = rr;
  }
  if (!o.lone.empty()) {
    TIERMEM_ASSIGN_OR_RETURN(s.lone, ParseBytes(o.lone));
    if (s.lone == 0 || s.lone % 4096 != 0 || s.size % s.lone != 0 || s.lone > 256 * kMiB) {
      return InvalidArgumentError(
          "--lone must be a multiple of 4 KiB dividing --size, at most 256 MiB");
    }
  }
  return s;
}

int Run(const BenchNvmeOptions& o) {
  StatusOr<Setup> s = ParseSetup(o);
  if (!s.ok()) return Fail(s.status());
  return s->lone > 0 ? RunLone(o, *s) : RunStreaming(o, *s);
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
                  "fio's buffers: auto (huge pages, set up for the run as root when missing, "
                  "else malloc), or fio's malloc, mmaphuge, shmhuge")
      ->capture_default_str();
  cmd->add_option(
      "--host-buffers", opts->host_buffers,
      "bytes of host buffers the tier copies from and to, in block-sized slots (default: "
      "depth x block, fio's buffers)");
  cmd->add_option("--checksum-threads", opts->checksum_threads,
                  "the tier's checksum_threads (0: checksums on its I/O thread)")
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
