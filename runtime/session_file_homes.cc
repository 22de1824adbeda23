// Session's hooks for serving in place (session.h, "serving in place"): the chunks whose NVMe
// home is a checkpoint's bytes (runtime/weights.cc decides which; tiers/nvme/file_homes.h reads
// them; chunks::Engine::SetReadOnlyHome keeps them unwritten).
#include "runtime/session.h"
#include "runtime/tier_stack.h"
#include "tiers/nvme/file_homes.h"

namespace tiermem::session {

FileHomeTier* Session::file_homes() { return closed() ? nullptr : stack_->file_homes(); }

Status Session::SetReadOnlyHome(size_t group, ChunkKind kind, const Region& region) {
  TIERMEM_RETURN_IF_ERROR(CheckKind(group, kind));
  return stack_->engine()->SetReadOnlyHome(Chunk(group, kind), region);
}

StatusOr<ChunkId> Session::AddChunk(size_t gi, ChunkKind kind) {
  chunks::Engine* eng = stack_->engine();
  const Bytes bytes = layout_.ShardChunkBytes(gi, kind);
  const Category category = chunks::ChunkKindCategory(kind);
  FileHomeTier* files = stack_->file_homes();
  if (files == nullptr || kind != layout_.compute_kind() || layout_.sharded() ||
      !ServesInPlace(config_.in_place) || !layout_.read_in_place(gi) ||
      eng->HostHasRoomFor(bytes)) {
    return eng->AddChunk(bytes, category);
  }
  // Read in place from a served checkpoint, likely: a placeholder file home (no spans: it
  // reads as zeros, and it is not counted in the NVMe budget) until the loader gives the chunk
  // its file home or, where it cannot be read in place, a home of the tier's own
  // (HomePlaceholders).
  TIERMEM_ASSIGN_OR_RETURN(const Region home, files->AddFileHome(bytes, {}));
  StatusOr<ChunkId> id = eng->AddChunk(bytes, category, TierKind::kNvme, home);
  if (!id.ok()) {
    files->Free(home).IgnoreError();
    return id.status();
  }
  placeholder_homes_.push_back(static_cast<uint32_t>(gi));
  return id;
}

Status Session::HomePlaceholders(const std::set<uint32_t>& in_place) {
  const ChunkKind kind = layout_.compute_kind();
  for (uint32_t g : placeholder_homes_) {
    if (in_place.count(g) != 0) continue;  // its file home replaced the placeholder
    TIERMEM_RETURN_IF_ERROR(stack_->engine()->RehomeOnNvme(Chunk(g, kind)));
  }
  placeholder_homes_.clear();
  return OkStatus();
}

bool Session::ReadOnlyHome(size_t group, ChunkKind kind) const {
  if (closed() || group >= layout_.groups.size() || !layout_.has_kind(group, kind)) return false;
  return stack_->engine()->ReadOnlyHome(Chunk(group, kind));
}

}  // namespace tiermem::session
