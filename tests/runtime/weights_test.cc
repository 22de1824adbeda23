// LoadWeights / ExportWeights (runtime/weights.h): values land exactly as WriteParam would put
// them (fp32, bf16 and fp16 files; fp32 and mixed-precision sessions), in host mode, with
// SimDevice and with NVMe homes; fused tensors assembled from keys in several shards, and
// transposed; every bad input refused with the session untouched; exports that load back.
#include "runtime/weights.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/resource.h>

#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "runtime/session.h"
#include "tests/support/status_matchers.h"
#include "tiers/nvme/file_homes.h"
#include "weights/shard_writer.h"
#include "weights/weight_files.h"

namespace tiermem::session {
namespace {

using ::testing::ElementsAre;
using ::tiermem::testing::IsOk;
using ::tiermem::testing::StatusIs;
using nlohmann::json;
using weights::DType;

std::string TempDir() {
  char tmpl[] = "/tmp/tiermem-weights-XXXXXX";
  EXPECT_NE(mkdtemp(tmpl), nullptr);
  return tmpl;
}

// "big" (10000 elements) is larger than a 4096-element chunk: several pieces in several groups.
const std::vector<TensorSpec> kSpecs = {
    {"emb", 3000, true, 0, {30, 100}},   {"w", 2048, true, 0, {32, 64}},
    {"b", 77, true, 0, {77}},            {"big", 10000, true, 0, {100, 100}},
    {"frozen", 900, false, 0, {30, 30}},
};

// Chunks of 4096 elements split "big"; host mode keeps tensors whole (session.cc), so there
// chunks are 10240 elements unless the test says otherwise.
std::unique_ptr<Session> Make(json config, const std::vector<TensorSpec>& specs = kSpecs) {
  if (!config.contains("chunk_size")) {
    config["chunk_size"] = config.value("device_kind", "") == "host" ? 10240 : 4096;
  }
  auto c = ParseConfig(config, MapEnv({}));
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  if (!c.ok()) return nullptr;
  auto s = Session::Create(*c, specs);
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? std::move(s).value() : nullptr;
}

float Value(size_t t, size_t i) { return std::sin(0.37f * static_cast<float>(i) + t) * 3.1f; }
std::vector<float> Values(size_t t, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = Value(t, i);
  return v;
}

// `v` as a file of `d` stores it, and back: what loading it must give in fp32.
std::vector<float> AsStored(const std::vector<float>& v, DType d) {
  if (d == DType::kF32) return v;
  const kernels::DType k = d == DType::kBF16 ? kernels::DType::kBF16 : kernels::DType::kF16;
  std::vector<uint16_t> low(v.size());
  kernels::CastFromF32(v.data(), low.data(), k, v.size());
  std::vector<float> back(v.size());
  kernels::CastToF32(low.data(), k, back.data(), v.size());
  return back;
}

struct FileTensor {
  std::string key;
  DType dtype = DType::kF32;
  std::vector<uint64_t> shape;
  std::vector<float> values;
};

// Writes the tensors with the project's writer (max_shard 0: model.safetensors).
void WriteWeights(const std::string& dir, const std::vector<FileTensor>& ts,
                  uint64_t max_shard = 0) {
  std::vector<weights::ShardEntry> entries;
  for (const FileTensor& t : ts) entries.push_back({t.key, t.dtype, t.shape});
  weights::ShardWriterOptions o;
  o.max_shard_bytes = max_shard;
  auto w = weights::ShardWriter::Create(dir, entries, o);
  ASSERT_THAT(w, IsOk());
  for (size_t i : (*w)->order()) {
    const FileTensor& t = ts[i];
    if (t.dtype == DType::kF32) {
      ASSERT_THAT((*w)->Put(t.values.data(), t.values.size() * 4), IsOk());
    } else if (t.dtype != DType::kBF16 && t.dtype != DType::kF16) {  // zeros of its size
      const std::string zeros(entries[i].bytes(), '\0');
      ASSERT_THAT((*w)->Put(zeros.data(), zeros.size()), IsOk());
    } else {
      std::vector<uint16_t> low(t.values.size());
      kernels::CastFromF32(t.values.data(), low.data(),
                           t.dtype == DType::kBF16 ? kernels::DType::kBF16 : kernels::DType::kF16,
                           low.size());
      ASSERT_THAT((*w)->Put(low.data(), low.size() * 2), IsOk());
    }
  }
  ASSERT_THAT((*w)->Finish(), IsOk());
}

// One file tensor per session tensor, named and shaped like it.
std::vector<FileTensor> Named(const std::vector<TensorSpec>& specs, DType d) {
  std::vector<FileTensor> out;
  for (size_t t = 0; t < specs.size(); ++t) {
    out.push_back({specs[t].name, d,
                   std::vector<uint64_t>(specs[t].shape.begin(), specs[t].shape.end()),
                   Values(t, specs[t].numel)});
  }
  return out;
}

std::vector<WeightTarget> ByName(const Session& s) {
  std::vector<WeightTarget> out;
  for (size_t t = 0; t < s.layout().num_tensors(); ++t) out.push_back({t, {{s.layout().spec(t).name}}});
  return out;
}

std::vector<float> Param(Session& s, size_t t) {
  std::vector<float> v(s.layout().place(t).numel);
  EXPECT_THAT(s.values().ReadParam(t, v.data()), IsOk());
  return v;
}

std::vector<uint16_t> Lowp(Session& s, size_t t) {
  std::vector<uint16_t> v(s.layout().place(t).numel);
  EXPECT_THAT(s.values().ReadTensor(t, ChunkKind::kParamLowp, v.data()), IsOk());
  return v;
}

StatusOr<LoadWeightsReport> Load(Session& s, const std::string& path,
                                 const std::vector<WeightTarget>& targets,
                                 const LoadWeightsOptions& o = {}) {
  StatusOr<weights::WeightFiles> files = weights::OpenWeights(path);
  if (!files.ok()) return files.status();
  return LoadWeights(s, *files, targets, o);
}

class WeightsTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = TempDir(); }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string dir_;
};

