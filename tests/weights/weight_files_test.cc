// Opening weights: a file, a directory with model.safetensors, a directory with the index and
// its shards — and every inconsistency between them, each naming the file.
#include "weights/weight_files.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/support/status_matchers.h"
#include "tests/weights/weights_test_support.h"

namespace tiermem::weights {
namespace {

using ::testing::ElementsAre;
using tiermem::testing::IsOk;
using tiermem::testing::StatusIs;
using namespace tiermem::weights::testing;  // NOLINT

class WeightFilesTest : public TempDirTest {
 protected:
  // Two shards (a, b | c) and their index.
  void WriteSharded(const std::string& index_text = "") {
    WriteF32File(Path("model-00001-of-00002.safetensors"), {{"a", {2}}, {"b", {3}}});
    WriteF32File(Path("model-00002-of-00002.safetensors"), {{"c", {4}}});
    std::ofstream(Path(kIndexFileName))
        << (index_text.empty() ? R"({"metadata": {"total_size": 36},
              "weight_map": {"a": "model-00001-of-00002.safetensors",
                             "b": "model-00001-of-00002.safetensors",
                             "c": "model-00002-of-00002.safetensors"}})"
                               : index_text);
  }
};

TEST_F(WeightFilesTest, ASingleFile) {
  WriteF32File(Path("w.safetensors"), {{"x", {2, 2}}});
  StatusOr<WeightFiles> w = OpenWeights(Path("w.safetensors"));
  ASSERT_THAT(w, IsOk());
  EXPECT_EQ(w->files.size(), 1u);
  EXPECT_EQ(w->index_path, "");
  EXPECT_EQ(w->total_size, 16u);
  uint32_t f = 9;
  ASSERT_NE(w->Find("x", &f), nullptr);
  EXPECT_EQ(f, 0u);
  EXPECT_EQ(w->Find("y"), nullptr);
}

TEST_F(WeightFilesTest, ADirectoryWithModelSafetensors) {
  WriteF32File(Path(kSingleFileName), {{"x", {2}}, {"y", {1}}});
  StatusOr<WeightFiles> w = OpenWeights(dir_);
  ASSERT_THAT(w, IsOk());
  EXPECT_THAT(w->Keys(), ElementsAre("x", "y"));
  EXPECT_EQ(w->FileOf("y"), Path(kSingleFileName));
}

TEST_F(WeightFilesTest, ADirectoryWithTheIndexAndItsShards) {
  WriteSharded();
  StatusOr<WeightFiles> w = OpenWeights(dir_);
  ASSERT_THAT(w, IsOk());
  EXPECT_EQ(w->index_path, Path(kIndexFileName));
  ASSERT_EQ(w->files.size(), 2u);
  EXPECT_THAT(w->Keys(), ElementsAre("a", "b", "c"));
  uint32_t f = 0;
  const TensorInfo* c = w->Find("c", &f);
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(f, 1u);
  EXPECT_EQ(c->numel, 4u);
  EXPECT_EQ(w->FileOf("b"), Path("model-00001-of-00002.safetensors"));
  EXPECT_EQ(w->total_size, 36u);
  StatusOr<std::string> bytes = ReadTensorBytes(*w, "c");
  ASSERT_THAT(bytes, IsOk());
  EXPECT_EQ(*bytes, F32Values(0, 4));  // c is its file's first tensor
  EXPECT_THAT(ReadTensorBytes(*w, "d"), StatusIs(StatusCode::kInvalidArgument, "no tensor 'd'"));
}

TEST_F(WeightFilesTest, AShardTheIndexNamesButTheDirectoryLacks) {
  WriteSharded();
  std::filesystem::remove(Path("model-00002-of-00002.safetensors"));
  EXPECT_THAT(OpenWeights(dir_),
              StatusIs(StatusCode::kInvalidArgument,
                       "names the shard model-00002-of-00002.safetensors, which " + dir_ +
                           " lacks"));
}

TEST_F(WeightFilesTest, ATensorInTwoShards) {
  WriteSharded();
  WriteF32File(Path("model-00002-of-00002.safetensors"), {{"c", {4}}, {"a", {2}}});
  EXPECT_THAT(OpenWeights(dir_), StatusIs(StatusCode::kInvalidArgument,
                                          "tensor 'a' is in two shards: " +
                                              Path("model-00002-of-00002.safetensors") + " and " +
                                              Path("model-00001-of-00002.safetensors")));
}

TEST_F(WeightFilesTest, TheIndexMapsATensorToAShardWithoutIt) {
  WriteSharded(R"({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                  "b": "model-00001-of-00002.safetensors",
                                  "c": "model-00002-of-00002.safetensors",
                                  "d": "model-00002-of-00002.safetensors"}})");
  EXPECT_THAT(OpenWeights(dir_),
              StatusIs(StatusCode::kInvalidArgument,
                       "maps tensor 'd' to model-00002-of-00002.safetensors, which has no tensor"));
}

TEST_F(WeightFilesTest, AShardTensorTheIndexDoesNotList) {
  WriteSharded(R"({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                  "c": "model-00002-of-00002.safetensors"}})");
  EXPECT_THAT(OpenWeights(dir_),
              StatusIs(StatusCode::kInvalidArgument, "holds tensor 'b', which the index"));
}

TEST_F(WeightFilesTest, MalformedIndexes) {
  for (const auto& [text, why] : std::vector<std::pair<std::string, std::string>>{
           {"{", "is not valid JSON"},
           {"[]", "is not a JSON object"},
           {R"({"metadata": {}})", "has no weight_map object"},
           {R"({"weight_map": {"a": 3}})", "entry 'a' is not a file name"},
           {R"({"weight_map": {"a": "../x.safetensors"}})", "not a file of the checkpoint's"},
           {R"({"weight_map": {"a": ".."}})", "not a file of the checkpoint's"},
           {R"({"weight_map": {}, "metadata": {"total_size": "big"}})",
            "total_size is not a byte count"},
       }) {
    std::ofstream(Path(kIndexFileName), std::ios::trunc) << text;
    EXPECT_THAT(OpenWeights(dir_), StatusIs(StatusCode::kInvalidArgument, why)) << text;
  }
}

TEST_F(WeightFilesTest, ATornShardIsInvalidArgumentNamingIt) {
  WriteSharded();
  const std::string p = Path("model-00002-of-00002.safetensors");
  std::filesystem::resize_file(p, std::filesystem::file_size(p) - 3);
  EXPECT_THAT(OpenWeights(dir_),
              StatusIs(StatusCode::kInvalidArgument, p + " is shorter than its header says"));
}

TEST_F(WeightFilesTest, ADirectoryWithoutWeightsOrAMissingPath) {
  EXPECT_THAT(OpenWeights(dir_), StatusIs(StatusCode::kInvalidArgument,
                                          "has neither model.safetensors nor "
                                          "model.safetensors.index.json"));
  EXPECT_THAT(OpenWeights(Path("nope")), StatusIs(StatusCode::kNotFound, "does not exist"));
}

TEST_F(WeightFilesTest, ModelSafetensorsWinsOverAnIndexAsInTransformers) {
  WriteSharded();
  WriteF32File(Path(kSingleFileName), {{"z", {1}}});
  StatusOr<WeightFiles> w = OpenWeights(dir_);
  ASSERT_THAT(w, IsOk());
  EXPECT_THAT(w->Keys(), ElementsAre("z"));
}

}  // namespace
}  // namespace tiermem::weights
