// Perfetto / Chrome-trace export: one streaming pass over the time-ordered events, writing
// JSON records as it goes. Open async slices (allocations, copies, stalls) are remembered by
// id so that their end record repeats the begin's name and category (the format pairs async
// events by cat + id + name) and so that they can be closed at the end.
#include "prof/perfetto.h"

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_map>

#include "prof/analysis.h"
#include "prof/json_writer.h"

namespace tiermem::prof {
namespace {

constexpr int kMainPid = 10;
constexpr int kTidPhases = 1, kTidIterations = 2, kTidMoments = 3, kTidStalls = 4;
constexpr int kTidPrefetches = 5;
constexpr int kTidCollectives = 6;
constexpr int kTidLaneBase = 100;

std::string Hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

class Exporter {
 public:
  explicit Exporter(OutputFile* out) : out_(out) {}

  void Begin() {
    *out_ << "{\"displayTimeUnit\":\"ns\",\"traceEvents\":[\n";
    for (int t = 0; t < kNumTierKinds; ++t) {
      Meta("process_name", t + 1, 0, std::string(TierKindName(static_cast<TierKind>(t))) + " tier");
    }
    Meta("process_name", kMainPid, 0, "tiermem");
    Meta("thread_name", kMainPid, kTidPhases, "phases");
    Meta("thread_name", kMainPid, kTidIterations, "iterations");
    Meta("thread_name", kMainPid, kTidMoments, "moments");
    Meta("thread_name", kMainPid, kTidStalls, "stalls & OOMs");
    Meta("thread_name", kMainPid, kTidPrefetches, "prefetches");
    Meta("thread_name", kMainPid, kTidCollectives, "collectives");
  }

  // Allocation args: bytes, chunk, and what the preload shim adds (stream label, managed).
  static std::string AllocArgs(const Event& e, std::string_view label) {
    std::string a = "{\"bytes\":" + std::to_string(e.bytes) + ",\"chunk\":" + ChunkArg(e.chunk);
    if (!label.empty()) a += ",\"label\":" + nlohmann::json(std::string(label)).dump();
    if (e.flags & kFlagManaged) a += ",\"managed\":true";
    return a + "}";
  }

