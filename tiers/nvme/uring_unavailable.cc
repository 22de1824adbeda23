// Built instead of uring_engine.cc when TIERMEM_WITH_IO_URING is OFF.
#include "tiers/nvme/io_engine.h"

namespace tiermem::nvme {

StatusOr<std::unique_ptr<IoEngine>> NewUringEngine(const EngineConfig&) {
  return UnavailableError("io_uring: this build has no liburing (TIERMEM_WITH_IO_URING=OFF)");
}

}  // namespace tiermem::nvme
