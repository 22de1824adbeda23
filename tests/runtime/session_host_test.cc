// Host mode (device_kind "host"; session.h host_compute()): no device tier. Chunks are
// acquired on the host, in place when homed there; NVMe-homed ones come into host room and a
// modified one goes back before its room is reused. The same values as a SimDevice session,
// bit for bit, through the optimizer steps.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "runtime/session.h"
#include "runtime/tier_stack.h"
#include "tests/support/status_matchers.h"

namespace tiermem::session {
namespace {

using ::tiermem::testing::IsOk;
using ::tiermem::testing::StatusIs;
using nlohmann::json;

const std::vector<TensorSpec> kSix = {{"a", 4000, true, 0}, {"b", 4096, true, 0},
                                      {"c", 3000, true, 0}, {"d", 2500, true, 0},
                                      {"e", 4096, true, 0}, {"f", 1000, true, 0}};

std::string TempDir() {
  char tmpl[] = "/tmp/tiermem-host-XXXXXX";
  EXPECT_NE(mkdtemp(tmpl), nullptr);
  return tmpl;
}

std::unique_ptr<Session> Make(json config) {
  config["chunk_size"] = 4096;
  auto c = ParseConfig(config, MapEnv({}));
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  if (!c.ok()) return nullptr;
  auto s = Session::Create(*c, kSix);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? std::move(s).value() : nullptr;
}

// Trains `s` for `steps` steps with deterministic gradients written on the compute tier;
// returns every tensor's final value.
std::vector<std::vector<float>> Train(Session& s, int steps) {
  const TierKind where = s.placement().compute_tier();
  for (int it = 0; it < steps; ++it) {
    s.iterations().BeginIteration();
    for (size_t g = 0; g < s.layout().num_groups(); ++g) {
      bool must_zero = false;
      auto p = s.chunks().AcquireForWrite(g, ChunkKind::kGrad, where, &must_zero);
      EXPECT_THAT(p.status(), IsOk());
      if (!p.ok()) return {};
      float* grad = static_cast<float*>(*p);
      for (uint64_t i = 0; i < s.layout().chunk_elems; ++i) {
        grad[i] = 0.001f * static_cast<float>((i * 7 + g * 13 + it * 3) % 101) - 0.05f;
      }
      EXPECT_THAT(s.chunks().Release(g, ChunkKind::kGrad, true), IsOk());
    }
    for (size_t t = 0; t < s.layout().num_tensors(); ++t) s.optimizer().SetHasGrad(t, true);
    OptimizerConfig hyper;
    hyper.lr = 1e-2;
    EXPECT_THAT(s.optimizer().Step({hyper}).status(), IsOk());
  }
  std::vector<std::vector<float>> out;
  for (size_t t = 0; t < s.layout().num_tensors(); ++t) {
    out.emplace_back(s.layout().place(t).numel);
    EXPECT_THAT(s.values().ReadParam(t, out.back().data()), IsOk());
  }
  return out;
}

TEST(HostMode, AutoWithoutAGpuIsHost) {
  if (TierStack::CudaBuilt() && TierStack::ResolveDeviceKind(DeviceKind::kCuda).ok()) {
    GTEST_SKIP() << "a GPU is present";
  }
  StatusOr<DeviceKind> k = TierStack::ResolveDeviceKind(DeviceKind::kAuto);
  ASSERT_TRUE(k.ok());
  EXPECT_EQ(*k, DeviceKind::kHost);
}

TEST(HostMode, HostHomedChunksAreComputedOnInPlace) {
  auto s = Make({{"device_kind", "host"}, {"host", "64MiB"}});
  ASSERT_NE(s, nullptr);
  EXPECT_TRUE(s->placement().host_compute());
  EXPECT_EQ(s->placement().compute_tier(), TierKind::kHost);
  EXPECT_EQ(s->layout().min_device_budget, 0u);
  auto p = s->chunks().Acquire(0, ChunkKind::kParamFp32, TierKind::kHost);
  ASSERT_THAT(p.status(), IsOk());
  EXPECT_EQ(s->chunks().Resident(0, ChunkKind::kParamFp32), TierKind::kHost);
  EXPECT_EQ(s->chunks().Home(0, ChunkKind::kParamFp32), TierKind::kHost);
  ASSERT_THAT(s->chunks().Release(0, ChunkKind::kParamFp32, false), IsOk());
  // There is no device: acquiring there is a clear error, not a silent fallback.
  EXPECT_THAT(s->chunks().Acquire(0, ChunkKind::kParamFp32, TierKind::kDevice).status(),
              StatusIs(StatusCode::kFailedPrecondition, "this stack has none"));
  EXPECT_THAT(s->memory().SetExternalDeviceBytes(1), StatusIs(StatusCode::kFailedPrecondition, "this stack has none"));
  EXPECT_THAT(s->memory().SetExternalComputeBytes(4096), IsOk());
  auto st = s->Stats();
  ASSERT_TRUE(st.ok());
  Bytes moved = 0;
  for (const auto& row : st->bytes_moved) {
    for (Bytes b : row) moved += b;
  }
  EXPECT_EQ(moved, 0u);  // nothing was copied: compute used the homes
  EXPECT_EQ(st->tiers[static_cast<int>(TierKind::kDevice)].capacity, 0u);
}

TEST(HostMode, WithNvmeEqualsASimDeviceSessionBitForBit) {
  const std::string dir = TempDir();
  // 6 groups x (param, grad, m, v) x 16 KiB = 384 KiB of state; the host holds ~half.
  auto host = Make({{"device_kind", "host"}, {"host", "224KiB"},
                    {"nvme", {{"size", "4MiB"}, {"path", dir + "/h"}}}});
  auto sim = Make({{"device_kind", "sim"}, {"device", "1MiB"}, {"host", "64MiB"}});
  ASSERT_NE(host, nullptr);
  ASSERT_NE(sim, nullptr);
  int on_nvme = 0;
  for (size_t g = 0; g < host->layout().num_groups(); ++g) {
    for (ChunkKind k : {ChunkKind::kParamFp32, ChunkKind::kGrad, ChunkKind::kExpAvg,
                        ChunkKind::kExpAvgSq}) {
      on_nvme += host->chunks().Home(g, k) == TierKind::kNvme;
    }
  }
  EXPECT_GT(on_nvme, 0);
  std::vector<float> init(4096);
  for (size_t t = 0; t < kSix.size(); ++t) {
    for (size_t i = 0; i < init.size(); ++i) init[i] = 0.01f * static_cast<float>((i + t) % 37);
    ASSERT_THAT(host->values().WriteParam(t, init.data()), IsOk());
    ASSERT_THAT(sim->values().WriteParam(t, init.data()), IsOk());
  }
  const auto a = Train(*host, 4);
  const auto b = Train(*sim, 4);
  ASSERT_EQ(a.size(), b.size());
  for (size_t t = 0; t < a.size(); ++t) {
    EXPECT_EQ(0, std::memcmp(a[t].data(), b[t].data(), a[t].size() * 4)) << kSix[t].name;
  }
  auto st = host->Stats();
  ASSERT_TRUE(st.ok());
  const int H = static_cast<int>(TierKind::kHost), N = static_cast<int>(TierKind::kNvme),
            D = static_cast<int>(TierKind::kDevice);
  EXPECT_GT(st->bytes_moved[N][H], 0u);
  EXPECT_GT(st->bytes_moved[H][N], 0u);
  EXPECT_EQ(st->bytes_moved[H][D] + st->bytes_moved[D][H] + st->bytes_moved[N][D], 0u);
  host->Close();
  sim->Close();
  std::filesystem::remove_all(dir);
}

TEST(HostMode, ChunksOfTheLargestTensorLeaveRoomForTheSmallOnes) {
  // A GPT block of width 64: its largest tensors (fc, out: 16384 elements) are more than
  // 1/32 of a 1 MiB host budget, so chunks are sized by them; qkv + proj fill one exactly.
  // Chunks of exactly the largest tensor would give the biases and norms chunks of their
  // own (5 groups per block); a little larger, a block packs into 3.
  std::vector<TensorSpec> specs;
  const int kBlocks = 4;
  for (int b = 0; b < kBlocks; ++b) {
    const std::string p = "b" + std::to_string(b) + ".";
    for (auto [name, n] : std::vector<std::pair<std::string, uint64_t>>{
             {"ln1.w", 64}, {"ln1.b", 64}, {"qkv.w", 12288}, {"qkv.b", 192},
             {"proj.w", 4096}, {"proj.b", 64}, {"ln2.w", 64}, {"ln2.b", 64},
             {"fc.w", 16384}, {"fc.b", 256}, {"out.w", 16384}, {"out.b", 64}}) {
      specs.push_back({p + name, n, true, 0});
    }
  }
  uint64_t total = 0;
  for (const TensorSpec& t : specs) total += t.numel;
  const std::string dir = TempDir();
  auto c = ParseConfig({{"device_kind", "host"}, {"host", "1MiB"},
                        {"nvme", {{"size", "16MiB"}, {"path", dir}}}},
                       MapEnv({}));
  ASSERT_TRUE(c.ok());
  auto s = Session::Create(*c, specs);
  ASSERT_TRUE(s.ok()) << s.status().ToString();
  EXPECT_GT((*s)->layout().chunk_elems, 16384u);
  EXPECT_LE((*s)->layout().chunk_elems, 16384u + 16384u / 4);
  EXPECT_LE((*s)->layout().num_groups(), 3u * kBlocks + 1);
  EXPECT_LT((*s)->layout().num_groups() * (*s)->layout().chunk_elems, total + total / 4);  // waste < 25%
  (*s)->Close();
  std::filesystem::remove_all(dir);
}

TEST(HostMode, BadConfigsAreClearErrors) {
  EXPECT_THAT(ParseConfig({{"device_kind", "host"}, {"device", "1GiB"}}, MapEnv({})).status(),
              StatusIs(StatusCode::kInvalidArgument, "host mode has no device tier"));
  auto c = ParseConfig({{"device_kind", "host"}, {"activations", "offload"}}, MapEnv({}));
  ASSERT_TRUE(c.ok());
  EXPECT_THAT(Session::Create(*c, kSix).status(),
              StatusIs(StatusCode::kInvalidArgument, "in host memory already"));
  const std::string dir = TempDir();
  auto small = ParseConfig({{"device_kind", "host"}, {"host", "32KiB"}, {"chunk_size", 4096},
                            {"nvme", {{"size", "4MiB"}, {"path", dir}}}},
                           MapEnv({}));
  ASSERT_TRUE(small.ok());
  EXPECT_THAT(Session::Create(*small, kSix).status(),
              StatusIs(StatusCode::kResourceExhausted, "below the minimum of"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tiermem::session
