// What the bindings ask of a session's layout (session.h, "what the bindings ask of the
// layout"): the compute copy's element size and dtype, the compute budget and whether it holds
// every chunk, whether grad chunks are held through the backward, the activation cap, the
// sharded recent-chunk count and a unit's compute bytes (the serving minimum) — exact values on
// small layouts whose sizes are written out below. And the NVMe directory: one that does not
// exist is an error naming 'nvme.path', whoever built the config.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "runtime/session.h"
#include "tests/support/session.h"
#include "tests/support/status_matchers.h"

namespace tiermem::session {
namespace {

using ::tiermem::testing::MakeSession;
using ::tiermem::testing::StatusIs;
using nlohmann::json;

constexpr uint64_t kElems = 4096;  // chunk_size: every tensor below fills one chunk
constexpr Bytes kChunk = kElems * 4;

// `trainable` trainable tensors and one frozen one of a chunk each: one group each.
std::vector<TensorSpec> Specs(int trainable) {
  std::vector<TensorSpec> v;
  for (int i = 0; i < trainable; ++i) v.push_back({"t" + std::to_string(i), kElems, true, 0});
  v.push_back({"frozen", kElems, false, 0});
  return v;
}

std::string TempDir() {
  char tmpl[] = "/tmp/tiermem-facts-XXXXXX";
  EXPECT_NE(mkdtemp(tmpl), nullptr);
  return tmpl;
}

TEST(SessionFacts, OnADeviceTheComputeBudgetIsTheDevicesAndTheCapsFollowIt) {
  // 3 groups; fp32: a group's compute + grad chunks are 2 x 16 KiB. Chunks: 2 trainable
  // groups x (param, grad, m, v) + the frozen param = 9 x 16 KiB = 147456 bytes.
  auto s = MakeSession({{"device", "1MiB"}, {"chunk_size", kElems}}, Specs(2));
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->layout().num_groups(), 3u);
  EXPECT_EQ(s->layout().compute_element_size(), 4u);
  EXPECT_EQ(s->layout().compute_dtype(), kernels::DType::kF32);
  EXPECT_EQ(s->placement().total_chunk_bytes, 9 * kChunk);
  EXPECT_EQ(s->placement().compute_budget, kMiB);
  EXPECT_TRUE(s->placement().compute_tier_holds_every_chunk());
  EXPECT_TRUE(s->placement().holds_grad_chunks());  // 3 x 32 KiB fit
  EXPECT_EQ(s->placement().ActivationCap(2), kMiB - 2 * 2 * 2 * kChunk);
  EXPECT_EQ(s->placement().RecentFullChunks(2), 5u);                 // 2 units of 2 groups, and one
  EXPECT_EQ(s->placement().RecentFullChunks(100), kMiB / (4 * kChunk));  // a quarter of the budget: 16
}

TEST(SessionFacts, ASmallDeviceHoldsNeitherEveryChunkNorEveryGradChunk) {
  // The minimum device budget for this chunk size: 4 x (16 + 16) KiB. 6 groups' compute and
  // grad chunks (6 x 32 KiB) do not fit it, nor do the 21 chunks.
  auto s = MakeSession({{"device", 4 * 2 * kChunk}, {"chunk_size", kElems}}, Specs(5));
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->placement().compute_budget, 4 * 2 * kChunk);
  EXPECT_FALSE(s->placement().compute_tier_holds_every_chunk());
  EXPECT_FALSE(s->placement().holds_grad_chunks());
  EXPECT_EQ(s->placement().ActivationCap(1), 2 * 2 * kChunk);  // two units of one group leave half
  EXPECT_EQ(s->placement().ActivationCap(2), 0u);
  EXPECT_EQ(s->placement().ActivationCap(3), 0u);  // more than the budget: none, not a wrap-around
}

TEST(SessionFacts, MixedPrecisionHalvesTheComputeCopy) {
  auto s = MakeSession({{"device", "1MiB"}, {"chunk_size", kElems}, {"precision", "bf16"}},
                       Specs(2));
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->layout().compute_element_size(), 2u);
  EXPECT_EQ(s->layout().compute_dtype(), kernels::DType::kBF16);
  EXPECT_EQ(s->placement().ActivationCap(2), kMiB - 2 * 2 * 2 * (kElems * 2));
  EXPECT_EQ(s->placement().RecentFullChunks(100), kMiB / (4 * kElems * 2));
}

