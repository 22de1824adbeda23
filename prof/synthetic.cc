// The synthetic run: device budget = 10 parameter chunks + activations; chunks are evicted
// least-recently-used (clean, no copy back: params are only written by the optimizer on
// host). Every region allocated is freed exactly once; every copy and stall is closed.
#include "prof/synthetic.h"

#include <deque>
#include <vector>

#include "base/clock.h"
#include "base/timeline.h"

namespace tiermem::prof {

StatusOr<uint64_t> WriteSyntheticTimeline(const std::string& path, const SyntheticOptions& o) {
  ManualClock clock(1'000'000'000);
  TIERMEM_ASSIGN_OR_RETURN(std::unique_ptr<TimelineRecorder> rec,
                           TimelineRecorder::Open(path, &clock));
  const int L = std::max(2, o.layers);
  const Bytes kChunk = 64 * kMiB, kAct = 24 * kMiB;
  const int kResident = 10;
  uint64_t events = 0, next_id = 1, copy_id = 1, stall_id = 1;
  auto rec_event = [&](Event e) {
    e.ts_ns = clock.NowNs();
    rec->Record(e);
    ++events;
  };
  auto ev = [](EventType type, TierKind tier, uint64_t id, Bytes bytes, Category cat) {
    Event e;
    e.type = type;
    e.tier = tier;
    e.id = id;
    e.bytes = bytes;
    e.category = cat;
    return e;
  };
  auto copy = [&](TierKind src, TierKind dst, Bytes bytes, uint16_t lane, ChunkId chunk,
                  double gbps) {
    Event b = ev(EventType::kCopyBegin, src, copy_id, bytes, Category::kOther);
    b.tier2 = dst;
    b.lane = lane;
    b.chunk = chunk;
    rec_event(b);
    clock.AdvanceNs(static_cast<uint64_t>(bytes / gbps));
    Event e = ev(EventType::kCopyEnd, src, copy_id++, bytes, Category::kOther);
    e.tier2 = dst;
    e.lane = lane;
    e.chunk = chunk;
    rec_event(e);
  };
  const uint32_t l_fwd = rec->InternLabel("forward"), l_bwd = rec->InternLabel("backward"),
                 l_opt = rec->InternLabel("optimizer"), l_late = rec->InternLabel("prefetch late"),
                 l_evict = rec->InternLabel("evict");
  std::vector<uint32_t> pre_fwd(L), pre_bwd(L), opt(L);
  for (int l = 0; l < L; ++l) {
    pre_fwd[l] = rec->InternLabel("model.layers." + std::to_string(l) + ".pre-forward");
    pre_bwd[l] = rec->InternLabel("model.layers." + std::to_string(l) + ".pre-backward");
    opt[l] = rec->InternLabel("optimizer.chunk" + std::to_string(l));
  }
  Event budget = ev(EventType::kBudget, TierKind::kDevice, 0,
                    kResident * kChunk + kChunk + 16 * kAct, Category::kOther);
  rec_event(budget);
  rec_event(ev(EventType::kBudget, TierKind::kHost, 0, 8 * kGiB, Category::kOther));
  // Host copies of all params and fp32 master + Adam state (half of the state on NVMe).
  std::vector<uint64_t> state_id(L);
  for (int l = 0; l < L; ++l) {
    rec_event(ev(EventType::kAlloc, TierKind::kHost, next_id++, kChunk, Category::kParam));
    state_id[l] = next_id++;
    const TierKind home = l < 3 * L / 4 ? TierKind::kHost : TierKind::kNvme;
    rec_event(ev(EventType::kAlloc, home, state_id[l], 3 * kChunk, Category::kOptimState));
  }
  std::deque<std::pair<int, uint64_t>> resident;  // (layer, region id) in LRU order
  auto ensure = [&](int l, uint32_t moment) {
    for (auto it = resident.begin(); it != resident.end(); ++it) {
      if (it->first == l) {
        auto v = *it;
        resident.erase(it);
        resident.push_back(v);
        return;
      }
    }
    if (static_cast<int>(resident.size()) >= kResident) {
      Event f = ev(EventType::kFree, TierKind::kDevice, resident.front().second, kChunk,
                   Category::kParam);
      f.flags = kFlagClean;
      f.label = l_evict;
      f.chunk = static_cast<ChunkId>(resident.front().first);
      rec_event(f);
      resident.pop_front();
    }
    const bool late = (l % 7) == 3;
    if (late) {
      Event s = ev(EventType::kStallBegin, TierKind::kNone, stall_id, 0, Category::kOther);
      s.label = l_late;
      rec_event(s);
    }
    copy(TierKind::kHost, TierKind::kDevice, kChunk, 0, static_cast<ChunkId>(l), 20.0);
    if (late) rec_event(ev(EventType::kStallEnd, TierKind::kNone, stall_id++, 0, Category::kOther));
    Event a = ev(EventType::kAlloc, TierKind::kDevice, next_id, kChunk, Category::kParam);
    a.chunk = static_cast<ChunkId>(l);
    a.label = moment;
    rec_event(a);
    resident.push_back({l, next_id++});
  };
  for (uint64_t iter = 0; events < o.min_events; ++iter) {
    rec_event(ev(EventType::kIteration, TierKind::kNone, iter, 0, Category::kOther));
    if (iter == 1) {  // one refused allocation, as a demo of the OOM markers
      rec_event(ev(EventType::kOom, TierKind::kDevice, 0, 2 * kGiB, Category::kActivation));
    }
    Event ph = ev(EventType::kPhase, TierKind::kNone, 0, 0, Category::kOther);
    ph.label = l_fwd;
    rec_event(ph);
    std::vector<uint64_t> acts(L);
    for (int l = 0; l < L; ++l) {
      Event m = ev(EventType::kMoment, TierKind::kNone, 0, 0, Category::kOther);
      m.label = pre_fwd[l];
      rec_event(m);
      ensure(l, pre_fwd[l]);
      acts[l] = next_id++;
      rec_event(ev(EventType::kAlloc, TierKind::kDevice, acts[l], kAct / (1 + l % 3),
                   Category::kActivation));
      clock.AdvanceNs(900'000 + 40'000 * (l % 5));  // compute
    }
    ph.label = l_bwd;
    rec_event(ph);
    for (int l = L - 1; l >= 0; --l) {
      Event m = ev(EventType::kMoment, TierKind::kNone, 0, 0, Category::kOther);
      m.label = pre_bwd[l];
      rec_event(m);
      ensure(l, pre_bwd[l]);
      clock.AdvanceNs(1'800'000);
      const uint64_t g = next_id++;
      rec_event(ev(EventType::kAlloc, TierKind::kDevice, g, kChunk, Category::kGrad));
      rec_event(ev(EventType::kFree, TierKind::kDevice, acts[l], 0, Category::kActivation));
      copy(TierKind::kDevice, TierKind::kHost, kChunk, 1, static_cast<ChunkId>(l), 22.0);
      rec_event(ev(EventType::kFree, TierKind::kDevice, g, kChunk, Category::kGrad));
    }
    ph.label = l_opt;
    rec_event(ph);
    for (int l = 0; l < L; ++l) {
      Event m = ev(EventType::kMoment, TierKind::kNone, 0, 0, Category::kOther);
      m.label = opt[l];
      rec_event(m);
      const uint64_t g = next_id++;
      rec_event(ev(EventType::kAlloc, TierKind::kHost, g, kChunk, Category::kGrad));
      if (l >= 3 * L / 4)
        copy(TierKind::kNvme, TierKind::kHost, 3 * kChunk, 2, static_cast<ChunkId>(1000 + l), 6.0);
      clock.AdvanceNs(2'000'000);  // CPU Adam
      if (l >= 3 * L / 4)
        copy(TierKind::kHost, TierKind::kNvme, 3 * kChunk, 2, static_cast<ChunkId>(1000 + l), 6.0);
      rec_event(ev(EventType::kFree, TierKind::kHost, g, kChunk, Category::kGrad));
    }
  }
  TIERMEM_RETURN_IF_ERROR(rec->Close());
  return events;
}

}  // namespace tiermem::prof
