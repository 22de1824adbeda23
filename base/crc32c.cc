// CRC32C. Three implementations, picked once by CPUID: (1) AVX-512 VPCLMULQDQ folding for
// inputs of 256 bytes and more (about 3x the crc32 instruction's rate: it keeps checksumming
// cheap next to a 2+ GB/s disk on a busy machine), (2) the SSE4.2 crc32 instruction, (3) a
// table. All produce identical values (tested against the table). The SSE4.2 path runs three
// independent crc32q streams over three equal thirds of a long buffer (the instruction has 3-cycle
// latency and 1-cycle throughput, so one stream runs at a third of the possible rate) and merges
// them with the zero-extension operator: crc(A||B) = shift(crc(A), |B|) ^ crc(B), where shift()
// over the fixed stream length is a GF(2) matrix power turned into four byte tables once. The table
// path is the classic reflected slice-by-8.
#include "base/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace tiermem {
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

__attribute__((target("sse4.2"))) uint32_t UpdateHw1(uint32_t c, const unsigned char* p, size_t n) {
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

// Raw register of x^e mod P in the reflected representation, shifted left by one: the
// folding constant format (bit 32 may be set). Validated against zlib's CRC-32 constants:
// with the CRC-32 polynomial, XPow(480) == 0x1c6e41596 and XPow(544) == 0x154442bd4.
constexpr uint64_t XPow(unsigned e) {
  uint32_t v = 0x80000000u;  // x^0
  for (unsigned i = 0; i < e; ++i) v = (v & 1) ? (v >> 1) ^ kPoly : v >> 1;
  return static_cast<uint64_t>(v) << 1;
}
// Folding a 128-bit lane forward over `bits` bits: its low qword (earlier, higher-degree
// coefficients) is multiplied by x^(bits+32), its high qword by x^(bits-32), modulo P.
constexpr uint64_t kFoldLo2048 = XPow(2048 + 32), kFoldHi2048 = XPow(2048 - 32);
constexpr uint64_t kFoldLo512 = XPow(512 + 32), kFoldHi512 = XPow(512 - 32);
constexpr uint64_t kFoldLo384 = XPow(384 + 32), kFoldHi384 = XPow(384 - 32);
constexpr uint64_t kFoldLo256 = XPow(256 + 32), kFoldHi256 = XPow(256 - 32);
constexpr uint64_t kFoldLo128 = XPow(128 + 32), kFoldHi128 = XPow(128 - 32);

bool DetectVpclmul() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq") &&
         __builtin_cpu_supports("pclmul") && DetectSse42();
}

#define TIERMEM_VPCLMUL_TARGET \
  __attribute__((target("avx512f,avx512vl,avx512bw,vpclmulqdq,pclmul,sse4.2")))

