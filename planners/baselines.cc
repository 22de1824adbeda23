// The baseline policies (simulator.h describes them) and MimicSchedule.
#include "planners/baselines.h"

#include <algorithm>
#include <array>
#include <map>
#include <tuple>

#include "layout/eviction_rank.h"

namespace tiermem::planners {
namespace {

// The engine's eviction rule (layout/eviction_rank.h) without a recorded order: the least
// recently used, clean first. Ties go to the lower chunk id, as in the engine (MakeRoom scans
// chunks by id).
chunks::EvictionRank Lru(const SimulatedRun& ex, ChunkId c) {
  return chunks::RankForEviction(chunks::EvictionCandidate{
      .chunk = c, .dirty = ex.Chunk(c).dirty, .last_use = ex.Chunk(c).last_use});
}

// Next access of `c` (any tier, any mode) strictly after moment `i` of `r`, or kNever.
constexpr uint64_t kNever = chunks::kNeverUsed;
class OrderIndex {
 public:
  OrderIndex(const EffIteration& r, size_t num_chunks) : pos_(num_chunks) {
    for (size_t m = 0; m < r.size(); ++m) {
      for (const EffAccess* a = r.begin(m); a != r.end(m); ++a) pos_[a->chunk].push_back(m);
    }
  }
  uint64_t Next(ChunkId c, size_t i) const {
    const auto& p = pos_[c];
    auto it = std::upper_bound(p.begin(), p.end(), static_cast<uint64_t>(i));
    return it == p.end() ? kNever : *it;
  }
  // Next taken to repeat: a use in the next iteration counts at `size` + its moment.
  uint64_t NextWrapped(ChunkId c, size_t i, size_t size) const {
    const uint64_t n = Next(c, i);
    if (n != kNever || pos_[c].empty()) return n;
    return size + pos_[c].front();
  }

 private:
  std::vector<std::vector<uint64_t>> pos_;
};

class LruPolicy : public BaselinePolicy {
 public:
  Status Before(SimulatedRun& ex, size_t i) override {
    return EnsureMoment(ex, i, [&ex](ChunkId c, TierKind) { return Lru(ex, c); });
  }
};

// Shared by the policies that follow the previous iteration's order.
class Following : public BaselinePolicy {
 public:
  explicit Following(const EffIteration* recorded) : rec_(recorded) {}
  Status BeginIteration(SimulatedRun& ex) override {
    following_ = rec_ != nullptr;
    if (rec_ != nullptr) index_ = std::make_unique<OrderIndex>(*rec_, ex.NumChunks());
    return OkStatus();
  }
  bool diverged() const override { return rec_ != nullptr && !following_; }

