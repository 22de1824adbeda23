// The chunk schedule: Belady demand pass, early eviction, fetch hoisting (planner.h explains
// why), and PlanPolicy, which executes a plan in the simulated run.
//
// Positions: the demand pass walks a horizon of two copies of the iteration (0..2n-1);
// next-use lookups see three. Program-order capacity of tier t for chunks at position q is
// its budget minus the non-chunk bytes of that moment (EffIteration::dev_extra / host_extra)
// and, on the host, minus the homes there. occ[t][q] is the chunk bytes cached on t during
// q after q's actions; every transformation below keeps occ[t][q] <= capacity(t, q), which
// is exactly what the simulated run's program-order check needs, so an executed plan never needs
// repairs when the iteration matches it.
#include "planners/schedule.h"

#include <algorithm>
#include <array>
#include <iterator>
#include <set>
#include <string>
#include <tuple>

namespace tiermem::planners {

NextUse::NextUse(const std::vector<const EffIteration*>& seq, size_t num_chunks)
    : uses_(num_chunks) {
  uint64_t pos = 0;
  for (const EffIteration* it : seq) {
    for (size_t m = 0; m < it->size(); ++m, ++pos) {
      moments_.push_back({it, m});
      for (const EffAccess* a = it->begin(m); a != it->end(m); ++a) {
        uses_[a->chunk].push_back(Use{pos, a->tier, a->needs_content});
      }
    }
  }
}

uint64_t NextUse::NextRead(ChunkId c, TierKind tier, uint64_t pos, bool* leaves) const {
  if (leaves != nullptr) *leaves = false;
  const std::vector<Use>& u = uses_[c];
  auto it =
      std::upper_bound(u.begin(), u.end(), pos, [](uint64_t p, const Use& x) { return p < x.pos; });
  if (pos == UINT64_MAX) it = u.begin();  // "before the first moment"
  if (it == u.end()) return kDead;
  if (it->tier != tier) {
    if (leaves != nullptr) *leaves = true;
    return kDead;
  }
  return it->reads ? it->pos : kDead;
}

VictimKey BeladyKey(const NextUse& nu, ChunkId c, TierKind tier, uint64_t pos, bool dirty,
                    Bytes bytes) {
  bool leaves = false;
  const uint64_t nr = nu.NextRead(c, tier, pos, &leaves);
  VictimKey k;
  k.id = c;
  k.bytes = UINT64_MAX - bytes;
  if (nr == NextUse::kDead) {
    k.cls = !dirty ? 0 : (leaves ? 1 : 2);
  } else {
    k.cls = 3;
    k.far = UINT64_MAX - nr;
  }
  return k;
}

namespace {

constexpr int kD = static_cast<int>(TierKind::kDevice);
constexpr int kH = static_cast<int>(TierKind::kHost);

struct FetchEv {
  ChunkId chunk;
  int tier;
  int64_t need;  // position it is cached from in the demand pass (its use, or earlier
                 // for an aggressive prefetch)
  bool copy;
  int64_t after_access;  // position of the chunk's previous access (-1: none)
  int64_t prev_evict;    // index into evicts of its previous eviction (-1: none)
  int64_t use;           // position of the access that needs it
};
struct EvictEv {
  ChunkId chunk;
  int tier;
  int64_t at;         // position (start of that moment)
  int64_t arrived;    // position the copy arrived at (-1: resident from the start)
  bool dirty;         // written back to its home
  bool victim;        // made room for a fetch (may leave earlier, right after its last use)
  bool emit;          // a plan action (false: a copy that moved up to a faster tier)
  int64_t freed = 0;  // position from which its room is usable
};

// Copy-lane clocks, [source tier][destination tier], in ns of the modelled stream.
using LaneClocks = std::array<std::array<uint64_t, kNumTierKinds>, kNumTierKinds>;

// Builds one Schedule in four steps (MakeSchedule runs them in order): the demand pass
// records every fetch and eviction Belady makes over the horizon; victims of this iteration
// then leave right after their last use; each eviction's room gets the position it is usable
// from; and the fetches are hoisted as early as the room allows and emitted as plan actions.
// The demand pass's state (what is cached where, dirty, when it arrived) lives here; the later
// steps read only the recorded events.
class ScheduleBuilder {
 public:
  explicit ScheduleBuilder(const ScheduleInput& in);

  // Belady over two copies of the iteration. kResourceExhausted naming the moment when its
  // chunks cannot fit next to its non-chunk bytes.
  Status DemandPass();
  // Victims evicted in this iteration leave right after their last use (before their
  // eviction's position, never before they arrived).
  void EvictVictimsEarly();
  // When each eviction's room is usable: at once, or (write-back aware) when its write-back
  // is modelled to end, lanes in the order of the evictions.
  void SetFreed();
  // The plan actions: prefetches hoisted, evictions, activation fetches.
  Schedule Emit() const;

 private:
  // Program-order capacity of tier t for chunks at position q (the file comment).
  int64_t Cap(int t, int64_t q) const;
  int64_t BytesOf(ChunkId c) const { return static_cast<int64_t>(trace_.chunks[c].bytes); }
  // The first position at or after `from` whose start is at or after `time` (horizon: none).
  int64_t PosAt(int64_t from, uint64_t time) const;
  // Models c's write-back from `tier` to its home starting at `at` on `clocks`; its end.
  uint64_t WritebackEnd(LaneClocks& clocks, int tier, ChunkId c, int64_t at) const;

