// HTML rendering in two streaming passes over the timeline: the first is the full analysis
// (the report, t0 and the duration, which fix the time buckets), the second replays the
// events through a fresh Analyzer and samples its usage per tier into buckets. Copies,
// stalls and markers closer together than one bucket-width/2 on a track are coalesced into
// one span carrying a count, so the output size is bounded by the number of buckets and
// lanes, not by the number of events.
#include "prof/html.h"

#include <algorithm>
#include <array>
#include <nlohmann/json.hpp>
#include <unordered_map>
#include <vector>

#include "prof/analysis.h"
#include "prof/json_writer.h"
#include "prof/render.h"

namespace tiermem::prof {
namespace {

#include "prof/html_template.inc"

struct Snapshot {
  uint64_t t = 0;
  Bytes total = 0;
  std::array<Bytes, kNumCategories> v{};
};

// Keeps first/min/max/last snapshots per bucket of one tier.
class TierSampler {
 public:
  void Observe(int bucket, const Snapshot& s) {
    if (bucket != bucket_) {
      FlushBucket();
      bucket_ = bucket;
      first_ = min_ = max_ = s;
    }
    if (s.total < min_.total) min_ = s;
    if (s.total > max_.total) max_ = s;
    last_ = s;
  }
  nlohmann::json Finish(const Snapshot& end) {
    FlushBucket();
    if (points_.empty() || points_.back().t < end.t) points_.push_back(end);
    nlohmann::json t = nlohmann::json::array(), cats = nlohmann::json::array();
    for (int c = 0; c < kNumCategories; ++c) cats.push_back(nlohmann::json::array());
    for (const Snapshot& s : points_) {
      t.push_back(s.t);
      for (int c = 0; c < kNumCategories; ++c) cats[c].push_back(s.v[c]);
    }
    return {{"t", t}, {"v", cats}};
  }