struct Mode {
  const char* name;
  json config;
};

class LoadIntoEveryTier : public WeightsTest, public ::testing::WithParamInterface<Mode> {
 protected:
  std::unique_ptr<Session> MakeParam(const std::string& precision) {
    json c = GetParam().config;
    c["precision"] = precision;
    if (c.contains("nvme")) c["nvme"]["path"] = dir_;
    return Make(c);
  }
};

// A bf16 checkpoint into fp32 chunks: the widened values exactly, m and v lazily zero; in
// NVMe homes, no chunk is read back from NVMe during the load.
TEST_P(LoadIntoEveryTier, Bf16IntoFp32ChunksExactlyWithoutReadingNvmeBack) {
  WriteWeights(dir_ + "/ckpt", Named(kSpecs, DType::kBF16), 20'000);
  auto s = MakeParam("fp32");
  ASSERT_NE(s, nullptr);
  StatusOr<LoadWeightsReport> r = Load(*s, dir_ + "/ckpt", ByName(*s));
  ASSERT_THAT(r, IsOk());
  EXPECT_TRUE(r->missing.empty());
  EXPECT_LE(r->staging_bytes, 32 * kMiB);
  auto st = s->Stats();
  ASSERT_TRUE(st.ok());
  const int H = static_cast<int>(TierKind::kHost), N = static_cast<int>(TierKind::kNvme);
  EXPECT_EQ(st->bytes_moved[N][H], 0u);  // nothing read back
  for (size_t t = 0; t < kSpecs.size(); ++t) {
    EXPECT_EQ(Param(*s, t), AsStored(Values(t, kSpecs[t].numel), DType::kBF16)) << kSpecs[t].name;
  }
  for (size_t g = 0; g < s->layout().num_groups(); ++g) {
    if (!s->layout().group(g).trainable) continue;
    EXPECT_TRUE(s->chunks().LazilyZero(g, ChunkKind::kExpAvg)) << g;
    EXPECT_TRUE(s->chunks().LazilyZero(g, ChunkKind::kExpAvgSq)) << g;
    EXPECT_TRUE(s->chunks().LazilyZero(g, ChunkKind::kGrad)) << g;
  }
}

// The loader acquires each lazily zero values chunk (fp32, or the bf16 compute chunk of a group
// exact in it) unfilled and writes its tensors: every element no tensor covers (the padding
// between and after them) is zero after the load, even where the memory handed over held other
// bytes (a chunk zeroed lazily over old content).
TEST_P(LoadIntoEveryTier, ChunkPaddingStaysZero) {
  WriteWeights(dir_ + "/ckpt", Named(kSpecs, DType::kBF16), 20'000);
  // fp32 chunks; in bf16, the frozen tensor's group holds its values in its bf16 compute chunk.
  std::vector<TensorSpec> lowp = kSpecs;
  for (TensorSpec& t : lowp) t.values_in_compute_dtype = !t.trainable;
  for (const auto& [precision, specs] : {std::pair{"fp32", kSpecs}, std::pair{"bf16", lowp}}) {
    SCOPED_TRACE(precision);
    json c = GetParam().config;
    c["precision"] = precision;
    if (c.contains("nvme")) c["nvme"]["path"] = dir_;
    auto s = Make(c, specs);
    ASSERT_NE(s, nullptr);
    auto kind = [&](size_t g) { return s->layout().value_kind(g); };
    for (size_t g = 0; g < s->layout().num_groups(); ++g) {  // old bytes everywhere, then lazily zero
      auto p = s->chunks().Acquire(g, kind(g), TierKind::kHost);
      ASSERT_THAT(p, IsOk());
      std::memset(*p, 0xff, s->chunks().ChunkBytes(g, kind(g)));
      ASSERT_THAT(s->chunks().Release(g, kind(g), true), IsOk());
      ASSERT_THAT(s->chunks().ZeroChunk(g, kind(g)), IsOk());
    }
    ASSERT_THAT(Load(*s, dir_ + "/ckpt", ByName(*s)), IsOk());
    auto esize = [&](size_t g) { return kind(g) == ChunkKind::kParamFp32 ? 4u : 2u; };
    std::vector<std::vector<bool>> covered(s->layout().num_groups());
    for (size_t g = 0; g < s->layout().num_groups(); ++g) {
      covered[g].assign(s->chunks().ChunkBytes(g, kind(g)) / esize(g), false);
    }
    for (size_t t = 0; t < s->layout().num_tensors(); ++t) {
      for (const auto& pc : s->layout().place(t).pieces) {
        for (uint64_t i = 0; i < pc.numel; ++i) covered[pc.group][pc.offset + i] = true;
      }
    }
    int padded = 0, lowp_groups = 0;
    for (size_t g = 0; g < s->layout().num_groups(); ++g) {
      lowp_groups += kind(g) != ChunkKind::kParamFp32;
      auto p = s->chunks().Acquire(g, kind(g), TierKind::kHost);
      ASSERT_THAT(p, IsOk());
      const auto* v = static_cast<const uint8_t*>(*p);  // bits: -0.0 is not padding's zero
      for (size_t i = 0; i < covered[g].size(); ++i) {
        if (covered[g][i]) continue;
        ++padded;
        for (size_t b = 0; b < esize(g); ++b) {
          ASSERT_EQ(v[i * esize(g) + b], 0u) << "group " << g << " element " << i;
        }
      }
      ASSERT_THAT(s->chunks().Release(g, kind(g), false), IsOk());
    }
    EXPECT_GT(padded, 0);  // the test is about them
    EXPECT_EQ(lowp_groups > 0, std::string(precision) == "bf16");
  }
}

// Mixed precision: the master and the compute copy bit for bit those WriteParam gives the same
// values — from bf16, fp16 and fp32 files.
TEST_P(LoadIntoEveryTier, MixedPrecisionEqualsWriteParamBitForBit) {
  for (DType d : {DType::kBF16, DType::kF16, DType::kF32}) {
    for (const char* precision : {"bf16", "fp16"}) {
      const std::string path = dir_ + "/c" + std::string(weights::DTypeName(d));
      std::filesystem::remove_all(path);
      WriteWeights(path, Named(kSpecs, d));
      auto loaded = MakeParam(precision);
      auto written = Make({{"device_kind", "host"}, {"host", "64MiB"}, {"precision", precision}});
      ASSERT_NE(loaded, nullptr);
      ASSERT_NE(written, nullptr);
      ASSERT_THAT(Load(*loaded, path, ByName(*loaded)), IsOk());
      for (size_t t = 0; t < kSpecs.size(); ++t) {
        const std::vector<float> v = AsStored(Values(t, kSpecs[t].numel), d);
        ASSERT_THAT(written->values().WriteParam(t, v.data()), IsOk());
        EXPECT_EQ(Param(*loaded, t), v) << kSpecs[t].name;
        EXPECT_EQ(Lowp(*loaded, t), Lowp(*written, t)) << kSpecs[t].name << " " << precision;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Tiers, LoadIntoEveryTier,
    ::testing::Values(Mode{"host", {{"device_kind", "host"}, {"host", "64MiB"}}},
                      Mode{"sim", {{"device_kind", "sim"}, {"device", "1MiB"}, {"host", "64MiB"}}},
                      // Host budgets below the model: most chunks are homed on NVMe.
                      Mode{"host_nvme",
                           {{"device_kind", "host"}, {"host", "320KiB"},
                            {"nvme", {{"size", "8MiB"}}}}},
                      Mode{"sim_nvme",
                           {{"device_kind", "sim"}, {"device", "256KiB"}, {"host", "192KiB"},
                            {"nvme", {{"size", "8MiB"}}}}}),
    [](const auto& info) { return std::string(info.param.name); });

TEST_F(WeightsTest, NvmeHomesAreFilledWhenTheHostBudgetIsBelowTheModel) {
  auto s = Make({{"device_kind", "host"}, {"host", "320KiB"},
                 {"nvme", {{"size", "8MiB"}, {"path", dir_}}}});
  ASSERT_NE(s, nullptr);
  int on_nvme = 0;
  for (size_t g = 0; g < s->layout().num_groups(); ++g) {
    on_nvme += s->chunks().Home(g, ChunkKind::kParamFp32) == TierKind::kNvme;
  }
  EXPECT_GT(on_nvme, 1);  // the test is about them
}

// A checkpoint whose order interleaves the chunk groups (tensor k of every group, then k + 1)
// while the host room holds far fewer chunks than there are NVMe-homed groups: a load in file
// order would write chunks home half-filled and read them back; group by group, none is.
TEST_F(WeightsTest, NvmeHomedChunksAreNeverReadBackWhateverTheFileOrder) {
  const size_t kGroups = 12, kPer = 4;
  std::vector<TensorSpec> specs;
  for (size_t i = 0; i < kGroups * kPer; ++i) {
    specs.push_back({"t" + std::to_string(i), 2500, true, 0, {50, 50}});
  }
  auto s = Make({{"device_kind", "host"}, {"host", "320KiB"},
                 {"nvme", {{"size", "16MiB"}, {"path", dir_}}}},
                specs);
  ASSERT_NE(s, nullptr);
  ASSERT_EQ(s->layout().num_groups(), kGroups);
  std::vector<FileTensor> ts;
  for (size_t k = 0; k < kPer; ++k) {
    for (size_t g = 0; g < kGroups; ++g) {
      const size_t t = g * kPer + k;
      ts.push_back({specs[t].name, DType::kF32, {50, 50}, Values(t, 2500)});
    }
  }
  WriteWeights(dir_ + "/c", ts);
  ASSERT_THAT(Load(*s, dir_ + "/c", ByName(*s)), IsOk());
  auto st = s->Stats();
  ASSERT_TRUE(st.ok());
  const int H = static_cast<int>(TierKind::kHost), N = static_cast<int>(TierKind::kNvme);
  EXPECT_EQ(st->bytes_moved[N][H], 0u);
  EXPECT_GT(st->bytes_moved[H][N], 0u);  // written home, once each
  EXPECT_LE(st->bytes_moved[H][N], kGroups * s->chunks().ChunkBytes(0, ChunkKind::kParamFp32));
  for (size_t t = 0; t < specs.size(); ++t) EXPECT_EQ(Param(*s, t), Values(t, 2500)) << t;
}

// Twelve groups of four [50, 50] tensors with a host budget far below them: most groups are
// homed on NVMe, the host keeping room for a few chunks beside the homes.
std::vector<TensorSpec> TwelveGroups() {
  std::vector<TensorSpec> specs;
  for (size_t i = 0; i < 48; ++i) specs.push_back({"t" + std::to_string(i), 2500, true, 0, {50, 50}});
  return specs;
}

// The load is one pipeline (runtime/weights.cc): each NVMe-homed chunk, once filled, is written
// home in the background while the next groups are read and converted beside it. From fp32,
// bf16 and fp16 files in three shards, into fp32 and bf16 sessions: the values are the stored
// ones exactly (the compute copy as WriteParam rounds it), every NVMe-homed chunk is written
// home once and in the background (one write-behind each, none left dirty), none is read
// back, and the host tier never holds more than its budget.
TEST_F(WeightsTest, ThePipelinedLoadWritesEachNvmeHomeOnceInTheBackground) {
  const std::vector<TensorSpec> specs = TwelveGroups();
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (const char* precision : {"fp32", "bf16"}) {
      SCOPED_TRACE(std::string(weights::DTypeName(d)) + " into " + precision);
      const std::string path = dir_ + "/c";
      std::filesystem::remove_all(path);
      const std::vector<FileTensor> ts = Named(specs, d);
      WriteWeights(path, ts, 48 * 2500 * (d == DType::kF32 ? 4 : 2) / 3 + 1);
      ASSERT_TRUE(std::filesystem::exists(path + "/model-00003-of-00003.safetensors"));
      auto s = Make({{"device_kind", "host"}, {"host", "320KiB"}, {"precision", precision},
                     {"nvme", {{"size", "16MiB"}, {"path", dir_}}}},
                    specs);
      auto written = Make({{"device_kind", "host"}, {"host", "64MiB"}, {"precision", precision}},
                          specs);
      ASSERT_NE(s, nullptr);
      ASSERT_NE(written, nullptr);
      StatusOr<LoadWeightsReport> r = Load(*s, path, ByName(*s));
      ASSERT_THAT(r, IsOk());
      EXPECT_LE(r->staging_bytes, 32 * kMiB);
      uint64_t nvme_chunks = 0;
      Bytes nvme_bytes = 0;
      for (size_t g = 0; g < s->layout().num_groups(); ++g) {
        for (ChunkKind k : {ChunkKind::kParamFp32, ChunkKind::kParamLowp}) {
          if (k == ChunkKind::kParamLowp && !s->layout().mixed()) continue;
          if (s->chunks().Home(g, k) != TierKind::kNvme) continue;
          ++nvme_chunks;
          nvme_bytes += s->chunks().ChunkBytes(g, k);
          EXPECT_EQ(s->chunks().Resident(g, k), TierKind::kNvme) << g;  // written and dropped
        }
      }
      EXPECT_GT(nvme_chunks, 4u);  // the test is about them
      auto st = s->Stats();
      ASSERT_TRUE(st.ok());
      const int H = static_cast<int>(TierKind::kHost), N = static_cast<int>(TierKind::kNvme);
      EXPECT_EQ(st->bytes_moved[N][H], 0u);  // nothing read back
      EXPECT_EQ(st->bytes_moved[H][N], nvme_bytes);  // each written home once
      EXPECT_EQ(st->write_behinds, nvme_chunks);     // in the background
      EXPECT_LE(st->tiers[H].peak, st->tiers[H].capacity);
      for (size_t t = 0; t < specs.size(); ++t) {
        const std::vector<float> v = AsStored(Values(t, specs[t].numel), d);
        EXPECT_EQ(Param(*s, t), v) << t;
        if (!s->layout().mixed()) continue;
        ASSERT_THAT(written->values().WriteParam(t, v.data()), IsOk());
        EXPECT_EQ(Lowp(*s, t), Lowp(*written, t)) << t;
      }
    }
  }
}

// A write home failing in the pipeline (the NVMe file may not be written past all but the last
// NVMe home: RLIMIT_FSIZE, EFBIG) is the load's error, after validation, naming the write —
// also the last one, which fails in the background after every byte was read and converted,
// with nothing but the load's end waiting for it.
TEST_F(WeightsTest, AWriteHomeFailingInThePipelineIsTheLoadsError) {
  const std::vector<TensorSpec> specs = TwelveGroups();
  WriteWeights(dir_ + "/c", Named(specs, DType::kBF16), 100'000);
  auto s = Make({{"device_kind", "host"}, {"host", "320KiB"},
                 {"nvme", {{"size", "16MiB"}, {"path", dir_}}}},
                specs);
  ASSERT_NE(s, nullptr);
  StatusOr<weights::WeightFiles> files = weights::OpenWeights(dir_ + "/c");
  ASSERT_THAT(files, IsOk());
  const Bytes chunk = s->chunks().ChunkBytes(0, ChunkKind::kParamFp32);
  uint64_t on_nvme = 0;  // homed one after the other from the file's start
  for (size_t g = 0; g < s->layout().num_groups(); ++g) {
    on_nvme += s->chunks().Home(g, ChunkKind::kParamFp32) == TierKind::kNvme;
  }
  ASSERT_GT(on_nvme, 4u);
  rlimit was{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &was), 0);
  rlimit small = was;
  small.rlim_cur = (on_nvme - 1) * chunk;
  const auto sigxfsz = signal(SIGXFSZ, SIG_IGN);  // EFBIG instead of the signal
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  StatusOr<LoadWeightsReport> r = LoadWeights(*s, *files, ByName(*s));
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &was), 0);
  signal(SIGXFSZ, sigxfsz);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()),
              ::testing::AllOf(::testing::HasSubstr("failed after validation"),
                               ::testing::HasSubstr("partly loaded"),
                               ::testing::HasSubstr("File too large")));
  auto st = s->Stats();
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->bytes_moved[static_cast<int>(TierKind::kHost)][static_cast<int>(TierKind::kNvme)],
            on_nvme * chunk);  // each issued once; the last one failed
}

