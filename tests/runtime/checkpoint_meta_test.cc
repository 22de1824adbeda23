// CheckpointMeta (runtime/checkpoint_meta.h): the one metadata format of both bindings — its
// encoding and decoding, the two shapes earlier files carry, bad metadata refused with what is
// missing — and the session loading real version-2 files of each binding (tests/data), a file
// whose metadata is neither, and a group count that differs, each checked before anything
// changes.
#include "runtime/checkpoint_meta.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cinttypes>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>

#include "base/crc32c.h"
#include "runtime/session.h"
#include "tests/support/status_matchers.h"
#include "tests/support/paths.h"

namespace tiermem::session {
namespace {

using ::tiermem::testing::IsOk;
using ::tiermem::testing::StatusIs;
using nlohmann::json;

TEST(Base64, MatchesRfc4648AndRoundTripsEveryByte) {
  const std::pair<std::string, std::string> cases[] = {
      {"", ""},         {"f", "Zg=="},         {"fo", "Zm8="},        {"foo", "Zm9v"},
      {"foob", "Zm9vYg=="}, {"fooba", "Zm9vYmE="}, {"foobar", "Zm9vYmFy"}};
  for (const auto& [plain, coded] : cases) {
    EXPECT_EQ(Base64Encode(plain), coded);
    auto back = Base64Decode(coded);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(*back, plain);
  }
  std::string all;
  for (int i = 0; i < 256; ++i) all += static_cast<char>(i);
  for (size_t n : {all.size(), all.size() - 1, all.size() - 2}) {
    auto back = Base64Decode(Base64Encode(all.substr(0, n)));
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, all.substr(0, n));
  }
  EXPECT_THAT(Base64Decode("Zg="), StatusIs(StatusCode::kInvalidArgument, "multiple of 4"));
  EXPECT_THAT(Base64Decode("Z!=="), StatusIs(StatusCode::kInvalidArgument, "alphabet"));
}

// A CheckpointLoad (designated initializers leave members out, which -Wextra warns about).
CheckpointLoad How(std::optional<size_t> num_groups, std::optional<size_t> rng_state_bytes = {},
                   bool verify_only = false) {
  CheckpointLoad how;
  how.num_groups = num_groups;
  how.rng_state_bytes = rng_state_bytes;
  how.verify_only = verify_only;
  return how;
}

CheckpointMeta Sample() {
  CheckpointMeta m;
  m.groups.push_back({OptimizerConfig{1e-3, 0.9, 0.999, 1e-8, 0.01},
                      {{"amsgrad", false}, {"foreach", nullptr}, {"initial_lr", 2e-3}}});
  m.groups.push_back({OptimizerConfig{0.1 + 0.2, 0.5, 0.75, 3e-9, 0.0}});
  m.rng_state = std::string("\0\1\2\xfe\xff", 5);
  m.extra = {{"epoch", 3}, {"position", {1, 2.5, "x"}}};
  return m;
}

TEST(CheckpointMeta, EncodesToTheVersion3EntriesAndDecodesExactly) {
  const CheckpointMeta m = Sample();
  const std::map<std::string, std::string> e = EncodeCheckpointMeta(m);
  ASSERT_EQ(e.size(), 3u);
  // A group is the binding's keys with the hyper-parameters beside them, as a torch group.
  EXPECT_EQ(json::parse(e.at("param_groups")),
            json::parse(R"([{"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8,
                             "weight_decay": 0.01, "amsgrad": false, "foreach": null,
                             "initial_lr": 0.002},
                            {"lr": 0.30000000000000004, "betas": [0.5, 0.75], "eps": 3e-9,
                             "weight_decay": 0.0}])"));
  EXPECT_EQ(e.at("rng_state"), "AAEC/v8=");
  EXPECT_EQ(json::parse(e.at("extra")), m.extra);
  auto back = DecodeCheckpointMeta(e);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  ASSERT_EQ(back->groups.size(), 2u);
  for (size_t g = 0; g < 2; ++g) {
    const OptimizerConfig& a = back->groups[g].hyper;
    const OptimizerConfig& b = m.groups[g].hyper;
    EXPECT_EQ(a.lr, b.lr);  // doubles round-trip exactly
    EXPECT_EQ(a.beta1, b.beta1);
    EXPECT_EQ(a.beta2, b.beta2);
    EXPECT_EQ(a.eps, b.eps);
    EXPECT_EQ(a.weight_decay, b.weight_decay);
    EXPECT_EQ(back->groups[g].other, m.groups[g].other);
  }
  EXPECT_EQ(back->rng_state, m.rng_state);
  EXPECT_EQ(back->extra, m.extra);
  // Nothing saved: no groups, no RNG state, null extra.
  auto empty = DecodeCheckpointMeta(EncodeCheckpointMeta({}));
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->groups.empty() && empty->rng_state.empty() && empty->extra.is_null());
}