  void Add(const TimelineEntry& entry, Analyzer* analyzer) {
    const Event& e = entry.event;
    if (!started_) {
      started_ = true;
      t0_ = e.ts_ns;
    }
    now_ = std::max(now_, e.ts_ns >= t0_ ? e.ts_ns - t0_ : 0);
    const TierKind changed = analyzer->Add(e, entry.label);
    const int tier = static_cast<int>(e.tier) < kNumTierKinds ? static_cast<int>(e.tier) : -1;
    switch (e.type) {
      case EventType::kAlloc:
        if (tier < 0) break;
        {
          const std::string cat = "alloc:" + std::string(TierKindName(e.tier));
          const std::string name(CategoryName(e.category));
          const uint64_t key = AllocKey(tier, e.id);
          if (auto it = allocs_.find(key); it != allocs_.end()) {  // re-allocated live id
            Async('e', cat, it->second, tier + 1, 0, e.id, "");
          }
          allocs_[key] = name;
          Async('b', cat, name, tier + 1, 0, e.id, AllocArgs(e, entry.label));
        }
        break;
      case EventType::kFree:
        if (tier < 0) break;
        if (auto it = allocs_.find(AllocKey(tier, e.id)); it != allocs_.end()) {
          Async('e', "alloc:" + std::string(TierKindName(e.tier)), it->second, tier + 1, 0, e.id,
                (e.flags & kFlagClean) ? "{\"clean\":true}" : "");
          allocs_.erase(it);
        }
        break;
      case EventType::kCopyBegin: {
        const std::string name =
            std::string(TierKindName(e.tier)) + "->" + std::string(TierKindName(e.tier2));
        const int tid = kTidLaneBase + e.lane;
        if (lanes_.insert(e.lane).second) {
          Meta("thread_name", kMainPid, tid, "copy lane " + std::to_string(e.lane));
        }
        copies_[e.id] = {name, tid};
        Async('b', "copy", name, kMainPid, tid, e.id,
              "{\"bytes\":" + std::to_string(e.bytes) + ",\"chunk\":" + ChunkArg(e.chunk) + "}");
        break;
      }
      case EventType::kCopyEnd:
        if (auto it = copies_.find(e.id); it != copies_.end()) {
          Async('e', "copy", it->second.first, kMainPid, it->second.second, e.id,
                (e.flags & kFlagFailed) ? "{\"failed\":true}" : "");
          copies_.erase(it);
        }
        break;
      case EventType::kStallBegin: {
        std::string cause = entry.label.empty() ? "stall" : std::string(entry.label);
        stalls_[e.id] = cause;
        Instant(kTidStalls, "stall: " + cause, "t");
        Async('b', "stall", cause, kMainPid, kTidStalls, e.id, "");
        break;
      }
      case EventType::kStallEnd:
        if (auto it = stalls_.find(e.id); it != stalls_.end()) {
          Async('e', "stall", it->second, kMainPid, kTidStalls, e.id, "");
          stalls_.erase(it);
        }
        break;
      case EventType::kBudget:
        if (tier < 0) break;
        Record('C', tier + 1, 0, "budget");
        *out_ << ",\"args\":{\"bytes\":";
        out_->Uint(e.bytes) << "}}";
        break;
      case EventType::kMoment:
        Instant(kTidMoments, entry.label.empty() ? "moment" : std::string(entry.label), "t");
        break;
      case EventType::kPhase:
        if (in_phase_) Slice('E', kTidPhases, phase_);
        phase_ = entry.label.empty() ? "phase" : std::string(entry.label);
        in_phase_ = true;
        Slice('B', kTidPhases, phase_);
        break;
      case EventType::kIteration:
        if (in_iteration_) Slice('E', kTidIterations, iteration_);
        iteration_ = "iteration " + std::to_string(e.id);
        in_iteration_ = true;
        Slice('B', kTidIterations, iteration_);
        break;
      case EventType::kOom:
        Record('i', kMainPid, kTidStalls, "OOM on " + std::string(TierKindName(e.tier)));
        *out_ << ",\"s\":\"g\",\"args\":{\"bytes\":";
        out_->Uint(e.bytes) << "}}";
        break;
      case EventType::kKernelLaunches:  // a counter: launches per interval and in total
        launches_ += e.bytes;
        Record('C', kMainPid, 0, "kernel launches");
        *out_ << ",\"args\":{\"per_interval\":";
        out_->Uint(e.bytes) << ",\"total\":";
        out_->Uint(launches_) << "}}";
        break;
      case EventType::kCollective: {  // a slice ending now, `id` ns long
        const uint64_t dur = std::min(now_, e.id);
        Sep();
        *out_ << "{\"ph\":\"X\",\"pid\":";
        out_->Uint(kMainPid) << ",\"tid\":";
        out_->Uint(kTidCollectives) << ",\"name\":";
        out_->Quoted(entry.label.empty() ? std::string("collective") : std::string(entry.label))
            << ",\"ts\":";
        out_->Micros(now_ - dur) << ",\"dur\":";
        out_->Micros(dur) << ",\"args\":{\"bytes\":";
        out_->Uint(e.bytes) << "}}";
        break;
      }
      case EventType::kPrefetch:
        Record('i', kMainPid, kTidPrefetches, "prefetch to " + std::string(TierKindName(e.tier2)));
        *out_ << ",\"s\":\"t\",\"args\":{\"bytes\":";
        out_->Uint(e.bytes) << ",\"region\":\"" << Hex(e.id) << "\"}}";
        break;
    }
    if (changed != TierKind::kNone) {
      const int t = static_cast<int>(changed);
      Record('C', t + 1, 0, "memory");
      *out_ << ",\"args\":{";
      for (int c = 0; c < kNumCategories; ++c) {
        if (c > 0) *out_ << ',';
        *out_ << '"' << CategoryName(static_cast<Category>(c)) << "\":";
        out_->Uint(analyzer->usage()[t][c]);
      }
      *out_ << "}}";
    }
  }

