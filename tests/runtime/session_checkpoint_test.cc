// Session checkpoints: round trips (direct and buffered), torn, corrupt and foreign files,
// the safetensors layout and metadata, format-1 files, saving inside an accumulation window.
// Everything runs on SimDevice + the host tier.
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

TEST(SessionCheckpoint, RoundTripRestoresValuesStateAndSteps) {
  const std::string dir = TempDir();
  auto s = Make({{"device", "1MiB"}}, kThree);
  ASSERT_TRUE(s);
  for (size_t t = 0; t < 3; ++t) {
    auto w = Random(kThree[t].numel, t);
    ASSERT_THAT(s->values().WriteParam(t, w.data()), IsOk());
    SetGrad(*s, t, Random(kThree[t].numel, 7 + t));
  }
  ASSERT_TRUE(s->optimizer().Step({GroupHyper{}}).ok());
  const std::string path = dir + "/ckpt.tmc";
  CheckpointMeta meta_in;
  meta_in.groups.push_back({GroupHyper{5e-4, 0.8, 0.99, 1e-7, 0.1}, {{"amsgrad", false}}});
  meta_in.rng_state = std::string("\0\1\xff", 3);
  meta_in.extra = {{"epoch", 3}};
  ASSERT_THAT(s->SaveCheckpoint(path, meta_in), IsOk());
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
  std::vector<std::vector<float>> saved, saved_v;
  for (size_t t = 0; t < 3; ++t) {
    saved.push_back(Param(*s, t));
    std::vector<float> v(kThree[t].numel);
    ASSERT_THAT(s->values().ReadTensor(t, ChunkKind::kExpAvgSq, v.data()), IsOk());
    saved_v.push_back(v);
  }
  // Train on, then load: back to the saved state; and into a fresh bf16 session too.
  for (size_t t = 0; t < 3; ++t) SetGrad(*s, t, Random(kThree[t].numel, 17 + t));
  ASSERT_TRUE(s->optimizer().Step({GroupHyper{}}).ok());
  CheckpointMeta meta;
  ASSERT_THAT(s->LoadCheckpoint(path, &meta), IsOk());
  ASSERT_EQ(meta.groups.size(), 1u);
  EXPECT_EQ(meta.groups[0].hyper.lr, 5e-4);
  EXPECT_EQ(meta.groups[0].hyper.beta1, 0.8);
  EXPECT_EQ(meta.groups[0].hyper.beta2, 0.99);
  EXPECT_EQ(meta.groups[0].hyper.eps, 1e-7);
  EXPECT_EQ(meta.groups[0].hyper.weight_decay, 0.1);
  EXPECT_EQ(meta.groups[0].other, json({{"amsgrad", false}}));
  EXPECT_EQ(meta.rng_state, meta_in.rng_state);
  EXPECT_EQ(meta.extra, meta_in.extra);
  for (size_t t = 0; t < 3; ++t) {
    EXPECT_EQ(Param(*s, t), saved[t]);
    EXPECT_EQ(s->values().step_count(t), 1);
    EXPECT_FALSE(s->optimizer().has_grad(t));
  }
  auto fresh = Make({{"device", "1MiB"}, {"precision", "bf16"}}, kThree);
  ASSERT_THAT(fresh->LoadCheckpoint(path), IsOk());
  for (size_t t = 0; t < 3; ++t) {
    EXPECT_EQ(Param(*fresh, t), saved[t]);
    std::vector<float> v(kThree[t].numel);
    ASSERT_THAT(fresh->values().ReadTensor(t, ChunkKind::kExpAvgSq, v.data()), IsOk());
    EXPECT_EQ(v, saved_v[t]);
  }
  EXPECT_EQ(fresh->optimizer().loss_scale(), 1.0);
  std::filesystem::remove_all(dir);
}

