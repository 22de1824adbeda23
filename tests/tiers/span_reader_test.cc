// SpanReader: every span's bytes, once, in order, through both I/O backends, with O_DIRECT and
// buffered, across request boundaries, gaps and the unaligned end of a file.
#include "tiers/nvme/span_reader.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "tests/support/status_matchers.h"

namespace tiermem {
namespace {

using tiermem::testing::IsOk;
using tiermem::testing::StatusIs;

std::string MakeDir(const std::string& base) {
  std::string tmpl = base + "/tiermem_span_XXXXXX";
  if (mkdtemp(tmpl.data()) == nullptr) return "";
  return tmpl;
}

std::string RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string out(n, '\0');
  for (char& c : out) c = static_cast<char>(rng());
  return out;
}

struct Case {
  NvmeIoBackend backend;
  bool direct;
  const char* name;
};

class SpanReaderTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    dir_ = MakeDir(::testing::TempDir());
    ASSERT_FALSE(dir_.empty());
    // Two files whose lengths are not multiples of a block.
    for (size_t f = 0; f < 2; ++f) {
      bytes_.push_back(RandomBytes(f == 0 ? 1'000'003 : 70'001, 7 + f));
      paths_.push_back(dir_ + "/f" + std::to_string(f));
      std::ofstream(paths_.back(), std::ios::binary) << bytes_.back();
    }
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  SpanReaderConfig Config() const {
    SpanReaderConfig c;
    c.io_backend = GetParam().backend;
    c.direct_io = GetParam().direct;
    c.request_bytes = 64 * kKiB;
    c.depth = 3;
    c.max_gap_bytes = 1000;
    return c;
  }
  // Reads `spans` and checks every span came whole, in order, equal to the file's bytes.
  void ReadAndCheck(SpanReader& r, const std::vector<FileSpan>& spans) {
    std::vector<std::string> got(spans.size());
    size_t last_span = 0;
    ASSERT_THAT(r.Read(spans,
                       [&](size_t span, uint64_t at, const char* data, size_t n) {
                         EXPECT_GE(span, last_span);  // span order
                         last_span = span;
                         EXPECT_EQ(at, got[span].size());  // each span's pieces in order
                         got[span].append(data, n);
                         return OkStatus();
                       }),
                IsOk());
    for (size_t i = 0; i < spans.size(); ++i) {
      EXPECT_EQ(got[i], bytes_[spans[i].file].substr(spans[i].offset, spans[i].bytes))
          << "span " << i;
    }
  }
  std::string dir_;
  std::vector<std::string> paths_, bytes_;
};

TEST_P(SpanReaderTest, EverySpanOnceInOrderAcrossRequestsGapsAndTheFileEnd) {
  StatusOr<std::unique_ptr<SpanReader>> r = SpanReader::Open(paths_, Config());
  ASSERT_THAT(r, IsOk());
  EXPECT_EQ((*r)->staging_bytes(), 3 * 64 * kKiB);
  EXPECT_EQ((*r)->file_bytes(0), 1'000'003u);
  ReadAndCheck(**r, {
                        {0, 3, 10},             // unaligned, tiny
                        {0, 13, 5},             // adjacent: same request
                        {0, 500, 300'000},      // larger than a request (several)
                        {0, 300'600, 0},        // empty
                        {0, 300'700, 100},      // past the gap limit: a new request
                        {1, 0, 70'001},         // another file, up to its unaligned end
                        {0, 999'000, 1'003},    // the tail of the first file
                        {0, 4096 * 3, 4096},    // backwards: a request of its own
                    });
  // A second read with the same reader.
  ReadAndCheck(**r, {{1, 69'999, 2}, {0, 0, 1'000'003}});
  EXPECT_GT((*r)->stats().requests, 20u);
  EXPECT_GE((*r)->stats().bytes_read, 1'000'003u + 300'000u);
}

TEST_P(SpanReaderTest, ASpanOutsideItsFileIsRefusedBeforeReading) {
  StatusOr<std::unique_ptr<SpanReader>> r = SpanReader::Open(paths_, Config());
  ASSERT_THAT(r, IsOk());
  int calls = 0;
  auto count = [&](size_t, uint64_t, const char*, size_t) {
    ++calls;
    return OkStatus();
  };
  EXPECT_THAT((*r)->Read({{0, 0, 10}, {1, 70'000, 2}}, count),
              StatusIs(StatusCode::kInvalidArgument, "is outside " + paths_[1]));
  EXPECT_THAT((*r)->Read({{2, 0, 1}}, count), StatusIs(StatusCode::kInvalidArgument, "outside"));
  EXPECT_EQ(calls, 0);
}

TEST_P(SpanReaderTest, ASinkErrorStopsTheReadAndIsReturned) {
  StatusOr<std::unique_ptr<SpanReader>> r = SpanReader::Open(paths_, Config());
  ASSERT_THAT(r, IsOk());
  int calls = 0;
  EXPECT_THAT((*r)->Read({{0, 0, 1'000'000}},
                         [&](size_t, uint64_t, const char*, size_t) {
                           return ++calls == 2 ? DataLossError("stop here") : OkStatus();
                         }),
              StatusIs(StatusCode::kDataLoss, "stop here"));
  EXPECT_EQ(calls, 2);
  ReadAndCheck(**r, {{0, 1, 200'000}});  // the reader is usable afterwards
}

INSTANTIATE_TEST_SUITE_P(Backends, SpanReaderTest,
                         ::testing::Values(Case{NvmeIoBackend::kAuto, true, "auto_direct"},
                                           Case{NvmeIoBackend::kPosix, true, "posix_direct"},
                                           Case{NvmeIoBackend::kPosix, false, "posix_buffered"},
                                           Case{NvmeIoBackend::kAuto, false, "auto_buffered"}),
                         [](const auto& info) { return std::string(info.param.name); });

TEST(SpanReader, MissingFilesAndBadConfigs) {
  EXPECT_THAT(SpanReader::Open({"/nonexistent/tiermem/w.safetensors"}),
              StatusIs(StatusCode::kNotFound, "/nonexistent/tiermem/w.safetensors"));
  SpanReaderConfig c;
  c.request_bytes = 1000;
  EXPECT_THAT(SpanReader::Open({}, c), StatusIs(StatusCode::kInvalidArgument, "request_bytes"));
}

// tmpfs refuses O_DIRECT: the reader falls back to buffered reads of the same bytes.
TEST(SpanReader, AFileSystemWithoutODirect) {
  struct stat st;
  if (stat("/dev/shm", &st) != 0) GTEST_SKIP() << "no /dev/shm";
  const std::string dir = MakeDir("/dev/shm");
  ASSERT_FALSE(dir.empty());
  const std::string bytes = RandomBytes(100'000, 3);
  std::ofstream(dir + "/f", std::ios::binary) << bytes;
  StatusOr<std::unique_ptr<SpanReader>> r = SpanReader::Open({dir + "/f"});
  ASSERT_THAT(r, IsOk());
  std::string got;
  ASSERT_THAT((*r)->Read({{0, 5, 99'990}},
                         [&](size_t, uint64_t, const char* d, size_t n) {
                           got.append(d, n);
                           return OkStatus();
                         }),
              IsOk());
  EXPECT_EQ(got, bytes.substr(5, 99'990));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace tiermem