TEST(SessionFacts, UnitComputeBytesCountsTheUnitAndItsLargestExpertBeyondIt) {
  auto s = MakeSession({{"device", "1MiB"}, {"chunk_size", kElems}}, Specs(3));
  ASSERT_NE(s, nullptr);
  ASSERT_EQ(s->layout().num_groups(), 4u);
  EXPECT_EQ(s->layout().UnitComputeBytes({0, 1}).value(), 2 * kChunk);
  // Expert {1, 2} adds group 2 only (1 is the unit's); expert {3} adds group 3: the larger
  // of the two is one chunk.
  EXPECT_EQ(s->layout().UnitComputeBytes({0, 1}, {{1, 2}, {3}}).value(), 3 * kChunk);
  EXPECT_EQ(s->layout().UnitComputeBytes({0}, {{1, 2}, {3}}).value(), 3 * kChunk);
  EXPECT_EQ(s->layout().UnitComputeBytes({}, {}).value(), 0u);
  EXPECT_THAT(s->layout().UnitComputeBytes({0, 9}).status(),
              StatusIs(StatusCode::kOutOfRange, "unknown chunk group 9"));
}

TEST(SessionFacts, InHostModeTheComputeBudgetIsTheHostsOnlyWhenEveryChunkIsHomedThere) {
  auto all = MakeSession({{"device_kind", "host"}, {"host", "64MiB"}, {"chunk_size", kElems}},
                         Specs(2));
  ASSERT_NE(all, nullptr);
  EXPECT_EQ(all->placement().compute_budget, 64 * kMiB);
  EXPECT_TRUE(all->placement().compute_tier_holds_every_chunk());
  EXPECT_EQ(all->placement().RecentFullChunks(1000), 64 * kMiB / (4 * kChunk));  // 1024

  const std::string dir = TempDir();
  auto some = MakeSession({{"device_kind", "host"},
                           {"host", "224KiB"},
                           {"chunk_size", kElems},
                           {"nvme", {{"size", "4MiB"}, {"path", dir}}}},
                          Specs(5));
  ASSERT_NE(some, nullptr);
  bool on_nvme = false;
  for (size_t g = 0; g < some->layout().num_groups(); ++g) {
    for (ChunkKind k : {ChunkKind::kParamFp32, ChunkKind::kGrad, ChunkKind::kExpAvg,
                        ChunkKind::kExpAvgSq}) {
      on_nvme |= some->layout().has_kind(g, k) && some->chunks().Home(g, k) == TierKind::kNvme;
    }
  }
  ASSERT_TRUE(on_nvme);
  EXPECT_EQ(some->placement().compute_budget, 0u);  // NVMe-homed chunks pass through the host room
  EXPECT_FALSE(some->placement().compute_tier_holds_every_chunk());
  EXPECT_FALSE(some->placement().holds_grad_chunks());
  EXPECT_EQ(some->placement().ActivationCap(1), 0u);
  // Sharded recent chunks follow the host tier's configured budget, homes or not.
  EXPECT_EQ(some->placement().RecentFullChunks(100), 224 * kKiB / (4 * kChunk));
  some.reset();
  std::filesystem::remove_all(dir);
}

// A configured NVMe directory that does not exist is kInvalidArgument naming the key and the
// path, also for a config the parser never saw (a LibTorch program filling SessionConfig) and
// for one removed after parsing; nothing is created.
TEST(SessionNvmePath, AMissingDirectoryIsAnErrorNamingTheKeyAndThePath) {
  const std::string dir = TempDir();
  SessionConfig c;
  c.device_kind = DeviceKind::kSim;
  c.device_budget = kMiB;
  c.host_budget = 4 * kMiB;
  c.nvme_size = 4 * kMiB;
  c.nvme_path = dir + "/missing";
  EXPECT_THAT(Session::Create(c, Specs(1)).status(),
              StatusIs(StatusCode::kInvalidArgument,
                       "config 'nvme.path': '" + dir + "/missing' is not a writable directory "
                       "(it does not exist)"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/missing"));

  // Parsed (the parser creates the last directory), then removed before the session.
  StatusOr<SessionConfig> parsed = ParseConfig(
      {{"device_kind", "sim"},
       {"device", "1MiB"},
       {"host", "4MiB"},
       {"nvme", {{"size", "4MiB"}, {"path", dir + "/leaf"}}}},
      MapEnv({}));
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  ASSERT_TRUE(std::filesystem::is_directory(dir + "/leaf"));
  std::filesystem::remove(dir + "/leaf");
  EXPECT_THAT(Session::Create(*parsed, Specs(1)).status(),
              StatusIs(StatusCode::kInvalidArgument, "config 'nvme.path': '" + dir + "/leaf'"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/leaf"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tiermem::session