TIERMEM_VPCLMUL_TARGET inline __m512i Fold512(__m512i x, __m512i k) {
  return _mm512_xor_si512(_mm512_clmulepi64_epi128(x, k, 0x00),
                          _mm512_clmulepi64_epi128(x, k, 0x11));
}
TIERMEM_VPCLMUL_TARGET inline __m128i Fold128(__m128i x, uint64_t lo, uint64_t hi) {
  const __m128i k = _mm_set_epi64x(static_cast<long long>(hi), static_cast<long long>(lo));
  return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

// Carry-less multiplication folding (Intel's "Fast CRC computation for generic polynomials
// using PCLMULQDQ"), 4 x 512-bit accumulators over 256-byte strides; the final 128 bits are
// reduced with the crc32 instruction. Requires n >= 256.
TIERMEM_VPCLMUL_TARGET uint32_t UpdateVpclmul(uint32_t c, const unsigned char* p, size_t n) {
  const __m512i k2048 =
      _mm512_set_epi64(static_cast<long long>(kFoldHi2048), static_cast<long long>(kFoldLo2048),
                       static_cast<long long>(kFoldHi2048), static_cast<long long>(kFoldLo2048),
                       static_cast<long long>(kFoldHi2048), static_cast<long long>(kFoldLo2048),
                       static_cast<long long>(kFoldHi2048), static_cast<long long>(kFoldLo2048));
  const __m512i k512 =
      _mm512_set_epi64(static_cast<long long>(kFoldHi512), static_cast<long long>(kFoldLo512),
                       static_cast<long long>(kFoldHi512), static_cast<long long>(kFoldLo512),
                       static_cast<long long>(kFoldHi512), static_cast<long long>(kFoldLo512),
                       static_cast<long long>(kFoldHi512), static_cast<long long>(kFoldLo512));
  __m512i x0 = _mm512_loadu_si512(p);
  __m512i x1 = _mm512_loadu_si512(p + 64);
  __m512i x2 = _mm512_loadu_si512(p + 128);
  __m512i x3 = _mm512_loadu_si512(p + 192);
  x0 = _mm512_xor_si512(x0, _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(c))));
  p += 256;
  n -= 256;
  while (n >= 256) {
    x0 = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x0, k2048, 0x00),
                                   _mm512_clmulepi64_epi128(x0, k2048, 0x11), _mm512_loadu_si512(p),
                                   0x96);
    x1 = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x1, k2048, 0x00),
                                   _mm512_clmulepi64_epi128(x1, k2048, 0x11),
                                   _mm512_loadu_si512(p + 64), 0x96);
    x2 = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x2, k2048, 0x00),
                                   _mm512_clmulepi64_epi128(x2, k2048, 0x11),
                                   _mm512_loadu_si512(p + 128), 0x96);
    x3 = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x3, k2048, 0x00),
                                   _mm512_clmulepi64_epi128(x3, k2048, 0x11),
                                   _mm512_loadu_si512(p + 192), 0x96);
    p += 256;
    n -= 256;
  }
  x0 = _mm512_xor_si512(Fold512(x0, k512), x1);
  x0 = _mm512_xor_si512(Fold512(x0, k512), x2);
  x0 = _mm512_xor_si512(Fold512(x0, k512), x3);
  while (n >= 64) {
    x0 = _mm512_xor_si512(Fold512(x0, k512), _mm512_loadu_si512(p));
    p += 64;
    n -= 64;
  }
  // Lanes 0..3 sit 48, 32, 16 and 0 bytes before the end of the folded data.
  alignas(64) __m128i lane[4];
  _mm512_store_si512(lane, x0);
  __m128i r = lane[3];
  r = _mm_xor_si128(r, Fold128(lane[2], kFoldLo128, kFoldHi128));
  r = _mm_xor_si128(r, Fold128(lane[1], kFoldLo256, kFoldHi256));
  r = _mm_xor_si128(r, Fold128(lane[0], kFoldLo384, kFoldHi384));
  while (n >= 16) {
    r = _mm_xor_si128(Fold128(r, kFoldLo128, kFoldHi128),
                      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    p += 16;
    n -= 16;
  }
  uint64_t crc = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(r)));
  crc = _mm_crc32_u64(crc, static_cast<uint64_t>(_mm_extract_epi64(r, 1)));
  return UpdateHw1(static_cast<uint32_t>(crc), p, n);
}

const bool kHaveVpclmul = DetectVpclmul();
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

uint32_t Crc32cSse42(const void* data, size_t n, uint32_t crc) {
#if defined(__x86_64__)
  if (kHaveHw) return ~UpdateHw(~crc, static_cast<const unsigned char*>(data), n);
#endif
  return Crc32cPortable(data, n, crc);
}

uint32_t Crc32c(const void* data, size_t n, uint32_t crc) {
#if defined(__x86_64__)
  if (kHaveVpclmul && n >= 256) {
    return ~UpdateVpclmul(~crc, static_cast<const unsigned char*>(data), n);
  }
#endif
  return Crc32cSse42(data, n, crc);
}

std::string_view Crc32cVariant() {
#if defined(__x86_64__)
  if (kHaveVpclmul) return "vpclmulqdq";
#endif
  return kHaveHw ? "sse4.2" : "table";
}

}  // namespace tiermem
