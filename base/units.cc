#include "base/units.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

namespace tiermem {

std::string_view TierKindName(TierKind kind) {
  switch (kind) {
    case TierKind::kDevice:
      return "device";
    case TierKind::kHost:
      return "host";
    case TierKind::kNvme:
      return "nvme";
    case TierKind::kNone:
      return "none";
  }
  return "unknown";
}

StatusOr<TierKind> ParseTierKind(std::string_view name) {
  if (name == "device") return TierKind::kDevice;
  if (name == "host") return TierKind::kHost;
  if (name == "nvme") return TierKind::kNvme;
  return InvalidArgumentError("unknown tier '" + std::string(name) +
                              "' (expected device, host or nvme)");
}

std::string_view CategoryName(Category c) {
  switch (c) {
    case Category::kParam:
      return "param";
    case Category::kGrad:
      return "grad";
    case Category::kOptimState:
      return "optim_state";
    case Category::kActivation:
      return "activation";
    case Category::kOther:
      return "other";
  }
  return "unknown";
}

StatusOr<Bytes> ParseBytes(std::string_view text) {
  std::string s;
  for (char c : text) {
    if (!std::isspace(static_cast<unsigned char>(c))) s += c;
  }
  auto bad = [&] {
    return InvalidArgumentError("invalid size '" + std::string(text) +
                                "' (expected e.g. 4096, 512MiB, 16GiB, 1.5G)");
  };
  if (s.empty()) return bad();
  size_t i = 0;
  while (i < s.size() && (std::isdigit(static_cast<unsigned char>(s[i])) || s[i] == '.')) ++i;
  if (i == 0) return bad();
  std::string num = s.substr(0, i);
  std::string unit;
  for (size_t j = i; j < s.size(); ++j) unit += static_cast<char>(std::tolower(s[j]));
  char* end = nullptr;
  double value = std::strtod(num.c_str(), &end);
  if (end != num.c_str() + num.size() || !std::isfinite(value) || value < 0) return bad();
  double mult = 1;
  if (unit.empty() || unit == "b")
    mult = 1;
  else if (unit == "k" || unit == "kib")
    mult = static_cast<double>(kKiB);
  else if (unit == "m" || unit == "mib")
    mult = static_cast<double>(kMiB);
  else if (unit == "g" || unit == "gib")
    mult = static_cast<double>(kGiB);
  else if (unit == "t" || unit == "tib")
    mult = static_cast<double>(kTiB);
  else if (unit == "kb")
    mult = 1e3;
  else if (unit == "mb")
    mult = 1e6;
  else if (unit == "gb")
    mult = 1e9;
  else if (unit == "tb")
    mult = 1e12;
  else
    return bad();
  double bytes = value * mult;
  if (bytes >= static_cast<double>(std::numeric_limits<Bytes>::max())) return bad();
  if (bytes != std::floor(bytes)) {
    return InvalidArgumentError("size '" + std::string(text) + "' is not a whole number of bytes");
  }
  return static_cast<Bytes>(bytes);
}

std::string FormatBytes(Bytes n) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  if (n < kKiB) return std::to_string(n) + " B";
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024.0 && u < 5) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.2f %s", v, kUnits[u]);
  return buf;
}

}  // namespace tiermem
