// Optimizer placement (optimizer_stepper.h) and the session under the ordering contract: chunk groups
// whose optimizer state fits next to the working set step on the device; placed or not, with
// the binding's device work on a lagging SimStream over the asynchronous SimDevice or on the
// calling thread, the values are the same bit for bit (fp32 and bf16, with clipping).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "runtime/session.h"
#include "tests/support/status_matchers.h"
#include "tiers/fake/sim_stream.h"

namespace tiermem::session {
namespace {

using ::tiermem::testing::IsOk;
using nlohmann::json;

constexpr uint64_t kChunkElems = 4096;
// Four tensors, one per chunk group.
const std::vector<TensorSpec> kFour = {{"a", 4000, true, 0}, {"b", 4096, true, 0},
                                       {"c", 3000, true, 0}, {"d", 2500, true, 0}};

std::unique_ptr<Session> Make(json config) {
  if (!config.contains("device_kind")) config["device_kind"] = "sim";
  config["host"] = "64MiB";
  config["chunk_size"] = kChunkElems;
  auto c = ParseConfig(config, MapEnv({}));
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  auto s = Session::Create(*c, kFour);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? std::move(s).value() : nullptr;
}

std::vector<GroupHyper> Hyper() { return {GroupHyper{1e-2, 0.9, 0.999, 1e-8, 0.01}}; }

// Bytes of a group's compute + grad chunks, and of its optimizer state.
Bytes WorkingPerGroup(bool mixed) { return kChunkElems * (mixed ? 2 + 2 : 4 + 4); }
Bytes StatePerGroup(bool mixed) { return kChunkElems * (mixed ? 4 + 4 + 4 : 4 + 4); }

TEST(OptimizerPlacement, GroupsGetTheRoomTheWorkingSetLeavesInOrder) {
  for (bool mixed : {false, true}) {
    // Room for all compute + grad chunks and the optimizer state of two groups (not three).
    const Bytes budget = 4 * WorkingPerGroup(mixed) + 2 * StatePerGroup(mixed) + 1000;
    auto s = Make({{"device", budget}, {"precision", mixed ? "bf16" : "fp32"}});
    ASSERT_TRUE(s);
    ASSERT_EQ(s->layout().num_groups(), 4u);
    EXPECT_FALSE(s->optimizer().placed());
    for (size_t t = 0; t < 4; ++t) s->optimizer().SetHasGrad(t, true);
    ASSERT_TRUE(s->optimizer().Step(Hyper()).ok());
    ASSERT_TRUE(s->optimizer().placed());
    EXPECT_TRUE(s->optimizer().OnDevice(0));
    EXPECT_TRUE(s->optimizer().OnDevice(1));
    EXPECT_FALSE(s->optimizer().OnDevice(2));
    EXPECT_FALSE(s->optimizer().OnDevice(3));
    // The device groups' m and v live on the device once updated; the others' on the host.
    ASSERT_THAT(s->optimizer().FinishSteps(), IsOk());
    EXPECT_EQ(s->chunks().Resident(0, ChunkKind::kExpAvg), TierKind::kDevice);
    EXPECT_EQ(s->chunks().Resident(3, ChunkKind::kExpAvg), TierKind::kHost);
  }
  // Everything fits: every group; "host": none; no room beside the working set: none.
  auto all = Make({{"device", "4MiB"}});
  for (size_t t = 0; t < 4; ++t) all->optimizer().SetHasGrad(t, true);
  ASSERT_TRUE(all->optimizer().Step(Hyper()).ok());
  for (size_t g = 0; g < 4; ++g) EXPECT_TRUE(all->optimizer().OnDevice(g)) << g;
  auto host = Make({{"device", "4MiB"}, {"optimizer_placement", "host"}});
  for (size_t t = 0; t < 4; ++t) host->optimizer().SetHasGrad(t, true);
  ASSERT_TRUE(host->optimizer().Step(Hyper()).ok());
  for (size_t g = 0; g < 4; ++g) EXPECT_FALSE(host->optimizer().OnDevice(g)) << g;
  auto tight = Make({{"device", 4 * WorkingPerGroup(false)}});
  for (size_t t = 0; t < 4; ++t) tight->optimizer().SetHasGrad(t, true);
  ASSERT_TRUE(tight->optimizer().Step(Hyper()).ok());
  for (size_t g = 0; g < 4; ++g) EXPECT_FALSE(tight->optimizer().OnDevice(g)) << g;
}

// Device bytes held outside chunks (activations, a KV cache) before the first step count in
// the working set: the room they took is not given to optimizer state.
TEST(OptimizerPlacement, ExternalDeviceBytesSeenSoFarReduceTheRoom) {
  const Bytes budget = 4 * WorkingPerGroup(false) + 2 * StatePerGroup(false) + 1000;
  auto s = Make({{"device", budget}});
  ASSERT_THAT(s->memory().SetExternalDeviceBytes(StatePerGroup(false)), IsOk());
  ASSERT_THAT(s->memory().SetExternalDeviceBytes(0), IsOk());  // the peak is what counts
  for (size_t t = 0; t < 4; ++t) s->optimizer().SetHasGrad(t, true);
  ASSERT_TRUE(s->optimizer().Step(Hyper()).ok());
  EXPECT_TRUE(s->optimizer().OnDevice(0));
  EXPECT_FALSE(s->optimizer().OnDevice(1));
}

struct Variant {
  const char* name;
  const char* device_kind;
  const char* placement;
  bool stream;  // the binding's device work on a lagging SimStream
};

struct Outcome {
  std::vector<std::vector<float>> params;
  chunks::EngineStats stats;
  std::vector<double> norms;
};

// Twelve steps of a deterministic "training": each step's gradient is a function of the
// current fp32 values, written into the grad chunks on the device the way a binding's backward
// does (on the stream when there is one), then Step.
Outcome Train(const Variant& v, bool mixed, double clip) {
  const Bytes budget = 4 * WorkingPerGroup(mixed) + 2 * StatePerGroup(mixed) + 1000;
  auto s = Make({{"device", budget},
                 {"precision", mixed ? "bf16" : "fp32"},
                 {"device_kind", v.device_kind},
                 {"optimizer_placement", v.placement},
                 {"gradient_clipping", clip}});
  EXPECT_TRUE(s);
  Outcome out;
  if (!s) return out;
  std::unique_ptr<SimStream> stream;
  if (v.stream) {
    stream = std::make_unique<SimStream>(100'000);
    s->iterations().SetComputeStream(stream->handle());
  }
  for (size_t t = 0; t < 4; ++t) {
    std::vector<float> init(kFour[t].numel);
    for (size_t k = 0; k < init.size(); ++k) init[k] = std::sin(0.01f * (k + 1) * (t + 1));
    EXPECT_THAT(s->values().WriteParam(t, init.data()), IsOk());
  }
  for (int step = 0; step < 12; ++step) {
    s->iterations().BeginIteration();
    for (size_t t = 0; t < 4; ++t) {
      const TensorPlace& p = s->layout().place(t);
      std::vector<float> cur(p.numel);
      EXPECT_THAT(s->values().ReadParam(t, cur.data()), IsOk());
      auto g = std::make_shared<std::vector<float>>(p.numel);
      for (size_t k = 0; k < p.numel; ++k) {
        (*g)[k] = 0.5f * cur[k] + std::cos(0.1f * step + 0.001f * k) * (mixed ? 0.25f : 1.0f);
      }
      auto base = s->chunks().Acquire(p.group, ChunkKind::kGrad, TierKind::kDevice);
      EXPECT_TRUE(base.ok()) << base.status().ToString();
      char* dst = static_cast<char*>(*base) + p.offset * kernels::DTypeSize(s->layout().dtype(ChunkKind::kGrad));
      const kernels::DType gd = s->layout().dtype(ChunkKind::kGrad);
      auto write = [g, dst, gd] {
        if (gd == kernels::DType::kF32) {
          std::memcpy(dst, g->data(), g->size() * 4);
        } else {
          kernels::CastFromF32(g->data(), dst, gd, g->size());
        }
      };
      if (stream) {
        stream->Enqueue(write);
      } else {
        write();
      }
      EXPECT_THAT(s->chunks().Release(p.group, ChunkKind::kGrad, true), IsOk());
      s->optimizer().SetHasGrad(t, true);
    }
    auto r = s->optimizer().Step(Hyper());
    EXPECT_TRUE(r.ok()) << r.status().ToString();
    if (r.ok()) {
      out.norms.push_back(r->grad_norm);
    }
    EXPECT_THAT(s->optimizer().ZeroGrad(), IsOk());
  }
  if (stream) {
    EXPECT_THAT(stream->Synchronize(), IsOk());
  }
  for (size_t t = 0; t < 4; ++t) {
    out.params.emplace_back(kFour[t].numel);
    EXPECT_THAT(s->values().ReadParam(t, out.params.back().data()), IsOk());
  }
  out.stats = *s->Stats();
  return out;
}

TEST(OptimizerPlacement, DeviceAndHostPlacementAndAsyncStreamsAgreeBitForBit) {
  const Variant variants[] = {
      {"host placement", "sim", "host", false},
      {"auto placement", "sim", "auto", false},
      {"auto, sim-async + lagging stream", "sim-async", "auto", true},
      {"host, sim-async + lagging stream", "sim-async", "host", true},
  };
  for (bool mixed : {false, true}) {
    for (double clip : {0.0, 1.0}) {
      const Outcome ref = Train(variants[0], mixed, clip);
      ASSERT_EQ(ref.params.size(), 4u);
      for (const Variant& v : variants) {
        SCOPED_TRACE(std::string(v.name) + (mixed ? " bf16" : " fp32") + " clip " +
                     std::to_string(clip));
        const Outcome got = Train(v, mixed, clip);
        ASSERT_EQ(got.params.size(), 4u);
        for (size_t t = 0; t < 4; ++t) {
          EXPECT_EQ(std::memcmp(got.params[t].data(), ref.params[t].data(),
                                ref.params[t].size() * 4),
                    0)
              << "tensor " << t;
        }
        EXPECT_EQ(got.norms, ref.norms);
      }
    }
  }
}

// Placed groups keep their params and grads on the device: fewer bytes cross to the host.
TEST(OptimizerPlacement, PlacedGroupsMoveFewerBytesToTheHost) {
  const Outcome host = Train({"host", "sim", "host", false}, false, 0.0);
  const Outcome placed = Train({"auto", "sim", "auto", false}, false, 0.0);
  const int d = static_cast<int>(TierKind::kDevice), h = static_cast<int>(TierKind::kHost);
  EXPECT_LT(placed.stats.bytes_moved[d][h], host.stats.bytes_moved[d][h]);
}

}  // namespace
}  // namespace tiermem::session