// A fused mixture-of-experts pair, [E, 2I, H] and [E, H, I], assembled from per-expert [I, H]
// and [H, I] keys spread over three shards, as transformers saves them.
TEST_F(WeightsTest, FusedExpertsFromPerExpertKeysInSeveralShards) {
  const uint64_t E = 4, I = 8, H = 16;
  const std::vector<TensorSpec> specs = {{"gate_up", E * 2 * I * H, true, 0, {4, 16, 16}},
                                         {"down", E * H * I, true, 0, {4, 16, 8}}};
  std::vector<FileTensor> ts;
  std::vector<WeightTarget> targets = {{0, {}}, {1, {}}};
  std::vector<float> want_gu(E * 2 * I * H), want_down(E * H * I);
  for (uint64_t e = 0; e < E; ++e) {
    const std::string p = "experts." + std::to_string(e) + ".";
    for (int part = 0; part < 3; ++part) {
      const std::string name = part == 0 ? "gate_proj" : part == 1 ? "up_proj" : "down_proj";
      const std::vector<uint64_t> shape = part < 2 ? std::vector<uint64_t>{I, H} : std::vector<uint64_t>{H, I};
      ts.push_back({p + name + ".weight", DType::kBF16, shape, Values(10 * e + part, I * H)});
      const std::vector<float> v = AsStored(ts.back().values, DType::kBF16);
      if (part < 2) {
        const uint64_t at = e * 2 * I * H + part * I * H;
        targets[0].segments.push_back({ts.back().key, at});
        std::copy(v.begin(), v.end(), want_gu.begin() + at);
      } else {
        targets[1].segments.push_back({ts.back().key, e * H * I, {16, 8}});
        std::copy(v.begin(), v.end(), want_down.begin() + e * H * I);
      }
    }
  }
  WriteWeights(dir_ + "/moe", ts, 700);
  ASSERT_GE(weights::OpenWeights(dir_ + "/moe")->files.size(), 3u);
  auto s = Make({{"device_kind", "sim"}, {"device", "1MiB"}, {"host", "64MiB"},
                 {"chunk_size", 512}},
                specs);
  ASSERT_NE(s, nullptr);
  ASSERT_GT(s->layout().place(0).pieces.size(), 1u);  // spread over pieces too
  ASSERT_THAT(Load(*s, dir_ + "/moe", targets), IsOk());
  EXPECT_EQ(Param(*s, 0), want_gu);
  EXPECT_EQ(Param(*s, 1), want_down);
}