// Tensors larger than the writer's 8 MiB buffer and of odd sizes (the file's tail is not
// block-aligned) round-trip bit for bit, written and read with O_DIRECT and through the page
// cache (checkpoint_io), and across the two.
TEST(SessionCheckpoint, LargeAndOddTensorsRoundTripDirectAndBuffered) {
  const std::vector<TensorSpec> specs = {
      {"big", 2'500'001, true, 0}, {"odd", 1'234'567, true, 0}, {"tiny", 3, false, 0}};
  for (const auto& [save_io, load_io] : std::vector<std::pair<std::string, std::string>>{
           {"direct", "direct"}, {"buffered", "buffered"}, {"direct", "buffered"},
           {"buffered", "direct"}}) {
    SCOPED_TRACE("save " + save_io + ", load " + load_io);
    const std::string dir = TempDir();
    auto s = Make({{"device", "128MiB"}, {"host", "256MiB"}, {"checkpoint_io", save_io}}, specs);
    ASSERT_TRUE(s);
    for (size_t t = 0; t < specs.size(); ++t) {
      auto w = Random(specs[t].numel, 60 + t);
      ASSERT_THAT(s->values().WriteParam(t, w.data()), IsOk());
      if (specs[t].trainable) SetGrad(*s, t, Random(specs[t].numel, 70 + t));
    }
    ASSERT_TRUE(s->optimizer().Step({GroupHyper{}}).ok());
    const std::string path = dir + "/big.safetensors";
    ASSERT_THAT(s->SaveCheckpoint(path), IsOk());
    EXPECT_NE(std::filesystem::file_size(path) % 4096, 0u);  // cut back to its true size
    std::vector<std::vector<float>> saved, saved_m;
    for (size_t t = 0; t < specs.size(); ++t) {
      saved.push_back(Param(*s, t));
      std::vector<float> m(specs[t].numel);
      if (specs[t].trainable) {
        ASSERT_THAT(s->values().ReadTensor(t, ChunkKind::kExpAvg, m.data()), IsOk());
      }
      saved_m.push_back(m);
    }
    auto fresh =
        Make({{"device", "128MiB"}, {"host", "256MiB"}, {"checkpoint_io", load_io}}, specs);
    ASSERT_THAT(fresh->LoadCheckpoint(path), IsOk());
    for (size_t t = 0; t < specs.size(); ++t) {
      EXPECT_EQ(Param(*fresh, t), saved[t]);
      if (!specs[t].trainable) continue;
      std::vector<float> m(specs[t].numel);
      ASSERT_THAT(fresh->values().ReadTensor(t, ChunkKind::kExpAvg, m.data()), IsOk());
      EXPECT_EQ(m, saved_m[t]);
    }
    std::filesystem::remove_all(dir);
  }
}

TEST(SessionCheckpoint, TornCorruptOrForeignFilesChangeNothing) {
  const std::string dir = TempDir();
  auto s = Make({{"device", "1MiB"}}, kThree);
  ASSERT_TRUE(s);
  for (size_t t = 0; t < 3; ++t) {
    auto w = Random(kThree[t].numel, 40 + t);
    ASSERT_THAT(s->values().WriteParam(t, w.data()), IsOk());
  }
  const std::string path = dir + "/ckpt.tmc";
  ASSERT_THAT(s->SaveCheckpoint(path), IsOk());
  const auto size = std::filesystem::file_size(path);
  std::vector<char> bytes(size);
  std::ifstream(path, std::ios::binary).read(bytes.data(), size);
  // Change the session, so that a load that went through would be visible.
  const std::vector<float> now = Random(1000, 99);
  ASSERT_THAT(s->values().WriteParam(0, now.data()), IsOk());
  auto write = [&](const std::string& p, size_t n, long flip) {
    std::vector<char> b(bytes.begin(), bytes.begin() + n);
    if (flip >= 0) b[flip] ^= 0x40;
    std::ofstream(p, std::ios::binary).write(b.data(), b.size());
  };
  write(dir + "/torn.tmc", size - 100, -1);
  EXPECT_THAT(s->LoadCheckpoint(dir + "/torn.tmc"), StatusIs(StatusCode::kDataLoss, "torn"));
  write(dir + "/flip.tmc", size, static_cast<long>(size / 2));
  EXPECT_THAT(s->LoadCheckpoint(dir + "/flip.tmc"),
              StatusIs(StatusCode::kDataLoss, "checksum mismatch"));
  // The header length off by 64: the text read is still JSON (the header is padded with
  // spaces to a block boundary), and its checksum no longer matches.
  write(dir + "/length.tmc", size, 0);
  EXPECT_THAT(s->LoadCheckpoint(dir + "/length.tmc"),
              StatusIs(StatusCode::kDataLoss, "header: checksum mismatch"));
  std::ofstream(dir + "/foreign.tmc", std::ios::binary) << "PK\x03\x04 a zip file, say";
  EXPECT_THAT(s->LoadCheckpoint(dir + "/foreign.tmc"),
              StatusIs(StatusCode::kInvalidArgument, "not a tiermem checkpoint"));
  EXPECT_THAT(s->LoadCheckpoint(dir + "/missing.tmc"), StatusIs(StatusCode::kIOError, "missing"));
  auto other = Make({{"device", "1MiB"}}, {{"a", 1000, true, 0}, {"b", 301, true, 0},
                                           {"c", 77, true, 0}});
  EXPECT_THAT(other->LoadCheckpoint(path),
              StatusIs(StatusCode::kInvalidArgument, "this model has 'b' (301 elements"));
  EXPECT_EQ(Param(*s, 0), now);
  std::filesystem::remove_all(dir);
}

