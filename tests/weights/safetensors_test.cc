// The safetensors header parser: every rule of weights/safetensors.h, one malformed file each.
#include "weights/safetensors.h"

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

class SafetensorsTest : public TempDirTest {
 protected:
  // A file holding `header` and `data_bytes` bytes of tensor data.
  StatusOr<Header> Parse(const std::string& header, size_t data_bytes, int64_t n = -1) {
    const std::string p = Path("f.safetensors");
    WriteRaw(p, header, std::string(data_bytes, '\x01'), n);
    return ReadHeader(p);
  }
};

TEST_F(SafetensorsTest, AWellFormedFileParsesInDataOrder) {
  const std::string p = Path("ok.safetensors");
  WriteF32File(p, {{"b", {2, 3}}, {"a", {4}}, {"scalar", {}}}, {{"format", "pt"}});
  StatusOr<Header> h = ReadHeader(p);
  ASSERT_THAT(h, IsOk());
  ASSERT_EQ(h->tensors.size(), 3u);
  EXPECT_EQ(h->tensors[0].key, "b");  // by offset, not by name
  EXPECT_EQ(h->tensors[1].key, "a");
  EXPECT_EQ(h->tensors[2].key, "scalar");
  EXPECT_THAT(h->tensors[0].shape, ElementsAre(2u, 3u));
  EXPECT_EQ(h->tensors[0].numel, 6u);
  EXPECT_EQ(h->tensors[2].numel, 1u);  // a 0-d tensor holds one element
  EXPECT_EQ(h->tensors[1].begin, 24u);
  EXPECT_EQ(h->tensors[1].end, 40u);
  EXPECT_EQ(h->metadata.at("format"), "pt");
  EXPECT_EQ(h->Find("a"), &h->tensors[1]);
  EXPECT_EQ(h->Find("nope"), nullptr);
  EXPECT_EQ(h->data_start + 44, h->file_bytes);
  EXPECT_EQ(h->data_start % 8, 0u);
}

TEST_F(SafetensorsTest, EveryDTypeHasItsNameAndWidth) {
  for (const char* n : {"BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ",
                        "F8_E5M2FNUZ", "F4", "F6_E2M3", "F6_E3M2", "I16", "U16", "F16", "BF16",
                        "I32", "U32", "F32", "F64", "C64", "I64", "U64"}) {
    const std::optional<DType> d = ParseDType(n);
    ASSERT_TRUE(d) << n;
    EXPECT_EQ(DTypeName(*d), n);
  }
  EXPECT_EQ(DTypeBits(DType::kBF16), 16u);
  EXPECT_EQ(DTypeBits(DType::kF4), 4u);
  EXPECT_EQ(DTypeBits(DType::kF6E2M3), 6u);
  EXPECT_EQ(DTypeBits(DType::kC64), 64u);
  EXPECT_FALSE(ParseDType("bf16"));
}

TEST_F(SafetensorsTest, HeaderLengthOutOfRangeOrLongerThanTheFile) {
  EXPECT_THAT(Parse(R"({})", 0, 0), StatusIs(StatusCode::kInvalidArgument, "header length 0"));
  EXPECT_THAT(Parse(R"({})", 0, 100'000'001),
              StatusIs(StatusCode::kInvalidArgument, "header length 100000001"));
  EXPECT_THAT(Parse(R"({})", 0, 64), StatusIs(StatusCode::kDataLoss, "shorter than its header"));
  const std::string p = Path("tiny.safetensors");
  std::ofstream(p, std::ios::binary) << "abc";
  EXPECT_THAT(ReadHeader(p), StatusIs(StatusCode::kInvalidArgument, "too short for a header"));
  EXPECT_THAT(ReadHeader(Path("missing.safetensors")),
              StatusIs(StatusCode::kNotFound, "missing.safetensors"));
}

TEST_F(SafetensorsTest, MalformedJsonIsRefusedNamingTheFile) {
  EXPECT_THAT(Parse(R"({"a": )", 0), StatusIs(StatusCode::kInvalidArgument, "not valid JSON"));
  EXPECT_THAT(Parse(R"([1, 2])", 0), StatusIs(StatusCode::kInvalidArgument, "not a JSON object"));
  EXPECT_THAT(Parse("{\"\xff\": 1}", 0), StatusIs(StatusCode::kInvalidArgument, "not valid JSON"));
  EXPECT_THAT(Parse(R"({"a": 1})", 0), StatusIs(StatusCode::kInvalidArgument, "f.safetensors"));
}

TEST_F(SafetensorsTest, AKeyTwiceIsRefused) {
  EXPECT_THAT(Parse(R"({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                        "a": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}})",
                    2),
              StatusIs(StatusCode::kInvalidArgument, "names tensor 'a' twice"));
}