TEST(CheckpointMeta, AVersion3FileWithAMissingOrBadEntryNamesIt) {
  for (const char* key : {"param_groups", "rng_state", "extra"}) {
    auto e = EncodeCheckpointMeta(Sample());
    e.erase(key);
    EXPECT_THAT(DecodeCheckpointMeta(e),
                StatusIs(StatusCode::kInvalidArgument, std::string("no '") + key + "' entry"));
  }
  auto e = EncodeCheckpointMeta(Sample());
  e["rng_state"] = "not base64";
  EXPECT_THAT(DecodeCheckpointMeta(e), StatusIs(StatusCode::kInvalidArgument, "'rng_state'"));
  e = EncodeCheckpointMeta(Sample());
  e["extra"] = "{";
  EXPECT_THAT(DecodeCheckpointMeta(e), StatusIs(StatusCode::kInvalidArgument, "'extra'"));
}

TEST(CheckpointMeta, GroupsNeedEveryHyperParameter) {
  const json good = json::parse(R"([{"lr": 1, "betas": [0.9, 0.99], "eps": 1e-8,
                                     "weight_decay": 0}])");
  ASSERT_TRUE(ParseCheckpointGroups(good).ok());
  for (const char* key : {"lr", "betas", "eps", "weight_decay"}) {
    json g = good;
    g[0].erase(key);
    EXPECT_THAT(ParseCheckpointGroups(g),
                StatusIs(StatusCode::kInvalidArgument,
                         std::string("param_groups[0] has no '") + key + "'"));
  }
  json g = good;
  g[0]["lr"] = "fast";
  EXPECT_THAT(ParseCheckpointGroups(g),
              StatusIs(StatusCode::kInvalidArgument, "param_groups[0] 'lr' is not a number"));
  g = good;
  g[0]["betas"] = {0.9};
  EXPECT_THAT(ParseCheckpointGroups(g),
              StatusIs(StatusCode::kInvalidArgument, "'betas' is not a pair of numbers"));
  EXPECT_THAT(ParseCheckpointGroups(json::object()),
              StatusIs(StatusCode::kInvalidArgument, "not an array"));
  EXPECT_THAT(ParseCheckpointGroups(json::array({1})),
              StatusIs(StatusCode::kInvalidArgument, "param_groups[0] is not an object"));
}

TEST(CheckpointMeta, ReadsThePythonBindingsEarlierShape) {
  auto m = ParseLegacyCheckpointMeta(
      R"({"tiermem.python": {"param_groups": [{"lr": 0.002, "betas": [0.9, 0.999],
          "eps": 1e-08, "weight_decay": 0.01, "amsgrad": false, "fused": null}],
          "torch_rng": "AAEC/v8=", "extra": {"epoch": 7}}})");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  ASSERT_EQ(m->groups.size(), 1u);
  EXPECT_EQ(m->groups[0].hyper.lr, 0.002);
  EXPECT_EQ(m->groups[0].hyper.eps, 1e-8);
  EXPECT_EQ(m->groups[0].other, json::parse(R"({"amsgrad": false, "fused": null})"));
  EXPECT_EQ(m->rng_state, std::string("\0\1\2\xfe\xff", 5));
  EXPECT_EQ(m->extra, json::parse(R"({"epoch": 7})"));
  // extra None was written as null.
  m = ParseLegacyCheckpointMeta(R"({"tiermem.python": {"param_groups": [], "torch_rng": "",
                                                        "extra": null}})");
  ASSERT_TRUE(m.ok());
  EXPECT_TRUE(m->groups.empty() && m->rng_state.empty() && m->extra.is_null());
}