  void SetCache(ChunkId c, int t);  // -1: cached nowhere
  void Evict(ChunkId c, int64_t at, bool victim, bool emit = true);
  // Evicts c at the start of `at` when it is dead on its tier after `after_pos` (-1: before
  // the first moment). A copy's next use changes only when it is accessed, so only the chunks
  // just accessed need a look.
  void EvictDeadOne(ChunkId c, int64_t after_pos, int64_t at);
  // The Belady victim on tier t at pos (not used by its moment), -1 if none; its key in *key.
  int64_t Victim(int t, int64_t pos, VictimKey* key) const;
  void Insert(ChunkId c, int t, int64_t pos, bool copy, int64_t use);

  // The demand pass at position `pos` (moment i) on tier t: evicts until the moment's missing
  // chunks fit, then fetches them.
  Status FetchMoment(int t, int64_t pos, size_t i);
  // Aggressive variant: while the next chunk to be read on t can come in without harm (free
  // room, or a victim read later than it), fetch it now.
  void FetchAhead(int t, int64_t pos);
  // Occupancy per position after its actions, from the events.
  std::array<std::vector<int64_t>, 2> Occupancy() const;
  // Each fetch (need order per tier) as early as the room allows, into prefetch_at; counts
  // device_in_bytes into *out.
  void Hoist(std::array<std::vector<int64_t>, 2> occ,
             std::vector<std::vector<PlanAction>>* prefetch_at, Schedule* out) const;

  const ScheduleInput& in_;
  const Trace& trace_;
  const EffIteration& eff_;
  const size_t n_, nc_;
  const int64_t horizon_;  // 2n positions
  NextUse nu_;             // three copies of the iteration
  Bytes host_homes_ = 0;   // bytes of the chunks homed on the host
  // Write-back aware: the room of a dirty copy is usable only once its write-back is modelled
  // to end, on its copy lane in order, with the stream advancing by compute alone.
  const bool aware_;
  std::vector<uint64_t> t_at_;  // start time of each position (and the horizon's end), ns
  LaneClocks lane_{};           // the demand pass's clocks

  // Demand-pass state, per chunk.
  std::vector<int> cache_;                     // tier index of the cached copy, -1 none
  std::vector<bool> dirty_;                    // the cached copy differs from its home
  std::vector<int64_t> last_acc_;              // position of the last access (any tier)
  std::vector<int64_t> arrived_;               // position its current copy arrived at
  std::vector<int64_t> left_at_;               // position at whose start its copy last moved up
  std::vector<int64_t> last_evict_;            // index into evicts_ of its last eviction
  std::vector<int64_t> used_at_;               // the last position whose moment uses it
  std::array<int64_t, kNumTierKinds> used_{};  // chunk bytes counted on each tier
  // The chunks cached on each tier (unordered; slot_[c] is c's index there).
  std::array<std::vector<ChunkId>, 2> on_tier_;
  std::vector<size_t> slot_;

