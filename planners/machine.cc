#include "planners/machine.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <utility>
#include <vector>

namespace tiermem::planners {
namespace {

constexpr TierKind kD = TierKind::kDevice;
constexpr TierKind kH = TierKind::kHost;
constexpr TierKind kN = TierKind::kNvme;

std::string Trim(std::string_view s) {
  while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
  while (!s.empty() && s.back() == ' ') s.remove_suffix(1);
  return std::string(s);
}

StatusOr<uint64_t> ParseLatencyNs(std::string_view s) {
  double scale = 0;
  if (s.ends_with("ns")) {
    scale = 1;
  } else if (s.ends_with("us")) {
    scale = 1e3;
  } else if (s.ends_with("ms")) {
    scale = 1e6;
  } else {
    return InvalidArgumentError("latency '" + std::string(s) + "' needs a unit: ns, us or ms");
  }
  const std::string num(s.substr(0, s.size() - 2));
  char* end = nullptr;
  const double v = std::strtod(num.c_str(), &end);
  if (num.empty() || end != num.c_str() + num.size() || !std::isfinite(v) || v < 0) {
    return InvalidArgumentError("latency '" + std::string(s) + "' is not a number");
  }
  return static_cast<uint64_t>(std::llround(v * scale));
}

}  // namespace

MachineModel MachineModel::FromTrace(const Trace& t) {
  MachineModel m;
  m.budget = {t.budgets.device, t.budgets.host, t.budgets.nvme};
  m.link = t.rates.link;
  m.cpu_optim_elems_per_s = t.rates.cpu_optim_elems_per_s;
  m.device_optim_elems_per_s = t.rates.device_optim_elems_per_s;
  m.cpu_cores = t.rates.cpu_cores;
  m.DeriveNvmeLinks();
  return m;
}

void MachineModel::DeriveNvmeLinks() {
  auto derive = [this](TierKind a, TierKind b, TierKind c) {  // a->c through b
    LinkRate& out = link[static_cast<int>(a)][static_cast<int>(c)];
    const LinkRate& l1 = Link(a, b);
    const LinkRate& l2 = Link(b, c);
    if (out.bytes_per_s > 0 || l1.bytes_per_s <= 0 || l2.bytes_per_s <= 0) return;
    out.bytes_per_s = std::min(l1.bytes_per_s, l2.bytes_per_s);
    out.latency_ns = l1.latency_ns + l2.latency_ns;
  };
  derive(kD, kH, kN);
  derive(kN, kH, kD);
}

std::vector<std::string> MachineModel::FillMissingLinks() {
  static const char* kShort[kNumTierKinds] = {"d", "h", "n"};
  std::vector<std::string> filled;
  const auto measured = link;  // reverse rates come from measured links only
  for (int a = 0; a < kNumTierKinds; ++a) {
    for (int b = 0; b < kNumTierKinds; ++b) {
      const int dv = static_cast<int>(kD), nv = static_cast<int>(kN);
      if (a == b || link[a][b].bytes_per_s > 0) continue;
      if ((a == dv && b == nv) || (a == nv && b == dv)) continue;  // DeriveNvmeLinks below
      const bool nvme = a == nv || b == nv;
      const bool reverse = measured[b][a].bytes_per_s > 0;
      link[a][b] = reverse ? measured[b][a] : LinkRate{nvme ? 1e9 : 4e9, 10000};
      filled.push_back(std::string(kShort[a]) + "2" + kShort[b] + ": assumed " +
                       (reverse ? "the reverse direction's rate" : "a default rate"));
    }
  }
  DeriveNvmeLinks();
  return filled;
}

std::pair<int, int> MachineModel::LaneOf(TierKind src, TierKind dst) {
  constexpr int kNvmeLane = static_cast<int>(TierKind::kNvme);
  if (src == TierKind::kNvme || dst == TierKind::kNvme) return {kNvmeLane, kNvmeLane};
  return {static_cast<int>(src), static_cast<int>(dst)};
}

uint64_t MachineModel::CopyNs(TierKind src, TierKind dst, Bytes bytes) const {
  const LinkRate& l = Link(src, dst);
  return l.latency_ns +
         static_cast<uint64_t>(std::ceil(static_cast<double>(bytes) * 1e9 / l.bytes_per_s));
}

Status MachineModel::Validate() const {
  // No device budget: a host-mode machine (compute on the host tier; MakePlan refuses a trace
  // that accesses chunks on a device it does not have).
  const bool device = Budget(kD) > 0;
  if (Budget(kH) == 0) return InvalidArgumentError("machine: no host budget (--host)");
  auto need = [this](TierKind a, TierKind b, const char* name) {
    if (Link(a, b).bytes_per_s > 0) return OkStatus();
    return InvalidArgumentError(std::string("machine: no ") + name +
                                " copy rate (the trace has none; give --bw " + name + "=RATE)");
  };
  if (device) {
    TIERMEM_RETURN_IF_ERROR(need(kH, kD, "h2d"));
    TIERMEM_RETURN_IF_ERROR(need(kD, kH, "d2h"));
  }
  if (Budget(kN) > 0) {
    TIERMEM_RETURN_IF_ERROR(need(kH, kN, "h2n"));
    TIERMEM_RETURN_IF_ERROR(need(kN, kH, "n2h"));
    if (device) {
      TIERMEM_RETURN_IF_ERROR(need(kD, kN, "d2n"));
      TIERMEM_RETURN_IF_ERROR(need(kN, kD, "n2d"));
    }
  }
  if (!std::isfinite(cpu_optim_elems_per_s) || cpu_optim_elems_per_s < 0 ||
      !std::isfinite(device_optim_elems_per_s) || device_optim_elems_per_s < 0) {
    return InvalidArgumentError("machine: optimizer rates must be finite and >= 0");
  }
  return OkStatus();
}

std::string MachineModel::ToString() const {
  std::string s;
  char buf[160];
  for (int t = 0; t < kNumTierKinds; ++t) {
    s += std::string(TierKindName(static_cast<TierKind>(t))) + " budget " + FormatBytes(budget[t]) +
         "\n";
  }
  for (int a = 0; a < kNumTierKinds; ++a) {
    for (int b = 0; b < kNumTierKinds; ++b) {
      if (a == b || link[a][b].bytes_per_s <= 0) continue;
      std::snprintf(buf, sizeof(buf), "%s->%s %.2f GB/s, %.1f us\n",
                    std::string(TierKindName(static_cast<TierKind>(a))).c_str(),
                    std::string(TierKindName(static_cast<TierKind>(b))).c_str(),
                    link[a][b].bytes_per_s / 1e9, link[a][b].latency_ns / 1e3);
      s += buf;
    }
  }
  std::snprintf(buf, sizeof(buf), "optimizer: cpu %.3g elems/s (%u cores), device %.3g elems/s\n",
                cpu_optim_elems_per_s, cpu_cores, device_optim_elems_per_s);
  s += buf;
  return s;
}

Status ApplyLinkSpec(std::string_view spec, MachineModel* m) {
  while (!spec.empty()) {
    const size_t comma = spec.find(',');
    const std::string item = Trim(spec.substr(0, comma));
    spec = comma == std::string_view::npos ? std::string_view() : spec.substr(comma + 1);
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    if (eq == std::string::npos) {
      return InvalidArgumentError("--bw item '" + item + "' is not PAIR=RATE");
    }
    const std::string pair = item.substr(0, eq);
    std::string value = item.substr(eq + 1);
    std::string lat;
    if (const size_t at = value.find('@'); at != std::string::npos) {
      lat = value.substr(at + 1);
      value = value.substr(0, at);
    }
    if (value.ends_with("/s")) value.resize(value.size() - 2);
    std::vector<std::pair<TierKind, TierKind>> dirs;
    auto both = [&dirs](TierKind a, TierKind b) {
      dirs.push_back({a, b});
      dirs.push_back({b, a});
    };
    if (pair == "h2d")
      dirs.push_back({kH, kD});
    else if (pair == "d2h")
      dirs.push_back({kD, kH});
    else if (pair == "h2n")
      dirs.push_back({kH, kN});
    else if (pair == "n2h")
      dirs.push_back({kN, kH});
    else if (pair == "d2n")
      dirs.push_back({kD, kN});
    else if (pair == "n2d")
      dirs.push_back({kN, kD});
    else if (pair == "hd")
      both(kH, kD);
    else if (pair == "hn")
      both(kH, kN);
    else if (pair == "dn")
      both(kD, kN);
    else {
      return InvalidArgumentError("--bw pair '" + pair +
                                  "' is not one of h2d d2h h2n n2h d2n n2d hd hn dn");
    }
    auto rate = ParseBytes(value);
    if (!rate.ok() || *rate == 0) {
      return InvalidArgumentError("--bw " + pair + ": rate '" + value +
                                  "' is not a positive size per second (e.g. 24GB)");
    }
    uint64_t lat_ns = 0;
    bool have_lat = false;
    if (!lat.empty()) {
      auto l = ParseLatencyNs(lat);
      if (!l.ok()) return l.status().WithContext("--bw " + pair);
      lat_ns = *l;
      have_lat = true;
    }
    for (auto [a, b] : dirs) {
      LinkRate& l = m->link[static_cast<int>(a)][static_cast<int>(b)];
      l.bytes_per_s = static_cast<double>(*rate);
      if (have_lat) l.latency_ns = lat_ns;
    }
  }
  return OkStatus();
}

}  // namespace tiermem::planners
