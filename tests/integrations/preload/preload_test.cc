// The preload shim against the fake CUDA runtime: probe programs (probe.cc) run under
// LD_PRELOAD or `tiermem run`; the tests read the fake's call log (what reached the runtime)
// and the timeline through `tiermem prof report --json` / `prof export`.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <regex>
#include <sstream>
#include <string>

#include "tests/integrations/preload/preload_support.h"

namespace tiermem::preload::testing {
namespace {

constexpr uint64_t kKiB = 1024, kMiB = 1024 * kKiB;

// The programs under test, from the environment ctest gives the test (preload_support.h):
// read in test bodies, since discovery runs this binary without that environment.
std::string Probe() { return TestProbe(12); }
std::string Cli() { return TestCli(); }
// `tiermem run` with the sanitizer runtime preloaded first: in a sanitizer build the shim
// depends on it, and every child (sh, true, ...) that gets the shim must load it first.
std::string TiermemRun() { return SanitizerPreloadEnv() + " " + Cli() + " run"; }

// Environment for a probe run: the shim, the timeline, the fake's log, no periodic flush (so
// kernel-launch intervals are cut only by memory events: deterministic).
std::string Env(const std::string& dir, const std::string& extra = "") {
  return PreloadEnv() + " TIERMEM_PRELOAD_TIMELINE=" + dir + "/t.tmt FAKE_CUDART_LOG=" + dir +
         "/calls.log TIERMEM_PRELOAD_FLUSH_MS=0 " + extra + " ";
}

std::string NormalizePointers(const std::string& line) {
  // Addresses differ between runs (ASLR); sizes, flags, streams, pools and results must not.
  static const std::regex ptr("(ptr|func)=(0x[0-9a-f]+|\\(nil\\))");
  return std::regex_replace(line, ptr, "$1=P");
}

TEST(PreloadShim, ExportsOnlyTheInterposedSymbolsAndNeverLinksCudart) {
  Output nm = RunShell(std::string("nm -D --defined-only ") + TestShim() +
                  " | awk '{print $3}' | sort");
  ASSERT_EQ(nm.code, 0) << nm.out;
  EXPECT_EQ(nm.out,
            "cuGetProcAddress\ncuGetProcAddress_v2\ncudaFree\ncudaFreeAsync\ncudaFreeHost\n"
            "cudaGetDriverEntryPoint\ncudaGetDriverEntryPointByVersion\ncudaHostAlloc\n"
            "cudaHostRegister\ncudaHostUnregister\ncudaLaunchKernel\ncudaMalloc\n"
            "cudaMallocAsync\ncudaMallocFromPoolAsync\ncudaMallocHost\ncudaMallocManaged\n"
            "cudaMemGetInfo\n");
  Output needed = RunShell(std::string("readelf -d ") + TestShim() + " | grep NEEDED");
  ASSERT_EQ(needed.code, 0) << needed.out;
  EXPECT_EQ(needed.out.find("cudart"), std::string::npos) << needed.out;
  EXPECT_EQ(needed.out.find("libcuda"), std::string::npos) << needed.out;
}

TEST(PreloadShim, RecordsEveryAllocationWithExactCountsAndSizes) {
  const std::string dir = ScratchDir();
  Output o = RunShell(Env(dir) + Probe() + " basic");
  ASSERT_EQ(o.code, 0) << o.out;
  EXPECT_NE(o.out.find("tiermem preload: active in pid"), std::string::npos) << o.out;
  EXPECT_EQ(Value(o.out, "oom_rc"), "2");       // passed through unchanged
  EXPECT_EQ(Value(o.out, "bad_free_rc"), "1");  // passed through unchanged

  nlohmann::json r = ProfReport(dir + "/t.tmt");
  ASSERT_FALSE(r.is_null());
  EXPECT_EQ(r["file"]["complete"], true);
  const auto& dev = r["tiers"]["device"];
  EXPECT_EQ(dev["allocs"], 5);  // a, b, c (async), m (managed), p (pool)
  EXPECT_EQ(dev["frees"], 5);
  EXPECT_EQ(dev["peak"]["bytes"], 10 * kMiB + 128 * kKiB);
  EXPECT_EQ(dev["end_bytes"], 0);
  EXPECT_EQ(dev["ooms"], 1);
  EXPECT_EQ(dev["largest_oom_bytes"], uint64_t{1} << 40);
  EXPECT_EQ(dev["managed_allocs"], 1);
  EXPECT_EQ(dev["peak"]["kernel_launches"], 3);  // the peak came after the first 3 launches
  const auto& host = r["tiers"]["host"];
  EXPECT_EQ(host["allocs"], 3);  // cudaMallocHost, cudaHostAlloc, cudaHostRegister
  EXPECT_EQ(host["frees"], 2);
  EXPECT_EQ(host["peak"]["bytes"], 832 * kKiB);
  EXPECT_EQ(host["end_bytes"], 256 * kKiB);
  EXPECT_EQ(r["kernel_launches"]["total"], 18);
  EXPECT_EQ(r["kernel_launches"]["intervals"], 3);  // 3 | 10 | 5, cut by memory events
  EXPECT_EQ(r["unmatched"]["frees"], 0);
  // The shim's exit line agrees with the report.
  EXPECT_NE(o.out.find("device peak 10.12 MiB, pinned host peak 832.00 KiB, 18 kernel launches"),
            std::string::npos) << o.out;
}

TEST(PreloadShim, ForwardsEveryCallWithTheSameArgumentsAndResults) {
  const std::string dir = ScratchDir();
  Output plain = RunShell("FAKE_CUDART_LOG=" + dir + "/plain.log " + SanitizerPreloadEnv() + " " +
                     Probe() + " basic");
  ASSERT_EQ(plain.code, 0) << plain.out;
  Output shim = RunShell(Env(dir) + Probe() + " basic");
  ASSERT_EQ(shim.code, 0) << shim.out;
  std::vector<std::string> a = ReadLines(dir + "/plain.log"), b = ReadLines(dir + "/calls.log");
  ASSERT_FALSE(a.empty());
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(NormalizePointers(a[i]), NormalizePointers(b[i]));
  // The pointers the program got are the ones the runtime returned.
  EXPECT_EQ(Grep(b, "cudaMalloc size=1048576 ")[0], "cudaMalloc size=1048576 ptr=" + Value(shim.out, "a") + " rc=0");
  EXPECT_EQ(Grep(b, "cudaMallocFromPoolAsync")[0],
            "cudaMallocFromPoolAsync size=4194304 pool=0x77 stream=0x5200 ptr=" +
                Value(shim.out, "p") + " rc=0");
  EXPECT_EQ(Grep(b, "cudaHostAlloc")[0], "cudaHostAlloc size=262144 flags=4 ptr=" + Value(shim.out, "h2") + " rc=0");
  EXPECT_EQ(Grep(b, "cudaFreeAsync")[0], "cudaFreeAsync ptr=" + Value(shim.out, "c") + " stream=0x5100 rc=0");
  EXPECT_EQ(Grep(b, "cudaLaunchKernel").size(), 18u);
}

TEST(PreloadShim, StreamsAndManagedMemoryReachThePerfettoExport) {
  const std::string dir = ScratchDir();
  ASSERT_EQ(RunShell(Env(dir) + Probe() + " basic").code, 0);
  Output e = RunShell(Cli() + " prof export " + dir + "/t.tmt -o " + dir + "/t.json");
  ASSERT_EQ(e.code, 0) << e.out;
  std::ifstream in(dir + "/t.json");
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string json = ss.str();
  EXPECT_NE(json.find("\"label\":\"stream 0x5100\""), std::string::npos);
  EXPECT_NE(json.find("\"label\":\"stream 0x5200\""), std::string::npos);
  EXPECT_NE(json.find("\"managed\":true"), std::string::npos);
  EXPECT_NE(json.find("\"name\":\"kernel launches\""), std::string::npos);
  EXPECT_NE(json.find("\"total\":18"), std::string::npos);
}

TEST(PreloadShim, SeesVirtualMemoryCallsReachedThroughTheDriverEntryPointLookup) {
  const std::string dir = ScratchDir();
  Output o = RunShell(Env(dir) + Probe() + " vmm");
  ASSERT_EQ(o.code, 0) << o.out;
  EXPECT_EQ(Value(o.out, "release_unknown_rc"), "1");  // the driver's error, unchanged
  nlohmann::json r = ProfReport(dir + "/t.tmt");
  ASSERT_FALSE(r.is_null());
  EXPECT_EQ(r["tiers"]["device"]["allocs"], 3);
  EXPECT_EQ(r["tiers"]["device"]["frees"], 3);
  EXPECT_EQ(r["tiers"]["device"]["peak"]["bytes"], 6 * kMiB);
  EXPECT_EQ(r["tiers"]["device"]["end_bytes"], 0);
  std::vector<std::string> log = ReadLines(dir + "/calls.log");
  EXPECT_EQ(Grep(log, "cuMemCreate size=2097152 handle=").size(), 3u);
  EXPECT_EQ(Grep(log, "cuMemMap").size(), 3u);
  EXPECT_EQ(Grep(log, "cuMemUnmap").size(), 3u);
  EXPECT_EQ(Grep(log, "cuMemRelease").size(), 4u);
  EXPECT_EQ(Grep(log, "cuMemAddressReserve").size(), 1u);
}

TEST(PreloadShim, IsInertInAProcessWithoutCudaRuntime) {
  const std::string dir = ScratchDir();
  Output o = RunShell(Env(dir) + ::tiermem::testing::TestEnv("TIERMEM_TEST_NOCUDA_PROBE"));
  EXPECT_EQ(o.code, 3);
  EXPECT_EQ(o.out, "nocuda ok\n");  // not a word from the shim
  EXPECT_FALSE(Exists(dir + "/t.tmt"));
}

TEST(PreloadShim, FindsARuntimeLoadedWithRtldLocal) {
  const std::string dir = ScratchDir();
  Output o = RunShell(Env(dir) + ::tiermem::testing::TestEnv("TIERMEM_TEST_LOCAL_PROBE") + " " +
                      ::tiermem::testing::TestEnv("TIERMEM_TEST_LOCAL_USER"));
  ASSERT_EQ(o.code, 0) << o.out;
  EXPECT_NE(o.out.find("local rc=0"), std::string::npos) << o.out;
  nlohmann::json r = ProfReport(dir + "/t.tmt");
  ASSERT_FALSE(r.is_null());
  EXPECT_EQ(r["tiers"]["device"]["allocs"], 1);
  EXPECT_EQ(r["tiers"]["device"]["frees"], 1);
  EXPECT_EQ(r["tiers"]["device"]["peak"]["bytes"], 1 * kMiB);
}

TEST(PreloadShim, SaysWhatIsWrongWithItsOptionsAndOnlyForwards) {
  const std::string dir = ScratchDir();
  Output o = RunShell(Env(dir, "TIERMEM_PRELOAD_OFFLOAD=1 TIERMEM_PRELOAD_DEVICE_BUDGET=lots") +
                 Probe() + " basic");
  ASSERT_EQ(o.code, 0) << o.out;
  EXPECT_NE(o.out.find("TIERMEM_PRELOAD_DEVICE_BUDGET='lots'"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("the shim only forwards"), std::string::npos) << o.out;
  EXPECT_FALSE(Exists(dir + "/t.tmt"));
  EXPECT_EQ(Grep(ReadLines(dir + "/calls.log"), "cudaMalloc size=").size(), 3u);
}

// ---- offload mode ---------------------------------------------------------------------------

TEST(PreloadOffload, KeepsDeviceAllocationsWithinTheBudgetAndServesTheRestFromManaged) {
  const std::string dir = ScratchDir();
  Output o = RunShell(Env(dir, "TIERMEM_PRELOAD_OFFLOAD=1 TIERMEM_PRELOAD_DEVICE_BUDGET=3MiB "
                          "TIERMEM_PRELOAD_PREFETCH=off") +
                 Probe() + " offload");
  ASSERT_EQ(o.code, 0) << o.out;
  // cudaMemGetInfo reports the budget.
  EXPECT_NE(o.out.find("after_b free=1048576 total=3145728"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("after_c free=0 total=3145728"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("end free=3145728 total=3145728"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("offload: the 3.00 MiB device budget is reached"), std::string::npos);
  EXPECT_NE(o.out.find("2 allocations (peak 8.00 MiB) were served from managed memory"),
            std::string::npos) << o.out;

  const std::vector<std::string> log = ReadLines(dir + "/calls.log");
  const std::string b = Value(o.out, "b"), e = Value(o.out, "e");
  EXPECT_EQ(Grep(log, "cudaMalloc size=").size(), 1u);  // only a reached cudaMalloc
  EXPECT_EQ(Grep(log, "cudaMallocAsync size=").size(), 2u);
  const std::vector<std::string> managed = Grep(log, "cudaMallocManaged");
  ASSERT_EQ(managed.size(), 2u);
  EXPECT_EQ(managed[0], "cudaMallocManaged size=2097152 flags=1 ptr=" + b + " rc=0");
  EXPECT_EQ(managed[1], "cudaMallocManaged size=8388608 flags=1 ptr=" + e + " rc=0");
  const std::vector<std::string> advise = Grep(log, "cudaMemAdvise");
  ASSERT_EQ(advise.size(), 2u);  // SetPreferredLocation (3) = the host (type 2)
  EXPECT_EQ(advise[0], "cudaMemAdvise ptr=" + b + " count=2097152 advice=3 location=2:0 rc=0");
  // A stream-ordered free of managed memory waits for the stream and frees synchronously.
  EXPECT_EQ(Grep(log, "cudaStreamSynchronize")[0], "cudaStreamSynchronize stream=0x5300 rc=0");
  EXPECT_EQ(Grep(log, "cudaFree ptr=" + b).size(), 1u);
  EXPECT_EQ(Grep(log, "cudaFreeAsync ptr=" + b).size(), 0u);

  nlohmann::json r = ProfReport(dir + "/t.tmt");
  ASSERT_FALSE(r.is_null());
  EXPECT_EQ(r["tiers"]["device"]["budget_bytes"], 3 * kMiB);
  EXPECT_EQ(r["tiers"]["device"]["allocs"], 3);
  EXPECT_EQ(r["tiers"]["device"]["peak"]["bytes"], 3 * kMiB);
  EXPECT_EQ(r["tiers"]["host"]["allocs"], 2);
  EXPECT_EQ(r["tiers"]["host"]["managed_allocs"], 2);
  EXPECT_EQ(r["tiers"]["host"]["peak"]["bytes"], 8 * kMiB);
  EXPECT_EQ(r["tiers"]["host"]["end_bytes"], 0);
  EXPECT_EQ(r["prefetches"]["count"], 0);
}

TEST(PreloadOffload, ServesFromManagedWhenTheDeviceIsFullBeforeTheBudget) {
  const std::string dir = ScratchDir();
  Output o = RunShell(Env(dir, "TIERMEM_PRELOAD_OFFLOAD=1 TIERMEM_PRELOAD_DEVICE_BUDGET=1GiB "
                          "FAKE_CUDART_TOTAL=4194304") +
                 Probe() + " offload_full");
  ASSERT_EQ(o.code, 0) << o.out;
  EXPECT_EQ(Value(o.out, "a_rc"), "0");
  EXPECT_EQ(Value(o.out, "b_rc"), "0");
  EXPECT_EQ(Value(o.out, "last_error"), "0");  // the runtime's OOM was cleared
  const std::vector<std::string> log = ReadLines(dir + "/calls.log");
  EXPECT_EQ(Grep(log, "cudaMalloc size=2097152 ptr=(nil) rc=2").size(), 1u);
  EXPECT_EQ(Grep(log, "cudaMallocManaged size=2097152 flags=1 ptr=" + Value(o.out, "b")).size(), 1u);
}

class PreloadPrefetch : public ::testing::TestWithParam<int> {};  // the CUDA major

// Three iterations of k1(b+4K) k2(c) k3(d) with b, c, d managed, lookahead 1: the first
// iteration is the warm-up; from the second on, each launch prefetches what the next one
// touched before, on the launching stream, from the touched address to the end of the range.
TEST_P(PreloadPrefetch, PrefetchesWhatTheNextKernelTouchedInTheWarmUp) {
  const std::string dir = ScratchDir();
  Output o = RunShell(Env(dir, "TIERMEM_PRELOAD_OFFLOAD=1 TIERMEM_PRELOAD_DEVICE_BUDGET=1MiB "
                          "TIERMEM_PRELOAD_AHEAD=1") +
                 TestProbe(GetParam()) + " kernels");
  ASSERT_EQ(o.code, 0) << o.out;
  const std::string c = Value(o.out, "c"), d = Value(o.out, "d");
  char b4k[32];
  std::snprintf(b4k, sizeof(b4k), "%p",
                reinterpret_cast<void*>(std::stoull(Value(o.out, "b"), nullptr, 16) + 4096));
  const std::string tail = " location=1:0 flags=0 stream=0x5100 rc=0";
  const std::vector<std::string> expected = {
      "cudaMemPrefetchAsync ptr=" + c + " count=1048576" + tail,
      "cudaMemPrefetchAsync ptr=" + d + " count=1048576" + tail,
      "cudaMemPrefetchAsync ptr=" + std::string(b4k) + " count=1044480" + tail,
      "cudaMemPrefetchAsync ptr=" + c + " count=1048576" + tail,
      "cudaMemPrefetchAsync ptr=" + d + " count=1048576" + tail,
      "cudaMemPrefetchAsync ptr=" + std::string(b4k) + " count=1044480" + tail,
  };
  const std::vector<std::string> log = ReadLines(dir + "/calls.log");
  EXPECT_EQ(Grep(log, "cudaMemPrefetchAsync"), expected);
  // Each prefetch comes right before the launch that issued it: none in the first 3 launches.
  std::vector<std::string> order;
  for (const std::string& l : log) {
    if (l.rfind("cudaLaunchKernel", 0) == 0) order.push_back("L");
    if (l.rfind("cudaMemPrefetchAsync", 0) == 0) order.push_back("P");
  }
  EXPECT_EQ(order, (std::vector<std::string>{"L", "L", "L", "P", "L", "P", "L", "P", "L", "P",
                                             "L", "P", "L", "P", "L"}));
  nlohmann::json r = ProfReport(dir + "/t.tmt");
  ASSERT_FALSE(r.is_null());
  EXPECT_EQ(r["prefetches"]["count"], 6);
  EXPECT_EQ(r["prefetches"]["bytes"], 4 * kMiB + 2 * (kMiB - 4096));
}

// The CUDA 12 and CUDA 13 ABIs of cudaMemAdvise/cudaMemPrefetchAsync.
INSTANTIATE_TEST_SUITE_P(CudaMajor, PreloadPrefetch,
                         ::testing::Values(12, 13),
                         [](const auto& info) { return info.index == 0 ? "Cuda12" : "Cuda13"; });

TEST(PreloadOffload, PlainUnifiedMemoryIssuesNoPrefetch) {
  const std::string dir = ScratchDir();
  Output o = RunShell(Env(dir, "TIERMEM_PRELOAD_OFFLOAD=1 TIERMEM_PRELOAD_DEVICE_BUDGET=1MiB "
                          "TIERMEM_PRELOAD_AHEAD=1 TIERMEM_PRELOAD_PREFETCH=off") +
                 Probe() + " kernels");
  ASSERT_EQ(o.code, 0) << o.out;
  const std::vector<std::string> log = ReadLines(dir + "/calls.log");
  EXPECT_EQ(Grep(log, "cudaMemPrefetchAsync").size(), 0u);
  EXPECT_EQ(Grep(log, "cudaMallocManaged").size(), 3u);
  // Offload without a timeline still counts the launches for its exit line.
  Output untimed = RunShell(PreloadEnv() + " TIERMEM_PRELOAD_OFFLOAD=1 TIERMEM_PRELOAD_DEVICE_BUDGET=1MiB " +
                            Probe() + " kernels");
  ASSERT_EQ(untimed.code, 0) << untimed.out;
  EXPECT_NE(untimed.out.find("device peak 1.00 MiB, pinned host peak 0 B, 9 kernel launches; "
                             "timeline (none)"),
            std::string::npos) << untimed.out;
}

// ---- tiermem run ----------------------------------------------------------------------------

TEST(TiermemRun, ReturnsTheCommandsExitCode) {
  const std::string dir = ScratchDir();
  Output o = RunShell(SanitizerPreloadEnv() + " " + Cli() + " run --record " + dir + "/t.tmt -- " +
                 ::tiermem::testing::TestEnv("TIERMEM_TEST_NOCUDA_PROBE"));
  EXPECT_EQ(o.code, 3) << o.out;
  EXPECT_NE(o.out.find("no timeline"), std::string::npos) << o.out;
  EXPECT_FALSE(Exists(dir + "/t.tmt"));
  EXPECT_EQ(RunShell(TiermemRun() + " -- sh -c 'exit 7'").code, 7);
  Output missing = RunShell(TiermemRun() + " -- /nonexistent/program");
  EXPECT_EQ(missing.code, 127);
  EXPECT_NE(missing.out.find("cannot run '/nonexistent/program'"), std::string::npos) << missing.out;
}

TEST(TiermemRun, PassesTheCommandAndItsArgumentsUnparsedAndInOrder) {
  Output dashed = RunShell(TiermemRun() + " --record '' -- echo -c a -v b --record x");
  EXPECT_EQ(dashed.code, 0) << dashed.out;
  EXPECT_EQ(dashed.out, "-c a -v b --record x\n");
  Output bare = RunShell(TiermemRun() + " --record '' echo a b");
  EXPECT_EQ(bare.out, "a b\n");
  // Without "--" the command's own options would be parsed: refused, pointing at "--".
  Output ambiguous = RunShell(TiermemRun() + " --record '' echo -n a");
  EXPECT_EQ(ambiguous.code, 2);
  EXPECT_NE(ambiguous.out.find("put the command after --"), std::string::npos) << ambiguous.out;
  Output none = RunShell(TiermemRun() + " --record ''");
  EXPECT_EQ(none.code, 2);
  EXPECT_NE(none.out.find("no command"), std::string::npos) << none.out;
}

TEST(TiermemRun, RecordsTheTimelineAndSaysWhereItWent) {
  const std::string dir = ScratchDir();
  std::ofstream(dir + "/t.tmt") << "an old file";  // replaced
  Output o = RunShell(SanitizerPreloadEnv() + " FAKE_CUDART_LOG=" + dir + "/calls.log " + Cli() +
                 " run --record " + dir + "/t.tmt -- " + Probe() + " basic");
  ASSERT_EQ(o.code, 0) << o.out;
  EXPECT_NE(o.out.find("timeline written to " + dir + "/t.tmt"), std::string::npos) << o.out;
  nlohmann::json r = ProfReport(dir + "/t.tmt");
  ASSERT_FALSE(r.is_null());
  EXPECT_EQ(r["tiers"]["device"]["allocs"], 5);
  EXPECT_EQ(r["kernel_launches"]["total"], 18);
}

TEST(TiermemRun, EachProcessOfAJobGetsItsOwnTimeline) {
  const std::string dir = ScratchDir();
  Output o = RunShell(SanitizerPreloadEnv() + " " + Cli() + " run --record " + dir + "/t.tmt -- sh -c '" +
                 Probe() + " vmm && " + Probe() + " basic'");
  ASSERT_EQ(o.code, 0) << o.out;
  Output ls = RunShell("ls " + dir);
  std::regex second("t\\.[0-9]+\\.tmt");
  std::smatch m;
  ASSERT_TRUE(std::regex_search(ls.out, m, second)) << ls.out;
  EXPECT_NE(o.out.find("timeline written to " + dir + "/" + m.str()), std::string::npos) << o.out;
  nlohmann::json first = ProfReport(dir + "/t.tmt"), later = ProfReport(dir + "/" + m.str());
  ASSERT_FALSE(first.is_null());
  ASSERT_FALSE(later.is_null());
  EXPECT_EQ(first["tiers"]["device"]["peak"]["bytes"], 6 * kMiB);             // vmm
  EXPECT_EQ(later["tiers"]["device"]["peak"]["bytes"], 10 * kMiB + 128 * kKiB);  // basic
}

TEST(TiermemRun, PerTensorSelectsPytorchsAsyncAllocatorBackend) {
  Output o = RunShell(std::string("PYTORCH_CUDA_ALLOC_CONF= ") + TiermemRun() +
                 " --record '' --per-tensor -- sh -c 'echo conf=$PYTORCH_CUDA_ALLOC_CONF'");
  ASSERT_EQ(o.code, 0) << o.out;
  EXPECT_EQ(Value(o.out, "conf"), "backend:cudaMallocAsync");
  Output kept = RunShell("PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:64 " + TiermemRun() +
                    " --record '' --per-tensor -- sh -c 'echo conf=$PYTORCH_CUDA_ALLOC_CONF'");
  EXPECT_EQ(Value(kept.out, "conf"), "max_split_size_mb:64,backend:cudaMallocAsync");
  Output conflict = RunShell("PYTORCH_CUDA_ALLOC_CONF=backend:native " + TiermemRun() +
                        " --per-tensor -- true");
  EXPECT_EQ(conflict.code, 2);
  EXPECT_NE(conflict.out.find("already says 'backend:native'"), std::string::npos) << conflict.out;
  Output budget = RunShell(TiermemRun() + " --offload -- true");
  EXPECT_EQ(budget.code, 2);
  EXPECT_NE(budget.out.find("--offload needs --device-budget"), std::string::npos) << budget.out;
}

TEST(TiermemRun, ForwardsSigintToTheCommand) {
  const std::string dir = ScratchDir();
  int out[2];
  ASSERT_EQ(::pipe(out), 0);
  const std::string cmd = "exec env " + SanitizerPreloadEnv() + " " + Cli() + " run --record " + dir +
                          "/t.tmt -- " + Probe() + " sleep";
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::dup2(out[1], 1);
    ::close(out[0]);
    ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    ::_exit(126);
  }
  ::close(out[1]);
  std::string got;
  char buf[256];
  while (got.find("ready") == std::string::npos) {
    const ssize_t n = ::read(out[0], buf, sizeof(buf));
    if (n <= 0) break;
    got.append(buf, n);
  }
  ASSERT_NE(got.find("ready"), std::string::npos) << got;
  ASSERT_EQ(::kill(pid, SIGINT), 0);  // to the launcher, not the command
  for (ssize_t n; (n = ::read(out[0], buf, sizeof(buf))) > 0;) got.append(buf, n);
  ::close(out[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 42) << got;  // the command's answer to SIGINT
  EXPECT_NE(got.find("got SIGINT"), std::string::npos) << got;
  nlohmann::json r = ProfReport(dir + "/t.tmt");
  ASSERT_FALSE(r.is_null());
  EXPECT_EQ(r["file"]["complete"], true);
  EXPECT_EQ(r["tiers"]["device"]["frees"], 1);
}

TEST(TiermemRun, AKilledCommandLeavesAReadableTimeline) {
  const std::string dir = ScratchDir();
  Output o = RunShell(SanitizerPreloadEnv() + " TIERMEM_PRELOAD_FLUSH_MS=20 " + Cli() + " run --record " +
                 dir + "/t.tmt -- " + Probe() + " killself");
  EXPECT_EQ(o.code, 128 + SIGKILL) << o.out;
  EXPECT_NE(o.out.find("killed by signal 9"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("timeline written to " + dir + "/t.tmt"), std::string::npos) << o.out;
  nlohmann::json r = ProfReport(dir + "/t.tmt");
  ASSERT_FALSE(r.is_null());
  EXPECT_EQ(r["file"]["complete"], false);
  EXPECT_EQ(r["tiers"]["device"]["allocs"], 5);
  EXPECT_EQ(r["tiers"]["device"]["peak"]["bytes"], 5 * kMiB);
  EXPECT_EQ(r["kernel_launches"]["total"], 3);
}

}  // namespace
}  // namespace tiermem::preload::testing