  std::vector<FetchEv> fetches_;
  std::vector<EvictEv> evicts_;
  std::vector<std::tuple<int64_t, int, int64_t>> pending_;  // (usable from, tier, bytes)
};

ScheduleBuilder::ScheduleBuilder(const ScheduleInput& in)
    : in_(in),
      trace_(*in.trace),
      eff_(*in.eff),
      n_(eff_.size()),
      nc_(trace_.chunks.size()),
      horizon_(static_cast<int64_t>(2 * n_)),
      nu_({&eff_, &eff_, &eff_}, nc_),
      aware_(in.writeback_aware && in.machine != nullptr),
      t_at_(static_cast<size_t>(horizon_) + 1, 0),
      cache_(nc_, -1),
      dirty_(nc_, false),
      last_acc_(nc_, -1),
      arrived_(nc_, -1),
      left_at_(nc_, -1),
      last_evict_(nc_, -1),
      used_at_(nc_, -1),
      slot_(nc_, 0) {
  for (ChunkId c = 0; c < nc_; ++c) {
    if (in.homes[c] == TierKind::kHost) host_homes_ += trace_.chunks[c].bytes;
  }
  for (int64_t q = 0; q < horizon_; ++q) {
    const EffMoment& m = eff_.moments[static_cast<size_t>(q) % n_];
    t_at_[q + 1] = t_at_[q] + (m.async ? 0 : m.compute_ns);
  }
  for (ChunkId c = 0; c < nc_; ++c) {
    const TierKind t = in.start.cache.empty() ? TierKind::kNone : in.start.cache[c];
    if (t == TierKind::kDevice || t == TierKind::kHost) {
      SetCache(c, static_cast<int>(t));
      dirty_[c] = in.start.dirty[c];
      used_[cache_[c]] += BytesOf(c);
    }
  }
}

int64_t ScheduleBuilder::Cap(int t, int64_t q) const {
  const size_t i = static_cast<size_t>(q) % n_;
  if (t == kD)
    return static_cast<int64_t>(in_.device_budget) - static_cast<int64_t>(eff_.dev_extra[i]);
  return static_cast<int64_t>(in_.host_budget) - static_cast<int64_t>(host_homes_) -
         static_cast<int64_t>(eff_.host_extra[i]);
}

int64_t ScheduleBuilder::PosAt(int64_t from, uint64_t time) const {
  int64_t q = from;
  while (q < horizon_ && t_at_[q] < time) ++q;
  return q;
}

uint64_t ScheduleBuilder::WritebackEnd(LaneClocks& clocks, int tier, ChunkId c, int64_t at) const {
  const auto [ls, ld] = MachineModel::LaneOf(static_cast<TierKind>(tier), in_.homes[c]);
  uint64_t& clock = clocks[ls][ld];
  clock = std::max(clock, t_at_[at]) +
          in_.machine->CopyNs(static_cast<TierKind>(tier), in_.homes[c], trace_.chunks[c].bytes);
  return clock;
}

void ScheduleBuilder::SetCache(ChunkId c, int t) {
  if (cache_[c] >= 0) {
    std::vector<ChunkId>& v = on_tier_[cache_[c]];
    v[slot_[c]] = v.back();
    slot_[v.back()] = slot_[c];
    v.pop_back();
  }
  cache_[c] = t;
  if (t >= 0) {
    slot_[c] = on_tier_[t].size();
    on_tier_[t].push_back(c);
  }
}

void ScheduleBuilder::Evict(ChunkId c, int64_t at, bool victim, bool emit) {
  const int64_t b = BytesOf(c);
  const bool d = dirty_[c] && emit;
  int64_t freed = at;
  if (aware_ && d) {
    freed = PosAt(at, WritebackEnd(lane_, cache_[c], c, at));
    if (freed > at) pending_.push_back({freed, cache_[c], b});
  }
  if (freed == at) used_[cache_[c]] -= b;
  last_evict_[c] = static_cast<int64_t>(evicts_.size());
  evicts_.push_back({c, cache_[c], at, arrived_[c], d, victim, emit});
  SetCache(c, -1);
  dirty_[c] = false;
}

void ScheduleBuilder::EvictDeadOne(ChunkId c, int64_t after_pos, int64_t at) {
  if (cache_[c] < 0) return;
  const uint64_t p = after_pos < 0 ? UINT64_MAX : static_cast<uint64_t>(after_pos);
  const VictimKey k =
      BeladyKey(nu_, c, static_cast<TierKind>(cache_[c]), p, dirty_[c], trace_.chunks[c].bytes);
  if (k.cls <= 1) Evict(c, at, false);
}

int64_t ScheduleBuilder::Victim(int t, int64_t pos, VictimKey* key) const {
  bool have = false;
  ChunkId best = 0;
  for (ChunkId c : on_tier_[t]) {
    if (used_at_[c] == pos) continue;
    const VictimKey k = BeladyKey(nu_, c, static_cast<TierKind>(t), static_cast<uint64_t>(pos),
                                  dirty_[c], trace_.chunks[c].bytes);
    if (!have || k < *key) {
      have = true;
      best = c;
      *key = k;
    }
  }
  return have ? static_cast<int64_t>(best) : -1;
}

void ScheduleBuilder::Insert(ChunkId c, int t, int64_t pos, bool copy, int64_t use) {
  const int64_t after = std::max(last_acc_[c], left_at_[c]);
  if (cache_[c] >= 0) {  // moves up from another cache: that copy goes
    Evict(c, pos, false, /*emit=*/false);
    left_at_[c] = pos;
  }
  SetCache(c, t);
  dirty_[c] = false;
  arrived_[c] = pos;
  used_[t] += BytesOf(c);
  fetches_.push_back({c, t, pos, copy, after, last_evict_[c], use});
}

Status ScheduleBuilder::DemandPass() {
  for (ChunkId c = 0; c < nc_; ++c) EvictDeadOne(c, -1, 0);
  for (int64_t pos = 0; pos < horizon_; ++pos) {
    const size_t i = static_cast<size_t>(pos) % n_;
    for (const EffAccess* a = eff_.begin(i); a != eff_.end(i); ++a) used_at_[a->chunk] = pos;
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (std::get<0>(*it) <= pos) {
        used_[std::get<1>(*it)] -= std::get<2>(*it);
        it = pending_.erase(it);
      } else {
        ++it;
      }
    }
    // Copies above a chunk's home are dropped when it is accessed at home.
    for (const EffAccess* a = eff_.begin(i); a != eff_.end(i); ++a) {
      if (a->tier == in_.homes[a->chunk] && cache_[a->chunk] >= 0) Evict(a->chunk, pos, false);
    }
    for (int t : {kD, kH}) {
      TIERMEM_RETURN_IF_ERROR(FetchMoment(t, pos, i));
      if (in_.aggressive) FetchAhead(t, pos);
    }
    for (const EffAccess* a = eff_.begin(i); a != eff_.end(i); ++a) {
      last_acc_[a->chunk] = pos;
      if (a->modifies && cache_[a->chunk] == static_cast<int>(a->tier)) dirty_[a->chunk] = true;
    }
    if (pos + 1 < horizon_) {
      for (const EffAccess* a = eff_.begin(i); a != eff_.end(i); ++a) {
        EvictDeadOne(a->chunk, pos, pos + 1);
      }
    }
  }
  return OkStatus();
}

Status ScheduleBuilder::FetchMoment(int t, int64_t pos, size_t i) {
  int64_t missing = 0;
  for (const EffAccess* a = eff_.begin(i); a != eff_.end(i); ++a) {
    if (static_cast<int>(a->tier) == t && a->tier != in_.homes[a->chunk] && cache_[a->chunk] != t) {
      missing += BytesOf(a->chunk);
    }
  }
  while (used_[t] + missing > Cap(t, pos)) {
    VictimKey key;
    const int64_t v = Victim(t, pos, &key);
    if (v < 0) {
      const Bytes extra = t == kD ? eff_.dev_extra[i] : eff_.host_extra[i] + host_homes_;
      return ResourceExhaustedError(
          std::string(TierKindName(static_cast<TierKind>(t))) + " tier: moment " +
          std::to_string(i) + " (" + std::string(eff_.moments[i].label) + ") needs " +
          std::to_string(missing + used_[t] + static_cast<int64_t>(extra)) +
          " bytes (chunks it uses " + std::to_string(missing + used_[t]) + ", non-chunk " +
          std::to_string(extra) + "), the budget is " +
          std::to_string(t == kD ? in_.device_budget : in_.host_budget) + " bytes");
    }
    Evict(static_cast<ChunkId>(v), pos, true);
  }
  for (const EffAccess* a = eff_.begin(i); a != eff_.end(i); ++a) {
    const ChunkId c = a->chunk;
    if (static_cast<int>(a->tier) != t || a->tier == in_.homes[c] || cache_[c] == t) continue;
    Insert(c, t, pos, a->needs_content, pos);
  }
  return OkStatus();
}

void ScheduleBuilder::FetchAhead(int t, int64_t pos) {
  while (pos + 1 < horizon_) {
    // The earliest later read on t of a chunk cached nowhere (and not used now).
    bool have = false;
    ChunkId x = 0;
    uint64_t xr = NextUse::kDead;
    for (int64_t q = pos + 1; q < horizon_ && !have; ++q) {
      const size_t j = static_cast<size_t>(q) % n_;
      for (const EffAccess* a = eff_.begin(j); a != eff_.end(j); ++a) {
        const ChunkId c = a->chunk;
        if (static_cast<int>(a->tier) != t || !a->needs_content || cache_[c] >= 0 ||
            in_.homes[c] == a->tier || used_at_[c] == pos ||
            nu_.NextRead(c, a->tier, static_cast<uint64_t>(pos)) != static_cast<uint64_t>(q)) {
          continue;
        }
        have = true;
        x = c;
        xr = static_cast<uint64_t>(q);
        break;
      }
    }
    if (!have) return;
    while (used_[t] + BytesOf(x) > Cap(t, pos)) {
      VictimKey key;
      const int64_t v = Victim(t, pos, &key);
      // Do no harm: the victim must be dead or read after x.
      if (v < 0 || (key.cls == 3 && UINT64_MAX - key.far <= xr)) return;
      Evict(static_cast<ChunkId>(v), pos, true);
    }
    Insert(x, t, pos, true, static_cast<int64_t>(xr));
  }
}

void ScheduleBuilder::EvictVictimsEarly() {
  for (EvictEv& e : evicts_) {
    if (!e.victim || e.at >= static_cast<int64_t>(n_)) continue;
    int64_t last = -1;
    for (int64_t q = e.at - 1; q > e.arrived && q >= 0; --q) {
      if (UsedBy(eff_, static_cast<size_t>(q) % n_, e.chunk)) {
        last = q;
        break;
      }
    }
    e.at = std::max({last + 1, e.arrived + 1, int64_t{0}});
  }
}

void ScheduleBuilder::SetFreed() {
  std::vector<size_t> order(evicts_.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = k;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t x, size_t y) { return evicts_[x].at < evicts_[y].at; });
  LaneClocks clocks{};
  for (size_t k : order) {
    EvictEv& e = evicts_[k];
    e.freed = aware_ && e.dirty ? PosAt(e.at, WritebackEnd(clocks, e.tier, e.chunk, e.at)) : e.at;
  }
}