TEST_F(WeightsTest, ATransposedSegment) {
  const std::vector<TensorSpec> specs = {{"w", 12, true, 0, {3, 4}}};
  const std::vector<float> file = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11};  // [4, 3]
  WriteWeights(dir_ + "/t", {{"w", DType::kF32, {4, 3}, file}});
  auto s = Make({{"device_kind", "host"}, {"host", "64MiB"}}, specs);
  ASSERT_NE(s, nullptr);
  WeightSegment seg{"w"};
  seg.transpose = true;
  ASSERT_THAT(Load(*s, dir_ + "/t", {{0, {seg}}}), IsOk());
  EXPECT_THAT(Param(*s, 0), ElementsAre(0, 3, 6, 9, 1, 4, 7, 10, 2, 5, 8, 11));
  // Export transposes back.
  ExportOptions o;
  ASSERT_THAT(ExportWeights(*s, dir_ + "/back", {{"w", {4, 3}, {{0, 0, 12, true}}}}, o), IsOk());
  auto back = weights::OpenWeights(dir_ + "/back");
  ASSERT_THAT(back, IsOk());
  const std::string bytes = *weights::ReadTensorBytes(*back, "w");
  std::vector<float> v(12);
  std::memcpy(v.data(), bytes.data(), 48);
  EXPECT_EQ(v, file);
}

