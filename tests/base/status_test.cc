#include <cerrno>

#include <gtest/gtest.h>

#include "base/status.h"
#include "base/units.h"

namespace tiermem {
namespace {

StatusOr<int> Half(int x) {
  if (x % 2) return InvalidArgumentError("odd");
  return x / 2;
}

Status UseHalf(int x, int* out) {
  TIERMEM_ASSIGN_OR_RETURN(*out, Half(x));
  TIERMEM_RETURN_IF_ERROR(OkStatus());
  return OkStatus();
}

TEST(Status, CodesAndMessages) {
  Status s = ResourceExhaustedError("device: need 10 bytes");
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(s.ToString(), "RESOURCE_EXHAUSTED: device: need 10 bytes");
  EXPECT_EQ(s.WithContext("engine").message(), "engine: device: need 10 bytes");
  EXPECT_TRUE(OkStatus().WithContext("x").ok());
}

TEST(Status, Macros) {
  int out = -1;
  EXPECT_TRUE(UseHalf(8, &out).ok());
  EXPECT_EQ(out, 4);
  Status s = UseHalf(3, &out);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(out, 4);
}

TEST(Status, ErrnoMapping) {
  EXPECT_EQ(ErrnoToStatus(ENOSPC, "write").code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(ErrnoToStatus(EIO, "read").code(), StatusCode::kIOError);
  EXPECT_EQ(ErrnoToStatus(EACCES, "open").code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(ErrnoToStatus(ENOENT, "open").code(), StatusCode::kNotFound);
  EXPECT_NE(ErrnoToStatus(EIO, "read /x").message().find("read /x"), std::string::npos);
}

TEST(Units, ParseBytes) {
  EXPECT_EQ(*ParseBytes("4096"), 4096u);
  EXPECT_EQ(*ParseBytes("4k"), 4096u);
  EXPECT_EQ(*ParseBytes("512MiB"), 512 * kMiB);
  EXPECT_EQ(*ParseBytes("16GiB"), 16 * kGiB);
  EXPECT_EQ(*ParseBytes("16 gib"), 16 * kGiB);
  EXPECT_EQ(*ParseBytes("1.5G"), 3 * kGiB / 2);
  EXPECT_EQ(*ParseBytes("2GB"), 2000000000u);
  EXPECT_EQ(*ParseBytes("1TiB"), kTiB);
  for (const char* bad : {"", "abc", "12XB", "-1", "1.5", "1e3", "G"}) {
    auto r = ParseBytes(bad);
    EXPECT_FALSE(r.ok()) << bad;
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
    }
  }
}

TEST(Units, FormatBytes) {
  EXPECT_EQ(FormatBytes(12), "12 B");
  EXPECT_EQ(FormatBytes(1536), "1.50 KiB");
  EXPECT_EQ(FormatBytes(2 * kGiB), "2.00 GiB");
}

TEST(Units, Names) {
  EXPECT_EQ(TierKindName(TierKind::kNvme), "nvme");
  EXPECT_EQ(*ParseTierKind("host"), TierKind::kHost);
  EXPECT_FALSE(ParseTierKind("hbm").ok());
  EXPECT_EQ(CategoryName(Category::kOptimState), "optim_state");
}

}  // namespace
}  // namespace tiermem
