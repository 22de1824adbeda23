// A small hand-made timeline whose report is known exactly (see prof_test.cc for the numbers).
#pragma once

#include <string>

#include "base/clock.h"
#include "base/timeline.h"

namespace tiermem::prof::testing {

inline void WriteGoldenTimeline(const std::string& path) {
  ManualClock clock(500);
  auto rec = std::move(TimelineRecorder::Open(path, &clock).value());
  auto at = [&](uint64_t ts, EventType type, auto&&... fill) {
    Event e;
    e.ts_ns = ts;
    e.type = type;
    (fill(e), ...);
    rec->Record(e);
  };
  auto tier = [](TierKind t, TierKind t2 = TierKind::kNone) {
    return [=](Event& e) { e.tier = t; e.tier2 = t2; };
  };
  auto id = [](uint64_t v) { return [=](Event& e) { e.id = v; }; };
  auto bytes = [](uint64_t v) { return [=](Event& e) { e.bytes = v; }; };
  auto cat = [](Category c) { return [=](Event& e) { e.category = c; }; };
  auto chunk = [](ChunkId c) { return [=](Event& e) { e.chunk = c; }; };
  auto lane = [](uint16_t l) { return [=](Event& e) { e.lane = l; }; };
  auto label = [&](const char* text) {
    uint32_t l = rec->InternLabel(text);
    return [=](Event& e) { e.label = l; };
  };
  auto flags = [](uint8_t f) { return [=](Event& e) { e.flags = f; }; };
  constexpr uint64_t M = 1 << 20;
  at(1000, EventType::kIteration, id(0));
  at(1000, EventType::kPhase, label("forward"));
  at(1000, EventType::kBudget, tier(TierKind::kDevice), bytes(100 * M));
  at(1000, EventType::kMoment, label("layer0.pre-forward"));
  at(1000, EventType::kAlloc, tier(TierKind::kDevice), id(1), bytes(10 * M), cat(Category::kParam), chunk(0));
  at(2000, EventType::kCopyBegin, tier(TierKind::kHost, TierKind::kDevice), id(1), bytes(4 * M), lane(0), chunk(5));
  at(3000, EventType::kCopyEnd, tier(TierKind::kHost, TierKind::kDevice), id(1), lane(0), chunk(5));
  at(3000, EventType::kAlloc, tier(TierKind::kDevice), id(2), bytes(6 * M), cat(Category::kActivation));
  at(3000, EventType::kMoment, label("layer1.pre-forward"));
  at(4000, EventType::kAlloc, tier(TierKind::kDevice), id(3), bytes(4 * M), cat(Category::kActivation));
  at(4000, EventType::kStallBegin, id(1), label("prefetch late"));
  at(4500, EventType::kStallEnd, id(1));
  at(5000, EventType::kPhase, label("backward"));
  at(5000, EventType::kFree, tier(TierKind::kDevice), id(3), bytes(4 * M));
  at(5000, EventType::kFree, tier(TierKind::kDevice), id(2), bytes(6 * M));
  at(6000, EventType::kCopyBegin, tier(TierKind::kDevice, TierKind::kHost), id(2), bytes(8 * M), lane(1), chunk(5));
  at(6000, EventType::kStallBegin, id(2), label("evict"));
  at(7000, EventType::kStallEnd, id(2));
  at(8000, EventType::kCopyEnd, tier(TierKind::kDevice, TierKind::kHost), id(2), lane(1));
  at(8000, EventType::kCopyBegin, tier(TierKind::kHost, TierKind::kNvme), id(3), bytes(2 * M), lane(2));
  at(9000, EventType::kCopyEnd, tier(TierKind::kHost, TierKind::kNvme), id(3), lane(2), flags(kFlagFailed));
  at(9000, EventType::kIteration, id(1));
  at(9000, EventType::kPhase, label("forward"));
  at(9000, EventType::kAlloc, tier(TierKind::kHost), id(1), bytes(30 * M), cat(Category::kOptimState));
  at(10000, EventType::kFree, tier(TierKind::kHost), id(1));
  at(11000, EventType::kOom, tier(TierKind::kDevice), bytes(200 * M));
  at(11000, EventType::kFree, tier(TierKind::kDevice), id(99));
  rec->Close().IgnoreError();
}
inline constexpr uint64_t kGoldenEvents = 27;

}  // namespace tiermem::prof::testing
