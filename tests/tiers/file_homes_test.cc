// FileHomeTier: file homes read the spans they are made of (any sub-range, gaps as zeros)
// through both I/O backends, are never written, are refused when their file changed under
// them, and leave the wrapped NVMe tier's own regions and budget untouched.
#include "tiers/nvme/file_homes.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

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
  std::string tmpl = base + "/tiermem_fh_XXXXXX";
  if (mkdtemp(tmpl.data()) == nullptr) return "";
  return tmpl;
}

class FileHomesTest : public ::testing::TestWithParam<NvmeIoBackend> {
 protected:
  void SetUp() override {
    dir_ = MakeDir(::testing::TempDir());
    ASSERT_FALSE(dir_.empty());
    std::mt19937 rng(5);
    bytes_.resize(300'001);  // not a multiple of a block
    for (char& c : bytes_) c = static_cast<char>(rng());
    path_ = dir_ + "/w.safetensors";
    std::ofstream(path_, std::ios::binary) << bytes_;
    NvmeTierConfig nc;
    nc.dir = dir_;
    nc.capacity = 1 * kMiB;
    nc.io_backend = GetParam();
    auto inner = OpenNvmeTier(nc);
    ASSERT_THAT(inner.status(), IsOk());
    FileHomesConfig fc;
    fc.io_backend = GetParam();
    fc.request_bytes = 64 * kKiB;
    tier_ = std::make_unique<FileHomeTier>(std::move(*inner), fc);
    ASSERT_THAT(tier_->OpenFiles({path_}, {bytes_.size()}).status(), IsOk());
  }
  void TearDown() override {
    tier_.reset();
    std::filesystem::remove_all(dir_);
  }
  // A home of 200 KiB: file bytes [10'007, +70'000) at 0, a gap, [290'000, +10'001) (the file's
  // unaligned end) at 100'000, a gap to the end.
  Region Home() {
    auto r = tier_->AddFileHome(200 * kKiB, {{0, 10'007, 0, 70'000}, {0, 290'000, 100'000, 10'001}});
    EXPECT_THAT(r.status(), IsOk());
    return *r;
  }
  std::string Expected() const {
    std::string out(200 * kKiB, '\0');
    out.replace(0, 70'000, bytes_.substr(10'007, 70'000));
    out.replace(100'000, 10'001, bytes_.substr(290'000, 10'001));
    return out;
  }
  Status Read(const Region& r, Bytes offset, std::string* out, Bytes n) {
    out->assign(n, '\x55');
    return tier_->Copy({r, offset, out->data(), n, CopyDir::kFromTier})->Wait();
  }

  std::string dir_, path_, bytes_;
  std::unique_ptr<FileHomeTier> tier_;
};

TEST_P(FileHomesTest, ReadsItsSpansAndZerosTheGapsInAnySubRange) {
  const Region r = Home();
  EXPECT_TRUE(tier_->IsFileHome(r));
  EXPECT_EQ(r.addr, nullptr);
  const std::string want = Expected();
  std::string got;
  ASSERT_THAT(Read(r, 0, &got, r.bytes), IsOk());
  EXPECT_TRUE(got == want);
  for (auto [off, n] : std::vector<std::pair<Bytes, Bytes>>{{3, 69'999}, {65'536, 50'000},
                                                            {109'000, 91'800}, {80'000, 1}}) {
    ASSERT_THAT(Read(r, off, &got, n), IsOk());
    EXPECT_TRUE(got == want.substr(off, n)) << off;
  }
  const auto st = tier_->file_home_stats();
  EXPECT_EQ(st.homes, 1u);
  EXPECT_EQ(st.reads, 4u);  // the one inside a gap read nothing
  EXPECT_GE(st.bytes_read, 80'001u);
  // The budget is the wrapped tier's: file homes take none of it.
  EXPECT_EQ(tier_->Stats().used, 0u);
  EXPECT_GT(tier_->Stats().host_overhead, 0u);
  EXPECT_THAT(tier_->Free(r), IsOk());
  EXPECT_THAT(tier_->Free(r), StatusIs(StatusCode::kInvalidArgument, ""));
}

TEST_P(FileHomesTest, IsNeverWritten) {
  const Region r = Home();
  std::string junk(4096, 'x');
  EXPECT_THAT(tier_->Copy({r, 0, junk.data(), junk.size(), CopyDir::kToTier})->Wait(),
              StatusIs(StatusCode::kFailedPrecondition, ""));
  std::ifstream in(path_, std::ios::binary);
  std::string now((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_TRUE(now == bytes_);
}

TEST_P(FileHomesTest, AFileChangedUnderItIsDataLossNamingIt) {
  const Region r = Home();
  std::string got;
  ASSERT_THAT(Read(r, 0, &got, 4096), IsOk());
  ASSERT_EQ(truncate(path_.c_str(), 200'000), 0);
  Status s = Read(r, 0, &got, 4096);
  EXPECT_THAT(s, StatusIs(StatusCode::kDataLoss, ""));
  EXPECT_NE(s.message().find(path_ + ", read in place, changed size"), std::string::npos)
      << s.ToString();
}

TEST_P(FileHomesTest, ForwardsTheTiersOwnRegions) {
  auto r = tier_->Allocate(8 * kKiB);
  ASSERT_THAT(r.status(), IsOk());
  EXPECT_FALSE(tier_->IsFileHome(*r));
  std::string out(8 * kKiB, 'a'), back(8 * kKiB, '\0');
  ASSERT_THAT(tier_->Copy({*r, 0, out.data(), out.size(), CopyDir::kToTier})->Wait(), IsOk());
  ASSERT_THAT(tier_->Copy({*r, 0, back.data(), back.size(), CopyDir::kFromTier})->Wait(), IsOk());
  EXPECT_EQ(out, back);
  EXPECT_EQ(tier_->Stats().used, 8 * kKiB);
  EXPECT_THAT(tier_->Free(*r), IsOk());
}

TEST_P(FileHomesTest, BadSpansAndASecondSetOfFilesAreRefused) {
  EXPECT_THAT(tier_->AddFileHome(4096, {{0, 0, 0, 8192}}).status(),
              StatusIs(StatusCode::kInvalidArgument, ""));  // overruns the region
  EXPECT_THAT(tier_->AddFileHome(1 * kMiB, {{0, 299'000, 0, 4096}}).status(),
              StatusIs(StatusCode::kInvalidArgument, ""));  // overruns the file
  EXPECT_THAT(tier_->AddFileHome(1 * kMiB, {{0, 0, 100, 10}, {0, 0, 105, 10}}).status(),
              StatusIs(StatusCode::kInvalidArgument, ""));  // overlap
  EXPECT_THAT(tier_->OpenFiles({path_}, {bytes_.size()}).status(),
              StatusIs(StatusCode::kFailedPrecondition, ""));
}

INSTANTIATE_TEST_SUITE_P(Backends, FileHomesTest,
                         ::testing::Values(NvmeIoBackend::kPosix, NvmeIoBackend::kAuto),
                         [](const auto& info) {
                           return info.param == NvmeIoBackend::kPosix ? "posix" : "auto";
                         });

}  // namespace
}  // namespace tiermem
