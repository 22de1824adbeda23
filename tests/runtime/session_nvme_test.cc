// Session with the file-backed NVMe tier: fixed buffers, optimizer state spilling first,
// failed deferred updates, activation spills and their checksums.
#include "runtime/session.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>

#include "planners/trace.h"
#include "base/crc32c.h"
#include "runtime/tier_stack.h"
#include "tests/runtime/session_test_common.h"
#include "tests/runtime/session_test_support.h"
#include "tests/support/session.h"
#include "tests/support/status_matchers.h"

namespace tiermem::session {
namespace {

using ::tiermem::testing::IsOk;
using ::tiermem::testing::StatusIs;
using nlohmann::json;

using namespace session_tests;  // NOLINT: the split files' shared helpers

// 8 trainable tensors of one 16 Ki-element chunk each; host room for the params and grads (and
// the reserve) but not for m and v, which go to NVMe in `dir`.
std::unique_ptr<Session> MakeNvmeSpill(const std::string& dir) {
  std::vector<TensorSpec> specs;
  for (int i = 0; i < 8; ++i) specs.push_back({"t" + std::to_string(i), 16384, true, 0});
  return Make({{"device", "1MiB"},
               {"host", "2MiB"},
               {"chunk_size", 16384},
               {"prefetch_depth", 1},
               {"nvme", {{"path", dir}, {"size", "16MiB"}}}},
              specs);
}

// The host memory NVMe moves go to and from (homes, caches, staging slots) is registered with
// the NVMe tier as io_uring fixed buffers, as fio's --fixedbufs; none is left registered once
// the host tiers are gone.
TEST(SessionNvme, HostMemoryIsRegisteredAsFixedBuffersWithIoUring) {
  const std::string dir = TempDir();
  auto s = MakeNvmeSpill(dir);
  ASSERT_TRUE(s);
  if (s->io_backend() != "io_uring") GTEST_SKIP() << "io_uring refused here: " << s->io_backend();
  // Staging slots and the host homes: at least the host budget's slabs mapped so far.
  EXPECT_GT(s->nvme_registered_bytes(), 0u);
  EXPECT_LE(s->nvme_registered_bytes(), 2 * kMiB);
  for (size_t t = 0; t < 8; ++t) SetGrad(*s, t, Random(16384, t));
  ASSERT_TRUE(s->optimizer().Step({GroupHyper{}}).ok());  // m and v move through NVMe
  EXPECT_GT(s->nvme_registered_bytes(), 0u);
  s->Close();
  EXPECT_EQ(s->nvme_registered_bytes(), 0u);
  s.reset();
  std::filesystem::remove_all(dir);
}

TEST(SessionNvme, OptimizerStateSpillsToNvmeFirstAndTrainingMatches) {
  const std::string dir = TempDir();
  auto s = MakeNvmeSpill(dir);
  ASSERT_TRUE(s);
  int nvme_optim = 0, host_params = 0;
  for (size_t g = 0; g < s->layout().num_groups(); ++g) {
    host_params += s->chunks().Home(g, ChunkKind::kParamFp32) == TierKind::kHost;
    nvme_optim += s->chunks().Home(g, ChunkKind::kExpAvgSq) == TierKind::kNvme;
  }
  EXPECT_EQ(host_params, 8);
  EXPECT_EQ(nvme_optim, 8);
  std::vector<RefState> ref;
  for (size_t t = 0; t < 8; ++t) {
    ref.emplace_back(Random(16384, t));
    ASSERT_THAT(s->values().WriteParam(t, ref[t].p.data()), IsOk());
  }
  for (int step = 0; step < 2; ++step) {
    for (size_t t = 0; t < 8; ++t) {
      auto g = Random(16384, 200 + 10 * step + t);
      SetGrad(*s, t, g);
      ref[t].Step(g, GroupHyper{});
    }
    ASSERT_TRUE(s->optimizer().Step({GroupHyper{}}).ok());
    ASSERT_THAT(s->optimizer().ZeroGrad(), IsOk());
  }
  for (size_t t = 0; t < 8; ++t) EXPECT_EQ(Param(*s, t), ref[t].p);
  s.reset();
  std::filesystem::remove_all(dir);
}

// Overwrites the first 16 MiB of every NVMe file of a session under `dir` with junk, as a
// failing disk or another process would, and syncs; returns how many files. The tier's files
// are unnamed (O_TMPFILE): they are reached through this process's descriptors.
int OverwriteNvmeFiles(const std::string& dir) {
  int overwritten = 0;
  for (const auto& f : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    const std::string target = std::filesystem::read_symlink(f.path(), ec).string();
    if (ec || target.rfind(dir + "/", 0) != 0) continue;
    std::fstream io(f.path(), std::ios::in | std::ios::out | std::ios::binary);
    const std::string junk(16 << 20, '\x5a');
    io.write(junk.data(), static_cast<std::streamsize>(junk.size()));
    overwritten += io.good();
  }
  sync();
  return overwritten;
}

// A deferred update that meets a failing disk (here: the NVMe file overwritten behind the
// session's back, so the chunk checksums fail) returns the error from the call that ran it,
// naming the group and the deferral; the group is not stepped (its step counts stay).
TEST(SessionNvme, ADeferredUpdateThatFailsSaysSoAndLeavesTheGroupUnstepped) {
  const std::string dir = TempDir();
  auto s = MakeNvmeSpill(dir);
  ASSERT_TRUE(s);
  for (size_t t = 0; t < 8; ++t) {
    ASSERT_THAT(s->values().WriteParam(t, Random(16384, t).data()), IsOk());
  }
  for (int step = 0; step < 2; ++step) {
    for (size_t t = 0; t < 8; ++t) SetGrad(*s, t, Random(16384, 300 + 10 * step + t));
    ASSERT_TRUE(s->optimizer().Step({GroupHyper{}}).ok());
    EXPECT_EQ(s->optimizer().pending_steps(), 8u);
    if (step == 0) {
      ASSERT_THAT(s->optimizer().FinishSteps(), IsOk());
    }
  }
  ASSERT_EQ(s->chunks().Home(0, ChunkKind::kExpAvgSq), TierKind::kNvme);
  ASSERT_NE(s->chunks().Resident(0, ChunkKind::kExpAvgSq), TierKind::kHost);  // must be read from disk
  ASSERT_GT(OverwriteNvmeFiles(dir), 0);
  const Status st = s->optimizer().FinishStep(0);
  EXPECT_EQ(st.code(), StatusCode::kDataLoss) << st.ToString();  // the chunk's checksum
  EXPECT_NE(st.message().find("chunk group 0"), std::string::npos) << st.ToString();
  EXPECT_NE(st.message().find("deferred"), std::string::npos) << st.ToString();
  EXPECT_EQ(s->values().step_count(0), 1);  // step 2 did not happen for it
  EXPECT_EQ(s->optimizer().pending_steps(), 7u);
  s.reset();
  std::filesystem::remove_all(dir);
}

// Activations spilled to NVMe (the binding's offload when the host budget is short): bytes
// copied through host scratch into an NVMe region come back as written, in pieces at any
// offset; the region counts in the NVMe budget (too much is kResourceExhausted and changes
// nothing); bytes that read back other than written (the file overwritten behind the
// session's back) are kDataLoss, never other bytes.
TEST(SessionNvme, SpilledBytesComeBackAsWrittenAndACorruptedSpillIsDataLoss) {
  const std::string dir = TempDir();
  auto s = MakeNvmeSpill(dir);
  ASSERT_TRUE(s);
  const Bytes n = 64 * kKiB + 100;  // not a whole number of NVMe blocks
  StatusOr<Region> host = s->memory().AllocateScratch(TierKind::kHost, 64 * kKiB);
  ASSERT_THAT(host.status(), IsOk());
  StatusOr<Region> spill = s->memory().AllocateSpill(n);
  ASSERT_THAT(spill.status(), IsOk());
  std::vector<char> want(n);
  for (size_t i = 0; i < n; ++i) want[i] = static_cast<char>((i * 131 + 7) % 251);
  char* bounce = static_cast<char*>(host->addr);
  for (Bytes lo = 0; lo < n; lo += 64 * kKiB) {
    const Bytes k = std::min<Bytes>(64 * kKiB, n - lo);
    std::memcpy(bounce, want.data() + lo, k);
    ASSERT_THAT(s->memory().SpillCopy(*spill, lo, *host, 0, k, true), IsOk());
  }
  // Read back with both pieces in flight at once (StartSpillCopy), into two host regions.
  StatusOr<Region> host2 = s->memory().AllocateScratch(TierKind::kHost, 64 * kKiB);
  ASSERT_THAT(host2.status(), IsOk());
  std::memset(bounce, 0, 64 * kKiB);
  std::memset(host2->addr, 0, 64 * kKiB);
  auto first = s->memory().StartSpillCopy(*spill, 0, *host, 0, 64 * kKiB, false);
  auto second = s->memory().StartSpillCopy(*spill, 64 * kKiB, *host2, 0, 100, false);
  ASSERT_THAT(first.status(), IsOk());
  ASSERT_THAT(second.status(), IsOk());
  ASSERT_THAT((*first)->Wait(), IsOk());
  ASSERT_THAT((*second)->Wait(), IsOk());
  std::vector<char> got(n, 0);
  std::memcpy(got.data(), bounce, 64 * kKiB);
  std::memcpy(got.data() + 64 * kKiB, host2->addr, 100);
  EXPECT_EQ(got, want);
  EXPECT_THAT(s->memory().FreeScratch(TierKind::kHost, *host2), IsOk());
  EXPECT_THAT(s->memory().SpillCopy(*spill, 0, *host, 4, 64 * kKiB, true),
              StatusIs(StatusCode::kOutOfRange, "host region"));
  // The NVMe budget (16 MiB, the homes in it): a spill larger than its free room.
  EXPECT_THAT(s->memory().AllocateSpill(16 * kMiB), StatusIs(StatusCode::kResourceExhausted, "need"));
  ASSERT_GT(OverwriteNvmeFiles(dir), 0);
  EXPECT_THAT(s->memory().SpillCopy(*spill, 0, *host, 0, 64 * kKiB, false),
              StatusIs(StatusCode::kDataLoss, ""));
  EXPECT_THAT(s->memory().FreeSpill(*spill), IsOk());
  EXPECT_THAT(s->memory().FreeScratch(TierKind::kHost, *host), IsOk());
  s.reset();
  std::filesystem::remove_all(dir);
}

TEST(SessionNvme, NoSpillWithoutAnNvmeTier) {
  auto s = Make({{"device", "1MiB"}}, kThree);
  ASSERT_TRUE(s);
  EXPECT_THAT(s->memory().AllocateSpill(4096), StatusIs(StatusCode::kFailedPrecondition, "no NVMe"));
}

}  // namespace
}  // namespace tiermem::session