// A bf16 tensor at an odd byte offset (after a 3-byte one), read in 64 KiB requests: its
// elements straddle request boundaries.
TEST_F(WeightsTest, AnUnalignedTensorAcrossRequests) {
  const uint64_t n = 100'000;
  const std::vector<TensorSpec> specs = {{"w", n, true, 0, {n}}};
  const std::vector<float> v = AsStored(Values(0, n), DType::kBF16);
  std::vector<uint16_t> low(n);
  kernels::CastFromF32(v.data(), low.data(), kernels::DType::kBF16, n);
  const json h = {{"pad", {{"dtype", "U8"}, {"shape", {3}}, {"data_offsets", {0, 3}}}},
                  {"w", {{"dtype", "BF16"}, {"shape", {n}}, {"data_offsets", {3, 3 + 2 * n}}}}};
  std::string text = h.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t len = text.size();
  std::ofstream out(dir_ + "/u.safetensors", std::ios::binary);
  out.write(reinterpret_cast<const char*>(&len), 8);
  out << text << "abc";
  out.write(reinterpret_cast<const char*>(low.data()), 2 * n);
  out.close();
  auto s = Make({{"device_kind", "host"}, {"host", "64MiB"}, {"chunk_size", 1 << 17}}, specs);
  ASSERT_NE(s, nullptr);
  LoadWeightsOptions o;
  o.request_bytes = 64 * kKiB;
  o.depth = 2;
  o.ignore = [](std::string_view k) { return k == "pad"; };
  StatusOr<LoadWeightsReport> r = Load(*s, dir_ + "/u.safetensors", ByName(*s), o);
  ASSERT_THAT(r, IsOk());
  EXPECT_THAT(r->ignored, ElementsAre("pad"));
  EXPECT_EQ(Param(*s, 0), v);
}