std::array<std::vector<int64_t>, 2> ScheduleBuilder::Occupancy() const {
  std::array<std::vector<int64_t>, 2> occ;
  for (int t : {kD, kH}) {
    std::vector<int64_t> diff(static_cast<size_t>(horizon_) + 1, 0);
    for (ChunkId c = 0; c < nc_; ++c) {
      const TierKind st = in_.start.cache.empty() ? TierKind::kNone : in_.start.cache[c];
      if (static_cast<int>(st) == t) diff[0] += BytesOf(c);
    }
    for (const FetchEv& f : fetches_) {
      if (f.tier == t) diff[static_cast<size_t>(f.need)] += BytesOf(f.chunk);
    }
    for (const EvictEv& e : evicts_) {
      if (e.tier == t) diff[static_cast<size_t>(std::min(e.freed, horizon_))] -= BytesOf(e.chunk);
    }
    occ[t].resize(static_cast<size_t>(horizon_));
    int64_t run = 0;
    for (int64_t q = 0; q < horizon_; ++q) {
      run += diff[static_cast<size_t>(q)];
      occ[t][static_cast<size_t>(q)] = run;
    }
  }
  return occ;
}

void ScheduleBuilder::Hoist(std::array<std::vector<int64_t>, 2> occ,
                            std::vector<std::vector<PlanAction>>* prefetch_at,
                            Schedule* out) const {
  const int64_t n = static_cast<int64_t>(n_);
  std::array<int64_t, kNumTierKinds> prev{};
  std::array<bool, kNumTierKinds> stop{};
  for (const FetchEv& f : fetches_) {
    if (stop[f.tier]) continue;
    const bool next_iter = f.need >= n;
    const int64_t b = BytesOf(f.chunk);
    int64_t e = f.need;
    if (f.copy) {
      // After its previous access, and after its copy last left (an eviction the pass above
      // may have moved), in need order.
      int64_t earliest = f.after_access + 1;
      if (f.prev_evict >= 0) {
        earliest = std::max(earliest, evicts_[static_cast<size_t>(f.prev_evict)].at + 1);
      }
      e = std::max<int64_t>(earliest, prev[f.tier]);
      for (int64_t q = f.need - 1; q >= e; --q) {
        if (occ[f.tier][static_cast<size_t>(q)] + b > Cap(f.tier, q)) {
          e = q + 1;
          break;
        }
      }
      e = std::min(e, f.need);
    }
    if (next_iter && (e >= n || !f.copy)) {
      if (f.copy) stop[f.tier] = true;
      continue;
    }
    for (int64_t q = e; q < f.need; ++q) occ[f.tier][static_cast<size_t>(q)] += b;
    if (f.copy) prev[f.tier] = e;
    PlanAction a;
    a.kind = ActionKind::kPrefetch;
    a.tier = static_cast<TierKind>(f.tier);
    a.copy = f.copy;
    a.chunk = f.chunk;
    a.need_moment = static_cast<uint32_t>(f.use);
    (*prefetch_at)[static_cast<size_t>(e)].push_back(a);
    if (f.copy && f.tier == kD && f.use < n) out->device_in_bytes += static_cast<Bytes>(b);
  }
}

