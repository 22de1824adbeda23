// CRC32C: every implementation equals the table one on lengths around each stride and on
// misaligned starts; known vectors; continuation.
#include "base/crc32c.h"

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace tiermem {
namespace {

TEST(Crc32c, KnownVectorsAndHardwareMatchesTable) {
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(Crc32cPortable("123456789", 9), 0xE3069283u);
  std::vector<char> zeros(32, 0);
  EXPECT_EQ(Crc32c(zeros.data(), 32), 0x8A9136AAu);  // RFC 3720 B.4: 32 bytes of zeros
  std::mt19937_64 rng(1);
  std::vector<char> buf(20000);
  for (auto& b : buf) b = static_cast<char>(rng());
  // Lengths around every stride of every implementation (16, 64, 256, 4080 bytes), and
  // misaligned starts, with a non-zero running crc.
  for (size_t n : {0, 1, 7, 8, 15, 16, 17, 63, 64, 100, 255, 256, 257, 319, 320, 511, 512, 513,
                   1000, 4079, 4080, 4096, 4097, 8192, 12241, 20000 - 3}) {
    for (size_t start : {0, 1, 3}) {
      const uint32_t want = Crc32cPortable(buf.data() + start, n, 0x12345678u);
      EXPECT_EQ(Crc32c(buf.data() + start, n, 0x12345678u), want) << n << "+" << start;
      EXPECT_EQ(Crc32cSse42(buf.data() + start, n, 0x12345678u), want) << n << "+" << start;
    }
  }
  std::printf("crc32c variant: %s\n", std::string(Crc32cVariant()).c_str());
  // Continuation: crc(A || B) computed in two calls.
  EXPECT_EQ(Crc32c(buf.data() + 5000, 9000, Crc32c(buf.data(), 5000)),
            Crc32c(buf.data(), 14000));
}

}  // namespace
}  // namespace tiermem