TEST_F(SafetensorsTest, EntriesWithoutDtypeShapeOrOffsetsOrWithBadOnes) {
  EXPECT_THAT(Parse(R"({"w": {"shape": [1], "data_offsets": [0, 4]}})", 4),
              StatusIs(StatusCode::kInvalidArgument, "tensor 'w' has no dtype"));
  EXPECT_THAT(Parse(R"({"w": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 4]}})", 4),
              StatusIs(StatusCode::kInvalidArgument, "unknown dtype 'Q4'"));
  EXPECT_THAT(Parse(R"({"w": {"dtype": "F32", "data_offsets": [0, 4]}})", 4),
              StatusIs(StatusCode::kInvalidArgument, "tensor 'w' has no shape"));
  EXPECT_THAT(Parse(R"({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", 4),
              StatusIs(StatusCode::kInvalidArgument, "not a non-negative integer"));
  EXPECT_THAT(Parse(R"({"w": {"dtype": "F32", "shape": [1]}})", 4),
              StatusIs(StatusCode::kInvalidArgument, "no data_offsets"));
  EXPECT_THAT(Parse(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}})", 4),
              StatusIs(StatusCode::kInvalidArgument, "bad data_offsets"));
  EXPECT_THAT(Parse(R"({"w": [1, 2]})", 4),
              StatusIs(StatusCode::kInvalidArgument, "'w' is not a JSON object"));
}

TEST_F(SafetensorsTest, ByteCountMustBeNumelTimesElementSize) {
  EXPECT_THAT(Parse(R"({"w": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 8]}})", 8),
              StatusIs(StatusCode::kInvalidArgument, "holds 8 bytes, but 3 elements of BF16 are 6"));
  // Sub-byte dtypes: a whole number of bytes or nothing.
  EXPECT_THAT(Parse(R"({"w": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}})", 2),
              StatusIs(StatusCode::kInvalidArgument, "not a whole number of bytes"));
  EXPECT_THAT(Parse(R"({"w": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}})", 2), IsOk());
}

TEST_F(SafetensorsTest, OffsetsMustTileTheDataWithoutHolesOrOverlaps) {
  EXPECT_THAT(Parse(R"({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                        "b": {"dtype": "U8", "shape": [2], "data_offsets": [3, 5]}})",
                    5),
              StatusIs(StatusCode::kInvalidArgument, "'b' starts at data byte 3, leaving a hole"));
  EXPECT_THAT(Parse(R"({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                        "b": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}})",
                    3),
              StatusIs(StatusCode::kInvalidArgument, "'b' starts at data byte 1, overlapping"));
  EXPECT_THAT(Parse(R"({"a": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}})", 3),
              StatusIs(StatusCode::kInvalidArgument, "leaving a hole"));
}

TEST_F(SafetensorsTest, AFileShorterThanItsHeaderSaysIsDataLossNamingTheTensor) {
  EXPECT_THAT(Parse(R"({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                        "b": {"dtype": "F32", "shape": [4], "data_offsets": [2, 18]}})",
                    10),
              StatusIs(StatusCode::kDataLoss,
                       "shorter than its header says (torn or partially downloaded): tensor 'b' "
                       "ends at data byte 18, the file holds 10"));
}

TEST_F(SafetensorsTest, BytesAfterTheLastTensorAreRefused) {
  EXPECT_THAT(Parse(R"({"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}})", 7),
              StatusIs(StatusCode::kInvalidArgument, "5 bytes after its last tensor 'a'"));
}

TEST_F(SafetensorsTest, MetadataIsAStringMapOrNull) {
  EXPECT_THAT(Parse(R"({"__metadata__": {"format": 1}})", 0),
              StatusIs(StatusCode::kInvalidArgument, "entry 'format' is not a string"));
  EXPECT_THAT(Parse(R"({"__metadata__": [1]})", 0),
              StatusIs(StatusCode::kInvalidArgument, "__metadata__ is not an object"));
  StatusOr<Header> h = Parse(R"({"__metadata__": null})", 0);
  ASSERT_THAT(h, IsOk());
  EXPECT_TRUE(h->metadata.empty());
  EXPECT_TRUE(h->tensors.empty());
}

TEST_F(SafetensorsTest, EmptyTensorsAndPaddingWhitespaceAreFine) {
  StatusOr<Header> h = Parse(R"(  {"e": {"dtype": "F32", "shape": [0, 5], "data_offsets": [0, 0]},
                               "a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]}}     )",
                             3);
  ASSERT_THAT(h, IsOk());
  ASSERT_EQ(h->tensors.size(), 2u);
  EXPECT_EQ(h->tensors[0].key, "e");
  EXPECT_EQ(h->tensors[0].numel, 0u);
}

TEST_F(SafetensorsTest, HeaderTextRoundTripsAndPadsToTheAlignment) {
  std::vector<TensorInfo> ts(2);
  ts[0].key = "x";
  ts[0].dtype = DType::kBF16;
  ts[0].shape = {3};
  ts[0].numel = 3;
  ts[0].begin = 0;
  ts[0].end = 6;
  ts[1].key = "y";
  ts[1].dtype = DType::kU8;
  ts[1].shape = {2};
  ts[1].numel = 2;
  ts[1].begin = 6;
  ts[1].end = 8;
  for (uint64_t align : {8u, 4096u}) {
    const std::string text = HeaderText(ts, {{"format", "pt"}}, align);
    EXPECT_EQ((8 + text.size()) % align, 0u);
    StatusOr<Header> h = Parse(text, 8);
    ASSERT_THAT(h, IsOk());
    EXPECT_EQ(h->tensors[0].key, "x");
    EXPECT_EQ(h->tensors[0].dtype, DType::kBF16);
    EXPECT_EQ(h->tensors[1].begin, 6u);
    EXPECT_EQ(h->metadata.at("format"), "pt");
    EXPECT_EQ(h->data_start % align, 0u);
  }
  EXPECT_EQ(HeaderText({}, {}, 8), "{}      ");
}

}  // namespace
}  // namespace tiermem::weights
