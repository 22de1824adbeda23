// Compressed optimizer state in the session (session.h, "the optimizer-state format"): the
// layout (which tensors get the format, block alignment, chunk bytes), the step against the
// kernel on plain buffers bit for bit (with deferred and speculative updates, mixed precision
// and NVMe in the loop), values in and out (dequantized / quantized), checkpoints that keep
// the codes and convert between formats, and bad configurations.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "planners/simulator.h"
#include "planners/trace.h"
#include "runtime/session.h"
#include "tests/runtime/session_test_support.h"
#include "tests/support/session.h"
#include "tests/support/status_matchers.h"

namespace tiermem::session {
namespace {

using ::tiermem::testing::IsOk;
using ::tiermem::testing::StatusIs;
using nlohmann::json;
using kernels::StateDType;

std::unique_ptr<Session> Make(json config, std::vector<TensorSpec> specs) {
  return testing::MakeSession(std::move(config), std::move(specs));
}

json State(const std::string& dtype, json extra = json::object()) {
  json o = {{"state_dtype", dtype}, {"lr", 1e-2}, {"weight_decay", 0.01}};
  for (auto& [k, v] : extra.items()) o[k] = v;
  return o;
}

// Big tensors (quantized), a small one (fp32 state), a frozen one; sizes not multiples of
// the block, so tensors end mid-block.
const std::vector<TensorSpec> kModel = {{"emb", 5000, true, 0}, {"w", 4500, true, 0},
                                        {"bias", 100, true, 0}, {"w2", 6000, true, 0},
                                        {"frozen", 700, false, 0}};

std::vector<float> Init(size_t t, size_t n) {
  std::vector<float> v(n);
  for (size_t k = 0; k < n; ++k) v[k] = 0.1f * std::sin(0.013f * (k + 1) + t);
  return v;
}

std::vector<float> Grad(size_t t, size_t n, int step, const std::vector<float>& p) {
  std::vector<float> g(n);
  for (size_t k = 0; k < n; ++k) {
    g[k] = 0.3f * p[k] + 0.05f * std::cos(0.2f * step + 0.7f * k + t) * (k % 53 == 0 ? 20.f : 1.f);
  }
  return g;
}

// One tensor stepped by the kernel alone on plain buffers, its state in `format` (its blocks
// start at the tensor, as in the session).
struct Ref {
  kernels::StateFormat format;
  std::vector<float> p, m, v;            // fp32 state
  std::vector<uint8_t> mq, vq;           // codes (bf16: 2 bytes each)
  std::vector<float> ma, va;             // int8 absmax
  int64_t step = 0;
  Ref(kernels::StateFormat f, std::vector<float> init)
      : format(f), p(std::move(init)), m(p.size()), v(p.size()),
        mq(p.size() * 2), vq(p.size() * 2), ma(p.size() / 64 + 1), va(p.size() / 64 + 1) {}
  void Step(const std::vector<float>& g, uint64_t seed) {
    kernels::AdamConfig c;
    c.lr = 1e-2f;
    c.weight_decay = 0.01f;
    c.step = ++step;
    c.rounding_seed = seed;
    kernels::AdamSpans sp;
    sp.param = p.data();
    sp.grad = g.data();
    sp.n = p.size();
    if (format.compressed()) {
      sp.state = format;
      sp.exp_avg_q = {mq.data(), ma.data()};
      sp.exp_avg_sq_q = {vq.data(), va.data()};
    } else {
      sp.exp_avg = m.data();
      sp.exp_avg_sq = v.data();
    }
    kernels::AdamStep(c, sp);
  }
  std::vector<float> M() const {
    if (!format.compressed()) return m;
    std::vector<float> out(p.size());
    kernels::DequantizeState(format, true, {const_cast<uint8_t*>(mq.data()),
                                            const_cast<float*>(ma.data())}, out.data(), p.size());
    return out;
  }
};

std::vector<float> Read(Session& s, size_t t, ChunkKind kind) {
  std::vector<float> v(s.layout().place(t).numel);
  EXPECT_THAT(s.values().ReadTensor(t, kind, v.data()), IsOk());
  return v;
}

TEST(SessionState, LayoutAlignsInt8TensorsToTheBlockAndShrinksTheStateChunks) {
  for (const char* dtype : {"int8", "bf16"}) {
    auto s = Make({{"device", "1MiB"}, {"optimizer", State(dtype, {{"state_min_elems", 1000}})}},
                  kModel);
    ASSERT_TRUE(s);
    const bool int8 = std::string(dtype) == "int8";
    for (size_t t : {0u, 1u, 3u}) {  // >= 1000 elements: the format
      const size_t g = s->layout().place(t).group;
      EXPECT_EQ(s->values().state_format(g).dtype, int8 ? StateDType::kInt8 : StateDType::kBF16);
      if (int8) {
        EXPECT_EQ(s->layout().place(t).offset % 256, 0u) << kModel[t].name;
      }
      const uint64_t e = s->layout().shard_elems;
      EXPECT_EQ(s->chunks().ChunkBytes(g, ChunkKind::kExpAvg), int8 ? e + e / 256 * 4 : e * 2);
      EXPECT_EQ(s->chunks().ChunkBytes(g, ChunkKind::kParamFp32), e * 4);  // masters stay fp32
    }
    if (int8) {
      EXPECT_EQ(s->layout().chunk_elems % 256, 0u);
    }
    // The small tensor keeps fp32 state in a group of its own; frozen groups have none.
    const size_t small = s->layout().place(2).group;
    EXPECT_EQ(s->values().state_format(small).dtype, StateDType::kF32);
    EXPECT_NE(small, s->layout().place(0).group);
    EXPECT_EQ(s->chunks().ChunkBytes(small, ChunkKind::kExpAvg), s->layout().shard_elems * 4);
    EXPECT_LT(s->values().state_bytes(), s->values().state_bytes_fp32());
  }
  // fp32 (the default): one trainable layout as before, every state chunk fp32.
  auto f = Make({{"device", "1MiB"}}, kModel);
  ASSERT_TRUE(f);
  EXPECT_EQ(f->layout().place(2).group, f->layout().place(0).group);
  EXPECT_EQ(f->values().state_bytes(), f->values().state_bytes_fp32());
  // state_min_elems 0: every trainable tensor quantized, one layout.
  auto all = Make({{"device", "1MiB"}, {"optimizer", State("int8", {{"state_min_elems", 0}})}},
                  kModel);
  ASSERT_TRUE(all);
  EXPECT_EQ(all->values().state_format(all->layout().place(2).group).dtype, StateDType::kInt8);
  // int8 state: m and v take 1 + 4/256 bytes per element instead of 8 ... for both: 0.254x.
  EXPECT_NEAR(static_cast<double>(all->values().state_bytes()) / all->values().state_bytes_fp32(), 0.2539, 1e-3);
}

// Trains kModel for `steps` steps; checks every tensor against Ref after each.
void TrainAgainstRef(json config, const std::string& dtype, int steps, bool expect_nvme = false) {
  config["optimizer"] = State(dtype, {{"state_min_elems", 1000}});
  auto s = Make(config, kModel);
  ASSERT_TRUE(s);
  if (expect_nvme) {  // some optimizer state lives on NVMe
    int on_nvme = 0;
    for (size_t g = 0; g < s->layout().num_groups(); ++g) {
      if (s->layout().has_kind(g, ChunkKind::kExpAvg) && s->chunks().Home(g, ChunkKind::kExpAvg) == TierKind::kNvme) {
        ++on_nvme;
      }
    }
    EXPECT_GT(on_nvme, 0);
  }
  std::vector<Ref> refs;
  for (size_t t = 0; t < kModel.size(); ++t) {
    std::vector<float> init = Init(t, kModel[t].numel);
    ASSERT_THAT(s->values().WriteParam(t, init.data()), IsOk());
    const kernels::StateFormat f = s->values().state_format(s->layout().place(t).group);
    refs.emplace_back(f, init);
    if (s->layout().mixed()) {  // the master as the session keeps it
      ASSERT_THAT(s->values().ReadParam(t, refs.back().p.data()), IsOk());
    }
  }
  const std::vector<GroupHyper> hyper = {GroupHyper{1e-2, 0.9, 0.999, 1e-8, 0.01}};
  for (int step = 1; step <= steps; ++step) {
    s->iterations().BeginIteration();
    s->SetStepHyper(hyper);
    for (size_t t = 0; t < kModel.size(); ++t) {
      if (!kModel[t].trainable) continue;
      std::vector<float> g = Grad(t, kModel[t].numel, step, refs[t].p);
      if (s->layout().mixed()) {  // what the kernel reads: the bf16 gradient
        std::vector<uint16_t> h(g.size());
        kernels::CastFromF32(g.data(), h.data(), kernels::DType::kBF16, g.size());
        kernels::CastToF32(h.data(), kernels::DType::kBF16, g.data(), g.size());
      }
      SetGrad(*s, t, g);
      s->iterations().Moment("bwd", planners::MomentKind::kPreBackward, static_cast<uint32_t>(t));
      const TensorPlace& p = s->layout().place(t);
      refs[t].Step(g, (static_cast<uint64_t>(step) << 32) ^
                          (p.group * 0x9E3779B97F4A7C15ull) ^ p.offset);
    }
    ASSERT_TRUE(s->optimizer().Step(hyper).ok());
    ASSERT_THAT(s->optimizer().ZeroGrad(), IsOk());
    for (size_t t = 0; t < kModel.size(); ++t) {
      if (!kModel[t].trainable) continue;
      std::vector<float> got(kModel[t].numel);
      ASSERT_THAT(s->values().ReadParam(t, got.data()), IsOk());
      ASSERT_EQ(got, refs[t].p) << dtype << " step " << step << " " << kModel[t].name;
      ASSERT_EQ(Read(*s, t, ChunkKind::kExpAvg), refs[t].M()) << kModel[t].name;
    }
  }
}

TEST(SessionState, StepEqualsTheKernelOnThePlainTensorBitForBit) {
  for (const char* dtype : {"int8", "bf16"}) {
    for (const char* overlap : {"off", "next-forward", "backward"}) {
      SCOPED_TRACE(std::string(dtype) + " " + overlap);
      TrainAgainstRef({{"device", "1MiB"}, {"optimizer_overlap", overlap}}, dtype, 4);
    }
  }
  TrainAgainstRef({{"device", "1MiB"}, {"precision", "bf16"}}, "int8", 3);
}

// A trained session of `dtype` state (3 steps of Grad).
std::unique_ptr<Session> Trained(const std::string& dtype, json extra = json::object()) {
  json o = {{"state_min_elems", 1000}};
  for (auto& [k, v] : extra.items()) o[k] = v;
  auto s = Make({{"device", "1MiB"}, {"optimizer", State(dtype, o)}}, kModel);
  if (!s) return nullptr;
  const std::vector<GroupHyper> hyper = {GroupHyper{1e-2, 0.9, 0.999, 1e-8, 0.01}};
  for (size_t t = 0; t < kModel.size(); ++t) {
    std::vector<float> init = Init(t, kModel[t].numel);
    EXPECT_THAT(s->values().WriteParam(t, init.data()), IsOk());
  }
  for (int step = 1; step <= 3; ++step) {
    for (size_t t = 0; t < kModel.size(); ++t) {
      if (!kModel[t].trainable) continue;
      std::vector<float> p(kModel[t].numel);
      EXPECT_THAT(s->values().ReadParam(t, p.data()), IsOk());
      SetGrad(*s, t, Grad(t, p.size(), step, p));
    }
    EXPECT_TRUE(s->optimizer().Step(hyper).ok());
    EXPECT_THAT(s->optimizer().ZeroGrad(), IsOk());
  }
  return s;
}

TEST(SessionState, StochasticBf16StateIsDeterministicAndUnlikeNearest) {
  auto a = Trained("bf16", {{"state_rounding", "stochastic"}});
  auto b = Trained("bf16", {{"state_rounding", "stochastic"}});
  auto n = Trained("bf16");
  ASSERT_TRUE(a && b && n);
  EXPECT_TRUE(a->values().state_format(a->layout().place(0).group).stochastic);
  size_t differ = 0, total = 0;
  for (size_t t : {0u, 1u, 3u}) {
    const std::vector<float> ma = Read(*a, t, ChunkKind::kExpAvg);
    EXPECT_EQ(ma, Read(*b, t, ChunkKind::kExpAvg)) << "the same seeds, the same bits";
    const std::vector<float> mn = Read(*n, t, ChunkKind::kExpAvg);
    double d2 = 0, n2 = 0;
    for (size_t k = 0; k < ma.size(); ++k) {
      ++total;
      differ += ma[k] != mn[k];
      d2 += (ma[k] - mn[k]) * (ma[k] - mn[k]);
      n2 += mn[k] * mn[k];
    }
    // The two roundings agree to about bf16's resolution (2^-8) after 3 steps.
    EXPECT_LT(std::sqrt(d2 / n2), 1e-2) << kModel[t].name;
  }
  EXPECT_GT(differ, total / 10) << "stochastic rounding moves many values off the nearest";
}

TEST(SessionState, CompressedStateThroughNvmeAndHostModeTrainsTheSame) {
  const std::string dir = ::testing::TempDir() + "tiermem_state_nvme";
  std::filesystem::create_directories(dir);
  // A host budget that holds the params and grads but not all the state: m and v live on NVMe.
  TrainAgainstRef({{"device_kind", "host"}, {"host", 512 * 1024}, {"chunk_size", 8192},
                   {"nvme", {{"path", dir}, {"size", "64MiB"}}}},
                  "int8", 3, /*expect_nvme=*/true);
  std::filesystem::remove_all(dir);
}

// The recorded trace carries the compressed chunk sizes, so the planner and the simulator
// count compressed bytes: the simulated NVMe traffic of the same model and budgets shrinks.
TEST(SessionState, TheTraceAndTheSimulatorCountTheCompressedBytes) {
  const std::string dir = ::testing::TempDir() + "tiermem_state_trace_" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  Bytes nvme[2] = {0, 0};
  int i = 0;
  for (const char* dtype : {"fp32", "int8"}) {
    auto s = Make({{"device", 256 * 1024}, {"host", 400 * 1024}, {"chunk_size", 8192},
                   {"optimizer_overlap", "off"},
                   {"nvme", {{"path", dir}, {"size", "64MiB"}}},
                   {"optimizer", State(dtype, {{"state_min_elems", 1000}})}},
                  kModel);
    ASSERT_TRUE(s);
    const std::string path = dir + "/" + dtype + ".tmtrace";
    const std::vector<GroupHyper> hyper = {GroupHyper{1e-2, 0.9, 0.999, 1e-8, 0.01}};
    for (int it = 0; it < 4; ++it) {
      if (it == 1) {
        ASSERT_THAT(s->traces().RecordTrace(path, 2), IsOk());
      }
      s->iterations().BeginIteration();
      for (size_t t = 0; t < kModel.size(); ++t) {
        const TensorPlace& p = s->layout().place(t);
        s->iterations().Moment("fwd", planners::MomentKind::kPreForward, static_cast<uint32_t>(t));
        ASSERT_TRUE(s->chunks().Acquire(p.group, s->layout().compute_kind(), s->placement().compute_tier()).ok());
        ASSERT_THAT(s->chunks().Release(p.group, s->layout().compute_kind(), false), IsOk());
      }
      for (size_t t = kModel.size(); t-- > 0;) {
        if (!kModel[t].trainable) continue;
        s->iterations().Moment("bwd", planners::MomentKind::kPreBackward, static_cast<uint32_t>(t));
        SetGrad(*s, t, std::vector<float>(kModel[t].numel, 1e-3f));
      }
      ASSERT_TRUE(s->optimizer().Step(hyper).ok());
    }
    s->iterations().BeginIteration();
    auto trace = planners::ReadTraceFile(path);
    ASSERT_TRUE(trace.ok()) << trace.status().ToString();
    for (const planners::TraceChunk& c : trace->chunks) {
      if (trace->kind_names[c.kind] == "exp_avg") {
        EXPECT_EQ(c.bytes, s->chunks().ChunkBytes(c.group, ChunkKind::kExpAvg)) << dtype;
      }
    }
    // The disk's rates (the recorded ones when the trace has them): the bytes do not depend
    // on them.
    planners::MachineModel machine = planners::MachineModel::FromTrace(*trace);
    const int h = static_cast<int>(TierKind::kHost), n = static_cast<int>(TierKind::kNvme);
    for (auto [a, b] : {std::pair{h, n}, std::pair{n, h}}) {
      if (machine.link[a][b].bytes_per_s == 0) machine.link[a][b].bytes_per_s = 2e9;
    }
    auto sim = planners::Simulate(*trace, machine, planners::PolicyKind::kLru);
    ASSERT_TRUE(sim.ok()) << sim.status().ToString();
    ASSERT_TRUE(sim->status.ok()) << sim->status.ToString();
    nvme[i++] = sim->total.NvmeBytes();
  }
  EXPECT_GT(nvme[0], 0u);
  EXPECT_LT(nvme[1], nvme[0] * 0.8) << "int8 " << nvme[1] << " vs fp32 " << nvme[0];
  std::filesystem::remove_all(dir);
}

TEST(SessionState, ValuesAreDequantizedOutAndQuantizedIn) {
  auto s = Make({{"device", "1MiB"}, {"optimizer", State("int8", {{"state_min_elems", 1000}})}},
                kModel);
  ASSERT_TRUE(s);
  std::vector<float> m(kModel[1].numel);
  std::mt19937 rng(3);
  std::normal_distribution<float> d(0.0f, 1e-3f);
  for (float& x : m) x = d(rng);
  ASSERT_THAT(s->values().WriteTensor(1, ChunkKind::kExpAvg, m.data()), IsOk());
  // The codes and absmax stored are QuantizeState's of the values (blocks from the tensor).
  const kernels::StateFormat f = s->values().state_format(s->layout().place(1).group);
  std::vector<uint8_t> q(m.size()), q_got(m.size());
  std::vector<float> a(kernels::StateBlocks(f, m.size())), a_got(a.size());
  kernels::QuantizeState(f, true, m.data(), {q.data(), a.data()}, m.size());
  ASSERT_THAT(s->values().ReadStateRaw(1, ChunkKind::kExpAvg, q_got.data(), a_got.data()), IsOk());
  EXPECT_EQ(q_got, q);
  EXPECT_EQ(a_got, a);
  std::vector<float> back(m.size());
  kernels::DequantizeState(f, true, {q.data(), a.data()}, back.data(), m.size());
  EXPECT_EQ(Read(*s, 1, ChunkKind::kExpAvg), back);
  // Neighbours untouched (their blocks are their own): still the zeros of a fresh state.
  for (float x : Read(*s, 0, ChunkKind::kExpAvg)) ASSERT_EQ(x, 0.0f);
  for (float x : Read(*s, 3, ChunkKind::kExpAvg)) ASSERT_EQ(x, 0.0f);
  // Raw writes of another tensor's codes land where ReadStateRaw finds them.
  ASSERT_THAT(s->values().WriteStateRaw(3, ChunkKind::kExpAvgSq, std::vector<uint8_t>(6000, 200).data(),
                               std::vector<float>(24, 2.0f).data()),
              IsOk());
  for (float x : Read(*s, 3, ChunkKind::kExpAvgSq)) {
    ASSERT_EQ(x, kernels::DynamicCode(false)[200] * 2.0f);
  }
  EXPECT_THAT(s->values().ReadStateRaw(1, ChunkKind::kGrad, q_got.data(), a_got.data()),
              StatusIs(StatusCode::kInvalidArgument, "exp_avg or exp_avg_sq"));
}

std::string TempFile(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "tiermem_state_ckpt_" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  return dir + "/" + name;
}

TEST(SessionState, CheckpointKeepsTheCodesAndItsAbsmax) {
  auto a = Trained("int8");
  ASSERT_TRUE(a);
  const std::string path = TempFile("int8.safetensors");
  ASSERT_THAT(a->SaveCheckpoint(path), IsOk());
  // The file: U8 codes in the tensor's shape and F32 absmax per block; fp32 for the small one.
  std::ifstream in(path, std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  std::string text(n, '\0');
  in.read(text.data(), static_cast<std::streamsize>(n));
  const json h = json::parse(text);
  EXPECT_EQ(h["exp_avg/emb"]["dtype"], "U8");
  EXPECT_EQ(h["exp_avg_sq/w2"]["dtype"], "U8");
  EXPECT_EQ(h["exp_avg_absmax/emb"]["dtype"], "F32");
  EXPECT_EQ(h["exp_avg_absmax/emb"]["shape"], json::array({20}));  // ceil(5000 / 256)
  EXPECT_EQ(h["exp_avg/bias"]["dtype"], "F32");
  EXPECT_EQ(h["emb"]["dtype"], "F32");
  EXPECT_FALSE(h.contains("exp_avg_absmax/frozen"));
  EXPECT_EQ(json::parse(h["__metadata__"]["state_format"].get<std::string>())["dtype"], "int8");
  // Loaded into a fresh int8 session: the same codes, values and steps, bit for bit.
  auto b = Make({{"device", "1MiB"}, {"optimizer", State("int8", {{"state_min_elems", 1000}})}},
                kModel);
  ASSERT_THAT(b->LoadCheckpoint(path), IsOk());
  for (size_t t = 0; t < kModel.size(); ++t) {
    std::vector<float> pa(kModel[t].numel), pb(kModel[t].numel);
    ASSERT_THAT(a->values().ReadParam(t, pa.data()), IsOk());
    ASSERT_THAT(b->values().ReadParam(t, pb.data()), IsOk());
    EXPECT_EQ(pa, pb);
    if (!kModel[t].trainable) continue;
    EXPECT_EQ(b->values().step_count(t), 3);
    for (ChunkKind k : {ChunkKind::kExpAvg, ChunkKind::kExpAvgSq}) {
      EXPECT_EQ(Read(*a, t, k), Read(*b, t, k)) << kModel[t].name;
    }
    std::vector<uint8_t> qa(kModel[t].numel * 4), qb(qa.size());
    std::vector<float> aa(64), ab(64);
    ASSERT_THAT(a->values().ReadStateRaw(t, ChunkKind::kExpAvgSq, qa.data(), aa.data()), IsOk());
    ASSERT_THAT(b->values().ReadStateRaw(t, ChunkKind::kExpAvgSq, qb.data(), ab.data()), IsOk());
    EXPECT_EQ(qa, qb);
    EXPECT_EQ(aa, ab);
  }
  std::filesystem::remove_all(std::filesystem::path(path).parent_path());
}

TEST(SessionState, CheckpointsConvertBetweenFormats) {
  const std::string path = TempFile("convert.safetensors");
  for (const char* from : {"int8", "bf16", "fp32"}) {
    auto a = Trained(from);
    ASSERT_TRUE(a);
    ASSERT_THAT(a->SaveCheckpoint(path), IsOk());
    for (const char* to : {"int8", "bf16", "fp32"}) {
      SCOPED_TRACE(std::string(from) + " -> " + to);
      auto b = Make({{"device", "1MiB"}, {"optimizer", State(to, {{"state_min_elems", 1000}})}},
                    kModel);
      ASSERT_THAT(b->LoadCheckpoint(path), IsOk());
      for (size_t t = 0; t < kModel.size(); ++t) {
        if (!kModel[t].trainable) continue;
        for (ChunkKind k : {ChunkKind::kExpAvg, ChunkKind::kExpAvgSq}) {
          // The saved values (a's dequantized state), stored in b's format: exactly what
          // writing them into b gives.
          const std::vector<float> saved = Read(*a, t, k);
          if (std::string(from) == to) {  // the stored codes themselves
            EXPECT_EQ(Read(*b, t, k), saved) << kModel[t].name;
            continue;
          }
          auto c = Make({{"device", "1MiB"}, {"optimizer", State(to, {{"state_min_elems", 1000}})}},
                        kModel);
          ASSERT_THAT(c->values().WriteTensor(t, k, saved.data()), IsOk());
          EXPECT_EQ(Read(*b, t, k), Read(*c, t, k)) << kModel[t].name;
        }
      }
    }
  }
  std::filesystem::remove_all(std::filesystem::path(path).parent_path());
}

TEST(SessionState, BadFormatsAreRefusedBeforeAnythingIsBuilt) {
  SessionConfig c;
  c.device_kind = DeviceKind::kSim;
  c.host_budget = 64 << 20;
  c.optimizer_state.format = {StateDType::kInt8, 100};
  EXPECT_THAT(Session::Create(c, kModel),
              StatusIs(StatusCode::kInvalidArgument, "must be a power of two"));
  c.optimizer_state.format = {StateDType::kInt8, 256, true};
  EXPECT_THAT(Session::Create(c, kModel), StatusIs(StatusCode::kInvalidArgument, "stochastic"));
  c.optimizer_state.format = {StateDType::kInt8, 256};
  c.chunk_size = 10000;  // not a multiple of the block
  EXPECT_THAT(Session::Create(c, kModel),
              StatusIs(StatusCode::kInvalidArgument, "not a multiple of optimizer.state_block"));
}

// The NVMe bytes compressed state saved (Session::StateTrafficOf, stats()["optimizer"]), by
// hand: one int8 tensor of 1000 elements, block 256 -> m and v each 1000 code bytes + 4 absmax
// floats = 1016 bytes (2032 for both; 8000 in fp32). Both chunks written to and read from NVMe
// once: 4 x 1016 = 4064 bytes moved, which in fp32 would have been 4 x 4000 = 16000: 11936
// bytes saved.
TEST(SessionState, NvmeBytesSavedIsTheFp32TrafficLessTheMovedBytes) {
  const StateTraffic t = EstimateStateTraffic(2032, 8000, 4064);
  EXPECT_EQ(t.state_bytes, 2032u);
  EXPECT_EQ(t.state_bytes_fp32, 8000u);
  EXPECT_EQ(t.nvme_state_bytes, 4064u);
  EXPECT_EQ(t.nvme_bytes_saved, 11936u);
  // fp32 state saves nothing; no state at all (nothing trains) saves nothing and divides by
  // nothing; nothing moved saves nothing.
  EXPECT_EQ(EstimateStateTraffic(8000, 8000, 4064).nvme_bytes_saved, 0u);
  EXPECT_EQ(EstimateStateTraffic(0, 0, 0).nvme_bytes_saved, 0u);
  EXPECT_EQ(EstimateStateTraffic(2032, 8000, 0).nvme_bytes_saved, 0u);
  // The estimate truncates: 9 x (8/3 - 1) = 15 - 1 ulp in doubles.
  EXPECT_EQ(EstimateStateTraffic(3, 8, 9).nvme_bytes_saved, 14u);
}

}  // namespace
}  // namespace tiermem::session