 private:
  void FlushBucket() {
    if (bucket_ < 0) return;
    std::array<const Snapshot*, 4> keep = {&first_, &min_, &max_, &last_};
    std::sort(keep.begin(), keep.end(),
              [](const Snapshot* a, const Snapshot* b) { return a->t < b->t; });
    const Snapshot* prev = nullptr;
    for (const Snapshot* s : keep) {
      if (prev == s || (prev != nullptr && prev->t == s->t && prev->total == s->total)) continue;
      points_.push_back(*s);
      prev = s;
    }
    bucket_ = -1;
  }
  int bucket_ = -1;
  Snapshot first_, min_, max_, last_;
  std::vector<Snapshot> points_ = {Snapshot{}};  // starts empty at t = 0
};

struct Span {
  uint64_t t0, t1;
  Bytes bytes;
  uint64_t count;
  int src, dst;
  bool failed;
  std::string cause;
};

// Coalesces a span into the previous one on its track when they are closer than `gap` and
// the union stays within `max_width` (one bucket), so a track holds O(buckets) spans and a
// busy lane still shows its gaps at full zoom-out. Spans of different kinds merge into a
// "mixed" span (src = dst = kMixed).
constexpr int kMixed = -2;
void AddSpan(std::vector<Span>* track, Span s, uint64_t gap, uint64_t max_width) {
  if (!track->empty()) {
    Span& last = track->back();
    const uint64_t t0 = std::min(last.t0, s.t0), t1 = std::max(last.t1, s.t1);
    if (s.t0 <= last.t1 + gap && t1 - t0 <= max_width) {
      last.t0 = t0;
      last.t1 = t1;
      last.bytes += s.bytes;
      last.count += s.count;
      last.failed |= s.failed;
      if (s.src != last.src || s.dst != last.dst) last.src = last.dst = kMixed;
      return;
    }
  }
  track->push_back(std::move(s));
}

std::string SpanTierName(int t) {
  return t == kMixed ? "mixed" : std::string(TierKindName(static_cast<TierKind>(t)));
}

// Markers (phase, moment, budget) thinned to at most one per `gap`.
struct Markers {
  nlohmann::json items = nlohmann::json::array();
  uint64_t last_t = 0;
  uint64_t dropped = 0;
  void Add(uint64_t t, nlohmann::json item, uint64_t gap) {
    if (!items.empty() && t < last_t + gap) {
      ++dropped;
      return;
    }
    items.push_back(std::move(item));
    last_t = t;
  }
};

}  // namespace

Status RenderHtml(const std::string& timeline_path, const std::string& out_path,
                  const HtmlOptions& options) {
  TIERMEM_ASSIGN_OR_RETURN(Report report, AnalyzeFile(timeline_path));
  const int buckets = std::max(1, options.buckets);
  const uint64_t duration = report.duration_ns;
  const uint64_t gap = duration / (2 * static_cast<uint64_t>(buckets));
  const uint64_t bucket_width = std::max<uint64_t>(1, duration / static_cast<uint64_t>(buckets));
  auto bucket_of = [&](uint64_t t) {
    return duration == 0
               ? 0
               : static_cast<int>(std::min<uint64_t>(
                     buckets - 1, static_cast<unsigned __int128>(t) * buckets / duration));
  };

  std::array<TierSampler, kNumTierKinds> samplers;
  struct CopyInfo {
    uint64_t t0;
    Bytes bytes;
    int src, dst;
    uint16_t lane;
  };
  std::unordered_map<uint64_t, CopyInfo> copies;
  std::unordered_map<uint64_t, std::pair<uint64_t, std::string>> stalls;
  std::map<uint16_t, std::vector<Span>> lanes;
  std::vector<Span> stall_spans;
  Markers phases, moments, ooms;
  std::array<Markers, kNumTierKinds> budgets;
  Analyzer analyzer;
  uint64_t t0 = report.t0_ns;

  Status s = ForEachOrdered(timeline_path, [&](const TimelineEntry& entry) {
    const Event& e = entry.event;
    const TierKind changed = analyzer.Add(e, entry.label);
    const uint64_t t = std::min(duration, e.ts_ns > t0 ? e.ts_ns - t0 : 0);
    if (changed != TierKind::kNone) {
      const int tier = static_cast<int>(changed);
      Snapshot snap;
      snap.t = t;
      snap.total = analyzer.tier_total(tier);
      snap.v = analyzer.usage()[tier];
      samplers[tier].Observe(bucket_of(t), snap);
    }
    switch (e.type) {
      case EventType::kCopyBegin:
        copies[e.id] =
            CopyInfo{t, e.bytes, static_cast<int>(e.tier), static_cast<int>(e.tier2), e.lane};
        break;
      case EventType::kCopyEnd:
        if (auto it = copies.find(e.id); it != copies.end()) {
          const CopyInfo& c = it->second;
          AddSpan(&lanes[c.lane],
                  Span{c.t0, t, c.bytes, 1, c.src, c.dst, (e.flags & kFlagFailed) != 0, ""}, gap,
                  bucket_width);
          copies.erase(it);
        }
        break;
      case EventType::kStallBegin:
        stalls[e.id] = {t, std::string(entry.label)};
        break;
      case EventType::kStallEnd:
        if (auto it = stalls.find(e.id); it != stalls.end()) {
          AddSpan(&stall_spans, Span{it->second.first, t, 0, 1, 0, 0, false, it->second.second},
                  gap, bucket_width);
          stalls.erase(it);
        }
        break;
      case EventType::kPhase:
        phases.Add(t, {t, entry.label}, gap);
        break;
      case EventType::kMoment:
        moments.Add(t, {t, entry.label}, gap);
        break;
      case EventType::kOom:
        ooms.Add(t, {t, std::string(TierKindName(e.tier)), e.bytes}, 0);
        break;
      case EventType::kBudget:
        if (static_cast<int>(e.tier) < kNumTierKinds) {
          budgets[static_cast<int>(e.tier)].Add(t, {t, e.bytes}, gap);
        }
        break;
      default:
        break;
    }
  });
  TIERMEM_RETURN_IF_ERROR(s);
  for (auto& [id, c] : copies) {  // still in flight at the end
    AddSpan(&lanes[c.lane], Span{c.t0, duration, c.bytes, 1, c.src, c.dst, false, ""}, gap,
            bucket_width);
  }
  for (auto& [id, st] : stalls) {
    AddSpan(&stall_spans, Span{st.first, duration, 0, 1, 0, 0, false, st.second}, gap,
            bucket_width);
  }

  nlohmann::json data;
  data["name"] = timeline_path;
  data["duration_ns"] = duration;
  data["categories"] = nlohmann::json::array();
  for (int c = 0; c < kNumCategories; ++c) {
    data["categories"].push_back(std::string(CategoryName(static_cast<Category>(c))));
  }
  data["tiers"] = nlohmann::json::array();
  for (int t = 0; t < kNumTierKinds; ++t) {
    if (!report.tiers[t].seen) continue;
    Snapshot end;
    end.t = duration;
    end.v = analyzer.usage()[t];
    end.total = analyzer.tier_total(t);
    nlohmann::json tier = samplers[t].Finish(end);
    tier["name"] = std::string(TierKindName(static_cast<TierKind>(t)));
    tier["budgets"] = budgets[t].items;
    data["tiers"].push_back(std::move(tier));
  }
  nlohmann::json lanes_json = nlohmann::json::array();
  for (auto& [lane, spans] : lanes) {
    std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.t0 < b.t0; });
    nlohmann::json arr = nlohmann::json::array();
    for (const Span& sp : spans) {
      arr.push_back({sp.t0, sp.t1, SpanTierName(sp.src), SpanTierName(sp.dst), sp.bytes, sp.count,
                     sp.failed});
    }
    lanes_json.push_back({{"lane", lane}, {"spans", arr}});
  }
  data["lanes"] = lanes_json;
  nlohmann::json stall_json = nlohmann::json::array();
  std::sort(stall_spans.begin(), stall_spans.end(),
            [](const Span& a, const Span& b) { return a.t0 < b.t0; });
  for (const Span& sp : stall_spans) stall_json.push_back({sp.t0, sp.t1, sp.cause, sp.count});
  data["stalls"] = stall_json;
  data["phases"] = phases.items;
  data["moments"] = moments.items;
  data["ooms"] = ooms.items;
  data["report"] = ReportToJson(report);

  std::string json = data.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  // Inline <script> data must not contain "</" (a label could hold "</script>").
  for (size_t pos = 0; (pos = json.find("</", pos)) != std::string::npos; pos += 3) {
    json.replace(pos, 2, "<\\/");
  }
  const std::string_view tmpl = kHtmlTemplate;
  const std::string_view marker = "/*TIERMEM_DATA*/null";
  const size_t at = tmpl.find(marker);
  if (at == std::string_view::npos) return InternalError("html template lacks its data marker");
  TIERMEM_ASSIGN_OR_RETURN(std::unique_ptr<OutputFile> out, OutputFile::Create(out_path));
  *out << tmpl.substr(0, at) << json << tmpl.substr(at + marker.size());
  return out->Close();
}

}  // namespace tiermem::prof