 protected:
  void Track(const SimulatedRun& ex, size_t i) {
    if (following_ && (i >= rec_->size() || !SameMoment(ex.iteration(), i, *rec_, i))) {
      following_ = false;
    }
  }
  const EffIteration* rec_;
  std::unique_ptr<OrderIndex> index_;
  bool following_ = false;
};

class PatrickStarPolicy : public Following {
 public:
  using Following::Following;
  Status Before(SimulatedRun& ex, size_t i) override {
    Track(ex, i);
    if (!following_) {
      return EnsureMoment(ex, i, [&ex](ChunkId c, TierKind) { return Lru(ex, c); });
    }
    return EnsureMoment(ex, i, [&](ChunkId c, TierKind) {
      return std::make_tuple(UINT64_MAX - std::min(index_->Next(c, i), kNever - 1), c);
    });
  }
};

class EnginePolicy : public Following {
 public:
  EnginePolicy(const EffIteration* recorded, uint32_t depth, EngineLookahead lookahead)
      : Following(recorded), depth_(depth), lookahead_(lookahead) {}
  Status Before(SimulatedRun& ex, size_t i) override {
    Track(ex, i);
    if (!following_) {
      return EnsureMoment(ex, i, [&ex](ChunkId c, TierKind) { return Lru(ex, c); });
    }
    // The engine's eviction rule while it follows the recorded order (ties: the lower id).
    auto key = [&](ChunkId c) {
      return chunks::RankForEviction(chunks::EvictionCandidate{.chunk = c,
                                                               .dirty = ex.Chunk(c).dirty,
                                                               .next_use = index_->Next(c, i),
                                                               .order_known = true});
    };
    TIERMEM_RETURN_IF_ERROR(EnsureMoment(ex, i, [&](ChunkId c, TierKind) { return key(c); }));
    if (lookahead_ == EngineLookahead::kRoom) return LookaheadByRoom(ex, i, key);
    // Lookahead: the next `depth_` acquires of the recorded order after this moment.
    uint32_t seen = 0;
    for (size_t m = i + 1; m < rec_->size() && seen < depth_; ++m) {
      for (const EffAccess* a = rec_->begin(m); a != rec_->end(m) && seen < depth_; ++a, ++seen) {
        const ChunkId c = a->chunk;
        const ChunkView& v = ex.Chunk(c);
        if (a->tier == ex.Home(c) || v.cache != TierKind::kNone) continue;
        const Bytes need = ex.ChunkBytes(c) + ex.NeedExtra(i, a->tier);
        auto r = MakeRoom(ex, i, a->tier, need, key, [&](ChunkId x) {
          if (ex.Chunk(x).dirty) return true;
          const uint64_t next = index_->Next(x, i);
          return next != kNever && next <= m;
        });
        if (!r.ok()) return r.status();
        if (!*r) return OkStatus();  // no room without hurting sooner uses: stop looking
        TIERMEM_RETURN_IF_ERROR(ex.Fetch(c, a->tier, a->needs_content));
      }
    }
    return OkStatus();
  }

 private:
  // The engine's room lookahead (Engine::PrefetchByRoom) over one lap of the recorded order
  // from the moment after `i` (positions n.. are the next iteration's moments, fetched for
  // it): device entries within `depth_` acquires as the depth lookahead makes room; host
  // entries (NVMe-homed chunks) each make room by evicting the host copy used farthest after
  // the entry (LookaheadNextUse: the order taken to repeat) if it is clean — if it is dirty
  // (or none is used later), the dirty ones used farthest are written home in the background
  // until their bytes cover the entry (Engine::CleanFor) and the host lookahead stops. A tier
  // stops at its first entry that finds no room. Moment `i`'s chunks are pinned.
  template <typename KeyFn>
  Status LookaheadByRoom(SimulatedRun& ex, size_t i, KeyFn key) {
    const EffIteration& it = ex.iteration();
    const size_t n = rec_->size();
    bool dev_done = false, host_done = false;
    uint32_t seen = 0;
    for (size_t j = i + 1; j <= i + n && !(dev_done && host_done); ++j) {
      const size_t m = j % n;
      const uint32_t tag = ex.tag() + (j >= n ? 1 : 0);
      for (const EffAccess* a = rec_->begin(m); a != rec_->end(m); ++a, ++seen) {
        if (seen >= depth_) dev_done = true;
        const ChunkId c = a->chunk;
        const bool host = a->tier == TierKind::kHost;
        if ((host ? host_done : dev_done) || a->tier == ex.Home(c) ||
            ex.Chunk(c).cache != TierKind::kNone || UsedBy(it, i, c)) {
          continue;
        }
        const Bytes need = ex.ChunkBytes(c) + ex.NeedExtra(i, a->tier);
        if (!host) {
          auto r = MakeRoom(ex, i, a->tier, need, key, [&](ChunkId x) {
            if (ex.Chunk(x).dirty) return true;
            const uint64_t next = index_->Next(x, i);
            return next != kNever && next <= j;
          });
          if (!r.ok()) return r.status();
          if (!*r) {
            dev_done = true;
            continue;
          }
        } else {
          TIERMEM_ASSIGN_OR_RETURN(const bool room, HostRoomFor(ex, i, j, need));
          if (!room) {
            host_done = true;
            continue;
          }
        }
        TIERMEM_RETURN_IF_ERROR(ex.Fetch(c, a->tier, a->needs_content, tag));
      }
    }
    return OkStatus();
  }