Schedule ScheduleBuilder::Emit() const {
  Schedule out;
  out.actions.resize(n_);
  std::vector<std::vector<PlanAction>> prefetch_at(n_);
  Hoist(Occupancy(), &prefetch_at, &out);
  for (const EvictEv& e : evicts_) {
    if (!e.emit || e.at >= static_cast<int64_t>(n_)) continue;
    PlanAction a;
    a.kind = ActionKind::kEvict;
    a.tier = static_cast<TierKind>(e.tier);
    a.chunk = e.chunk;
    out.actions[static_cast<size_t>(e.at)].push_back(a);
  }
  // Evictions at a moment in chunk order (deterministic), then prefetches in need order.
  for (size_t i = 0; i < n_; ++i) {
    std::stable_sort(out.actions[i].begin(), out.actions[i].end(),
                     [](const PlanAction& x, const PlanAction& y) { return x.chunk < y.chunk; });
    for (const PlanAction& a : prefetch_at[i]) out.actions[i].push_back(a);
  }
  for (const ActSpan& s : eff_.spans) {
    if (s.policy != ActivationPolicy::kOffload) continue;
    PlanAction a;
    a.kind = ActionKind::kFetchActivation;
    a.tier = TierKind::kDevice;
    a.unit = s.unit;
    a.need_moment = s.bwd;
    out.actions[s.prefetch_at].push_back(a);
  }
  return out;
}

}  // namespace

StatusOr<Schedule> MakeSchedule(const ScheduleInput& in) {
  ScheduleBuilder b(in);
  TIERMEM_RETURN_IF_ERROR(b.DemandPass());
  b.EvictVictimsEarly();
  b.SetFreed();
  return b.Emit();
}

// ---- PlanPolicy --------------------------------------------------------------------------
//
// Alignment: the device-stream moments of the actual iteration are matched in order with the
// planned ones (same label, kind and unit, else the iteration took another path: reactive);
// an actual optimizer step with an unmatched planned step of the same (substituted) group.
// At each match the plan's actions of every planned moment up to the matched one are issued.
// Substitution: when a matched moment uses other chunk groups than planned (MoE routing:
// other experts), the groups planned and not used are paired in order with those used and
// not planned, and the rest of the plan is read through that map — a group's chunk of kind k
// becomes the substitute group's chunk of kind k — for actions and predicted next uses.
// Expert classes replace the substitution for a trace that marks its experts (schedule.h):
// members bind to slots at their access, before the moment's actions are issued.
PlanPolicy::PlanPolicy(const Plan* plan, const EffIteration* planned)
    : plan_(plan), planned_(planned), slots_(*plan) {
  if (!slots_.active()) return;
  uint32_t classes = 0;
  for (uint32_t k : plan_->expert_class) {
    if (k != kNoExpertSet) classes = std::max(classes, k + 1);
  }
  class_reads_.resize(classes);
  const size_t n = planned_->size();
  for (size_t copy = 0; copy < 3; ++copy) {
    for (size_t m = 0; m < n; ++m) {
      for (const EffAccess* a = planned_->begin(m); a != planned_->end(m); ++a) {
        if (!slots_.IsMember(a->chunk) || !a->needs_content) continue;
        class_reads_[slots_.ClassOf(a->chunk)].push_back({copy * n + m, a->tier});
      }
    }
  }
}

