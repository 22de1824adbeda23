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

QuantTables* MakeTables() {
  auto* t = new QuantTables();
  for (int s = 0; s < 2; ++s) {
    const std::vector<float> map = MakeMap(s == 1);
    std::copy(map.begin(), map.end(), t->code[s]);
    // The half map: the signed map's codes from 0 up, the unsigned map itself.
    const std::vector<float> half(map.begin() + (s == 1 ? QuantTables::kZeroSigned : 0),
                                  map.end());
    BuildBuckets(half, t->bucket[s]);
  }
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
    case StateDType::kF32: return "fp32";
    case StateDType::kBF16: return "bf16";
    case StateDType::kInt8: return "int8";
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
  if (f.dtype != StateDType::kF32 && f.dtype != StateDType::kBF16 &&
      f.dtype != StateDType::kInt8) {
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
    case StateDType::kF32: return n * 4;
    case StateDType::kBF16: return n * 2;
    case StateDType::kInt8: return n + StateBlocks(f, n) * 4;
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