  // Makes `need` bytes free on the host for the entry at lap position `j` (LookaheadByRoom):
  // true when it did; false after starting the write-backs (CleanFor) when it could not.
  StatusOr<bool> HostRoomFor(SimulatedRun& ex, size_t i, size_t j, Bytes need) {
    const EffIteration& it = ex.iteration();
    const size_t n = rec_->size();
    constexpr TierKind kHost = TierKind::kHost;
    while (ex.Free(kHost) < need) {
      ChunkId best = kNoChunk;
      uint64_t best_next = 0;
      for (ChunkId x = 0; x < ex.NumChunks(); ++x) {
        if (ex.Chunk(x).cache != kHost || UsedBy(it, i, x)) continue;
        const uint64_t next = index_->NextWrapped(x, i, n);
        if (next <= j) continue;  // needed before the entry
        if (best == kNoChunk || next > best_next) {
          best = x;
          best_next = next;
        }
      }
      if (best == kNoChunk || ex.Chunk(best).dirty) {
        // Engine::CleanFor: the dirty ones used farthest (and after the entry) go home.
        std::vector<std::pair<uint64_t, ChunkId>> dirty;
        for (ChunkId x = 0; x < ex.NumChunks(); ++x) {
          if (ex.Chunk(x).cache != kHost || !ex.Chunk(x).dirty || UsedBy(it, i, x)) continue;
          const uint64_t next = index_->NextWrapped(x, i, n);
          if (next > j) dirty.emplace_back(next, x);
        }
        std::sort(dirty.begin(), dirty.end(), [](const auto& a, const auto& b) {
          return a.first != b.first ? a.first > b.first : a.second < b.second;
        });
        Bytes cleaning = 0;
        for (const auto& [next, x] : dirty) {
          if (cleaning >= need) break;
          TIERMEM_RETURN_IF_ERROR(ex.WriteBack(x));
          cleaning += ex.ChunkBytes(x);
        }
        return false;
      }
      TIERMEM_RETURN_IF_ERROR(ex.Evict(best));
    }
    return true;
  }

  uint32_t depth_;
  EngineLookahead lookahead_;
};

class DeepSpeedPolicy : public Following {
 public:
  DeepSpeedPolicy(const EffIteration* recorded, Bytes bucket)
      : Following(recorded), bucket_(bucket) {}
  Status Before(SimulatedRun& ex, size_t i) override {
    Track(ex, i);
    const EffIteration& it = ex.iteration();
    // The window: recorded moments after this one while their new chunks fit the bucket.
    size_t window_end = i;
    if (following_) {
      Bytes acc = 0;
      for (size_t m = i + 1; m < rec_->size(); ++m) {
        for (const EffAccess* a = rec_->begin(m); a != rec_->end(m); ++a) {
          if (a->tier != ex.Home(a->chunk)) acc += ex.ChunkBytes(a->chunk);
        }
        if (acc > bucket_) break;
        window_end = m;
      }
    }
    // Release what the previous moment used unless it is reused within the window.
    if (i > 0) {
      for (const EffAccess* a = it.begin(i - 1); a != it.end(i - 1); ++a) {
        const ChunkId c = a->chunk;
        if (ex.Chunk(c).cache == TierKind::kNone || UsedBy(it, i, c)) continue;
        if (following_) {
          const uint64_t next = index_->Next(c, i - 1);
          if (next != kNever && next <= window_end) continue;
        }
        TIERMEM_RETURN_IF_ERROR(ex.Evict(c));
      }
    }
    TIERMEM_RETURN_IF_ERROR(EnsureMoment(ex, i, [&ex](ChunkId c, TierKind) { return Lru(ex, c); }));
    if (!following_) return OkStatus();
    for (size_t m = i + 1; m <= window_end; ++m) {
      for (const EffAccess* a = rec_->begin(m); a != rec_->end(m); ++a) {
        const ChunkId c = a->chunk;
        if (a->tier == ex.Home(c) || ex.Chunk(c).cache != TierKind::kNone || !a->needs_content) {
          continue;
        }
        const Bytes need = ex.ChunkBytes(c) + ex.NeedExtra(i, a->tier);
        auto r = MakeRoom(
            ex, i, a->tier, need, [&ex](ChunkId x) { return Lru(ex, x); },
            [&](ChunkId x) {
              const uint64_t next = index_->Next(x, i);
              return next != kNever && next <= window_end;
            });
        if (!r.ok()) return r.status();
        if (!*r) return OkStatus();
        TIERMEM_RETURN_IF_ERROR(ex.Fetch(c, a->tier, true));
      }
    }
    return OkStatus();
  }