void PlanPolicy::Remap(const Trace& t) {
  mapped_ = *planned_;
  for (EffAccess& a : mapped_.accesses) a.chunk = Map(t, a.chunk);
  next_use_ = std::make_unique<NextUse>(
      std::vector<const EffIteration*>{&mapped_, &mapped_, &mapped_}, t.chunks.size());
}

ChunkId PlanPolicy::Map(const Trace& t, ChunkId c) const {
  const TraceChunk& ch = t.chunks[c];
  const uint32_t g = sigma_[ch.group];
  if (g == ch.group) return c;
  auto it = chunk_of_.find({g, ch.kind});
  return it == chunk_of_.end() ? c : it->second;
}

uint64_t PlanPolicy::NextRead(ChunkId c, TierKind tier, uint64_t pos) const {
  if (!slots_.IsMember(c)) return next_use_->NextRead(c, tier, pos);
  const ChunkId s = slots_.SlotOf(c);
  if (s != kNoChunk) return next_use_->NextRead(s, tier, pos);
  // Beyond the slots: the next planned read of its class there (its set's next visit).
  const auto& reads = class_reads_[slots_.ClassOf(c)];
  auto it = std::upper_bound(
      reads.begin(), reads.end(), pos,
      [](uint64_t p, const std::pair<uint64_t, TierKind>& r) { return p < r.first; });
  for (; it != reads.end(); ++it) {
    if (it->second == tier) return it->first;
  }
  return NextUse::kDead;
}

VictimKey PlanPolicy::Key(const SimulatedRun& ex, ChunkId c, TierKind tier, uint64_t pos) const {
  const bool dirty = ex.Chunk(c).dirty;
  if (!slots_.IsMember(c)) return BeladyKey(*next_use_, c, tier, pos, dirty, ex.ChunkBytes(c));
  const ChunkId s = slots_.SlotOf(c);
  if (s != kNoChunk) return BeladyKey(*next_use_, s, tier, pos, dirty, ex.ChunkBytes(c));
  VictimKey k;
  k.id = c;
  k.bytes = UINT64_MAX - ex.ChunkBytes(c);
  const uint64_t nr = NextRead(c, tier, pos);
  if (nr == NextUse::kDead) {
    k.cls = dirty ? 1 : 0;  // a member's copy goes home after its last use (its step reads it)
  } else {
    k.cls = 3;
    k.far = UINT64_MAX - nr;
  }
  return k;
}

ChunkId PlanPolicy::Target(const Trace& t, const PlanAction& act) const {
  if (step_to_ != kNoGroup && t.chunks[act.chunk].group == step_to_) {
    // A class step's actions: the planned group's chunk of kind k is the actual group's.
    auto it = chunk_of_.find({step_from_, t.chunks[act.chunk].kind});
    return it == chunk_of_.end() ? kNoChunk : it->second;
  }
  if (!slots_.IsMember(act.chunk)) return Map(t, act.chunk);
  const ChunkId bound = slots_.Resolve(act.chunk);
  if (act.kind == ActionKind::kPrefetch) {
    // Not chosen yet, or for the next iteration's routing: fetched at its use.
    return act.need_moment >= planned_->size() ? kNoChunk : bound;
  }
  if (bound != kNoChunk) return bound;
  // An eviction of a slot nothing is bound to: the copy the plan knew of, if that chunk is
  // not the member of another slot now.
  return slots_.SlotOf(act.chunk) == kNoChunk ? act.chunk : kNoChunk;
}

bool PlanPolicy::SameDense(const Trace& t, const EffIteration& actual, size_t i, size_t q) const {
  const EffMoment& a = actual.moments[i];
  const EffMoment& b = mapped_.moments[q];
  if (a.kind != b.kind) return false;
  const bool step = a.kind == MomentKind::kOptimizerStep;
  auto member_step = [&](const EffIteration& it, size_t m) {
    return step && it.moments[m].count > 0 && slots_.IsMember(it.begin(m)->chunk);
  };
  if (member_step(actual, i) || member_step(mapped_, q)) {
    // Matched through the binding: the step of the expert in the planned one's slot.
    return member_step(actual, i) && member_step(mapped_, q);
  }
  if (a.label != b.label) return false;
  auto dense = [&](const EffIteration& it, size_t m) {
    std::vector<const EffAccess*> out;
    for (const EffAccess* x = it.begin(m); x != it.end(m); ++x) {
      if (!slots_.IsMember(x->chunk)) out.push_back(x);
    }
    return out;
  };
  const auto da = dense(actual, i), db = dense(mapped_, q);
  if (da.size() != db.size()) return false;
  for (size_t k = 0; k < da.size(); ++k) {
    if (da[k]->chunk != db[k]->chunk || da[k]->needs_content != db[k]->needs_content ||
        da[k]->modifies != db[k]->modifies || (!step && da[k]->tier != db[k]->tier)) {
      return false;
    }
  }
  return true;
}