// Every bad input is kInvalidArgument naming the key (or tensor) and the file, and changes
// nothing.
TEST_F(WeightsTest, BadInputsAreRefusedAndTheSessionIsUntouched) {
  auto s = Make({{"device_kind", "sim"}, {"device", "1MiB"}, {"host", "64MiB"},
                 {"precision", "bf16"}});
  ASSERT_NE(s, nullptr);
  std::vector<std::vector<float>> before;
  for (size_t t = 0; t < kSpecs.size(); ++t) {
    const std::vector<float> v = Values(t + 50, kSpecs[t].numel);
    ASSERT_THAT(s->values().WriteParam(t, v.data()), IsOk());
    before.push_back(Param(*s, t));
  }
  std::vector<FileTensor> good = Named(kSpecs, DType::kF32);
  const std::string ckpt = dir_ + "/ckpt";
  WriteWeights(ckpt, good);
  const std::string file = ckpt + "/model.safetensors";
  auto refused = [&](const std::vector<WeightTarget>& targets, const std::string& why,
                     const LoadWeightsOptions& o = {}) {
    EXPECT_THAT(Load(*s, ckpt, targets, o), StatusIs(StatusCode::kInvalidArgument, why));
    for (size_t t = 0; t < kSpecs.size(); ++t) EXPECT_EQ(Param(*s, t), before[t]) << why;
  };
  std::vector<WeightTarget> t = ByName(*s);
  t[1].segments[0].key = "nope";
  refused(t, "tensor 'w': the checkpoint " + ckpt + " has no key 'nope'");
  t = ByName(*s);
  t[1].segments.clear();  // 'w' has no source: missing, and its key unused
  refused(t, "tensor 'w' has no source in " + ckpt);
  LoadWeightsOptions lax;
  lax.strict = false;
  refused(t, "holds key 'w', which no parameter of the model uses", lax);
  t = ByName(*s);
  t[0].segments[0].shape = {100, 30};
  refused(t, "tensor 'emb': key 'emb' in " + file + " has shape [30, 100], expected [100, 30]");
  t = ByName(*s);
  t[2].segments[0].key = "emb";  // a tensor's only key: the tensor's shape expected
  refused(t, "key 'emb' in " + file + " has shape [30, 100], expected [77]");
  t = ByName(*s);
  t[3].segments = {{"emb", 0}, {"big", 3000}};
  refused(t, "key 'big' in " + file + " has 10000 elements [100, 100], which from element 3000 "
             "overrun the tensor's 10000");
  t = ByName(*s);
  t[3].segments = {{"big", 0, {1, 10000}}};  // a stated shape the file does not have
  refused(t, "key 'big' in " + file + " has shape [100, 100], expected [1, 10000]");
  t = ByName(*s);
  t[3].segments = {{"emb", 0}, {"b", 2990}};
  refused(t, "tensor 'big': key 'b' starts at element 2990, overlapping 3000 (after key 'emb')",
          lax);
  t[3].segments = {{"emb", 0}, {"w", 3100}};
  refused(t, "tensor 'big': key 'w' starts at element 3100, leaving elements from 3000", lax);
  t[3].segments = {{"emb", 0}, {"w", 3000}};
  refused(t, "tensor 'big' has 10000 elements, its keys cover 5048 (the last: 'w')", lax);
  t = ByName(*s);
  t[3].segments[0].transpose = true;  // [100, 100] -> spread over pieces
  refused(t, "chunk pieces of the tensor: a transposed segment must land in one");
  t = ByName(*s);
  t.push_back(t[0]);
  refused(t, "tensor 'emb' is given sources twice");
  // A dtype that does not load.
  std::filesystem::remove_all(ckpt);
  std::vector<FileTensor> with_int = good;
  with_int.push_back({"steps", DType::kI32, {77}, {}});
  WriteWeights(ckpt, with_int);
  t = ByName(*s);
  refused(t, "holds key 'steps', which no parameter of the model uses");
  t[2].segments = {{"steps"}};
  LoadWeightsOptions allow_b;
  allow_b.ignore = [](std::string_view k) { return k == "b"; };
  refused(t, "tensor 'b': key 'steps' in " + file + " is I32: only F32, BF16 and F16 load",
          allow_b);
  // A file changed after its header was read.
  StatusOr<weights::WeightFiles> files = weights::OpenWeights(ckpt);
  ASSERT_THAT(files, IsOk());
  std::filesystem::resize_file(file, std::filesystem::file_size(file) + 10);
  EXPECT_THAT(LoadWeights(*s, *files, ByName(*s),
                          LoadWeightsOptions{true, [](std::string_view) { return true; }}),
              StatusIs(StatusCode::kInvalidArgument, file + " changed since its header was read"));
  for (size_t i = 0; i < kSpecs.size(); ++i) EXPECT_EQ(Param(*s, i), before[i]);
}

TEST_F(WeightsTest, StrictFalseLeavesTensorsWithoutSourcesUntouched) {
  auto s = Make({{"device_kind", "host"}, {"host", "64MiB"}});
  ASSERT_NE(s, nullptr);
  const std::vector<float> mine = Values(99, 77);
  ASSERT_THAT(s->values().WriteParam(2, mine.data()), IsOk());
  std::vector<FileTensor> ts = Named(kSpecs, DType::kF32);
  ts.erase(ts.begin() + 2);  // no "b"
  WriteWeights(dir_ + "/c", ts);
  std::vector<WeightTarget> t = ByName(*s);
  t.erase(t.begin() + 2);
  EXPECT_THAT(Load(*s, dir_ + "/c", t), StatusIs(StatusCode::kInvalidArgument,
                                                 "tensor 'b' has no source"));
  LoadWeightsOptions lax;
  lax.strict = false;
  StatusOr<LoadWeightsReport> r = Load(*s, dir_ + "/c", t, lax);
  ASSERT_THAT(r, IsOk());
  EXPECT_THAT(r->missing, ElementsAre(2u));
  EXPECT_EQ(Param(*s, 2), mine);
  EXPECT_EQ(Param(*s, 0), Values(0, 3000));
}