 private:
  Bytes bucket_;
};

// Belady's demand moves over the extended horizon the planner's own demand pass uses (the
// iteration, then a copy of it): fetches only when a moment needs them, victims by BeladyKey
// (dead on the tier first, then the farthest next read). Unlike the planner's own schedule
// (MakeSchedule) nothing else leaves: a chunk dead on one tier stays cached there until a
// moment needs its room or moves it (a host copy moved to the device is a host -> device
// copy, not a write-back home and a read from NVMe).
class BeladyMovesPolicy : public BaselinePolicy {
 public:
  explicit BeladyMovesPolicy(const NextUse* nu) : nu_(nu) {}
  Status Before(SimulatedRun& ex, size_t i) override {
    return EnsureMoment(ex, i, [&](ChunkId c, TierKind t) {
      return BeladyKey(*nu_, c, t, i, ex.Chunk(c).dirty, ex.ChunkBytes(c));
    });
  }

 private:
  const NextUse* nu_;
};

}  // namespace

std::string_view BaselineName(BaselineKind k) {
  switch (k) {
    case BaselineKind::kLru:
      return "lru";
    case BaselineKind::kPatrickStar:
      return "patrickstar";
    case BaselineKind::kDeepSpeed:
      return "deepspeed";
    case BaselineKind::kEngine:
      return "engine";
  }
  return "?";
}

std::string_view EngineLookaheadName(EngineLookahead l) {
  return l == EngineLookahead::kRoom ? "room" : "depth";
}

StatusOr<EngineLookahead> ParseEngineLookahead(std::string_view name) {
  if (name == "depth") return EngineLookahead::kDepth;
  if (name == "room") return EngineLookahead::kRoom;
  return InvalidArgumentError("engine lookahead must be depth or room, not '" + std::string(name) +
                              "'");
}

std::unique_ptr<BaselinePolicy> MakeBaselinePolicy(BaselineKind kind, const EffIteration* recorded,
                                                   const BaselineParams& params,
                                                   Bytes max_chunk_bytes) {
  switch (kind) {
    case BaselineKind::kLru:
      return std::make_unique<LruPolicy>();
    case BaselineKind::kPatrickStar:
      return std::make_unique<PatrickStarPolicy>(recorded);
    case BaselineKind::kDeepSpeed:
      return std::make_unique<DeepSpeedPolicy>(recorded, params.deepspeed_bucket_bytes != 0
                                                             ? params.deepspeed_bucket_bytes
                                                             : 4 * max_chunk_bytes);
    case BaselineKind::kEngine:
      return std::make_unique<EnginePolicy>(recorded, params.engine_prefetch_depth,
                                            params.engine_lookahead);
  }
  return nullptr;
}

namespace {

// Moves each eviction of `evicts` (per moment) to right after the chunk's last access before
// it, and after the fetch that brought that copy (a victim leaves as soon as it is done
// with): the same moves, room free sooner in program order.
void EvictEarly(const EffIteration& eff, const std::vector<std::vector<PlanAction>>& fetches,
                std::vector<std::vector<PlanAction>>* evicts) {
  const size_t n = eff.size();
  std::map<ChunkId, int64_t> bound;  // per chunk: the earliest moment an eviction may move to
  std::vector<std::vector<PlanAction>> out(n);
  for (size_t i = 0; i < n; ++i) {
    for (const PlanAction& a : (*evicts)[i]) {
      auto it = bound.find(a.chunk);
      const size_t e = it == bound.end() ? 0 : static_cast<size_t>(it->second);
      out[std::min(e, i)].push_back(a);
      bound[a.chunk] = static_cast<int64_t>(i) + 1;  // not before this copy left
    }
    for (const PlanAction& a : fetches[i]) bound[a.chunk] = static_cast<int64_t>(i) + 1;
    for (const EffAccess* x = eff.begin(i); x != eff.end(i); ++x) {
      bound[x->chunk] = static_cast<int64_t>(i) + 1;
    }
  }
  *evicts = std::move(out);
}

// Moves each copying fetch of `fetches` (per moment, issue order) to the earliest moment from
// which its room is free in program order up to the moment it was issued at — after the
// chunk's previous access and its previous eviction, and in issue order per tier (FIFO copy
// lanes then serve them in that order). Capacity of tier t at moment q: its budget less the
// moment's non-chunk bytes and, on the host, the homes there (as the planner's own schedule
// counts it: what the simulated run's program-order check needs).
void HoistFetches(const ScheduleInput& in, const std::vector<std::vector<PlanAction>>& evicts,
                  std::vector<std::vector<PlanAction>>* fetches) {
  const Trace& t = *in.trace;
  const EffIteration& eff = *in.eff;
  const size_t n = eff.size();
  constexpr int kD = static_cast<int>(TierKind::kDevice), kH = static_cast<int>(TierKind::kHost);
  Bytes host_homes = 0;
  for (ChunkId c = 0; c < t.chunks.size(); ++c) {
    if (in.homes[c] == TierKind::kHost) host_homes += t.chunks[c].bytes;
  }
  const auto cap = [&](int tier, size_t q) {
    return tier == kD
               ? static_cast<int64_t>(in.device_budget) - static_cast<int64_t>(eff.dev_extra[q])
               : static_cast<int64_t>(in.host_budget) - static_cast<int64_t>(host_homes) -
                     static_cast<int64_t>(eff.host_extra[q]);
  };
  // Occupancy after each moment's actions, per tier; the last access and eviction before
  // each moment, per chunk (filled as the walk goes).
  std::array<std::vector<int64_t>, 2> occ{std::vector<int64_t>(n, 0), std::vector<int64_t>(n, 0)};
  {
    std::array<int64_t, 2> run{};
    for (ChunkId c = 0; c < t.chunks.size(); ++c) {
      const int st = static_cast<int>(in.start.cache[c]);
      if (st == kD || st == kH) run[st] += static_cast<int64_t>(t.chunks[c].bytes);
    }
    for (size_t q = 0; q < n; ++q) {
      for (const PlanAction& a : evicts[q])
        run[static_cast<int>(a.tier)] -= t.chunks[a.chunk].bytes;
      for (const PlanAction& a : (*fetches)[q])
        run[static_cast<int>(a.tier)] += t.chunks[a.chunk].bytes;
      occ[kD][q] = run[kD];
      occ[kH][q] = run[kH];
    }
  }
  std::vector<int64_t> last_access(t.chunks.size(), -1), last_evict(t.chunks.size(), -1);
  std::array<size_t, 2> prev{};
  std::vector<std::vector<PlanAction>> out(n);
  for (size_t i = 0; i < n; ++i) {
    for (const PlanAction& a : evicts[i]) last_evict[a.chunk] = static_cast<int64_t>(i);
    for (const PlanAction& a : (*fetches)[i]) {
      const int tier = static_cast<int>(a.tier);
      size_t e = i;
      if (a.copy) {
        const int64_t earliest = std::max(last_access[a.chunk], last_evict[a.chunk]) + 1;
        e = std::max<size_t>(static_cast<size_t>(std::max<int64_t>(earliest, 0)), prev[tier]);
        const int64_t b = static_cast<int64_t>(t.chunks[a.chunk].bytes);
        for (size_t q = i; q > e; --q) {
          if (occ[tier][q - 1] + b > cap(tier, q - 1)) {
            e = q;
            break;
          }
        }
        e = std::min(e, i);
        for (size_t q = e; q < i; ++q) occ[tier][q] += b;
        prev[tier] = e;
      }
      out[e].push_back(a);
    }
    for (const EffAccess* x = eff.begin(i); x != eff.end(i); ++x) {
      last_access[x->chunk] = static_cast<int64_t>(i);
    }
  }
  *fetches = std::move(out);
}

}  // namespace

namespace {

// The moves `policy` makes over `in.eff` from `in.start`, as a schedule (MimicSchedule).
StatusOr<Schedule> ScheduleOfMoves(const ScheduleInput& in, Policy& policy, bool hoist) {
  const Trace& t = *in.trace;
  const EffIteration& eff = *in.eff;
  TIERMEM_ASSIGN_OR_RETURN(auto ex, SimulatedRun::Create(in.trace, in.machine, in.homes));
  for (ChunkId c = 0; c < t.chunks.size(); ++c) {
    TIERMEM_RETURN_IF_ERROR(ex->Preload(c, in.start.cache[c], in.start.dirty[c]));
  }
  std::vector<LoggedMove> moves;
  ex->set_move_log(&moves);
  TIERMEM_ASSIGN_OR_RETURN(const IterationStats st, ex->Run(eff, policy, 0));
  (void)st;
  // Per chunk the moments that access it, for the fetches' need moments.
  std::vector<std::vector<std::pair<uint32_t, TierKind>>> uses(t.chunks.size());
  for (size_t m = 0; m < eff.size(); ++m) {
    for (const EffAccess* a = eff.begin(m); a != eff.end(m); ++a) {
      uses[a->chunk].push_back({static_cast<uint32_t>(m), a->tier});
    }
  }
  Schedule out;
  std::vector<std::vector<PlanAction>> evicts(eff.size()), fetches(eff.size());
  for (const LoggedMove& mv : moves) {
    PlanAction a;
    a.kind = mv.evict ? ActionKind::kEvict : ActionKind::kPrefetch;
    a.tier = mv.tier;
    a.copy = mv.copy;
    a.chunk = mv.chunk;
    a.need_moment = mv.moment;
    if (mv.evict) {
      evicts[mv.moment].push_back(a);
      continue;
    }
    for (auto [m, tier] : uses[mv.chunk]) {
      if (m >= mv.moment && tier == mv.tier) {
        a.need_moment = m;
        break;
      }
    }
    if (mv.copy) out.device_in_bytes += a.tier == TierKind::kDevice ? t.chunks[mv.chunk].bytes : 0;
    // An allocation ahead of its use (the engine's lookahead allocates a chunk that a later
    // moment overwrites) is issued at that use: a plan's allocation-only prefetch is honoured
    // only by the moment that overwrites the chunk (PlanPolicy::Issue); its room is taken no
    // earlier than the policy took it, so every other move still finds its room.
    const bool alloc_ahead = !mv.copy && a.need_moment > mv.moment && a.need_moment < eff.size();
    fetches[alloc_ahead ? a.need_moment : mv.moment].push_back(a);
  }
  if (hoist) {
    EvictEarly(eff, fetches, &evicts);
    HoistFetches(in, evicts, &fetches);
  }
  out.actions = std::move(evicts);
  for (size_t m = 0; m < eff.size(); ++m) {
    out.actions[m].insert(out.actions[m].end(), fetches[m].begin(), fetches[m].end());
  }
  return out;
}

}  // namespace

StatusOr<Schedule> MimicSchedule(const ScheduleInput& in, BaselineKind kind,
                                 const BaselineParams& params, bool hoist) {
  auto policy = MakeBaselinePolicy(kind, in.eff, params, in.trace->MaxChunkBytes());
  return ScheduleOfMoves(in, *policy, hoist);
}

StatusOr<Schedule> BeladyMovesSchedule(const ScheduleInput& in, bool hoist) {
  const NextUse nu({in.eff, in.eff}, in.trace->chunks.size());
  BeladyMovesPolicy policy(&nu);
  return ScheduleOfMoves(in, policy, hoist);
}

}  // namespace tiermem::planners