Status PlanPolicy::BeginIteration(SimulatedRun& ex) {
  const Trace& t = ex.trace();
  sigma_.resize(t.chunks.size());
  for (uint32_t g = 0; g < sigma_.size(); ++g) sigma_[g] = g;
  chunk_of_.clear();
  for (ChunkId c = 0; c < t.chunks.size(); ++c)
    chunk_of_[{t.chunks[c].group, t.chunks[c].kind}] = c;
  Remap(t);
  mode_ = Mode::kFollow;
  div_kind_ = DivergenceKind::kNone;
  next_stream_ = 0;
  issued_ = 0;
  step_matched_.assign(planned_->size(), false);
  volatile_.assign(t.chunks.size(), false);
  for (uint32_t g : plan_->volatile_groups) {
    if (g < volatile_.size()) volatile_[g] = true;
  }
  seen_.assign(t.chunks.size(), false);
  slots_.Reset();
  return OkStatus();
}

bool PlanPolicy::Learn(const Trace& t, const EffIteration& actual, size_t i, size_t q) {
  std::set<uint32_t> want, got;
  for (const EffAccess* a = mapped_.begin(q); a != mapped_.end(q); ++a) {
    want.insert(t.chunks[a->chunk].group);
  }
  for (const EffAccess* a = actual.begin(i); a != actual.end(i); ++a) {
    got.insert(t.chunks[a->chunk].group);
  }
  std::vector<uint32_t> missing, extra;
  std::set_difference(want.begin(), want.end(), got.begin(), got.end(),
                      std::back_inserter(missing));
  std::set_difference(got.begin(), got.end(), want.begin(), want.end(), std::back_inserter(extra));
  const size_t pairs = std::min(missing.size(), extra.size());
  if (pairs == 0) return false;
  for (size_t k = 0; k < pairs; ++k) {
    const uint32_t m = missing[k], x = extra[k];
    for (uint32_t& s : sigma_) {  // sigma followed by the transposition (m x)
      if (s == m) {
        s = x;
      } else if (s == x) {
        s = m;
      }
    }
  }
  Remap(t);
  return true;
}

Status PlanPolicy::Issue(SimulatedRun& ex, size_t i, size_t q) {
  const EffIteration& actual = ex.iteration();
  const Trace& t = ex.trace();
  const size_t n = planned_->size();
  const PlannedMoment& pm = plan_->moments[q];
  for (uint32_t k = 0; k < pm.num_actions; ++k) {
    const PlanAction& act = plan_->actions[pm.first_action + k];
    if (act.kind == ActionKind::kFetchActivation) continue;  // the simulated run does these
    const ChunkId c = Target(t, act);
    if (c == kNoChunk) continue;
    // A volatile group's chunk comes in only once this iteration showed which group it is.
    if (act.kind == ActionKind::kPrefetch && volatile_[t.chunks[act.chunk].group] &&
        !seen_[t.chunks[c].group]) {
      continue;
    }
    if (act.kind == ActionKind::kEvict) {
      // (A chunk this moment uses on its home tier leaves its cached copy anyway.)
      bool used_there = false;
      for (const EffAccess* a = actual.begin(i); a != actual.end(i); ++a) {
        used_there |= a->chunk == c && a->tier == act.tier;
      }
      if (ex.Chunk(c).cache == act.tier && !used_there) TIERMEM_RETURN_IF_ERROR(ex.Evict(c));
      continue;
    }
    const ChunkView& v = ex.Chunk(c);
    if (v.cache == act.tier || ex.Home(c) == act.tier) continue;
    if (!act.copy) {
      // Allocation only, for a moment that overwrites the chunk: only if this moment does
      // (after a divergence it may read it; then the moment's own fetch copies it).
      bool overwrites = false;
      for (const EffAccess* a = actual.begin(i); a != actual.end(i); ++a) {
        overwrites |= a->chunk == c && a->tier == act.tier && !a->needs_content;
      }
      if (!overwrites) continue;
    }
    const Bytes b = ex.ChunkBytes(c);
    if (ex.Free(act.tier) < b + ex.NeedExtra(i, act.tier)) {
      if (mode_ == Mode::kFollow) ++repairs_;
      // Make room only from chunks not needed before this prefetch's use.
      const uint64_t need = act.need_moment;
      auto r = MakeRoom(
          ex, i, act.tier, b + ex.NeedExtra(i, act.tier),
          [&](ChunkId x) { return Key(ex, x, act.tier, q); },
          [&](ChunkId x) {
            const uint64_t nr = NextRead(x, act.tier, q);
            return nr != NextUse::kDead && nr <= need;
          });
      if (!r.ok()) return r.status();
      if (!*r) continue;
    }
    const uint32_t need_tag = act.need_moment >= n ? ex.tag() + 1 : ex.tag();
    TIERMEM_RETURN_IF_ERROR(ex.Fetch(c, act.tier, act.copy, need_tag));
  }
  return OkStatus();
}

