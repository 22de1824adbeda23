// Text and JSON renderings of a Report. The text report keeps every line within 80 columns:
// labels (module names) are shortened from the left, keeping their most specific end.
#include "prof/render.h"

#include <cmath>
#include <cstdarg>
#include <cstdio>

namespace tiermem::prof {
namespace {

constexpr size_t kWidth = 80;

std::string Printf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string Printf(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  return buf;
}

// Keeps the end of `s` (the most specific part of "model.layers.3.attn.pre-forward").
std::string Shorten(std::string_view s, size_t max) {
  if (s.size() <= max) return std::string(s);
  if (max <= 3) return std::string(s.substr(s.size() - max));
  return "..." + std::string(s.substr(s.size() - (max - 3)));
}

void Line(std::string* out, std::string line) {
  while (!line.empty() && line.back() == ' ') line.pop_back();
  if (line.size() > kWidth) line = line.substr(0, kWidth - 3) + "...";
  *out += line;
  *out += '\n';
}

std::string Fb(uint64_t b) { return FormatBytes(b); }

const char* Name(TierKind t) { return TierKindName(t).data(); }

uint64_t TotalMoved(const Report& r) {
  uint64_t n = 0;
  for (const MoveStats& m : r.moves) n += m.bytes;
  return n;
}

nlohmann::json PeakJson(const Peak& p) {
  return {{"bytes", p.bytes},
          {"t_ns", p.t_ns},
          {"moment", p.moment},
          {"phase", p.phase},
          {"kernel_launches", p.kernel_launches}};
}

uint64_t Round(double v) { return static_cast<uint64_t>(std::llround(v)); }

}  // namespace

std::string FormatDuration(uint64_t ns) {
  if (ns >= 1000000000ull) return Printf("%.3f s", ns / 1e9);
  if (ns >= 1000000ull) return Printf("%.2f ms", ns / 1e6);
  if (ns >= 1000ull) return Printf("%.2f us", ns / 1e3);
  return Printf("%llu ns", static_cast<unsigned long long>(ns));
}

nlohmann::json ReportToJson(const Report& r) {
  nlohmann::json j;
  j["file"] = {{"events", r.events},
               {"blocks", r.blocks},
               {"complete", r.complete},
               {"end_note", r.end_note},
               {"out_of_order_events", r.out_of_order},
               {"wall_start_ns", r.wall_start_ns}};
  j["t0_ns"] = r.t0_ns;
  j["duration_ns"] = r.duration_ns;
  nlohmann::json tiers = nlohmann::json::object();
  for (int t = 0; t < kNumTierKinds; ++t) {
    const TierStats& s = r.tiers[t];
    if (!s.seen) continue;
    nlohmann::json cats = nlohmann::json::object();
    for (int c = 0; c < kNumCategories; ++c) {
      cats[std::string(CategoryName(static_cast<Category>(c)))] = {
          {"peak", PeakJson(s.categories[c].peak)},
          {"avg_bytes", Round(s.categories[c].avg_bytes)}};
    }
    tiers[std::string(TierKindName(static_cast<TierKind>(t)))] = {
        {"peak", PeakJson(s.peak)},
        {"avg_bytes", Round(s.avg_bytes)},
        {"end_bytes", s.end_bytes},
        {"budget_bytes", s.budget_bytes},
        {"max_budget_bytes", s.max_budget_bytes},
        {"allocs", s.allocs},
        {"frees", s.frees},
        {"ooms", s.ooms},
        {"managed_allocs", s.managed_allocs},
        {"largest_oom_bytes", s.largest_oom_bytes},
        {"categories", cats}};
  }
  j["tiers"] = tiers;
  nlohmann::json moves = nlohmann::json::array();
  for (const MoveStats& m : r.moves) {
    moves.push_back({{"src", Name(m.src)},
                     {"dst", Name(m.dst)},
                     {"bytes", m.bytes},
                     {"count", m.count},
                     {"failed", m.failed},
                     {"busy_ns", m.busy_ns},
                     {"active_ns", m.active_ns}});
  }
  j["moves"] = moves;
  nlohmann::json io = nlohmann::json::object();
  for (int t = 0; t < kNumTierKinds; ++t) {
    const IoStats& x = r.io[t];
    if (x.read_active_ns == 0 && x.write_active_ns == 0) continue;
    nlohmann::json by_category = nlohmann::json::object();
    for (int c = 0; c < kNumCategories; ++c) {
      if (x.category_bytes[c] > 0) {
        by_category[std::string(CategoryName(static_cast<Category>(c)))] = x.category_bytes[c];
      }
    }
    io[std::string(TierKindName(static_cast<TierKind>(t)))] = {
        {"read_bytes", x.read_bytes},   {"read_active_ns", x.read_active_ns},
        {"write_bytes", x.write_bytes}, {"write_active_ns", x.write_active_ns},
        {"active_ns", x.active_ns},     {"category_bytes", by_category}};
  }
  j["io"] = io;
  j["bytes_moved"] = TotalMoved(r);
  nlohmann::json causes = nlohmann::json::array();
  for (const StallStats& s : r.stalls) {
    causes.push_back({{"cause", s.cause}, {"ns", s.ns}, {"count", s.count}});
  }
  j["stalls"] = {{"total_ns", r.stall_ns}, {"count", r.stall_count}, {"by_cause", causes}};
  nlohmann::json chunks = nlohmann::json::array();
  for (const ChunkStats& c : r.top_chunks) {
    chunks.push_back({{"chunk", c.chunk}, {"moves", c.moves}, {"bytes", c.bytes}});
  }
  j["top_chunks"] = chunks;
  nlohmann::json phases = nlohmann::json::array();
  for (const PhaseStats& p : r.phases) {
    phases.push_back({{"phase", p.name},
                      {"count", p.count},
                      {"time_ns", p.time_ns},
                      {"stall_ns", p.stall_ns},
                      {"bytes_moved", p.bytes_moved},
                      {"device_peak_bytes", p.device_peak_bytes}});
  }
  j["phases"] = phases;
  j["iterations"] = {{"count", r.iterations},
                     {"step_mean_ns", r.step_mean_ns},
                     {"step_min_ns", r.step_min_ns},
                     {"step_max_ns", r.step_max_ns}};
  j["kernel_launches"] = {{"total", r.kernel_launches}, {"intervals", r.kernel_launch_intervals}};
  j["prefetches"] = {{"count", r.prefetches}, {"bytes", r.prefetch_bytes}};
  nlohmann::json coll = nlohmann::json::array();
  for (const CollectiveStats& c : r.collectives) {
    coll.push_back({{"op", c.op}, {"count", c.count}, {"bytes", c.bytes}, {"ns", c.ns}});
  }
  j["collectives"] = coll;
  j["unmatched"] = {{"frees", r.unmatched_frees},
                    {"copy_ends", r.unmatched_copy_ends},
                    {"stall_ends", r.unmatched_stall_ends},
                    {"open_copies", r.open_copies},
                    {"open_stalls", r.open_stalls}};
  return j;
}

namespace {

// What was read: events, duration, iterations; truncation and ordering notes.
void TextHeader(const Report& r, const std::string& name, std::string* o) {
  Line(o, "tiermem prof report: " + Shorten(name, kWidth - 21));
  Line(o, Printf("  %llu events, %s, %llu iterations, mean step %s",
                 static_cast<unsigned long long>(r.events), FormatDuration(r.duration_ns).c_str(),
                 static_cast<unsigned long long>(r.iterations),
                 FormatDuration(r.step_mean_ns).c_str()));
  if (!r.complete) {
    Line(o, "  TRUNCATED (the recorder did not close the file):");
    const std::string& n = r.end_note;
    for (size_t i = 0; i < n.size(); i += kWidth - 4) Line(o, "    " + n.substr(i, kWidth - 4));
  }
  if (r.out_of_order > 0) {
    Line(o, Printf("  note: %llu events arrived out of time order (applied on arrival)",
                   static_cast<unsigned long long>(r.out_of_order)));
  }
}

// One row of the memory table: peak, average, when, and at which moment (on a line of its own
// when the row would pass kWidth).
void PeakRow(const std::string& label, const Peak& p, double avg, std::string* o) {
  std::string where = p.moment.empty() ? "-" : p.moment;
  if (!p.phase.empty()) where += " (" + p.phase + ")";
  std::string left = Printf("    %-16s %11s %11s %8.3f  ", label.c_str(), Fb(p.bytes).c_str(),
                            Fb(Round(avg)).c_str(), p.t_ns / 1e9);
  if (left.size() + where.size() <= kWidth) {
    Line(o, left + where);
  } else {  // the moment on its own line
    Line(o, left);
    Line(o, "      at " + Shorten(where, kWidth - 9));
  }
}

// Peak and average bytes per tier and category.
void TextMemory(const Report& r, std::string* o) {
  Line(o, "");
  Line(o, "Memory per tier and category (peak at t = seconds from the first event)");
  Line(o, "  tier/category         peak         avg     at t  moment (phase)");
  for (int t = 0; t < kNumTierKinds; ++t) {
    const TierStats& s = r.tiers[t];
    if (!s.seen) continue;
    std::string head = Printf("  %-10s", Name(static_cast<TierKind>(t)));
    std::string budget = s.budget_bytes ? "budget " + Fb(s.budget_bytes) : "no budget";
    Line(o, head + " " + budget +
                Printf(", %llu allocs, %llu OOMs", static_cast<unsigned long long>(s.allocs),
                       static_cast<unsigned long long>(s.ooms)));
    PeakRow("total", s.peak, s.avg_bytes, o);
    if (r.kernel_launches > 0) {
      Line(o, Printf("    (peak after %llu of %llu kernel launches)",
                     static_cast<unsigned long long>(s.peak.kernel_launches),
                     static_cast<unsigned long long>(r.kernel_launches)));
    }
    if (s.managed_allocs > 0) {
      Line(o, Printf("    %llu of the allocs are CUDA managed memory",
                     static_cast<unsigned long long>(s.managed_allocs)));
    }
    for (int c = 0; c < kNumCategories; ++c) {
      const CategoryStats& cs = s.categories[c];
      if (cs.peak.bytes == 0) continue;
      PeakRow(std::string(CategoryName(static_cast<Category>(c))), cs.peak, cs.avg_bytes, o);
    }
  }
}

// Bytes moved per tier pair, and the NVMe rates while it was busy.
void TextMoves(const Report& r, std::string* o) {
  Line(o, "");
  Line(o, Printf("Bytes moved: %s in total", Fb(TotalMoved(r)).c_str()));
  if (!r.moves.empty()) {
    // GB/s: bytes over the time copies of the pair were in flight (overlapping copies count
    // once), i.e. the rate the pair achieved while it was moving data.
    Line(o, "  from -> to             bytes   copies  failed active time     GB/s");
    for (const MoveStats& m : r.moves) {
      const double gbps = m.active_ns ? m.bytes / static_cast<double>(m.active_ns) : 0.0;
      Line(o, Printf("  %-6s -> %-6s %12s %8llu %7llu %11s %8.2f", Name(m.src), Name(m.dst),
                     Fb(m.bytes).c_str(), static_cast<unsigned long long>(m.count),
                     static_cast<unsigned long long>(m.failed), FormatDuration(m.active_ns).c_str(),
                     gbps));
    }
  }
  const IoStats& nvme = r.io[static_cast<int>(TierKind::kNvme)];
  if (nvme.read_active_ns > 0 || nvme.write_active_ns > 0) {
    auto rate = [](Bytes b, uint64_t ns) { return ns ? b / static_cast<double>(ns) : 0.0; };
    // The disk's achieved rate while the engine was moving data to or from it.
    Line(o, Printf("  NVMe reads while busy:  %s in %s, %.2f GB/s", Fb(nvme.read_bytes).c_str(),
                   FormatDuration(nvme.read_active_ns).c_str(),
                   rate(nvme.read_bytes, nvme.read_active_ns)));
    Line(o, Printf("  NVMe writes while busy: %s in %s, %.2f GB/s", Fb(nvme.write_bytes).c_str(),
                   FormatDuration(nvme.write_active_ns).c_str(),
                   rate(nvme.write_bytes, nvme.write_active_ns)));
    Line(o, Printf("  NVMe busy either way:   %s in %s, %.2f GB/s",
                   Fb(nvme.read_bytes + nvme.write_bytes).c_str(),
                   FormatDuration(nvme.active_ns).c_str(),
                   rate(nvme.read_bytes + nvme.write_bytes, nvme.active_ns)));
    const Bytes state = nvme.category_bytes[static_cast<int>(Category::kOptimState)];
    if (state > 0) {
      // Read and written: what the optimizer-state format (optimizer.state_dtype) shrinks.
      Line(o, Printf("  NVMe optimizer state:   %s of the %s moved", Fb(state).c_str(),
                     Fb(nvme.read_bytes + nvme.write_bytes).c_str()));
    }
  }
}

// Stalls by cause, then kernel launches and prefetches.
void TextStalls(const Report& r, std::string* o) {
  Line(o, "");
  Line(o, Printf("Stalls: %s in %llu stalls", FormatDuration(r.stall_ns).c_str(),
                 static_cast<unsigned long long>(r.stall_count)));
  for (const StallStats& s : r.stalls) {
    std::string left = Printf("  %12s %7llu  ", FormatDuration(s.ns).c_str(),
                              static_cast<unsigned long long>(s.count));
    Line(o, left + Shorten(s.cause, kWidth - left.size()));
  }

  if (r.kernel_launch_intervals > 0 || r.prefetches > 0) {
    Line(o, "");
    Line(o, Printf("Kernel launches: %llu (%llu intervals); prefetches issued: %llu (%s)",
                   static_cast<unsigned long long>(r.kernel_launches),
                   static_cast<unsigned long long>(r.kernel_launch_intervals),
                   static_cast<unsigned long long>(r.prefetches), Fb(r.prefetch_bytes).c_str()));
  }
}

// Collectives, the most moved chunks, phases, unpaired events.
void TextTables(const Report& r, std::string* o) {
  if (!r.collectives.empty()) {
    Line(o, "");
    Line(o, "Collectives (sharded across ranks; bytes of the full buffers on this rank)");
    Line(o, "  operation          count        bytes        time");
    for (const CollectiveStats& c : r.collectives) {
      Line(o,
           Printf("  %-16s %7llu %12s %11s", c.op.c_str(), static_cast<unsigned long long>(c.count),
                  Fb(c.bytes).c_str(), FormatDuration(c.ns).c_str()));
    }
  }

  if (!r.top_chunks.empty()) {
    Line(o, "");
    Line(o, "Top chunks by moves");
    Line(o, "     chunk    moves        bytes");
    for (const ChunkStats& c : r.top_chunks) {
      Line(o, Printf("  %8u %8llu %12s", c.chunk, static_cast<unsigned long long>(c.moves),
                     Fb(c.bytes).c_str()));
    }
  }

  if (!r.phases.empty()) {
    Line(o, "");
    Line(o, "Phases");
    Line(o, "  phase               count        time      stalls        moved   device peak");
    for (const PhaseStats& p : r.phases) {
      Line(o, Printf("  %-16s %8llu %11s %11s %12s %13s", Shorten(p.name, 16).c_str(),
                     static_cast<unsigned long long>(p.count), FormatDuration(p.time_ns).c_str(),
                     FormatDuration(p.stall_ns).c_str(), Fb(p.bytes_moved).c_str(),
                     Fb(p.device_peak_bytes).c_str()));
    }
  }
  const uint64_t unmatched = r.unmatched_frees + r.unmatched_copy_ends + r.unmatched_stall_ends;
  if (unmatched + r.open_copies + r.open_stalls > 0) {
    Line(o, "");
    Line(o, Printf("Unpaired: %llu frees, %llu copy ends, %llu stall ends without a begin; "
                   "%llu copies, %llu stalls still open",
                   static_cast<unsigned long long>(r.unmatched_frees),
                   static_cast<unsigned long long>(r.unmatched_copy_ends),
                   static_cast<unsigned long long>(r.unmatched_stall_ends),
                   static_cast<unsigned long long>(r.open_copies),
                   static_cast<unsigned long long>(r.open_stalls)));
  }
}

}  // namespace

std::string RenderReportText(const Report& r, const std::string& name) {
  std::string o;
  TextHeader(r, name, &o);
  TextMemory(r, &o);
  TextMoves(r, &o);
  TextStalls(r, &o);
  TextTables(r, &o);
  return o;
}

namespace {

struct DiffRow {
  std::string name;
  uint64_t a, b;
  bool is_time;
};

std::vector<DiffRow> DiffRows(const Report& a, const Report& b) {
  std::vector<DiffRow> rows;
  for (int t = 0; t < kNumTierKinds; ++t) {
    if (!a.tiers[t].seen && !b.tiers[t].seen) continue;
    const std::string tier(TierKindName(static_cast<TierKind>(t)));
    rows.push_back({tier + " peak", a.tiers[t].peak.bytes, b.tiers[t].peak.bytes, false});
    for (int c = 0; c < kNumCategories; ++c) {
      const Bytes pa = a.tiers[t].categories[c].peak.bytes,
                  pb = b.tiers[t].categories[c].peak.bytes;
      if (pa == 0 && pb == 0) continue;
      rows.push_back({tier + " " + std::string(CategoryName(static_cast<Category>(c))) + " peak",
                      pa, pb, false});
    }
  }
  rows.push_back({"bytes moved", TotalMoved(a), TotalMoved(b), false});
  std::map<std::pair<int, int>, std::pair<uint64_t, uint64_t>> pairs;
  for (const MoveStats& m : a.moves) pairs[{int(m.src), int(m.dst)}].first = m.bytes;
  for (const MoveStats& m : b.moves) pairs[{int(m.src), int(m.dst)}].second = m.bytes;
  for (const auto& [k, v] : pairs) {
    rows.push_back({std::string("  ") + Name(TierKind(k.first)) + " -> " + Name(TierKind(k.second)),
                    v.first, v.second, false});
  }
  rows.push_back({"stall time", a.stall_ns, b.stall_ns, true});
  rows.push_back({"mean step time", a.step_mean_ns, b.step_mean_ns, true});
  rows.push_back({"duration", a.duration_ns, b.duration_ns, true});
  return rows;
}

nlohmann::json Change(uint64_t a, uint64_t b) {
  if (a == 0) return nullptr;
  return (static_cast<double>(b) - static_cast<double>(a)) / static_cast<double>(a) * 100.0;
}

}  // namespace

nlohmann::json DiffToJson(const Report& a, const Report& b) {
  nlohmann::json rows = nlohmann::json::array();
  for (const DiffRow& r : DiffRows(a, b)) {
    rows.push_back({{"metric", r.name},
                    {"a", r.a},
                    {"b", r.b},
                    {"change_pct", Change(r.a, r.b)},
                    {"unit", r.is_time ? "ns" : "bytes"}});
  }
  return {{"rows", rows}};
}

std::string RenderDiffText(const Report& a, const Report& b, const std::string& name_a,
                           const std::string& name_b) {
  std::string o;
  Line(&o, "tiermem prof diff");
  Line(&o, "  A: " + Shorten(name_a, kWidth - 5));
  Line(&o, "  B: " + Shorten(name_b, kWidth - 5));
  Line(&o, "");
  Line(&o, Printf("  %-30s %14s %14s %10s", "metric", "A", "B", "change"));
  for (const DiffRow& r : DiffRows(a, b)) {
    auto v = [&](uint64_t x) { return r.is_time ? FormatDuration(x) : Fb(x); };
    std::string change = "n/a";
    if (r.a != 0) {
      change = Printf("%+.1f%%", (static_cast<double>(r.b) - static_cast<double>(r.a)) /
                                     static_cast<double>(r.a) * 100.0);
    } else if (r.b == 0) {
      change = "=";
    }
    Line(&o, Printf("  %-30s %14s %14s %10s", Shorten(r.name, 30).c_str(), v(r.a).c_str(),
                    v(r.b).c_str(), change.c_str()));
  }
  if (!a.complete || !b.complete) {
    Line(&o, "");
    if (!a.complete) Line(&o, "  note: A is truncated: " + a.end_note);
    if (!b.complete) Line(&o, "  note: B is truncated: " + b.end_note);
  }
  return o;
}

}  // namespace tiermem::prof