// Export: F32 exactly, BF16 rounded to nearest even; a fused tensor split back per key;
// the export loads back into a fresh session.
TEST_F(WeightsTest, ExportsLoadBack) {
  auto s = Make({{"device_kind", "sim"}, {"device", "1MiB"}, {"host", "64MiB"},
                 {"nvme", {{"size", "8MiB"}, {"path", dir_}}}});
  ASSERT_NE(s, nullptr);
  for (size_t t = 0; t < kSpecs.size(); ++t) {
    const std::vector<float> v = Values(t, kSpecs[t].numel);
    ASSERT_THAT(s->values().WriteParam(t, v.data()), IsOk());
  }
  std::vector<ExportEntry> entries;
  for (size_t t = 0; t < kSpecs.size(); ++t) {
    if (kSpecs[t].name == "big") {  // split in two keys, as fused experts go back per expert
      entries.push_back({"big.0", {50, 100}, {{t, 0, 5000}}});
      entries.push_back({"big.1", {50, 100}, {{t, 5000, 5000}}});
      continue;
    }
    entries.push_back({kSpecs[t].name, kSpecs[t].shape, {{t, 0, kSpecs[t].numel}}});
  }
  const std::vector<int64_t> buffer = {7, -1, 42};
  entries.push_back({"pos", {3}, {}, buffer.data(), DType::kI64});
  for (DType d : {DType::kF32, DType::kBF16}) {
    ExportOptions o;
    o.dtype = d;
    o.writer.max_shard_bytes = 10'000;
    o.piece_elems = 1000;
    const std::string out = dir_ + "/out" + std::string(weights::DTypeName(d));
    ASSERT_THAT(ExportWeights(*s, out, entries, o), IsOk());
    auto files = weights::OpenWeights(out);
    ASSERT_THAT(files, IsOk());
    EXPECT_GT(files->files.size(), 2u);
    EXPECT_EQ(*weights::ReadTensorBytes(*files, "pos"),
              std::string(reinterpret_cast<const char*>(buffer.data()), 24));
    auto fresh = Make({{"device_kind", "host"}, {"host", "64MiB"}});
    ASSERT_NE(fresh, nullptr);
    std::vector<WeightTarget> t = ByName(*fresh);
    t[3].segments = {{"big.0", 0}, {"big.1", 5000}};
    LoadWeightsOptions lo;
    lo.ignore = [](std::string_view k) { return k == "pos"; };
    ASSERT_THAT(Load(*fresh, out, t, lo), IsOk());
    for (size_t i = 0; i < kSpecs.size(); ++i) {
      EXPECT_EQ(Param(*fresh, i), AsStored(Values(i, kSpecs[i].numel), d)) << kSpecs[i].name;
    }
  }
  EXPECT_THAT(ExportWeights(*s, dir_ + "/x", {{"w", {2}, {{1, 0, 3}}}}),
              StatusIs(StatusCode::kInvalidArgument, "'w' [2] has 2 elements, its segments 3"));
  EXPECT_THAT(ExportWeights(*s, dir_ + "/x", {{"w", {2}, {{9, 0, 2}}}}),
              StatusIs(StatusCode::kInvalidArgument, "outside the session's tensors"));
  ExportOptions i64;
  i64.dtype = DType::kI64;
  EXPECT_THAT(ExportWeights(*s, dir_ + "/x", entries, i64),
              StatusIs(StatusCode::kInvalidArgument, "F32, BF16 or F16, not I64"));
}

// A served mixed-precision model on a device with NVMe homes: the session keeps host room for
// one chunk only, so the compute chunk is written where it lives — still WriteParam's bits.
TEST_F(WeightsTest, ServingOnADeviceWithNvmeHomesInMixedPrecision) {
  std::vector<TensorSpec> frozen = kSpecs;
  for (TensorSpec& t : frozen) t.trainable = false;
  auto s = Make({{"device_kind", "sim"}, {"device", "256KiB"}, {"host", "120KiB"},
                 {"precision", "bf16"}, {"nvme", {{"size", "8MiB"}, {"path", dir_}}}},
                frozen);
  auto written = Make({{"device_kind", "host"}, {"host", "64MiB"}, {"precision", "bf16"}}, frozen);
  ASSERT_NE(s, nullptr);
  int on_nvme = 0;
  for (size_t g = 0; g < s->layout().num_groups(); ++g) {
    on_nvme += s->chunks().Home(g, ChunkKind::kParamLowp) == TierKind::kNvme;
  }
  ASSERT_GT(on_nvme, 0);
  WriteWeights(dir_ + "/c", Named(kSpecs, DType::kF32));
  ASSERT_THAT(Load(*s, dir_ + "/c", ByName(*s)), IsOk());
  for (size_t t = 0; t < kSpecs.size(); ++t) {
    const std::vector<float> v = Values(t, kSpecs[t].numel);
    ASSERT_THAT(written->values().WriteParam(t, v.data()), IsOk());
    EXPECT_EQ(Param(*s, t), v) << kSpecs[t].name;
    EXPECT_EQ(Lowp(*s, t), Lowp(*written, t)) << kSpecs[t].name;
  }
}