Status PlanPolicy::Before(SimulatedRun& ex, size_t i) {
  const EffIteration& actual = ex.iteration();
  const Trace& t = ex.trace();
  const size_t n = planned_->size();
  const EffMoment& am = actual.moments[i];
  const bool classes = slots_.active();
  auto diverge = [&](DivergenceKind k, Mode m) {
    if (mode_ == Mode::kFollow) {
      div_kind_ = k;
      div_moment_ = static_cast<uint32_t>(i);
    }
    mode_ = m;
  };
  // The routing has spoken for this moment's experts: bind them to slots.
  bool class_moment = false;
  for (const EffAccess* a = actual.begin(i); a != actual.end(i); ++a) {
    if (!slots_.IsMember(a->chunk)) continue;
    class_moment = true;
    if (mode_ != Mode::kReactive) slots_.Bind(a->chunk);
  }
  const bool class_step = class_moment && am.kind == MomentKind::kOptimizerStep;
  step_from_ = step_to_ = kNoGroup;
  // The planned moment this one is.
  int64_t q = -1;
  if (mode_ != Mode::kReactive) {
    if (am.kind == MomentKind::kOptimizerStep) {
      uint32_t group = kNoGroup;
      if (am.count > 0) {
        ChunkId first = actual.begin(i)->chunk;
        if (class_step) first = slots_.SlotOf(first);  // its planned name (kNoChunk: none)
        if (first != kNoChunk) group = t.chunks[first].group;
      }
      for (size_t j = 0; j < n && q < 0 && group != kNoGroup; ++j) {
        const EffMoment& pm = mapped_.moments[j];
        if (pm.kind != MomentKind::kOptimizerStep || step_matched_[j] || pm.count == 0) continue;
        if (t.chunks[mapped_.begin(j)->chunk].group == group) q = static_cast<int64_t>(j);
      }
      if (q >= 0) {
        step_matched_[q] = true;
        if (class_step) {
          step_from_ = t.chunks[actual.begin(i)->chunk].group;
          step_to_ = group;
        }
      }
    } else {
      size_t j = next_stream_;
      while (j < n && mapped_.moments[j].kind == MomentKind::kOptimizerStep) ++j;
      if (j >= n) {
        diverge(DivergenceKind::kLonger, Mode::kReactive);
      } else {
        const EffMoment& pm = mapped_.moments[j];
        if (pm.label != am.label || pm.kind != am.kind || pm.unit != am.unit) {
          diverge(DivergenceKind::kMoment, Mode::kReactive);
        } else {
          q = static_cast<int64_t>(j);
          next_stream_ = j + 1;
        }
      }
    }
    if (mode_ != Mode::kReactive) {
      // With expert classes a moment follows the plan when its dense accesses do, and a
      // step of experts the plan has no slot for is the class policy's (no divergence).
      const bool same =
          classes ? (q >= 0 ? SameDense(t, actual, i, static_cast<size_t>(q)) : class_step)
                  : q == static_cast<int64_t>(i) && SameMoment(actual, i, mapped_, i);
      if (!same) {
        // Another path (a step that was not planned) or other chunks: substitute and repair.
        if (mode_ == Mode::kFollow) diverge(DivergenceKind::kAccess, Mode::kRepair);
        if (q >= 0 && !classes) Learn(t, actual, i, static_cast<size_t>(q));
      }
    }
  }
  if (mode_ == Mode::kReactive) {
    return EnsureMoment(ex, i, [&ex](ChunkId c, TierKind) {
      return std::make_tuple(ex.Chunk(c).dirty, ex.Chunk(c).last_use, c);
    });
  }
  for (const EffAccess* a = actual.begin(i); a != actual.end(i); ++a) {
    seen_[t.chunks[a->chunk].group] = true;
  }
  // Issue the actions of the planned moments up to this one (a step: its own only).
  if (q >= 0) {
    if (am.kind == MomentKind::kOptimizerStep && static_cast<size_t>(q) >= issued_) {
      TIERMEM_RETURN_IF_ERROR(Issue(ex, i, static_cast<size_t>(q)));
    } else {
      for (; issued_ <= static_cast<size_t>(q); ++issued_) {
        if (mapped_.moments[issued_].kind == MomentKind::kOptimizerStep && step_matched_[issued_] &&
            issued_ != static_cast<size_t>(q)) {
          continue;  // issued when its step ran
        }
        TIERMEM_RETURN_IF_ERROR(Issue(ex, i, issued_));
      }
    }
  }
  step_from_ = step_to_ = kNoGroup;
  const uint64_t pos = q >= 0 ? static_cast<uint64_t>(q) : static_cast<uint64_t>(issued_);
  uint32_t changed = 0;
  TIERMEM_RETURN_IF_ERROR(EnsureMoment(
      ex, i, [&](ChunkId c, TierKind tier) { return Key(ex, c, tier, pos); }, &changed));
  // Fetching a volatile group's chunk (or an expert) on demand is what the plan chose, not a
  // repair.
  bool volatile_moment = class_moment;
  for (const EffAccess* a = actual.begin(i); a != actual.end(i); ++a) {
    volatile_moment |= volatile_[t.chunks[a->chunk].group];
  }
  if (mode_ == Mode::kFollow && !volatile_moment) repairs_ += changed;
  return OkStatus();
}

}  // namespace tiermem::planners
