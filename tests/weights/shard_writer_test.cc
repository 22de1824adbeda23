// The streaming writer of Hugging Face's layout: the shard split, the files and index it
// writes, and what an interrupted export leaves (a failed one, and a process killed mid-shard).
#include "weights/shard_writer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <span>
#include <vector>

#include "base/crc32c.h"
#include "tests/support/status_matchers.h"
#include "tests/weights/weights_test_support.h"
#include "weights/weight_files.h"

namespace tiermem::weights {
namespace {

using ::testing::ElementsAre;
using tiermem::testing::IsOk;
using tiermem::testing::StatusIs;
using namespace tiermem::weights::testing;  // NOLINT

ShardEntry E(const std::string& key, DType d, std::vector<uint64_t> shape) {
  return ShardEntry{key, d, std::move(shape)};
}

// The bytes of entry i: its own pattern, so a misplaced byte shows.
std::string Bytes(size_t i, uint64_t n) {
  std::string b(n, '\0');
  for (uint64_t k = 0; k < n; ++k) b[k] = static_cast<char>((i * 31 + k * 7) & 0xff);
  return b;
}

// Puts every entry's bytes in the writer's order, in pieces of `piece` bytes that span
// entries and shards.
Status PutAll(ShardWriter& w, size_t piece) {
  std::string all;
  for (size_t i : w.order()) all += Bytes(i, w.entries()[i].bytes());
  for (size_t at = 0; at < all.size(); at += piece) {
    TIERMEM_RETURN_IF_ERROR(w.Put(all.data() + at, std::min(piece, all.size() - at)));
  }
  return OkStatus();
}

// Every dtype, an empty tensor and one larger than the 100-byte shards: three shards at 100.
std::vector<ShardEntry> ThreeShardEntries() {
  return {E("w1", DType::kF32, {3, 5}), E("w2", DType::kBF16, {7}), E("w3", DType::kF32, {1000}),
          E("empty", DType::kF32, {0}), E("w4", DType::kF16, {2, 2})};
}

class ShardWriterTest : public TempDirTest {};

TEST(PlanShards, GreedyInOrderALargeTensorAloneNamesLikeTransformers) {
  const std::vector<ShardEntry> e = {E("a", DType::kF32, {10}), E("b", DType::kF32, {10}),
                                     E("big", DType::kF32, {100}), E("c", DType::kBF16, {5}),
                                     E("d", DType::kF32, {5})};
  const ShardLayout l = PlanShards(e, 80);
  ASSERT_EQ(l.shards.size(), 3u);
  EXPECT_THAT(l.shards[0].entries, ElementsAre(0u, 1u));
  EXPECT_EQ(l.shards[0].bytes, 80u);
  EXPECT_THAT(l.shards[1].entries, ElementsAre(2u));  // 400 bytes: alone, over the limit
  EXPECT_THAT(l.shards[2].entries, ElementsAre(4u, 3u));  // F32 before BF16 in the data
  EXPECT_EQ(l.shards[0].name, "model-00001-of-00003.safetensors");
  EXPECT_EQ(l.shards[2].name, "model-00003-of-00003.safetensors");
  const ShardLayout one = PlanShards(e, 0);
  ASSERT_EQ(one.shards.size(), 1u);
  EXPECT_EQ(one.shards[0].name, "model.safetensors");
}

TEST_F(ShardWriterTest, WritesShardsAndTheIndexThatOpenWeightsReadsBack) {
  const std::vector<ShardEntry> e = ThreeShardEntries();
  ShardWriterOptions o;
  o.max_shard_bytes = 100;
  StatusOr<std::unique_ptr<ShardWriter>> w = ShardWriter::Create(dir_, e, o);
  ASSERT_THAT(w, IsOk());
  ASSERT_EQ((*w)->layout().shards.size(), 3u);
  ASSERT_THAT(PutAll(**w, 37), IsOk());
  ASSERT_THAT((*w)->Finish(), IsOk());
  EXPECT_THAT(Listing(dir_),
              ElementsAre("model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                          "model-00003-of-00003.safetensors", kIndexFileName));
  const nlohmann::json index = nlohmann::json::parse(ReadAll(Path(kIndexFileName)));
  EXPECT_EQ(index["metadata"]["total_size"], 60 + 14 + 4000 + 8);
  EXPECT_EQ(index["metadata"]["total_parameters"], 15 + 7 + 1000 + 4);
  EXPECT_EQ(index["weight_map"]["w3"], "model-00002-of-00003.safetensors");
  EXPECT_EQ(index["weight_map"]["w4"], "model-00003-of-00003.safetensors");
  StatusOr<WeightFiles> back = OpenWeights(dir_);
  ASSERT_THAT(back, IsOk());
  for (size_t i = 0; i < e.size(); ++i) {
    uint32_t f = 0;
    const TensorInfo* t = back->Find(e[i].key, &f);
    ASSERT_NE(t, nullptr) << e[i].key;
    EXPECT_EQ(t->dtype, e[i].dtype);
    EXPECT_EQ(t->shape, e[i].shape);
    EXPECT_EQ(back->files[f].metadata.at("format"), "pt");
    EXPECT_EQ(back->files[f].data_start % 4096, 0u);  // page-aligned tensor bytes
    EXPECT_EQ(*ReadTensorBytes(*back, e[i].key), Bytes(i, e[i].bytes())) << e[i].key;
  }
}

TEST_F(ShardWriterTest, OneShardIsModelSafetensorsWithoutAnIndex) {
  StatusOr<std::unique_ptr<ShardWriter>> w =
      ShardWriter::Create(dir_, {E("a", DType::kF32, {4}), E("b", DType::kU8, {3})});
  ASSERT_THAT(w, IsOk());
  ASSERT_THAT(PutAll(**w, 5), IsOk());
  ASSERT_THAT((*w)->Finish(), IsOk());
  EXPECT_THAT(Listing(dir_), ElementsAre(kSingleFileName));
  StatusOr<WeightFiles> back = OpenWeights(dir_);
  ASSERT_THAT(back, IsOk());
  EXPECT_EQ(*ReadTensorBytes(*back, "b"), Bytes(1, 3));
}

TEST_F(ShardWriterTest, ASingleFileWhateverItsSize) {
  ShardWriterOptions o;
  o.single_file = true;
  o.max_shard_bytes = 4;
  const std::string p = Path("out.safetensors");
  StatusOr<std::unique_ptr<ShardWriter>> w =
      ShardWriter::Create(p, {E("a", DType::kF32, {4}), E("b", DType::kF32, {4})}, o);
  ASSERT_THAT(w, IsOk());
  ASSERT_THAT(PutAll(**w, 1000), IsOk());
  ASSERT_THAT((*w)->Finish(), IsOk());
  EXPECT_THAT(Listing(dir_), ElementsAre("out.safetensors"));
  StatusOr<WeightFiles> back = OpenWeights(p);
  ASSERT_THAT(back, IsOk());
  EXPECT_EQ(*ReadTensorBytes(*back, "a"), Bytes(0, 16));
}

TEST_F(ShardWriterTest, AnEarlierExportsFilesAreReplacedAndStaleShardsRemoved) {
  WriteF32File(Path(kSingleFileName), {{"old", {1}}});
  WriteF32File(Path("model-00004-of-00009.safetensors"), {{"old", {1}}});
  std::ofstream(Path(kIndexFileName)) << R"({"weight_map": {}})";
  std::ofstream(Path("README.md")) << "kept";
  ShardWriterOptions o;
  o.max_shard_bytes = 16;
  StatusOr<std::unique_ptr<ShardWriter>> w =
      ShardWriter::Create(dir_, {E("a", DType::kF32, {4}), E("b", DType::kF32, {4})}, o);
  ASSERT_THAT(w, IsOk());
  EXPECT_FALSE(std::filesystem::exists(Path(kIndexFileName)));  // gone before any shard
  ASSERT_THAT(PutAll(**w, 3), IsOk());
  ASSERT_THAT((*w)->Finish(), IsOk());
  EXPECT_THAT(Listing(dir_),
              ElementsAre("README.md", "model-00001-of-00002.safetensors",
                          "model-00002-of-00002.safetensors", kIndexFileName));
  StatusOr<WeightFiles> back = OpenWeights(dir_);
  ASSERT_THAT(back, IsOk());
  EXPECT_THAT(back->Keys(), ElementsAre("a", "b"));
}

TEST_F(ShardWriterTest, AFailedExportLeavesNoTemporaryFileAndNoIndex) {
  ShardWriterOptions o;
  o.max_shard_bytes = 16;
  {
    StatusOr<std::unique_ptr<ShardWriter>> w = ShardWriter::Create(
        dir_, {E("a", DType::kF32, {4}), E("b", DType::kF32, {4}), E("c", DType::kF32, {4})}, o);
    ASSERT_THAT(w, IsOk());
    const std::string bytes(24, 'x');  // shard 1 and half of shard 2
    ASSERT_THAT((*w)->Put(bytes.data(), bytes.size()), IsOk());
    EXPECT_THAT((*w)->Finish(), StatusIs(StatusCode::kFailedPrecondition, "24 bytes"));
    EXPECT_THAT((*w)->Put(bytes.data(), 25), StatusIs(StatusCode::kInvalidArgument, "1 bytes"));
  }  // destroyed unfinished: the source of the values failed, say
  EXPECT_THAT(Listing(dir_), ElementsAre("model-00001-of-00003.safetensors"));
  EXPECT_THAT(OpenWeights(dir_), StatusIs(StatusCode::kInvalidArgument, "has neither"));
}

// A process killed in the middle of a shard (SIGKILL: no destructor runs) leaves the shards it
// finished, the one it was writing under its temporary name, and no index: nothing that
// loads as a checkpoint, even over an earlier export of the same layout.
TEST_F(ShardWriterTest, AKillMidShardLeavesNothingThatLooksWhole) {
  const std::vector<ShardEntry> e = {E("a", DType::kF32, {1024}), E("b", DType::kF32, {1024}),
                                     E("c", DType::kF32, {1024})};
  ShardWriterOptions o;
  o.max_shard_bytes = 4096;
  {  // an earlier, complete export of the same layout
    StatusOr<std::unique_ptr<ShardWriter>> w = ShardWriter::Create(dir_, e, o);
    ASSERT_THAT(w, IsOk());
    ASSERT_THAT(PutAll(**w, 1000), IsOk());
    ASSERT_THAT((*w)->Finish(), IsOk());
    ASSERT_THAT(OpenWeights(dir_), IsOk());
  }
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    StatusOr<std::unique_ptr<ShardWriter>> w = ShardWriter::Create(dir_, e, o);
    if (!w.ok()) _exit(2);
    const std::string bytes(4096 + 2000, 'k');
    if (!(*w)->Put(bytes.data(), bytes.size()).ok()) _exit(3);
    raise(SIGKILL);
    _exit(4);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << status;
  EXPECT_THAT(Listing(dir_), ElementsAre("model-00001-of-00003.safetensors",
                                         "model-00002-of-00003.safetensors",
                                         "model-00002-of-00003.safetensors.tmp",
                                         "model-00003-of-00003.safetensors"));
  EXPECT_THAT(OpenWeights(dir_), StatusIs(StatusCode::kInvalidArgument, "has neither"));
  // The new shard 1 replaced the old one whole (renamed), never a torn file under the name.
  EXPECT_EQ(ReadAll(Path("model-00001-of-00003.safetensors")).substr(4096, 4096),
            std::string(4096, 'k'));
}

TEST_F(ShardWriterTest, BadEntriesAreRefused) {
  EXPECT_THAT(ShardWriter::Create(dir_, {}), StatusIs(StatusCode::kInvalidArgument, "no tensors"));
  EXPECT_THAT(ShardWriter::Create(dir_, {E("a", DType::kF32, {1}), E("a", DType::kF32, {1})}),
              StatusIs(StatusCode::kInvalidArgument, "'a' is named twice"));
  EXPECT_THAT(ShardWriter::Create(dir_, {E("", DType::kF32, {1})}),
              StatusIs(StatusCode::kInvalidArgument, "no name"));
}

TEST_F(ShardWriterTest, FileWriterPadsOnlyInMemoryAndRewritesInPlace) {
  const std::string p = Path("f.bin");
  StatusOr<std::unique_ptr<FileWriter>> w = FileWriter::Create(p, true, 8192, /*crc=*/true);
  ASSERT_THAT(w, IsOk());
  const std::string a(5000, 'a'), b(9000, 'b');
  ASSERT_THAT((*w)->Put(a.data(), a.size()), IsOk());
  const uint32_t crc_a = (*w)->TakeCrc();
  EXPECT_NE(crc_a, 0u);
  ASSERT_THAT((*w)->Put(b.data(), b.size()), IsOk());
  ASSERT_THAT((*w)->Finish(), IsOk());
  EXPECT_EQ((*w)->bytes(), 14000u);
  const std::string head(4096, 'h');
  ASSERT_THAT((*w)->Rewrite(0, head.data(), head.size()), IsOk());
  ASSERT_THAT((*w)->Close(), IsOk());
  EXPECT_EQ(ReadAll(p), head + a.substr(4096) + b);
}

// Writing in place (Space + Commit, no copy) in irregular amounts, mixed with Put, across
// entries and shards: the same files, index and bytes as Put alone; the CRC a FileWriter keeps
// is the one Put gives; a Commit past the free room is refused.
TEST_F(ShardWriterTest, InPlaceWritesEqualPut) {
  const std::vector<ShardEntry> e = ThreeShardEntries();
  ShardWriterOptions o;
  o.max_shard_bytes = 100;
  StatusOr<std::unique_ptr<ShardWriter>> w = ShardWriter::Create(dir_, e, o);
  ASSERT_THAT(w, IsOk());
  std::string all;
  for (size_t i : (*w)->order()) all += Bytes(i, e[i].bytes());
  size_t at = 0, round = 0;
  while (at < all.size()) {
    const size_t want = std::min<size_t>(all.size() - at, 1 + (round * 977) % 3001);
    if (round++ % 3 == 2) {
      ASSERT_THAT((*w)->Put(all.data() + at, want), IsOk());
      at += want;
      continue;
    }
    StatusOr<std::span<char>> room = (*w)->Space(want);
    ASSERT_THAT(room, IsOk());
    ASSERT_GE(room->size(), 1u);
    ASSERT_LE(room->size(), want);
    std::memcpy(room->data(), all.data() + at, room->size());
    ASSERT_THAT((*w)->Commit(room->size()), IsOk());
    at += room->size();
  }
  EXPECT_THAT((*w)->Space(1), StatusIs(StatusCode::kFailedPrecondition, "after the last byte"));
  ASSERT_THAT((*w)->Finish(), IsOk());
  StatusOr<WeightFiles> back = OpenWeights(dir_);
  ASSERT_THAT(back, IsOk());
  ASSERT_EQ(back->files.size(), 3u);
  for (size_t i = 0; i < e.size(); ++i) {
    EXPECT_EQ(*ReadTensorBytes(*back, e[i].key), Bytes(i, e[i].bytes())) << e[i].key;
  }

  // A FileWriter's buffer of 8192 bytes: 10000 bytes in place fill it (a flush) and go on.
  std::string a(10000, '\0');
  for (size_t k = 0; k < a.size(); ++k) a[k] = static_cast<char>(k * 13);
  StatusOr<std::unique_ptr<FileWriter>> f = FileWriter::Create(Path("f.bin"), true, 8192, true);
  ASSERT_THAT(f, IsOk());
  std::vector<size_t> sizes;
  for (size_t done = 0; done < a.size();) {
    StatusOr<std::span<char>> room = (*f)->Space(std::min<size_t>(5000, a.size() - done));
    ASSERT_THAT(room, IsOk());
    std::memcpy(room->data(), a.data() + done, room->size());
    ASSERT_THAT((*f)->Commit(room->size()), IsOk());
    sizes.push_back(room->size());
    done += room->size();
  }
  EXPECT_THAT(sizes, ElementsAre(5000u, 3192u, 1808u));  // cut at the buffer's end
  EXPECT_EQ((*f)->TakeCrc(), Crc32c(a.data(), a.size(), 0));
  EXPECT_THAT((*f)->Commit(8192), StatusIs(StatusCode::kInvalidArgument, "6384 were free"));
  ASSERT_THAT((*f)->Finish(), IsOk());
  ASSERT_THAT((*f)->Close(), IsOk());
  EXPECT_EQ(ReadAll(Path("f.bin")), a);
}

// A write that fails on the writer's thread (a full disk: /dev/full answers ENOSPC) is
// returned by the next call that waits for it — a later flush, Finish or Close — never lost.
TEST(FileWriterTest, AFailedWriteOnItsThreadIsReturnedByALaterCall) {
  const std::string big(3 * 8192, 'x');
  for (int where = 0; where < 3; ++where) {
    StatusOr<std::unique_ptr<FileWriter>> f = FileWriter::Create("/dev/full", false, 8192);
    ASSERT_THAT(f, IsOk());
    Status s;
    if (where == 0) {  // a second flush waits for the first write
      s = (*f)->Put(big.data(), big.size());
    } else if (where == 1) {  // Finish waits for the one write
      ASSERT_THAT((*f)->Put(big.data(), 8192), IsOk());
      s = (*f)->Finish();
    } else {  // Close waits for it too
      ASSERT_THAT((*f)->Put(big.data(), 8192), IsOk());
      s = (*f)->Close();
    }
    EXPECT_THAT(s, StatusIs(StatusCode::kResourceExhausted, "writing /dev/full")) << where;
  }
}

}  // namespace
}  // namespace tiermem::weights