// Served in place (TensorSpec::read_in_place, runtime/weights.h "Serving in place"): the session
// holds no NVMe room for the compute chunks it expects to read from the checkpoint, so an NVMe
// tier far smaller than the model serves it; a chunk that turns out not readable in place (a
// transposed key) gets a home of the tier's own at the load, or a clear error naming the bytes
// when the tier is too small for it, before anything is written.
class ServedInPlace : public WeightsTest {
 protected:
  // Frozen (served) tensors of 1024 elements, chunks of 2048, host room for few of them: most
  // NVMe-homed. "sq" is square (a transposed key of it has its shape).
  static std::vector<TensorSpec> Specs(bool read_in_place) {
    std::vector<TensorSpec> specs;
    for (int i = 0; i < 7; ++i) {
      specs.push_back({"t" + std::to_string(i), 1024, false, 0, {16, 64}});
    }
    specs.push_back({"sq", 1024, false, 0, {32, 32}});
    for (TensorSpec& t : specs) t.read_in_place = read_in_place;
    return specs;
  }
  std::unique_ptr<Session> MakeServed(bool read_in_place, const std::string& nvme_size) {
    auto c = ParseConfig({{"device_kind", "host"}, {"host", "64KiB"}, {"chunk_size", 2048},
                          {"nvme", {{"size", nvme_size}, {"path", dir_}}}},
                         MapEnv({}));
    EXPECT_TRUE(c.ok()) << c.status().ToString();
    auto s = Session::Create(*c, Specs(read_in_place));
    if (!s.ok()) {
      create_error_ = s.status();
      return nullptr;
    }
    return std::move(s).value();
  }
  Bytes NvmeUsed(Session& s) { return s.chunks().file_homes()->Stats().used; }
  // The NVMe-homed compute chunks: how many, and their bytes.
  std::pair<uint64_t, Bytes> NvmeHomed(Session& s) {
    std::pair<uint64_t, Bytes> out{0, 0};
    for (size_t g = 0; g < s.layout().num_groups(); ++g) {
      if (s.chunks().Home(g, ChunkKind::kParamFp32) == TierKind::kNvme) {
        ++out.first;
        out.second += s.chunks().ChunkBytes(g, ChunkKind::kParamFp32);
      }
    }
    return out;
  }
  Status create_error_;
};

TEST_F(ServedInPlace, NoNvmeRoomIsHeldForChunksReadFromTheCheckpoint) {
  const std::vector<TensorSpec> specs = Specs(false);
  WriteWeights(dir_ + "/c", Named(specs, DType::kF32));
  LoadWeightsOptions serve;
  serve.serving = true;
  // Without the fact, the NVMe-homed chunks need their room in the tier: 4 KiB is too small.
  EXPECT_EQ(MakeServed(false, "4KiB"), nullptr);
  EXPECT_EQ(create_error_.code(), StatusCode::kResourceExhausted) << create_error_.ToString();
  auto s = MakeServed(true, "4KiB");
  ASSERT_NE(s, nullptr) << create_error_.ToString();
  const auto [chunks_on_nvme, bytes_on_nvme] = NvmeHomed(*s);
  ASSERT_GE(bytes_on_nvme, Bytes{16} * kKiB);  // the test is about them
  EXPECT_EQ(NvmeUsed(*s), 0u);
  auto r = Load(*s, dir_ + "/c", ByName(*s), serve);
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ(r->chunks_in_place, chunks_on_nvme);  // every NVMe-homed chunk read in place
  EXPECT_EQ(NvmeUsed(*s), 0u);
  for (size_t t = 0; t < specs.size(); ++t) {
    EXPECT_EQ(Param(*s, t), Values(t, specs[t].numel)) << specs[t].name;
  }
}

TEST_F(ServedInPlace, AChunkNotReadableInPlaceGetsATierHomeOrAClearError) {
  // "sq" stored transposed: its chunk cannot be read in place, and it is NVMe-homed (the last
  // tensor: homes go to the host first).
  const std::vector<TensorSpec> specs = Specs(false);
  std::vector<FileTensor> file = Named(specs, DType::kF32);
  std::vector<float>& sq = file.back().values;
  std::vector<float> sq_t(sq.size());
  for (size_t i = 0; i < 32; ++i) {
    for (size_t j = 0; j < 32; ++j) sq_t[j * 32 + i] = sq[i * 32 + j];
  }
  sq = sq_t;
  WriteWeights(dir_ + "/c", file);
  LoadWeightsOptions serve;
  serve.serving = true;
  auto targets = [](const Session& s) {
    std::vector<WeightTarget> ts = ByName(s);
    ts.back().segments[0].transpose = true;
    return ts;
  };
  {
    auto s = MakeServed(true, "4KiB");
    ASSERT_NE(s, nullptr) << create_error_.ToString();
    ASSERT_EQ(s->chunks().Home(s->layout().place(specs.size() - 1).pieces[0].group,
                               ChunkKind::kParamFp32),
              TierKind::kNvme);
    auto r = Load(*s, dir_ + "/c", targets(*s), serve);
    ASSERT_THAT(r, StatusIs(StatusCode::kResourceExhausted, "of tensor '"));
    EXPECT_THAT(r.status().message(), ::testing::HasSubstr("transposed"));
    EXPECT_THAT(r.status().message(), ::testing::HasSubstr("raise nvme size"));
    EXPECT_EQ(NvmeUsed(*s), 0u);  // nothing changed
    EXPECT_FALSE(s->chunks().placeholder_homes().empty());
  }
  auto s = MakeServed(true, "1MiB");
  ASSERT_NE(s, nullptr) << create_error_.ToString();
  auto r = Load(*s, dir_ + "/c", targets(*s), serve);
  ASSERT_THAT(r, IsOk());
  EXPECT_GT(r->chunks_in_place, 0u);
  EXPECT_GT(NvmeUsed(*s), 0u);  // sq's chunk: a home of the tier's own
  EXPECT_TRUE(s->chunks().placeholder_homes().empty());
  for (size_t t = 0; t < specs.size(); ++t) {
    EXPECT_EQ(Param(*s, t), Values(t, specs[t].numel)) << specs[t].name;
  }
}

}  // namespace
}  // namespace tiermem::session
