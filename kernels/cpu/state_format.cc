// The compressed optimizer-state formats (optim.h, "Compressed state"): names, sizes, the
// dynamic code maps and the nearest-code bucket tables (quant_tables.h).
//
// The maps are generated in double precision from their description (Dettmers et al. 2022,
// bitsandbytes' create_dynamic_map(signed, max_exponent_bits = 7, total_bits = 8)) and rounded
// to float once: for decade i in 0..6 the k midpoints of linspace(0.1, 1, k + 1) times
// 10^(i - 6), k = 2^i for the signed map (and their negations) and 2^(i + 1) for the unsigned
// one, plus 0 and 1, sorted. bitsandbytes computes the same numbers in float32 with torch, so
// a value may differ from its map in the last bit (tests/python/test_state_dtype.py measures
// it); the quantization is nearest-code either way.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "base/logging.h"
#include "kernels/cpu/optim.h"
#include "kernels/cpu/quant_tables.h"

namespace tiermem::kernels {
namespace {

using internal::QuantTables;

uint32_t Bits(float f) { return std::bit_cast<uint32_t>(f); }
float FromBits(uint32_t u) { return std::bit_cast<float>(u); }

std::vector<float> MakeMap(bool is_signed) {
  std::vector<double> v;
  for (int i = 0; i < 7; ++i) {
    const int k = is_signed ? (1 << i) : (1 << (i + 1));
    const double scale = std::pow(10.0, i - 6);
    for (int j = 0; j < k; ++j) {
      const double lo = 0.1 + 0.9 * j / k, hi = 0.1 + 0.9 * (j + 1) / k;
      const double mean = (lo + hi) / 2.0;
      v.push_back(scale * mean);
      if (is_signed) v.push_back(-scale * mean);
    }
  }
  v.push_back(0.0);
  v.push_back(1.0);
  std::sort(v.begin(), v.end());
  std::vector<float> out(v.begin(), v.end());
  return out;  // 256 entries: 2 * 127 + 2 signed, 254 + 2 unsigned
}

// The bucket table of one half map (quant_tables.h).
void BuildBuckets(const std::vector<float>& half, uint32_t* bucket) {
  const size_t k = half.size();
  std::vector<float> t(k - 1);  // T_j: the largest float <= the exact midpoint
  for (size_t j = 0; j + 1 < k; ++j) {
    const double mid = (static_cast<double>(half[j]) + static_cast<double>(half[j + 1])) / 2.0;
    float f = static_cast<float>(mid);
    if (static_cast<double>(f) > mid) f = std::nextafter(f, -1.0f);
    t[j] = f;
  }
  for (int b = 0; b < QuantTables::kBuckets; ++b) {
    const uint32_t lo_bits = static_cast<uint32_t>(b + QuantTables::kBucketBase) << 16;
    const uint32_t last_bits = lo_bits + 0xFFFFu;  // the bucket's largest value
    const bool top = b == QuantTables::kBuckets - 1;
    const float x_lo = b == 0 ? 0.0f : FromBits(lo_bits);
    uint32_t idx = 0;
    while (idx < t.size() && x_lo > t[idx]) ++idx;
    uint32_t low = 0xFFFFu;
    if (idx < t.size() && Bits(t[idx]) <= last_bits && !top) {
      // A threshold inside the bucket: below it lies nothing of the bucket for b = 0 only if
      // the clamped values (|x| < 2^-23) cannot reach it, which the check below rules out.
      if (b == 0 || Bits(t[idx]) < lo_bits) std::abort();  // thresholds never that small
      low = Bits(t[idx]) & 0xFFFFu;
      if (idx + 1 < t.size() && Bits(t[idx + 1]) < last_bits) std::abort();  // two in one
    }
    bucket[b] = (idx << 16) | low;
  }
}

// The segment tables of one half map (quant_tables.h, "Nearest code without a table per
// value"); `offset`: what the codes add to the half map's index (127 signed, 0 unsigned).
// Returns whether the fast path is exact for every input (checked at each threshold).
bool BuildSegments(const std::vector<float>& half, bool is_signed, int offset, QuantTables* t,
                   int s) {
  using Q = QuantTables;
  const size_t k = half.size();
  std::vector<float> thr(k - 1);  // T_j as BuildBuckets computes them
  for (size_t j = 0; j + 1 < k; ++j) {
    const double mid = (static_cast<double>(half[j]) + static_cast<double>(half[j + 1])) / 2.0;
    float f = static_cast<float>(mid);
    if (static_cast<double>(f) > mid) f = std::nextafter(f, -1.0f);
    thr[j] = f;
  }
  // Groups of the half map: 0, the 7 decades, 1.
  int size[9], start[9];
  size[0] = size[8] = 1;
  for (int i = 0; i < 7; ++i) size[1 + i] = is_signed ? (1 << i) : (1 << (i + 1));
  start[0] = 0;
  for (int r = 1; r < 9; ++r) start[r] = start[r - 1] + size[r - 1];
  if (static_cast<size_t>(start[8] + 1) != k) return false;
  uint32_t bound[8];  // bits of the threshold between group r and group r + 1
  for (int r = 0; r < 8; ++r) bound[r] = Bits(thr[start[r + 1] - 1]);
  if (bound[0] <= Q::kFastMinBits || bound[7] >= Q::kFastMaxBits) return false;
  constexpr double kOne = 1 << Q::kFastShift;
  for (int r = 0; r < 16; ++r) {
    t->seg_mul[s][r] = 0.0f;
    t->seg_add[s][r] = 0.0f;
    t->seg_hi[s][r] = 0;
  }
  for (int r = 0; r < 9; ++r) {
    const int first = start[r] + offset;
    t->seg_hi[s][r] = first + size[r] - 1;
    if (r == 0 || r == 8) {  // one code: t in the middle of its unit
      t->seg_add[s][r] = static_cast<float>(kOne * (first + 0.5));
      continue;
    }
    const double scale = std::pow(10.0, r - 1 - 6), kk = size[r];
    t->seg_mul[s][r] = static_cast<float>(kOne * kk / (0.9 * scale));
    t->seg_add[s][r] = static_cast<float>(kOne * (first - 0.1 * kk / 0.9) + Q::kFastBias);
  }
  for (uint32_t e = Q::kFastMinBits >> 23; e <= (Q::kFastMaxBits >> 23); ++e) {
    const uint32_t lo = e << 23, hi = ((e + 1) << 23) - 1;
    int base = 0, inside = 0;
    uint32_t split = 0x7FFFFFFFu;
    for (uint32_t b : bound) {
      if (b < lo) ++base;
      if (b >= lo && b <= hi) {
        ++inside;
        split = b;
      }
    }
    if (inside > 1) return false;
    t->seg_base[s][e & 31] = base;
    t->seg_split[s][e & 31] = split;
  }
  // Exactness, by monotonicity of t in a inside a segment: every a of segment r at most T_g
  // yields t < (g + 1) units + the window, every a above it t >= (g + 1) units; the segment's
  // smallest a yields at least its first code and no t leaves [0, 2^31).
  auto tf = [&](int r, uint32_t bits) -> int64_t {
    const float v = std::fma(FromBits(bits), t->seg_mul[s][r], t->seg_add[s][r]);
    if (!(v >= 0.0f && v < 2147483520.0f)) return -1;
    return static_cast<int64_t>(v);
  };
  const int64_t window = static_cast<int64_t>(~Q::kFastWindow & 0xFFFFu) + 1;  // 16
  for (int r = 0; r < 9; ++r) {
    const int first = start[r] + offset;
    const uint32_t lo_bits = r == 0 ? Q::kFastMinBits : bound[r - 1] + 1;
    const uint32_t hi_bits = r == 8 ? Q::kFastMaxBits : bound[r];
    const int64_t t_lo = tf(r, lo_bits), t_hi = tf(r, hi_bits);
    if (t_lo < 0 || t_hi < 0 || (t_lo >> Q::kFastShift) < first) return false;
    if ((r == 0 || r == 8) && ((t_lo & Q::kFastWindow) == 0 || t_lo != t_hi)) return false;
    for (int g = start[r]; g + 1 < start[r] + size[r]; ++g) {
      const int64_t unit = static_cast<int64_t>(g + 1 + offset) << Q::kFastShift;
      if (tf(r, Bits(thr[g])) >= unit + window || tf(r, Bits(thr[g]) + 1) < unit) return false;
    }
  }
  return true;
}

QuantTables* MakeTables() {
  auto* t = new QuantTables();
  bool fast_ok = true;
  for (int s = 0; s < 2; ++s) {
    const std::vector<float> map = MakeMap(s == 1);
    std::copy(map.begin(), map.end(), t->code[s]);
    for (int i = 0; i < 256; ++i) {
      for (int p = 0; p < 4; ++p) t->plane[s][p][i] = static_cast<uint8_t>(Bits(map[i]) >> (8 * p));
    }
    // The half map: the signed map's codes from 0 up, the unsigned map itself.
    const std::vector<float> half(map.begin() + (s == 1 ? QuantTables::kZeroSigned : 0), map.end());
    BuildBuckets(half, t->bucket[s]);
    fast_ok = BuildSegments(half, s == 1, s == 1 ? QuantTables::kZeroSigned : 0, t, s) && fast_ok;
  }
  t->fast_ok = fast_ok;
  return t;
}

}  // namespace

namespace internal {
const QuantTables& GetQuantTables() {
  static const QuantTables* t = MakeTables();  // never freed: read until exit
  return *t;
}
}  // namespace internal

std::string_view StateDTypeName(StateDType dtype) {
  switch (dtype) {
    case StateDType::kF32:
      return "fp32";
    case StateDType::kBF16:
      return "bf16";
    case StateDType::kInt8:
      return "int8";
  }
  return "unknown";
}

StatusOr<StateDType> ParseStateDType(std::string_view name) {
  if (name == "fp32") return StateDType::kF32;
  if (name == "bf16") return StateDType::kBF16;
  if (name == "int8") return StateDType::kInt8;
  return InvalidArgumentError("unknown optimizer state dtype '" + std::string(name) +
                              "' (expected fp32, bf16 or int8)");
}

Status ValidateStateFormat(const StateFormat& f) {
  if (f.dtype != StateDType::kF32 && f.dtype != StateDType::kBF16 && f.dtype != StateDType::kInt8) {
    return InvalidArgumentError("unknown optimizer state dtype value " +
                                std::to_string(static_cast<int>(f.dtype)));
  }
  if (f.block < kMinStateBlock || f.block > kMaxStateBlock || (f.block & (f.block - 1)) != 0) {
    return InvalidArgumentError("optimizer state block of " + std::to_string(f.block) +
                                " elements: must be a power of two in [" +
                                std::to_string(kMinStateBlock) + ", " +
                                std::to_string(kMaxStateBlock) + "]");
  }
  return OkStatus();
}

size_t StateBytes(const StateFormat& f, size_t n) {
  switch (f.dtype) {
    case StateDType::kF32:
      return n * 4;
    case StateDType::kBF16:
      return n * 2;
    case StateDType::kInt8:
      return n + StateBlocks(f, n) * 4;
  }
  return n * 4;
}

const float* DynamicCode(bool is_signed) {
  return internal::GetQuantTables().code[is_signed ? 1 : 0];
}

uint8_t QuantizeToCode(float x, bool is_signed) {
  return internal::QuantizeScalar(internal::GetQuantTables(), x, is_signed);
}

}  // namespace tiermem::kernels