// The safetensors layout (format 2): u64 header length, a JSON header naming every tensor
// with dtype F32, its shape and contiguous data offsets, tiermem's metadata; values stored
// as written. (tests/python/test_checkpoint.py loads the same kind of file with the
// safetensors library itself.)
TEST(SessionCheckpoint, FileIsSafetensorsWithShapesAndMetadata) {
  const std::string dir = TempDir();
  std::vector<TensorSpec> specs = {{"w", 6, true, 0, {2, 3}}, {"frozen", 4, false, 0, {4}}};
  auto s = Make({{"device", "1MiB"}}, specs);
  ASSERT_TRUE(s);
  const std::vector<float> w = {1, 2, 3, 4, 5, 6};
  ASSERT_THAT(s->values().WriteParam(0, w.data()), IsOk());
  const std::string path = dir + "/c.safetensors";
  CheckpointMeta meta_in;
  meta_in.groups.push_back({GroupHyper{}});
  meta_in.rng_state = "rng";
  meta_in.extra = "x";
  ASSERT_THAT(s->SaveCheckpoint(path, meta_in), IsOk());
  std::ifstream in(path, std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  ASSERT_EQ(n % 8, 0u);
  ASSERT_EQ((8 + n) % 4096, 0u);  // tensor bytes block-aligned (O_DIRECT)
  std::string text(n, '\0');
  in.read(text.data(), n);
  const json h = json::parse(text);
  EXPECT_EQ(h["w"]["dtype"], "F32");
  EXPECT_EQ(h["w"]["shape"], json::array({2, 3}));
  EXPECT_EQ(h["w"]["data_offsets"], json::array({0, 24}));
  EXPECT_EQ(h["exp_avg/w"]["data_offsets"], json::array({24, 48}));
  EXPECT_EQ(h["exp_avg_sq/w"]["data_offsets"], json::array({48, 72}));
  EXPECT_EQ(h["frozen"]["data_offsets"], json::array({72, 88}));
  EXPECT_FALSE(h.contains("exp_avg/frozen"));
  EXPECT_EQ(h["__metadata__"]["format"], "tiermem-checkpoint");
  EXPECT_EQ(h["__metadata__"]["version"], "3");
  EXPECT_EQ(json::parse(h["__metadata__"]["param_groups"].get<std::string>()),
            json::parse(R"([{"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8,
                             "weight_decay": 0.01}])"));
  EXPECT_EQ(h["__metadata__"]["rng_state"], "cm5n");  // base64 of "rng"
  EXPECT_EQ(h["__metadata__"]["extra"], "\"x\"");
  EXPECT_FALSE(h["__metadata__"].contains("binding"));
  std::vector<float> back(6);
  in.read(reinterpret_cast<char*>(back.data()), 24);
  EXPECT_EQ(back, w);
  in.seekg(0, std::ios::end);
  EXPECT_EQ(static_cast<uint64_t>(in.tellg()), 8 + n + 88);
  auto meta = Session::CheckpointMetadata(path);
  ASSERT_TRUE(meta.ok()) << meta.status().ToString();
  EXPECT_EQ(meta->groups.size(), 1u);
  EXPECT_EQ(meta->rng_state, "rng");
  EXPECT_EQ(meta->extra, "x");
  // A byte of the header changed (a step count: not a tensor): the header checksum catches it.
  std::ifstream whole(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(whole)), std::istreambuf_iterator<char>());
  const size_t at = bytes.find("\\\"w\\\":0");
  ASSERT_NE(at, std::string::npos);
  bytes[at + 6] = '7';  // the step of w: 0 -> 7
  std::ofstream(dir + "/h.safetensors", std::ios::binary) << bytes;
  EXPECT_THAT(s->LoadCheckpoint(dir + "/h.safetensors"),
              StatusIs(StatusCode::kDataLoss, "header: checksum mismatch"));
  std::filesystem::remove_all(dir);
}

