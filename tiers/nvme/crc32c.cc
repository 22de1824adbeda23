// CRC32C. The hardware path runs three independent crc32q streams over three equal thirds of
// a long buffer (the instruction has 3-cycle latency and 1-cycle throughput, so one stream
// runs at a third of the possible rate) and merges them with the zero-extension operator:
// crc(A||B) = shift(crc(A), |B|) ^ crc(B), where shift() over the fixed stream length is a
// GF(2) matrix power turned into four byte tables once. The table path is the
// classic reflected slice-by-8.
#include "tiers/nvme/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace tiermem::nvme {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial

struct Tables {
  uint32_t t[8][256];
  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
    }
  }
};
const Tables& GetTables() {
  static const Tables tables;
  return tables;
}

// Raw update (no pre/post inversion).
uint32_t UpdatePortable(uint32_t c, const unsigned char* p, size_t n) {
  const Tables& tb = GetTables();
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    v ^= c;
    c = tb.t[7][v & 0xff] ^ tb.t[6][(v >> 8) & 0xff] ^ tb.t[5][(v >> 16) & 0xff] ^
        tb.t[4][(v >> 24) & 0xff] ^ tb.t[3][(v >> 32) & 0xff] ^ tb.t[2][(v >> 40) & 0xff] ^
        tb.t[1][(v >> 48) & 0xff] ^ tb.t[0][v >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ tb.t[0][(c ^ *p++) & 0xff];
  return c;
}

// GF(2) 32x32 matrices (column i = image of bit i) for the zero-extension operator.
using Mat = std::array<uint32_t, 32>;
uint32_t MatTimes(const Mat& m, uint32_t v) {
  uint32_t r = 0;
  for (int i = 0; v; ++i, v >>= 1) {
    if (v & 1) r ^= m[i];
  }
  return r;
}
Mat MatSquare(const Mat& m) {
  Mat r;
  for (int i = 0; i < 32; ++i) r[i] = MatTimes(m, m[i]);
  return r;
}
// Operator that advances a raw CRC register over `n` zero bytes.
Mat ZerosOperator(size_t n) {
  Mat odd;  // one zero bit
  odd[0] = kPoly;
  for (int i = 1; i < 32; ++i) odd[i] = 1u << (i - 1);
  Mat result;
  for (int i = 0; i < 32; ++i) result[i] = 1u << i;
  Mat pw = MatSquare(MatSquare(MatSquare(odd)));  // one zero byte
  while (n) {
    if (n & 1) {
      Mat next;
      for (int i = 0; i < 32; ++i) next[i] = MatTimes(pw, result[i]);
      result = next;
    }
    n >>= 1;
    if (n) pw = MatSquare(pw);
  }
  return result;
}

#if defined(__x86_64__)
bool DetectSse42() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  return (c & bit_SSE4_2) != 0;
}

__attribute__((target("sse4.2"))) uint32_t UpdateHw1(uint32_t c, const unsigned char* p,
                                                      size_t n) {
  uint64_t c64 = c;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c64 = _mm_crc32_u64(c64, v);
    p += 8;
    n -= 8;
  }
  c = static_cast<uint32_t>(c64);
  while (n--) c = _mm_crc32_u8(c, *p++);
  return c;
}

// The zero-extension operator as four byte tables: Apply(v) == MatTimes(m, v).
struct ShiftTables {
  uint32_t t[4][256];
  explicit ShiftTables(const Mat& m) {
    for (int k = 0; k < 4; ++k) {
      for (uint32_t b = 0; b < 256; ++b) t[k][b] = MatTimes(m, b << (8 * k));
    }
  }
  uint32_t Apply(uint32_t v) const {
    return t[0][v & 0xff] ^ t[1][(v >> 8) & 0xff] ^ t[2][(v >> 16) & 0xff] ^ t[3][v >> 24];
  }
};

// Three streams over thirds of length `third` (a multiple of 8), then merged.
__attribute__((target("sse4.2"))) uint32_t UpdateHw3(uint32_t c, const unsigned char* p,
                                                      size_t third, const ShiftTables& shift) {
  uint64_t c0 = c, c1 = 0, c2 = 0;
  const unsigned char* p1 = p + third;
  const unsigned char* p2 = p + 2 * third;
  for (size_t i = 0; i < third; i += 8) {
    uint64_t v0, v1, v2;
    std::memcpy(&v0, p + i, 8);
    std::memcpy(&v1, p1 + i, 8);
    std::memcpy(&v2, p2 + i, 8);
    c0 = _mm_crc32_u64(c0, v0);
    c1 = _mm_crc32_u64(c1, v1);
    c2 = _mm_crc32_u64(c2, v2);
  }
  uint32_t r = shift.Apply(static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1);
  return shift.Apply(r) ^ static_cast<uint32_t>(c2);
}

// Stream length used for long inputs: 3 x 1360 = 4080 bytes per round (a multiple of 8).
constexpr size_t kThird = 1360;
const ShiftTables& ThirdShift() {
  static const ShiftTables tables(ZerosOperator(kThird));
  return tables;
}

uint32_t UpdateHw(uint32_t c, const unsigned char* p, size_t n) {
  if (n >= 3 * kThird) {
    const ShiftTables& shift = ThirdShift();
    while (n >= 3 * kThird) {
      c = UpdateHw3(c, p, kThird, shift);
      p += 3 * kThird;
      n -= 3 * kThird;
    }
  }
  return UpdateHw1(c, p, n);
}
#endif

const bool kHaveHw =
#if defined(__x86_64__)
    DetectSse42();
#else
    false;
#endif

}  // namespace

uint32_t Crc32cPortable(const void* data, size_t n, uint32_t crc) {
  return ~UpdatePortable(~crc, static_cast<const unsigned char*>(data), n);
}

uint32_t Crc32c(const void* data, size_t n, uint32_t crc) {
#if defined(__x86_64__)
  if (kHaveHw) return ~UpdateHw(~crc, static_cast<const unsigned char*>(data), n);
#endif
  return Crc32cPortable(data, n, crc);
}

bool Crc32cHardware() { return kHaveHw; }

}  // namespace tiermem::nvme