  void End() {
    const std::string unfinished = "{\"unfinished\":true}";
    for (const auto& [key, name] : allocs_) {
      const int tier = static_cast<int>(key >> 62);
      Async('e', "alloc:" + std::string(TierKindName(static_cast<TierKind>(tier))), name, tier + 1,
            0, key & ((uint64_t{1} << 62) - 1), unfinished);
    }
    for (const auto& [id, v] : copies_)
      Async('e', "copy", v.first, kMainPid, v.second, id, unfinished);
    for (const auto& [id, cause] : stalls_)
      Async('e', "stall", cause, kMainPid, kTidStalls, id, unfinished);
    if (in_phase_) Slice('E', kTidPhases, phase_);
    if (in_iteration_) Slice('E', kTidIterations, iteration_);
    *out_ << "\n]}\n";
  }

 private:
  static uint64_t AllocKey(int tier, uint64_t id) {
    return (static_cast<uint64_t>(tier) << 62) | (id & ((uint64_t{1} << 62) - 1));
  }
  static std::string ChunkArg(ChunkId c) { return c == kNoChunk ? "null" : std::to_string(c); }

  void Sep() {
    if (!first_) *out_ << ",\n";
    first_ = false;
  }
  // Opens a record: {"ph":..,"pid":..,"tid":..,"name":..,"ts":..  (caller closes it).
  void Record(char ph, int pid, int tid, const std::string& name) {
    Sep();
    *out_ << "{\"ph\":\"" << ph << "\",\"pid\":";
    out_->Uint(pid) << ",\"tid\":";
    out_->Uint(tid) << ",\"name\":";
    out_->Quoted(name) << ",\"ts\":";
    out_->Micros(now_);
  }
  void Meta(const char* what, int pid, int tid, const std::string& value) {
    Sep();
    *out_ << "{\"ph\":\"M\",\"pid\":";
    out_->Uint(pid) << ",\"tid\":";
    out_->Uint(tid) << ",\"name\":\"" << what << "\",\"args\":{\"name\":";
    out_->Quoted(value) << "}}";
  }
  void Async(char ph, const std::string& cat, const std::string& name, int pid, int tid,
             uint64_t id, const std::string& args) {
    Record(ph, pid, tid, name);
    *out_ << ",\"cat\":";
    out_->Quoted(cat) << ",\"id\":\"" << Hex(id) << '"';
    if (!args.empty()) *out_ << ",\"args\":" << args;
    *out_ << '}';
  }
  void Instant(int tid, const std::string& name, const char* scope) {
    Record('i', kMainPid, tid, name);
    *out_ << ",\"s\":\"" << scope << "\"}";
  }
  void Slice(char ph, int tid, const std::string& name) {
    Record(ph, kMainPid, tid, name);
    *out_ << '}';
  }

  OutputFile* out_;
  bool first_ = true;
  bool started_ = false;
  uint64_t t0_ = 0;
  uint64_t now_ = 0;                                                  // ns since t0, non-decreasing
  std::unordered_map<uint64_t, std::string> allocs_;                  // (tier, id) -> async name
  std::unordered_map<uint64_t, std::pair<std::string, int>> copies_;  // id -> (name, tid)
  std::unordered_map<uint64_t, std::string> stalls_;                  // id -> cause
  std::set<uint16_t> lanes_;
  uint64_t launches_ = 0;
  bool in_phase_ = false, in_iteration_ = false;
  std::string phase_, iteration_;
};

}  // namespace

Status ExportPerfetto(const std::string& timeline_path, const std::string& out_path) {
  TIERMEM_ASSIGN_OR_RETURN(std::unique_ptr<OutputFile> out, OutputFile::Create(out_path));
  Exporter exporter(out.get());
  Analyzer analyzer;
  exporter.Begin();
  TIERMEM_RETURN_IF_ERROR(
      ForEachOrdered(timeline_path, [&](const TimelineEntry& e) { exporter.Add(e, &analyzer); }));
  exporter.End();
  return out->Close();
}

}  // namespace tiermem::prof