TEST(CheckpointMeta, ReadsTheLibTorchApisEarlierShape) {
  auto m = ParseLegacyCheckpointMeta(
      R"({"param_groups":[{"betas":[0.9,0.999],"eps":1e-08,"lr":0.0005,"weight_decay":0.01},)"
      R"({"betas":[0.8,0.9],"eps":1e-06,"lr":0.001,"weight_decay":0.0}]})");
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  ASSERT_EQ(m->groups.size(), 2u);
  EXPECT_EQ(m->groups[0].hyper.lr, 5e-4);
  EXPECT_EQ(m->groups[1].hyper.beta1, 0.8);
  EXPECT_EQ(m->groups[1].hyper.weight_decay, 0.0);
  EXPECT_EQ(m->groups[1].other, json::object());
  EXPECT_TRUE(m->rng_state.empty());  // it saved none
  EXPECT_TRUE(m->extra.is_null());
}

TEST(CheckpointMeta, EarlierMetadataOfNeitherShapeSaysWhatIsMissing) {
  for (const char* text : {"", "old", "[1, 2]", "{}", R"({"groups": 1})",
                           R"({"tiermem.python": {"extra": 1}})", R"({"tiermem.python": 3})"}) {
    SCOPED_TRACE(text);
    auto m = ParseLegacyCheckpointMeta(text);
    EXPECT_THAT(m, StatusIs(StatusCode::kInvalidArgument, "no optimizer param groups"));
    EXPECT_THAT(m, StatusIs(StatusCode::kInvalidArgument, "nothing was loaded"));
  }
  EXPECT_THAT(ParseLegacyCheckpointMeta(R"({"groups": 1})"),
              StatusIs(StatusCode::kInvalidArgument,
                       R"(has no "tiermem.python" object and no "param_groups" array)"));
  EXPECT_THAT(ParseLegacyCheckpointMeta(
                  R"({"tiermem.python": {"param_groups": [], "torch_rng": "%%%%"}})"),
              StatusIs(StatusCode::kInvalidArgument, "torch_rng"));
}

TEST(CheckpointMeta, ALoadChecksTheGroupCountAndTheRngStateSize) {
  const CheckpointMeta m = Sample();
  EXPECT_THAT(CheckCheckpointMeta(m, {}), IsOk());
  EXPECT_THAT(CheckCheckpointMeta(m, How(2, 5)), IsOk());
  EXPECT_THAT(CheckCheckpointMeta(m, How(1)),
              StatusIs(StatusCode::kInvalidArgument,
                       "it has 2 optimizer param groups, the optimizer has 1: nothing was loaded"));
  EXPECT_THAT(CheckCheckpointMeta(m, How({}, 5056)),
              StatusIs(StatusCode::kInvalidArgument, "its RNG state has 5 bytes"));
  CheckpointMeta none = m;
  none.rng_state.clear();  // none saved: nothing to check
  EXPECT_THAT(CheckCheckpointMeta(none, How({}, 5056)), IsOk());
}

// ---- the session with files of version 2 (tests/data/README.md) ------------------------------

std::string Data(const std::string& name) { return ::tiermem::testing::TestData(name); }

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

std::string TempDir() {
  char tmpl[] = "/tmp/tiermem-ckptmeta-XXXXXX";
  EXPECT_NE(mkdtemp(tmpl), nullptr);
  return tmpl;
}

