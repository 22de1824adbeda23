// Private to kernels/: the tables of the 8-bit dynamic state format (optim.h, "Compressed
// state"), built once (GetQuantTables) and read by every kernel variant — the CPU ISA
// translation units and the CUDA kernels, which copy them to the device.
//
// Nearest code without a search. Quantizing works on |x| and a *half map* H: the signed map's
// non-negative codes (0, its 127 positive values, 1: K = 129 entries; a negative x takes the
// negation of its |x|'s code, 1 excluded) or the whole unsigned map (K = 256). With T_j the
// largest float not above the exact midpoint of H[j] and H[j + 1], the nearest code of |x| is
// #{j : |x| > T_j} (ties go to the smaller magnitude). `bucket` is indexed by |x|'s bits >> 16
// (its exponent and top 7 mantissa bits) minus kBucketBase, clamped to [0, kBuckets): every
// |x| below 2^-23 falls into bucket 0 and everything from 1 up (and Inf/NaN) into the last.
// An entry is (idx << 16) | low, where idx is the nearest code of the bucket's smallest value
// and `low` the low 16 bits of T_idx when T_idx lies in the bucket (0xFFFF when none does):
// the nearest code of any |x| of the bucket is idx + ((bits(|x|) & 0xFFFF) > low). Building
// checks that no bucket holds two thresholds and that the clamped ends hold none.
//
// Thread-safety: immutable after the first GetQuantTables() (a function-local static).
#pragma once

#include <cstdint>

namespace tiermem::kernels::internal {

struct QuantTables {
  static constexpr int kBucketBase = (127 - 23) << 7;            // bits >> 16 of 2^-23
  static constexpr int kBuckets = (127 << 7) - kBucketBase + 1;  // through [1, 1 + 2^-7)
  static constexpr int kZeroSigned = 127;                        // index of 0 in the signed map
  // code[s]: the map (s = 1 signed, 0 unsigned), ascending, as DynamicCode returns it.
  alignas(64) float code[2][256];
  alignas(64) uint32_t bucket[2][kBuckets];
  // code[s] split into byte planes (plane[s][p][i]: byte p of code[s][i]), for lookups of 64
  // codes at once with byte permutes (AVX512-VBMI).
  alignas(64) uint8_t plane[2][4][256];

  // Nearest code without a table per value (the AVX-512 kernels; QuantizeScalar's result).
  // The half map is 0, then decades of k codes at s * (0.1 + 0.9 (j + 0.5) / k), then 1: 9
  // *segments* of |x| split at the thresholds between those groups (0: |x| <= T_0, 8: above
  // the last threshold). Inside a segment the thresholds sit at (nearly) integer positions of
  // a linear function, so with a = |x| clamped to [2^-31, 1] (neither clamp changes the code),
  //   t = int(fma(a, seg_mul, seg_add))   (truncated; 16 fraction bits, the code biased by 8)
  //   code = min(t >> 16, seg_hi)   unless (t & 0xFFF0) == 0, i.e. t within 16 units above an
  // integer, where the rounding of the map and of t could matter: such a vector takes the
  // bucket table. MakeTables verifies at every threshold, by the same float operations, that
  // this is exact (t is monotone in a inside a segment); `fast_ok` false means it is not and
  // the kernels use the bucket table only. The segment of a: seg_base[e & 31] plus one when
  // bits(a) > seg_split[e & 31], e = bits(a) >> 23 (96..127; at most one segment boundary per
  // binade, also verified). For the signed map the tables include the + 127 of its codes.
  static constexpr int kFastShift = 16, kFastBias = 8;
  static constexpr uint32_t kFastWindow = 0xFFF0u;
  static constexpr uint32_t kFastMinBits = 96u << 23;    // 2^-31
  static constexpr uint32_t kFastMaxBits = 0x3F800000u;  // 1.0
  alignas(64) int32_t seg_base[2][32];
  alignas(64) uint32_t seg_split[2][32];
  alignas(64) float seg_mul[2][16];
  alignas(64) float seg_add[2][16];
  alignas(64) int32_t seg_hi[2][16];
  bool fast_ok = false;
};

const QuantTables& GetQuantTables();

// The scalar quantizer of one normalized value (the reference every variant reproduces).
inline uint8_t QuantizeScalar(const QuantTables& t, float x, bool is_signed) {
  uint32_t bits;
  __builtin_memcpy(&bits, &x, 4);
  const uint32_t a = bits & 0x7FFFFFFFu;
  int b = static_cast<int>(a >> 16) - QuantTables::kBucketBase;
  b = b < 0 ? 0 : (b >= QuantTables::kBuckets ? QuantTables::kBuckets - 1 : b);
  const uint32_t e = t.bucket[is_signed ? 1 : 0][b];
  uint32_t k = (e >> 16) + ((a & 0xFFFFu) > (e & 0xFFFFu) ? 1u : 0u);
  if (!is_signed) return static_cast<uint8_t>(k);
  if (bits >> 31) return static_cast<uint8_t>(QuantTables::kZeroSigned - (k > 127 ? 127 : k));
  return static_cast<uint8_t>(QuantTables::kZeroSigned + k);
}

}  // namespace tiermem::kernels::internal
