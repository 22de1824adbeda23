// Session's hooks for serving in place (session.h, "serving in place"): the chunks whose NVMe
// home is a checkpoint's bytes (runtime/weights.cc decides which; tiers/nvme/file_homes.h reads
// them; chunks::Engine::SetReadOnlyHome keeps them unwritten).
#include "runtime/session.h"
#include "runtime/tier_stack.h"

namespace tiermem::session {

FileHomeTier* Session::file_homes() { return closed() ? nullptr : stack_->file_homes(); }

Status Session::SetReadOnlyHome(size_t group, ChunkKind kind, const Region& region) {
  TIERMEM_RETURN_IF_ERROR(CheckKind(group, kind));
  return stack_->engine()->SetReadOnlyHome(Chunk(group, kind), region);
}

bool Session::ReadOnlyHome(size_t group, ChunkKind kind) const {
  if (closed() || group >= layout_.groups.size() || !layout_.has_kind(group, kind)) return false;
  return stack_->engine()->ReadOnlyHome(Chunk(group, kind));
}

}  // namespace tiermem::session