std::unique_ptr<Session> Make(std::vector<TensorSpec> specs) {
  auto c = ParseConfig({{"device", "1MiB"}, {"host", "16MiB"}, {"device_kind", "sim"}},
                       MapEnv({}));
  EXPECT_TRUE(c.ok()) << c.status().ToString();
  auto s = Session::Create(*c, std::move(specs));
  EXPECT_TRUE(s.ok()) << s.status().ToString();
  return s.ok() ? std::move(s).value() : nullptr;
}

// A LibTorch Linear(3, 2)'s tensors, as legacy-libtorch.safetensors holds them.
std::unique_ptr<Session> MakeLinear() {
  return Make({{"weight", 6, true, 0, {2, 3}}, {"bias", 2, true, 0, {2}}});
}

std::vector<float> Values(Session& s, size_t t, ChunkKind kind = ChunkKind::kParamFp32) {
  std::vector<float> v(s.layout().place(t).numel);
  if (kind == ChunkKind::kParamFp32) {
    EXPECT_THAT(s.values().ReadParam(t, v.data()), IsOk());
  } else {
    EXPECT_THAT(s.values().ReadTensor(t, kind, v.data()), IsOk());
  }
  return v;
}

// `file` with its header's metadata edited by `edit` and the header checksum made right again
// (as checkpoint.cc computes it: over the padded text with its own value zeroed).
std::string EditMetadata(const std::string& file, const std::function<void(json&)>& edit) {
  uint64_t n = 0;
  std::memcpy(&n, file.data(), 8);
  json h = json::parse(file.substr(8, n));
  edit(h["__metadata__"]);
  h["__metadata__"]["header_crc32c"] = "00000000";
  std::string text = h.dump();
  text.append((8 + text.size() + 4095) / 4096 * 4096 - 8 - text.size(), ' ');
  char crc[9];
  std::snprintf(crc, sizeof(crc), "%08" PRIx32, Crc32c(text.data(), text.size()));
  const size_t at = text.find("\"header_crc32c\":\"00000000\"");
  text.replace(at + 17, 8, crc);
  const uint64_t m = text.size();
  return std::string(reinterpret_cast<const char*>(&m), 8) + text + file.substr(8 + n);
}

TEST(CheckpointMetaFiles, TheLibTorchApisVersion2FileLoads) {
  auto s = MakeLinear();
  ASSERT_TRUE(s);
  CheckpointMeta meta;
  ASSERT_THAT(s->LoadCheckpoint(Data("legacy-libtorch.safetensors"), &meta), IsOk());
  ASSERT_EQ(meta.groups.size(), 1u);
  EXPECT_EQ(meta.groups[0].hyper.lr, 5e-4);
  EXPECT_TRUE(meta.rng_state.empty());
  EXPECT_TRUE(meta.extra.is_null());
  // The values make_legacy_checkpoints.py wrote: (arange(n) + 10 t) / 8, m / 64, v / 512.
  for (size_t t = 0; t < 2; ++t) {
    std::vector<float> p, m, v;
    for (size_t i = 0; i < s->layout().place(t).numel; ++i) {
      const float b = static_cast<float>(i + 10 * t);
      p.push_back(b / 8);
      m.push_back(b / 64);
      v.push_back(b / 512);
    }
    EXPECT_EQ(Values(*s, t), p);
    EXPECT_EQ(Values(*s, t, ChunkKind::kExpAvg), m);
    EXPECT_EQ(Values(*s, t, ChunkKind::kExpAvgSq), v);
    EXPECT_EQ(s->values().step_count(t), 3);
  }
}

