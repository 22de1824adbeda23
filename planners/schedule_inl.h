// Template bodies of schedule.h (included from it only).
#pragma once

namespace tiermem::planners {

inline bool UsedBy(const EffIteration& it, size_t i, ChunkId c) {
  for (const EffAccess* a = it.begin(i); a != it.end(i); ++a) {
    if (a->chunk == c) return true;
  }
  return false;
}

template <typename KeyFn, typename SkipFn>
StatusOr<bool> MakeRoom(SimulatedRun& ex, size_t i, TierKind t, Bytes need, KeyFn key,
                        SkipFn skip) {
  const EffIteration& it = ex.iteration();
  while (ex.Free(t) < need) {
    bool have = false;
    ChunkId best = 0;
    decltype(key(ChunkId{0})) best_key{};
    for (ChunkId c = 0; c < ex.NumChunks(); ++c) {
      if (ex.Chunk(c).cache != t || UsedBy(it, i, c) || skip(c)) continue;
      auto k = key(c);
      if (!have || k < best_key) {
        have = true;
        best = c;
        best_key = k;
      }
    }
    if (!have) return false;
    TIERMEM_RETURN_IF_ERROR(ex.Evict(best));
  }
  return true;
}

template <typename KeyFn>
Status EnsureMoment(SimulatedRun& ex, size_t i, KeyFn key, uint32_t* changed) {
  const EffIteration& it = ex.iteration();
  uint32_t n = 0;
  for (const EffAccess* a = it.begin(i); a != it.end(i); ++a) {
    if (a->tier == ex.Home(a->chunk) && ex.Chunk(a->chunk).cache != TierKind::kNone) {
      TIERMEM_RETURN_IF_ERROR(ex.Evict(a->chunk));
      ++n;
    }
  }
  for (TierKind t : {TierKind::kDevice, TierKind::kHost}) {
    Bytes missing = 0;
    for (const EffAccess* a = it.begin(i); a != it.end(i); ++a) {
      if (a->tier == t && a->tier != ex.Home(a->chunk) && ex.Chunk(a->chunk).cache != t) {
        missing += ex.ChunkBytes(a->chunk);
      }
    }
    const Bytes extra = ex.NeedExtra(i, t);
    if (missing + extra == 0 || ex.Free(t) >= missing + extra) continue;
    const Bytes free_before = ex.Free(t);
    auto ok = MakeRoom(
        ex, i, t, missing + extra, [&](ChunkId c) { return key(c, t); },
        [](ChunkId) { return false; });
    if (!ok.ok()) return ok.status();
    if (!*ok) {
      return ResourceExhaustedError(
          std::string(TierKindName(t)) + " tier: moment " + std::to_string(i) + " (" +
          std::string(it.moments[i].label) + ") needs " + std::to_string(missing + extra) +
          " more bytes (" + std::to_string(missing) + " of chunks, " + std::to_string(extra) +
          " non-chunk), but only " + std::to_string(ex.Free(t)) + " can be freed: the budget is " +
          std::to_string(ex.Budget(t)) + " bytes (" + FormatBytes(ex.Budget(t)) + ")");
    }
    if (ex.Free(t) != free_before) ++n;
  }
  for (const EffAccess* a = it.begin(i); a != it.end(i); ++a) {
    if (a->tier != ex.Home(a->chunk) && ex.Chunk(a->chunk).cache != a->tier) {
      TIERMEM_RETURN_IF_ERROR(ex.Fetch(a->chunk, a->tier, a->needs_content));
      ++n;
    }
  }
  if (changed != nullptr) *changed += n;
  return OkStatus();
}

}  // namespace tiermem::planners