// A format-1 file (earlier builds) with one tensor "a" of 3 elements and `meta` as its
// metadata (what ChunkedModel::Save wrote then).
std::string FormatOneFile(const std::string& meta) {
  std::string f;
  auto put = [&](const void* p, size_t n) { f.append(static_cast<const char*>(p), n); };
  auto crc_of = [&](size_t from) { return Crc32c(f.data() + from, f.size() - from); };
  put("TMCKPT01", 8);
  const uint32_t version = 1, meta_bytes = static_cast<uint32_t>(meta.size());
  const uint64_t ntensors = 1, micro = 5, skipped = 0;
  const double scale = 1.0;
  const int32_t good = 0;
  put(&version, 4); put(&ntensors, 8); put(&micro, 8); put(&scale, 8); put(&good, 4);
  put(&skipped, 8); put(&meta_bytes, 4); put(meta.data(), meta.size());
  uint32_t c = crc_of(0);
  put(&c, 4);
  const size_t rec = f.size();
  const uint32_t name_bytes = 1;
  const uint64_t numel = 3;
  const uint8_t trainable = 1;
  const int64_t step = 4;
  put(&name_bytes, 4); put("a", 1); put(&numel, 8); put(&trainable, 1); put(&step, 8);
  const float vals[9] = {1, 2, 3, .1f, .2f, .3f, .01f, .02f, .03f};
  put(vals, sizeof(vals));
  const uint32_t rc = crc_of(rec);
  put(&rc, 4);
  put("TMCKEND1", 8);
  const uint32_t all = Crc32c(&rc, 4);
  put(&all, 4);
  return f;
}

// Files of the earliest format (1) still load, their LibTorch-shaped metadata converted; one
// whose metadata has neither earlier shape is refused before anything changes.
TEST(SessionCheckpoint, ReadsFormatOneFiles) {
  const std::string dir = TempDir();
  std::ofstream(dir + "/v1.tmc", std::ios::binary) << FormatOneFile(
      R"({"param_groups":[{"betas":[0.9,0.999],"eps":1e-08,"lr":0.0005,"weight_decay":0.01}]})");
  std::ofstream(dir + "/bad.tmc", std::ios::binary) << FormatOneFile("old");
  auto s = Make({{"device", "1MiB"}}, {{"a", 3, true, 0}});
  ASSERT_TRUE(s);
  const std::vector<float> before = Param(*s, 0);
  EXPECT_THAT(s->LoadCheckpoint(dir + "/bad.tmc"),
              StatusIs(StatusCode::kInvalidArgument, "no optimizer param groups"));
  EXPECT_EQ(Param(*s, 0), before);
  EXPECT_EQ(s->optimizer().micro_steps(), 0u);
  CheckpointMeta got;
  ASSERT_THAT(s->LoadCheckpoint(dir + "/v1.tmc", &got), IsOk());
  ASSERT_EQ(got.groups.size(), 1u);
  EXPECT_EQ(got.groups[0].hyper.lr, 5e-4);
  EXPECT_TRUE(got.rng_state.empty());
  EXPECT_TRUE(got.extra.is_null());
  EXPECT_EQ(Param(*s, 0), std::vector<float>({1, 2, 3}));
  EXPECT_EQ(s->values().step_count(0), 4);
  EXPECT_EQ(s->optimizer().micro_steps(), 5u);
  std::filesystem::remove_all(dir);
}

TEST(SessionCheckpoint, SavingInsideAnAccumulationWindowIsRefused) {
  const std::string dir = TempDir();
  auto s = Make({{"device", "1MiB"}, {"gradient_accumulation_steps", 2}}, kThree);
  ASSERT_TRUE(s);
  SetGrad(*s, 0, Random(1000, 1));
  ASSERT_TRUE(s->optimizer().Step({GroupHyper{}}).ok());
  EXPECT_THAT(s->SaveCheckpoint(dir + "/c.tmc"),
              StatusIs(StatusCode::kFailedPrecondition, "accumulation"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/c.tmc"));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tiermem::session