TEST(CheckpointMetaFiles, ThePythonBindingsVersion2FileLoads) {
  auto s = Make({{"0.weight", 6, true, 0, {2, 3}}, {"0.bias", 2, true, 0, {2}},
                 {"1.weight", 2, true, 0, {1, 2}}, {"1.bias", 1, true, 0, {1}}});
  ASSERT_TRUE(s);
  CheckpointMeta meta;
  ASSERT_THAT(s->LoadCheckpoint(Data("legacy-python.safetensors"), &meta), IsOk());
  ASSERT_EQ(meta.groups.size(), 1u);
  EXPECT_EQ(meta.groups[0].hyper.lr, 2e-3);
  EXPECT_EQ(meta.groups[0].other.at("amsgrad"), false);  // torch's keys, kept
  EXPECT_FALSE(meta.rng_state.empty());
  EXPECT_EQ(meta.extra, json::parse(R"({"epoch": 7})"));
  EXPECT_EQ(s->values().step_count(0), 2);
}

TEST(CheckpointMetaFiles, AVersion2FileOfNeitherShapeOrAnotherGroupCountChangesNothing) {
  const std::string dir = TempDir();
  const std::string bad = dir + "/bad.safetensors";
  std::ofstream(bad, std::ios::binary)
      << EditMetadata(ReadFile(Data("legacy-libtorch.safetensors")),
                      [](json& m) { m["binding"] = R"({"groups": 1})"; });
  auto s = MakeLinear();
  ASSERT_TRUE(s);
  const std::vector<float> w = {1, 1, 1, 1, 1, 1};
  ASSERT_THAT(s->values().WriteParam(0, w.data()), IsOk());
  const Status st = s->LoadCheckpoint(bad);
  EXPECT_THAT(st, StatusIs(StatusCode::kInvalidArgument, "checkpoint " + bad + ": "));
  EXPECT_THAT(st, StatusIs(StatusCode::kInvalidArgument, "no optimizer param groups"));
  EXPECT_THAT(Session::CheckpointMetadata(bad),
              StatusIs(StatusCode::kInvalidArgument, "no optimizer param groups"));
  // The edit itself is sound: the same file with a LibTorch-shaped binding loads.
  const std::string good = dir + "/good.safetensors";
  std::ofstream(good, std::ios::binary)
      << EditMetadata(ReadFile(Data("legacy-libtorch.safetensors")), [](json&) {});
  EXPECT_THAT(s->LoadCheckpoint(good, nullptr, How({}, {}, true)), IsOk());
  // Two groups expected, one saved.
  EXPECT_THAT(s->LoadCheckpoint(Data("legacy-libtorch.safetensors"), nullptr, How(2)),
              StatusIs(StatusCode::kInvalidArgument, "1 optimizer param groups, the optimizer "
                                                     "has 2: nothing was loaded"));
  EXPECT_EQ(Values(*s, 0), w);
  EXPECT_EQ(s->values().step_count(0), 0);
  std::filesystem::remove_all(dir);
}

// A version-3 file round-trips the metadata through the session.
TEST(CheckpointMetaFiles, TheSessionWritesVersion3AndReadsItBack) {
  const std::string dir = TempDir();
  auto s = MakeLinear();
  ASSERT_TRUE(s);
  const CheckpointMeta m = Sample();
  ASSERT_THAT(s->SaveCheckpoint(dir + "/c.safetensors", m), IsOk());
  const std::string file = ReadFile(dir + "/c.safetensors");
  uint64_t n = 0;
  std::memcpy(&n, file.data(), 8);
  const json meta = json::parse(file.substr(8, n))["__metadata__"];
  EXPECT_EQ(meta["version"], "3");
  EXPECT_FALSE(meta.contains("binding"));
  auto back = Session::CheckpointMetadata(dir + "/c.safetensors");
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->groups.size(), 2u);
  EXPECT_EQ(back->groups[0].other, m.groups[0].other);
  EXPECT_EQ(back->rng_state, m.rng_state);
  EXPECT_EQ(back->extra, m.extra);
  EXPECT_THAT(s->LoadCheckpoint(dir + "/c.safetensors", nullptr, How({}, 4)),
              StatusIs(StatusCode::kInvalidArgument, "its RNG state has 5 bytes"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tiermem::session
